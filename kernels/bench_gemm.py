"""Decode GEMM benchmark: `python -m kernels.bench --only gemm [--sweep]` (or part of the whole run).

llama3-8b's projections (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336,
lm_head 128256 x 4096; bf16) at decode batch sizes, ours (kernels/triton_skinny.py, the engine's
choice of tile) against cuBLAS (torch.matmul) and cuBLASLt, and the MLP's gate_up + SiLU-and-mul as
one launch against cuBLAS's gate_up then `silu_and_mul`; at MID_ROWS (96-512) cuBLAS and cuBLASLt
against each projection's bound (the device's measured rates). `split` is the skinny kernel's
split-K form (`triton_skinny.SPLIT_CONFIG`), which the GEMM plan also times; `lt best` the fastest of
the algorithms cuBLASLt's heuristic lists for the product (kernels/cublaslt.py; torch runs the first of
them) and `rank` its place in that list (the plan's "cublaslt_algo"). A weight read from L2
would flatter either side, so each case captures one call per layer, 32 layers' own weights (4 for
lm_head), in one CUDA graph, and reports its replay time per call (median of 20 replays) and the
weight bytes per second.
`--sweep` also times every SWEEP_CONFIGS / SWEEP_GATED entry.
"""

from functools import partial

import torch

import kernels
from kernels import triton_layers, triton_skinny
from kernels.bench_common import graph_call_us
from kernels.triton_skinny import SkinnyConfig

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 8, 16, 32, 64)
# Past the skinny kernel's rows (decode batches of 96-512 sequences): cuBLAS against cuBLASLt and each
# projection's bound, the choice the engine's GEMM plan (executor_svc/layers/gemm_plan.py) makes per GPU
MID_ROWS = (96, 128, 192, 256, 320, 384, 512)
LAYERS = 32
SWEEP_CONFIGS = [SkinnyConfig(*c) for c in ((64, 128, 4), (64, 128, 6), (128, 128, 3), (128, 128, 4),
                                            (64, 256, 3), (64, 64, 8), (128, 64, 6), (64, 128, 6, 8))]
SWEEP_GATED = [SkinnyConfig(*c) for c in ((64, 128, 3), (64, 128, 4), (64, 128, 5), (64, 64, 8), (64, 64, 6))]


def _graph_us(calls) -> float:
    """Median replay time of one CUDA graph holding every call, per call (µs)."""
    return graph_call_us(calls, 20)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _time(fn, x, weights, outs, **kwargs) -> float | str:
    """Per-call µs of fn(x, w, out=o, **kwargs) over every layer's weight, or why it failed (a sweep
    tile that does not fit shared memory at this M)."""
    try:
        return _graph_us([partial(fn, x, w, out=o, **kwargs) for w, o in zip(weights, outs, strict=True)])
    except Exception as exc:  # noqa: BLE001 - reported in the results, the sweep goes on
        return f"failed: {type(exc).__name__}"


def _cublas(x, w, out):
    return torch.matmul(x, w.T, out=out)


def _cublaslt(x, w, out):
    with kernels.blas_library("cublaslt"):
        return torch.matmul(x, w.T, out=out)


def _cublas_silu(x, w, out):
    return triton_layers.silu_and_mul(torch.matmul(x, w.T, out=out))


def _lt_algos(x, weights, outs, ref, wide: bool = False) -> dict:
    """cuBLASLt's heuristic candidates for this product (kernels/cublaslt.py), each timed as the others:
    the best one's µs, its rank in the heuristic's list, the first-ranked one's µs (what the library's
    own choice would be), how many were listed, and whether the best gives the same bits twice."""
    from kernels import cublaslt

    try:
        lt = cublaslt.product(x.shape[0], weights[0].shape[0], x.shape[1], x.dtype, False, x.device)
        algos = lt.algos()
    except Exception as exc:  # noqa: BLE001 - reported in the results
        return {"lt_best_us": f"failed: {type(exc).__name__}: {exc}"}
    times = [_time(lambda x, w, out, a=a: lt.run(x, w, None, a, out), x, weights, outs) for a in algos]
    timed = [(t, i) for i, t in enumerate(times) if isinstance(t, float)]
    if not timed:
        return {"lt_best_us": "failed: no algorithm ran", "lt_listed": len(algos)}
    best_us, rank = min(timed)
    first = lt.run(x, weights[0], None, algos[rank]).clone()
    again = lt.run(x, weights[0], None, algos[rank])
    row = {"lt_best_us": best_us, "lt_rank": rank, "lt_first_us": times[0], "lt_listed": len(algos),
           "lt_best_algo": algos[rank].describe(), "lt_rel_err": _error(first, ref),
           "lt_same_bits": bool(torch.equal(first, again))}
    if wide:
        row.update(_lt_wide(lt, algos, x, weights, outs, ref))
    return row


def _lt_wide(lt, listed, x, weights, outs, ref) -> dict:
    """The algorithms one configuration attribute away from the listed ones (`LtMatmul.variants`),
    timed over 8 layers' weights: the fastest, its configuration and error, how many ran."""
    variants = lt.variants(listed)
    few, few_outs = weights[:8], outs[:8]
    base = _time(lambda x, w, out: lt.run(x, w, None, listed[0], out), x, few, few_outs)
    times = [(_time(lambda x, w, out, a=a: lt.run(x, w, None, a, out), x, few, few_outs), i)
             for i, a in enumerate(variants)]
    ran = [(t, i) for t, i in times if isinstance(t, float)]
    if not ran or not isinstance(base, float):
        return {"wide_variants": len(variants), "wide_ran": len(ran)}
    best_us, i = min(ran)
    out = lt.run(x, weights[0], None, variants[i])
    return {"wide_variants": len(variants), "wide_ran": len(ran), "wide_best_over_first": best_us / base,
            "wide_best_algo": variants[i].describe(), "wide_rel_err": _error(out, ref)}


def bench_gemm(gen: torch.Generator, sweep: bool = False, copy_bytes_per_s: float | None = None,
               matmul_flops_per_s: float | None = None, lt_algos: bool = True) -> list[dict]:
    """Per projection and row count: cuBLAS, cuBLASLt and (up to SKINNY_MAX_ROWS) ours; with the
    device's rates, each row's bound max(weight bytes / copy rate, FLOPs / matmul rate)."""
    results = []
    dev, dtype = "cuda", torch.bfloat16
    for name, (n, k) in SHAPES.items():
        layers = 4 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * 0.02 for _ in range(layers)]
        for rows in (*ROWS, *MID_ROWS):
            x = torch.randn(rows, k, device=dev, dtype=dtype, generator=gen)
            outs = [torch.empty(rows, n, device=dev, dtype=dtype) for _ in weights]
            row = {"shape": name, "rows": rows, "n": n, "k": k}
            if copy_bytes_per_s and matmul_flops_per_s:
                bound_s = max(n * k * 2 / copy_bytes_per_s, 2 * rows * n * k / matmul_flops_per_s)
                row["bound_us"] = bound_s * 1e6
            row["cublas_us"] = _time(_cublas, x, weights, outs)
            ref = outs[0].clone()
            row["cublaslt_us"] = _time(_cublaslt, x, weights, outs)
            if lt_algos and name != "lm_head":
                row.update(_lt_algos(x, weights, outs, ref, wide=sweep and rows in MID_ROWS))
            if rows in ROWS:
                row["ours_us"] = _time(triton_skinny.skinny_linear, x, weights, outs)
                row["rel_err"] = _error(outs[0], ref)
                row["ours_split_us"] = _time(triton_skinny.skinny_linear, x, weights, outs,
                                             config=triton_skinny.SPLIT_CONFIG)
                row["split_rel_err"] = _error(outs[0], ref)
                for cfg in SWEEP_CONFIGS if sweep else ():
                    key = f"{cfg.block_n}x{cfg.block_k}s{cfg.stages}w{cfg.warps}"
                    row[key] = _time(triton_skinny.skinny_linear, x, weights, outs, config=cfg)
            if name == "gate_up" and (rows in ROWS or rows in kernels.SKINNY_GATED_WIDE_ROWS):
                acts = [torch.empty(rows, n // 2, device=dev, dtype=dtype) for _ in weights]
                row["cublas_silu_us"] = _time(_cublas_silu, x, weights, outs)
                ref_act = triton_layers.silu_and_mul(x @ weights[0].T)
                row["gated_us"] = _time(triton_skinny.skinny_gate_up_silu, x, weights, acts)
                row["gated_rel_err"] = _error(acts[0], ref_act)
                for cfg in SWEEP_GATED if sweep else ():
                    key = f"gated_{cfg.block_n}x{cfg.block_k}s{cfg.stages}"
                    row[key] = _time(triton_skinny.skinny_gate_up_silu, x, weights, acts, config=cfg)
            timed = [key for key in ("cublas", "cublaslt", "lt_best", "ours", "ours_split")
                     if isinstance(row.get(f"{key}_us"), float)]
            row["weight_tb_s"] = {key: n * k * 2 / row[f"{key}_us"] / 1e6 for key in timed}
            results.append(row)
            print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()
                   if key != "weight_tb_s"}, flush=True)
        del weights
        torch.cuda.empty_cache()
    return results


def gemm_table(rows: list[dict]) -> str:
    def us(r, key):
        v = r.get(f"{key}_us")
        return f"{v:>8.2f}" if isinstance(v, float) else f"{'-':>8}"

    lines = ["decode GEMMs (llama3-8b projections, bf16, 32 layers' weights in one graph): µs per call; "
             "bound = max(weight bytes / copy rate, FLOPs / matmul rate)",
             f"{'shape':>8} {'rows':>4} {'bound':>8} {'cublas':>8} {'cublasLt':>8} {'ours':>8} {'split':>8}"
             f" {'lt best':>8} {'rank':>4} {'cublas/ours':>11} {'+silu cublas':>12} {'gated':>8}"
             f" {'ratio':>6}"]
    for r in rows:
        both = isinstance(r.get("ours_us"), float) and isinstance(r["cublas_us"], float)
        ratio = f"{r['cublas_us'] / r['ours_us']:>11.3f}" if both else f"{'':>11}"
        line = (f"{r['shape']:>8} {r['rows']:>4} {us(r, 'bound')} {us(r, 'cublas')} {us(r, 'cublaslt')} "
                f"{us(r, 'ours')} {us(r, 'ours_split')} {us(r, 'lt_best')} {r.get('lt_rank', '-'):>4} "
                f"{ratio}")
        if isinstance(r.get("gated_us"), float) and isinstance(r.get("cublas_silu_us"), float):
            gated = r["cublas_silu_us"] / r["gated_us"]
            line += f" {r['cublas_silu_us']:>12.2f} {r['gated_us']:>8.2f} {gated:>6.3f}"
        lines.append(line)
    return "\n".join(lines)
