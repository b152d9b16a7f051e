"""Kernel benchmarks on one CUDA device, in one run: `python -m kernels.bench [--out PATH] [--sweep]
[--only decode|prefill|cache|gemm]` (prefill: kernels/bench_prefill.py, four shapes against SDPA;
gemm: kernels/bench_gemm.py, the decode-batch projections against cuBLAS).

Prints a table and writes everything as JSON to --out. Times are medians of
triton.testing.do_bench (CUDA events, warm-up first, L2 flushed between repetitions); attention
(ours and SDPA alike, decode and prefill) is timed as a CUDA-graph replay of the call, as the engine
runs it (bench_common.time_graph_ms: the GPU's time without the host's launch cost), the cache
kernels eagerly. All inputs are random, block tables are random permutations (scattered blocks).
Bandwidth fractions are relative to the device-to-device copy bandwidth measured in the same run
(bytes read + bytes written per second), and the GEMM bounds to the 8192^3 bf16 matmul rate, both
as `bench throughput`'s ideal measures them (bench_common.device_rates).
"""

import argparse
import datetime
import json
import math
import platform
import time
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import reference, triton_attention, triton_cache
from kernels.bench_common import (
    BLOCK_SIZE,
    DEV,
    DTYPE,
    LLAMA3_8B,
    contiguous_kv,
    device_rates,
    paged_kv,
    time_graph_ms,
    time_ms,
)
from kernels.bench_gemm import bench_gemm, gemm_table
from kernels.bench_prefill import bench_prefill, prefill_table
from kernels.testing import relative_error

DECODE_CASES = [(64, 1024), (256, 1024), (64, 4096), (16, 16384)]  # (batch, context)


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy long enough for its clocks to rise before the first measurement (an idle
    H100 sat at 405 MHz, and the first case measured 40 % slow without this)."""
    src = torch.randn(1 << 28, device=DEV, dtype=DTYPE)  # 512 MiB
    dst = torch.empty_like(src)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()


def compiled_attention_kernels() -> list[dict]:
    """Registers, spills and shared memory of every compiled paged-attention variant (best effort)."""
    rows = []
    try:
        for caches in triton_attention._paged_attention_kernel.device_caches.values():
            for key, kernel in caches[0].items():
                rows.append(dict(key=str(key)[-160:], n_regs=kernel.n_regs, n_spills=kernel.n_spills,
                                 shared_bytes=kernel.metadata.shared))
    except (AttributeError, IndexError, TypeError) as exc:
        rows.append(dict(error=repr(exc)))
    return rows


def _decode_inputs(batch: int, context: int, gen: torch.Generator):
    heads, kv_heads, dim = LLAMA3_8B["num_heads"], LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    blocks_per_seq = context // BLOCK_SIZE
    key_cache, value_cache, block_tables = paged_kv(batch, blocks_per_seq, kv_heads, dim, gen, DEV, DTYPE)
    query = torch.randn(batch, heads, dim, device=DEV, dtype=DTYPE, generator=gen)  # [B, 32, 128]
    seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    return (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 1, context,
            1 / math.sqrt(dim))


def _decode_slots() -> int:
    return triton_attention.split_slots(torch.device(DEV))


PREFILL_TILES = [  # (block_m, (BLOCK_N, num_warps, num_stages)) of an earlier sweep; tests/gpu runs them
    (64, (64, 4, 2)), (64, (64, 4, 3)), (128, (64, 8, 2)),
    (128, (64, 8, 3)), (128, (128, 8, 2)), (128, (32, 4, 3)),
]


def _time_sdpa(query, key, value) -> dict[str, float]:
    """Every SDPA form that runs here, in ms: GQA without repeating K/V (enable_gqa) per backend."""
    q = query.unsqueeze(2)  # [B, 32, 1, 128]
    forms = {
        "default+enable_gqa": None,
        "flash+enable_gqa": SDPBackend.FLASH_ATTENTION,
        "cudnn+enable_gqa": SDPBackend.CUDNN_ATTENTION,
        "efficient+enable_gqa": SDPBackend.EFFICIENT_ATTENTION,
    }
    times = {}
    warnings.filterwarnings("ignore", message=".*(not used because|runtime disabled|same num_heads).*")
    for name, backend in forms.items():
        def run(backend=backend):
            if backend is None:
                return F.scaled_dot_product_attention(q, key, value, enable_gqa=True)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, key, value, enable_gqa=True)
        try:
            run()
            torch.cuda.synchronize()
        except RuntimeError:
            continue
        times[name] = time_graph_ms(run)
    return times


def bench_decode(batch: int, context: int, copy_bw: float, sweep: bool, gen) -> dict:
    args = _decode_inputs(batch, context, gen)
    query, key_cache, value_cache, block_tables = args[:4]
    out = triton_attention.paged_attention(*args)
    check = slice(0, min(batch, 8))  # reference on a few sequences: fp32 math, same bf16 inputs
    ref_args = (query[check], key_cache, value_cache, block_tables[check], args[4][check],
                args[5][: check.stop + 1], 1, context, args[8])
    error = relative_error(out[check], reference.paged_attention(*ref_args))
    ours_ms = time_graph_ms(lambda: triton_attention.paged_attention(*args))
    kv_bytes = 2 * key_cache[0].numel() * key_cache.element_size() * batch * context // BLOCK_SIZE
    key = contiguous_kv(key_cache, block_tables)
    value = contiguous_kv(value_cache, block_tables)
    sdpa = _time_sdpa(query, key, value)
    best = min(sdpa, key=sdpa.get)
    sdpa_out = F.scaled_dot_product_attention(query.unsqueeze(2), key, value, enable_gqa=True).squeeze(2)
    row = dict(
        batch=batch, context=context, ours_ms=ours_ms, sdpa_ms=sdpa[best], sdpa_form=best, sdpa_all_ms=sdpa,
        speed_vs_sdpa=sdpa[best] / ours_ms, kv_bytes=kv_bytes,
        ours_bw_fraction=kv_bytes / (ours_ms * 1e-3) / copy_bw,
        sdpa_bw_fraction=kv_bytes / (sdpa[best] * 1e-3) / copy_bw,
        rel_error_vs_reference=error, rel_error_vs_sdpa=relative_error(out, sdpa_out),
        num_splits=triton_attention.choose_num_splits(
            batch * LLAMA3_8B["num_kv_heads"], context, _decode_slots()
        ),
    )
    row.update(_fp8_decode(args, out, ours_ms, sweep))
    if sweep:
        row["sweep_splits_ms"] = {
            str(s): time_graph_ms(lambda s=s: triton_attention.paged_attention(*args, num_splits=s))
            for s in (1, 2, 3, 4, 5, 8, 16)
        }
        row["sweep_tile_ms"] = {
            str(t): time_graph_ms(lambda t=t: triton_attention.paged_attention(*args, tile=t))
            for t in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3), (32, 4, 4), (64, 8, 3))
        }
    return row


FP8_SCALE = 1 / 16  # the cache holds K / scale: N(0, 1) data spans ~+-80 of e4m3's +-448


FP8_DECODE_TILES = ((64, 4, 3), (64, 4, 5), (64, 4, 6), (64, 4, 7), (128, 4, 4), (128, 4, 5), (32, 4, 6))


def _fp8_decode(args: tuple, bf16_out: torch.Tensor, bf16_ms: float, sweep: bool = False) -> dict:
    """The same decode over an e4m3 copy of the cache (`--kv-cache-dtype fp8`): time, time relative to
    the bf16 cache's, and the error from the e4m3 rounding (relative to the bf16 cache's output);
    with `sweep`, the time of each (BLOCK_N, warps, stages) of FP8_DECODE_TILES."""
    if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability() < (8, 9):
        return {}
    fp8 = list(args)
    fp8[1] = (args[1].float() / FP8_SCALE).to(torch.float8_e4m3fn)
    fp8[2] = (args[2].float() / FP8_SCALE).to(torch.float8_e4m3fn)
    scales = dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)
    out = triton_attention.paged_attention(*fp8, **scales)
    fp8_ms = time_graph_ms(lambda: triton_attention.paged_attention(*fp8, **scales))
    row = dict(fp8_ms=fp8_ms, fp8_time_vs_bf16=fp8_ms / bf16_ms,
               fp8_rel_error_vs_bf16_cache=relative_error(out, bf16_out))
    if sweep:
        row["fp8_sweep_tile_ms"] = {
            str(t): time_graph_ms(lambda t=t: triton_attention.paged_attention(*fp8, **scales, tile=t))
            for t in FP8_DECODE_TILES
        }
    return row


def bench_reshape_and_cache(copy_bw: float, gen) -> dict:
    num_tokens, kv_heads, dim = 65536, LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    key = torch.randn(num_tokens, kv_heads, dim, device=DEV, dtype=DTYPE, generator=gen)  # [T, kvh, d]
    value = torch.randn_like(key)
    num_blocks = 2 * num_tokens // BLOCK_SIZE
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, device=DEV, dtype=DTYPE, generator=gen)
    value_cache = torch.randn_like(key_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV, generator=gen)[:num_tokens]  # [T]
    ms = time_ms(lambda: triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slots))
    moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read + write
    return dict(num_tokens=num_tokens, ms=ms, bytes_moved=moved, bw_fraction=moved / (ms * 1e-3) / copy_bw)


def _kv_cache(num_blocks: int, gen, device=DEV, pin=False) -> torch.Tensor:
    kv_heads, dim = LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"]
    shape = (LLAMA3_8B["num_layers"], 2, num_blocks, BLOCK_SIZE, kv_heads, dim)  # [L, 2, blocks, bs, kvh, d]
    cache = torch.randn(shape, device=DEV, dtype=DTYPE, generator=gen)
    if device == "cpu":
        cache = cache.cpu()
        return cache.pin_memory() if pin else cache
    return cache


def _block_bytes(cache: torch.Tensor) -> int:
    """Bytes of one block across all layers, K and V."""
    return cache[:, :, 0].numel() * cache.element_size()


def bench_copy_blocks(copy_bw: float, gen) -> dict:
    kv_cache = _kv_cache(2048, gen)  # [32, 2, 2048, 16, 8, 128] bf16 = 4 GiB
    num_pairs = 1024
    ids = torch.randperm(2048, device=DEV, generator=gen)
    mapping = torch.stack([ids[:num_pairs], ids[num_pairs:]], dim=1)  # [pairs, 2] disjoint
    ms = time_ms(lambda: triton_cache.copy_blocks(kv_cache, mapping))
    moved = 2 * num_pairs * _block_bytes(kv_cache)
    return dict(num_pairs=num_pairs, ms=ms, bytes_moved=moved, bw_fraction=moved / (ms * 1e-3) / copy_bw)


def bench_swap(gen) -> dict:
    gpu = _kv_cache(1024, gen)  # 2 GiB
    cpu = _kv_cache(512, gen, device="cpu", pin=True)  # 1 GiB pinned
    num_pairs = 256
    cpu_gen = torch.Generator().manual_seed(0)
    src = torch.randperm(1024, generator=cpu_gen)[:num_pairs]
    dst = torch.randperm(512, generator=cpu_gen)[:num_pairs]
    out_map, in_map = torch.stack([src, dst], 1), torch.stack([dst, src], 1)  # [pairs, 2] int64 on the CPU
    moved = num_pairs * _block_bytes(gpu)
    result = dict(num_pairs=num_pairs, bytes=moved)
    for name, fn, rep in (
        ("out_zero_copy", lambda: triton_cache.swap_blocks(gpu, cpu, out_map), 200),
        ("in_zero_copy", lambda: triton_cache.swap_blocks(cpu, gpu, in_map), 200),
        ("out_torch_reference", lambda: reference.swap_blocks(gpu, cpu, out_map), 300),
        ("in_torch_reference", lambda: reference.swap_blocks(cpu, gpu, in_map), 300),
    ):
        ms = time_ms(fn, rep=rep)
        result[name] = dict(ms=ms, gb_per_s=moved / (ms * 1e-3) / 1e9)
    return result


def _table(results: dict) -> str:
    copy_bw = results.get("copy_bandwidth_bytes_per_s")
    lines = [
        f"device: {results['device']}   torch {results['torch']}   triton {results['triton']}",
        f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)" if copy_bw else "",
    ]
    if "decode" in results:
        lines += [
            "",
            "paged decode, llama3-8b heads (32 q / 8 kv, d=128, bf16), block 16",
            f"{'batch':>5} {'ctx':>6} {'splits':>6} {'ours us':>8} {'sdpa us':>8} {'sdpa/ours':>9} "
            f"{'ours %bw':>8} {'sdpa %bw':>8}  sdpa form   fp8 cache: us, time / bf16's, rel. error",
        ]
    for r in results.get("decode", []):
        lines.append(
            f"{r['batch']:>5} {r['context']:>6} {r['num_splits']:>6} {r['ours_ms'] * 1e3:>8.1f} "
            f"{r['sdpa_ms'] * 1e3:>8.1f} {r['speed_vs_sdpa']:>9.2f} {100 * r['ours_bw_fraction']:>7.1f}% "
            f"{100 * r['sdpa_bw_fraction']:>7.1f}%  {r['sdpa_form']}"
            + (f"   {r['fp8_ms'] * 1e3:.1f} {r['fp8_time_vs_bf16']:.2f} "
               f"{r['fp8_rel_error_vs_bf16_cache']:.3f}" if "fp8_ms" in r else "")
        )
    if "prefill" in results:

        lines += ["", prefill_table(results["prefill"])]
    if "gemm" in results:
        lines += ["", gemm_table(results["gemm"])]
    if "reshape_and_cache" not in results:
        return "\n".join(lines)
    rc, cb = results["reshape_and_cache"], results["copy_blocks"]
    lines += [
        "",
        f"reshape_and_cache {rc['num_tokens']} tokens: {rc['ms'] * 1e3:.1f} us, "
        f"{100 * rc['bw_fraction']:.1f}% of copy bandwidth",
        f"copy_blocks {cb['num_pairs']} pairs x 32 layers: {cb['ms'] * 1e3:.1f} us, "
        f"{100 * cb['bw_fraction']:.1f}% of copy bandwidth",
    ]
    sw = results["swap"]
    for key in ("out_zero_copy", "in_zero_copy", "out_torch_reference", "in_torch_reference"):
        lines.append(f"swap {key} ({sw['bytes'] / 2**20:.0f} MiB): {sw[key]['ms']:.2f} ms, "
                     f"{sw[key]['gb_per_s']:.1f} GB/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true",
                        help="also time split counts and tile shapes (decode) and the prefill candidates")
    parser.add_argument("--only", choices=("decode", "prefill", "cache", "gemm"),
                        help="one part: decode or prefill attention, the cache kernels or the decode GEMMs")
    opts = parser.parse_args()

    gen = torch.Generator(DEV).manual_seed(0)
    results = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(),
    )
    warm_up_gpu()
    if opts.only != "prefill":  # the ceilings `bench throughput`'s ideal divides by, measured alike
        copy_bw, matmul_flops_per_s = device_rates()
        results["copy_bandwidth_bytes_per_s"] = copy_bw
    if opts.only in (None, "decode"):
        results["decode"] = []
        for batch, context in DECODE_CASES:
            results["decode"].append(bench_decode(batch, context, copy_bw, opts.sweep, gen))
            torch.cuda.empty_cache()
            print(json.dumps(results["decode"][-1]), flush=True)
    if opts.only in (None, "prefill"):
        results["prefill"] = bench_prefill(gen, opts.sweep)
        torch.cuda.empty_cache()
    if opts.only in (None, "decode", "prefill"):
        results["compiled_attention_kernels"] = compiled_attention_kernels()
    if opts.only in (None, "cache"):
        results["reshape_and_cache"] = bench_reshape_and_cache(copy_bw, gen)
        torch.cuda.empty_cache()
        results["copy_blocks"] = bench_copy_blocks(copy_bw, gen)
        torch.cuda.empty_cache()
        results["swap"] = bench_swap(gen)
    if opts.only in (None, "gemm"):
        results["matmul_flops_per_s"] = matmul_flops_per_s
        results["gemm"] = bench_gemm(gen, opts.sweep, copy_bw, results["matmul_flops_per_s"])
        torch.cuda.empty_cache()
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=2)
    print(_table(results))


if __name__ == "__main__":
    main()
