"""Prefill attention benchmark (issue 19: >= 0.9x the fastest SDPA backend on the same shapes), run by
`python -m kernels.bench --only prefill [--sweep]` (or as part of the whole `python -m kernels.bench`).

Four shapes, llama3-8b heads (32 q / 8 kv, d 128), bf16, block size 16, scattered blocks: causal
prefill of 4 x 2048, 1 x 8192 and 16 x 512 new tokens, and 4 x 1024 new tokens after a cached
prefix of 1024 (prefix caching, chunked prefill). SDPA gets the same K/V contiguous
([B, kv_heads, context, d]) and every form that runs here is timed (each backend, GQA without
repeating K/V or with K/V repeated, is_causal or the bottom-right-aligned causal mask a cached
prefix needs); the fastest form whose output agrees with the explicit-mask one is the baseline.
TFLOP/s count only the query-key pairs the causal mask lets through. Every time (ours, varlen, the
sweep, each SDPA form) is of the call captured in a CUDA graph and replayed (bench_common.time_graph_ms),
as the engine runs its steps: timed eagerly, a 16 x 512 launch of ours measured the host's launch
cost (two Triton launches, three TMA descriptors), 140-300 us for a kernel of 140 on the H100.

"ours" is paged_attention as the engine's attention layer calls it: with the step's own K/V
(`fresh_kv`, strided views of a QKV projection output holding what the cache holds for the new
tokens) and the host-built work list (`prefill_tile_starts`), so the new tokens' K/V are read as TMA
tiles and the cached prefix through the block table; on sm_90 that is the warp-specialized Gluon
kernel (kernels/gluon_prefill.py). "fresh_tl" forces the `tl` fresh-K/V kernel (_fresh_prefill_kernel,
by its FreshTuning: what other GPUs with TMA run); "varlen" is the call without fresh_kv, one kernel
reading everything through the block table (what deterministic mode and FP8 caches take). With
`sweep`, every entry of PREFILL_CANDIDATES (the varlen kernel's), FRESH_CANDIDATES and, without a
prefix, GLUON_CANDIDATES is timed on every shape too.
"""

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import kernels
from kernels import gluon_prefill, triton_attention
from kernels.bench_common import BLOCK_SIZE, DEV, DTYPE, LLAMA3_8B, contiguous_kv, paged_kv, time_graph_ms
from kernels.testing import relative_error

PREFILL_SHAPES = [  # (name, batch, new tokens per sequence, cached prefix per sequence)
    ("4x2048", 4, 2048, 0),
    ("1x8192", 1, 8192, 0),
    ("16x512", 16, 512, 0),
    ("4x1024+1024", 4, 1024, 1024),
]

_T = triton_attention.PrefillTuning
_FAST = dict(block_addressing=True, fma_softmax=True)
# name: paged_attention keyword arguments. Registers / spills / shared memory / programs per SM below
# are from ptxas for sm_90 (Triton 3.6, compiled on a CPU host, 4 x 2048 launch); an H100 SM has
# 64 K registers and 227 KB of shared memory.
PREFILL_CANDIDATES: dict[str, dict] = {
    # the untuned path (a forced tile takes no PrefillTuning): 64 rows, BLOCK_N 64, 4 warps, 2 stages:
    # 200 regs, 80 KB, 2 per SM
    "untuned_64": dict(tile=(64, 4, 2)),
    "default": {},  # what paged_attention picks without fresh_kv: DEFAULT_PREFILL_TUNING on these shapes
    "addr_fma": dict(prefill_tuning=_T(**_FAST)),  # ~100 fewer instructions per K/V tile (of ~500)
    # 5 stages: K/V two tiles ahead (3 buffers; with 2 or 3 stages the block-table load takes the
    # extra stage and each iteration waits for the tile issued at the end of the one before).
    # BLOCK_N 32: 166 regs, 65 KB: 3 per SM
    "n32_5stages": dict(prefill_tuning=_T(**_FAST, block_n=32, bulk_block_n=32, num_stages=5)),
    # 128-row tiles read each K/V tile for twice the rows (half the L2 traffic per FLOP)
    "m128_w8_5stages": dict(prefill_tuning=_T(**_FAST, block_m=128, num_warps=8, num_stages=5)),
    # 128 regs: 2 per SM, spilling 160 bytes a thread (DEFAULT_PREFILL_TUNING)
    "m128_w8_r128": dict(prefill_tuning=_T(**_FAST, block_m=128, num_warps=8, maxnreg=128)),
    "m128_n32_w8_5stages_r128": dict(prefill_tuning=_T(  # 128 regs, ~no spill, 80 KB: 2 per SM
        **_FAST, block_m=128, block_n=32, bulk_block_n=32, num_warps=8, num_stages=5, maxnreg=128,
    )),
    "m128_bulk128_w8_5stages": dict(prefill_tuning=_T(  # 238 regs, 225 KB: 1 per SM
        **_FAST, block_m=128, bulk_block_n=128, num_warps=8, num_stages=5,
    )),
}


_F = triton_attention.FreshTuning
# name: the fresh-K/V launch's FreshTuning (paged_attention's fresh_tuning)
FRESH_CANDIDATES: dict[str, object] = {
    "fresh_m64_n64_w4_s3": _F(),  # DEFAULT_FRESH_TUNING
    "fresh_m64_n64_w4_s4": _F(num_stages=4),
    "fresh_m64_n128_w4_s3": _F(block_n=128),
    "fresh_m128_n64_w8_s3": _F(block_m=128, num_warps=8),
    "fresh_m128_n128_w8_s3": _F(block_m=128, block_n=128, num_warps=8),  # LONG_FRESH_TUNING
    "fresh_m128_n128_w8_s2": _F(block_m=128, block_n=128, num_warps=8, num_stages=2),  # (s4: > 227 KB smem)
    # GQA packing: a program's rows are 16 or 32 tokens x the 4 query heads of one KV head
    "fresh_packed_m64_n64_w4_s3": _F(packed=True),
    "fresh_packed_m128_n64_w4_s3": _F(block_m=128, packed=True),
    "fresh_packed_m128_n64_w8_s3": _F(block_m=128, num_warps=8, packed=True),
    "fresh_packed_m128_n128_w8_s3": _F(block_m=128, block_n=128, num_warps=8, packed=True),
    # paired: a program owns query tiles p and n - 1 - p of its sequence (equal causal work, half the
    # programs)
    "fresh_m64_n64_w4_s3_paired": _F(paired=True),
    "fresh_m64_n64_w4_s4_paired": _F(num_stages=4, paired=True),
    "fresh_m128_n64_w8_s3_paired": _F(block_m=128, num_warps=8, paired=True),
    "fresh_m128_n128_w8_s3_paired": _F(block_m=128, block_n=128, num_warps=8, paired=True),
    "fresh_packed_m128_n64_w8_s3_paired": _F(block_m=128, num_warps=8, packed=True, paired=True),
    # the cached prefix through _attend_bulk's unmasked tiles (block-aligned addresses) and a masked rest
    "fresh_m64_n64_w4_s3_prefix_bulk": _F(prefix_bulk=True),
    "fresh_m128_n128_w8_s3_paired_prefix_bulk": _F(
        block_m=128, block_n=128, num_warps=8, paired=True, prefix_bulk=True,
    ),
}

# name: gluon_prefill.gluon_fresh_prefill's options (no cached prefix, sm_90)
GLUON_CANDIDATES: dict[str, dict] = {
    "gluon_n64_s4_pingpong": dict(block_n=64, stages=4, pingpong=True),  # the default
    "gluon_n64_s3_pingpong": dict(block_n=64, stages=3, pingpong=True),
    "gluon_n64_s3": dict(block_n=64, stages=3, pingpong=False),
    "gluon_n128_s2": dict(block_n=128, stages=2, pingpong=False),
    "gluon_n128_s2_pingpong": dict(block_n=128, stages=2, pingpong=True),
}


def causal_pairs(batch: int, new_tokens: int, prefix: int) -> int:
    """Query-key pairs a causal mask lets through: token i of a chunk after `prefix` cached ones sees
    prefix + i + 1 keys."""
    return batch * (new_tokens * prefix + new_tokens * (new_tokens + 1) // 2)


def prefill_inputs(batch: int, new_tokens: int, prefix: int, gen: torch.Generator) -> tuple:
    """paged_attention's arguments: `batch` sequences of prefix + new_tokens positions in scattered
    blocks, queries for the last new_tokens of each."""
    heads, kv_heads, dim = LLAMA3_8B["num_heads"], LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    context = prefix + new_tokens
    assert context % BLOCK_SIZE == 0
    blocks_per_seq = context // BLOCK_SIZE
    key_cache, value_cache, block_tables = paged_kv(batch, blocks_per_seq, kv_heads, dim, gen, DEV, DTYPE)
    # [B*L, 32, 128]
    query = torch.randn(batch * new_tokens, heads, dim, device=DEV, dtype=DTYPE, generator=gen)
    seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    query_start_loc = torch.arange(0, batch * new_tokens + 1, new_tokens, device=DEV, dtype=torch.int32)
    return (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, new_tokens, context,
            dim ** -0.5)


def fresh_inputs(args: tuple, batch: int, new_tokens: int, prefix: int) -> tuple:
    """(query, (key, value)) as a model's attention layer passes them: strided views of one
    [B * L, (32 + 2 * 8) * 128] QKV buffer, the query's values those of args[0] and the key and value
    those the cache holds at the new tokens' positions."""
    query, key_cache, value_cache, block_tables = args[:4]
    num_tokens, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * dim, device=query.device, dtype=query.dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(num_tokens, heads, dim)
    k = k.view(num_tokens, kv_heads, dim)
    v = v.view(num_tokens, kv_heads, dim)
    q.copy_(query)
    for cache, dst in ((key_cache, k), (value_cache, v)):
        contiguous = contiguous_kv(cache, block_tables)[:, :, prefix:]  # [B, kv_heads, L, d]
        dst.copy_(contiguous.transpose(1, 2).reshape(batch * new_tokens, kv_heads, dim))
    return q, (k, v)


def _sdpa_forms(q, key, value, prefix: int) -> dict:
    """name -> zero-argument callable for every SDPA form to try: q [B, 32, L, d], key/value
    [B, 8, S, d]. Without a prefix, is_causal (top-left aligned, right when L == S); with one, the
    bottom-right-aligned mask (causal_lower_right, or an explicit boolean [L, S] mask)."""
    group = q.shape[1] // key.shape[1]
    repeated = (key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1))
    length, context = q.shape[2], key.shape[2]
    backends = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if prefix == 0:
        masks = {"is_causal": dict(is_causal=True)}
    else:
        allowed = torch.ones(length, context, dtype=torch.bool, device=q.device)
        allowed = allowed.tril(diagonal=context - length)  # [L, S]: key j <= query i + prefix
        masks = {"lower_right": dict(attn_mask=causal_lower_right(length, context)),
                 "bool_mask": dict(attn_mask=allowed)}

    def form(kv, mask_kwargs, backend, gqa):
        def run():
            if backend is None:
                return F.scaled_dot_product_attention(q, *kv, enable_gqa=gqa, **mask_kwargs)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, *kv, enable_gqa=gqa, **mask_kwargs)
        return run

    forms = {}
    for mask_name, mask_kwargs in masks.items():
        for backend_name, backend in backends.items():
            if mask_name == "lower_right" and backend is not None:
                continue  # its own dispatch (flash, else efficient, else a materialized mask)
            forms[f"{backend_name}+{mask_name}+gqa"] = form((key, value), mask_kwargs, backend, True)
            forms[f"{backend_name}+{mask_name}+repeat_kv"] = form(repeated, mask_kwargs, backend, False)
    return forms


def time_sdpa_prefill(q, key, value, prefix: int) -> tuple[dict[str, float], str, torch.Tensor]:
    """(ms of every form that ran, the fastest form agreeing with the reference form, its output).
    The reference: the first form that ran of the explicit-mask (or is_causal) ones; a form whose
    output differs from it by more than 2 % (a mask aligned the wrong way) is not counted."""
    warnings.filterwarnings("ignore", message=".*(not used because|runtime disabled|same num_heads|"
                                              "Memory efficient|Flash attention|cuDNN|CuDNN).*")
    times, outputs = {}, {}
    for name, run in _sdpa_forms(q, key, value, prefix).items():
        try:
            out = run()
            if q.is_cuda:
                torch.cuda.synchronize()
        except Exception:  # a backend that does not take this form here: not a baseline
            continue
        outputs[name] = out
        times[name] = time_graph_ms(run)
    if not times:
        raise RuntimeError("no SDPA form ran")
    reference_name = next((n for n in outputs if "lower_right" not in n), next(iter(outputs)))
    agreeing = {n: t for n, t in times.items()
                if relative_error(outputs[n], outputs[reference_name]) < 2e-2}
    best = min(agreeing, key=agreeing.get)
    return times, best, outputs[best]


def _tflops(pairs: int, ms: float) -> float:
    heads, dim = LLAMA3_8B["num_heads"], LLAMA3_8B["head_dim"]
    return 4 * dim * heads * pairs / (ms * 1e-3) / 1e12  # QK^T and PV, 2 FLOPs a multiply-add


def bench_prefill_shape(name: str, batch: int, new_tokens: int, prefix: int, gen, sweep: bool) -> dict:
    args = prefill_inputs(batch, new_tokens, prefix, gen)
    query, key_cache, value_cache, block_tables = args[:4]
    heads, dim = LLAMA3_8B["num_heads"], LLAMA3_8B["head_dim"]
    q = query.view(batch, new_tokens, heads, dim).transpose(1, 2)  # [B, 32, L, 128]
    key = contiguous_kv(key_cache, block_tables)  # [B, 8, S, 128]
    value = contiguous_kv(value_cache, block_tables)
    sdpa_all, sdpa_form, sdpa_out = time_sdpa_prefill(q, key, value, prefix)
    sdpa_out = sdpa_out.transpose(1, 2).reshape(batch * new_tokens, heads, dim)  # as ours: [B*L, 32, 128]
    del key, value
    pairs = causal_pairs(batch, new_tokens, prefix)
    fresh_query, fresh_kv = fresh_inputs(args, batch, new_tokens, prefix)

    def measure(kwargs: dict, fresh: bool = False) -> dict:
        call = (fresh_query,) + args[1:] if fresh else args
        if fresh:
            kwargs = dict(kwargs, fresh_kv=fresh_kv)
        out = triton_attention.paged_attention(*call, **kwargs)
        ms = time_graph_ms(lambda: triton_attention.paged_attention(*call, **kwargs))
        return dict(ms=ms, speed_vs_sdpa=sdpa_all[sdpa_form] / ms, tflops=_tflops(pairs, ms),
                    rel_error_vs_sdpa=relative_error(out, sdpa_out))

    # ours: the engine's call (the Gluon kernel on sm_90); fresh_tl: the tl kernel, forced by its tuning
    tile_starts = kernels.prefill_tile_starts(args[5])
    ours = measure(dict(prefill_tile_starts=tile_starts), fresh=True)
    tl_tuning = triton_attention.fresh_tuning_for(batch * new_tokens, batch)
    fresh_tl = measure(dict(fresh_tuning=tl_tuning), fresh=True)
    varlen = measure({})
    row = dict(
        shape=name, batch=batch, prompt=new_tokens, prefix=prefix, causal_pairs=pairs,
        ours_ms=ours["ms"], sdpa_ms=sdpa_all[sdpa_form], sdpa_form=sdpa_form, sdpa_all_ms=sdpa_all,
        speed_vs_sdpa=ours["speed_vs_sdpa"], ours_tflops=ours["tflops"],
        sdpa_tflops=_tflops(pairs, sdpa_all[sdpa_form]), rel_error_vs_sdpa=ours["rel_error_vs_sdpa"],
        varlen_ms=varlen["ms"], varlen_speed_vs_sdpa=varlen["speed_vs_sdpa"],
        fresh_tl_ms=fresh_tl["ms"], fresh_tl_speed_vs_sdpa=fresh_tl["speed_vs_sdpa"],
    )
    if sweep:
        row["sweep"] = {}
        for variant, tuning in FRESH_CANDIDATES.items():
            try:
                row["sweep"][variant] = measure(dict(fresh_tuning=tuning), fresh=True)
            except Exception as exc:  # a variant that does not compile or launch here (e.g. shared memory)
                row["sweep"][variant] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(f"  {name} {variant}: {row['sweep'][variant]}", flush=True)
        for variant, options in GLUON_CANDIDATES.items() if prefix == 0 and gluon_prefill.supported(
                fresh_query, *fresh_kv) else ():
            def run(options=options):
                out = torch.empty_like(fresh_query)
                gluon_prefill.gluon_fresh_prefill(out, fresh_query, *fresh_kv, args[5], args[8], **options)
                return out
            out = run()
            ms = time_graph_ms(run)
            row["sweep"][variant] = dict(
                ms=ms, speed_vs_sdpa=sdpa_all[sdpa_form] / ms, tflops=_tflops(pairs, ms),
                rel_error_vs_sdpa=relative_error(out, sdpa_out),
            )
            print(f"  {name} {variant}: {row['sweep'][variant]}", flush=True)
        for variant, kwargs in PREFILL_CANDIDATES.items():
            try:
                row["sweep"][variant] = varlen if not kwargs else measure(kwargs)
            except Exception as exc:  # a variant that does not compile or launch here (e.g. shared memory)
                row["sweep"][variant] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(f"  {name} {variant}: {row['sweep'][variant]}", flush=True)
    return row


def bench_prefill(gen, sweep: bool) -> list[dict]:
    rows = []
    for name, batch, new_tokens, prefix in PREFILL_SHAPES:
        rows.append(bench_prefill_shape(name, batch, new_tokens, prefix, gen, sweep))
        torch.cuda.empty_cache()
    return rows


def prefill_table(rows: list[dict]) -> str:
    lines = ["prefill attention, llama3-8b heads (32 q / 8 kv, d=128, bf16), block 16, causal; "
             "TFLOP/s over the causal pairs",
             f"{'shape':>12} {'ours us':>8} {'sdpa us':>8} {'sdpa/ours':>9} {'ours TF':>8} {'sdpa TF':>8} "
             f"{'rel err':>8} {'varlen/ours':>11}  sdpa form"]
    for r in rows:
        lines.append(
            f"{r['shape']:>12} {r['ours_ms'] * 1e3:>8.1f} {r['sdpa_ms'] * 1e3:>8.1f} "
            f"{r['speed_vs_sdpa']:>9.3f} {r['ours_tflops']:>8.0f} {r['sdpa_tflops']:>8.0f} "
            f"{r['rel_error_vs_sdpa']:>8.4f} {r['varlen_ms'] / r['ours_ms']:>11.3f}  {r['sdpa_form']}"
        )
    if any("sweep" in r for r in rows):
        lines += ["", "sweep: us (sdpa/ours) per shape; * the shape's best; err: rel. error vs SDPA > 1e-2",
                  f"{'variant':>28} " + " ".join(f"{r['shape']:>22}" for r in rows)]
        best = {}  # shape -> the fastest variant with a small error
        for r in rows:
            timed = [(v["ms"], k) for k, v in r["sweep"].items() if v.get("rel_error_vs_sdpa", 1.0) <= 1e-2]
            best[r["shape"]] = min(timed)[1] if timed else None
        for variant in [*FRESH_CANDIDATES, *PREFILL_CANDIDATES]:
            cells = []
            for r in rows:
                v = r["sweep"].get(variant, {})
                if "ms" not in v:
                    cells.append(f"{'failed':>22}")
                    continue
                mark = "*" if best[r["shape"]] == variant else ""
                mark += " err" if v["rel_error_vs_sdpa"] > 1e-2 else ""
                cells.append(f"{v['ms'] * 1e3:.1f} ({v['speed_vs_sdpa']:.3f}){mark}".rjust(22))
            lines.append(f"{variant:>28} " + " ".join(cells))
    return "\n".join(lines)
