"""The FP8 (e4m3) KV cache on CUDA (skipped without CUDA; needs compute capability 8.9+).

Kernels, on llama3-8b's attention shapes (32 query / 8 KV heads, head_dim 128, blocks of 16):
reshape_and_cache's e4m3 bytes equal the reference's bit for bit (both round the float32 product
x * float32(1 / scale) to nearest even, after the same clamp); paged attention over the FP8 cache
matches the reference over the same cache within bf16 rounding (1e-2, as the bf16 kernel tests) and
the bf16 cache within the e4m3 bound (2^-4, tests/unit/test_fp8_kv_cache.py derives it) in mixed
prefill / decode batches, split-K and deterministic mode included; block copies and swaps move the
bytes unchanged.

Model: the medium random llama of tests/gpu/test_tensor_parallel_gpu.py (hidden 1024, 8 layers,
16 query / 8 KV heads, head_dim 64), bf16 weights, 8 prompts of 7..300 tokens and 32 greedy decode
steps (CUDA graphs), with the bf16 cache and with the FP8 cache (calibrated scales, and all scales
1.0 for comparison), teacher-forced on the bf16 run's tokens so every step's logits compare; then
free-running. e4m3 keeps 3 mantissa bits, so the logits move by ~4 % (relative norm) and the
argmax flips where the top two are close: free-running sequences part early, as with any change of
rounding on a random model (whose top-2 margins are small). The bounds (`check`) come from the CPU
dry run in fp32 (`--device cpu`, about 7 minutes on 2 cores) and have not yet been checked on a GPU.
Run with `-s`, or `python -m tests.gpu.test_fp8_kv_gpu`, for the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

import pytest
import torch

from tests.gpu.test_tensor_parallel_gpu import PROMPT_LENS, make_medium_model, run_greedy

E4M3 = torch.float8_e4m3fn
E4M3_REL = 2.0**-4
# a row whose top-2 gap exceeds twice the bound on any logit's error (0.25 sigma below) cannot flip
CLEAR_MARGIN = 0.5
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


# ---- kernels ---------------------------------------------------------------------------------------

LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
CASES = {
    "decode_ragged": ([1, 37, 64, 513, 1000, 2047], [1] * 6),
    "decode_few_long": ([5000, 3001], [1, 1]),  # split-K by default
    "mixed_chunks_and_decodes": ([400, 1, 1024, 77, 2500], [120, 1, 1, 77, 1]),
    "prefill_with_cached_prefix": ([700, 96, 1030], [50, 32, 300]),
}


@GPU
@pytest.mark.parametrize("scale", [1.0, 0.05, 2.0**-4])
def test_reshape_and_cache_fp8_is_the_references_bit_for_bit(seed, scale):
    from kernels import reference, triton_cache

    gen = torch.Generator("cuda").manual_seed(seed)
    kvh, d, bs = LLAMA3_8B["num_kv_heads"], LLAMA3_8B["head_dim"], LLAMA3_8B["block_size"]
    num_blocks, num_tokens = 300, 2000
    # K: ~15 values beyond 448 s
    qkv = torch.randn(num_tokens, 6 * kvh, d, generator=gen, device="cuda") * 100 * scale
    qkv = qkv.bfloat16()
    key, value = qkv[:, 4 * kvh : 5 * kvh], qkv[:, 5 * kvh :]  # strided, like a fused QKV output
    cpu_gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * bs, generator=cpu_gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=cpu_gen)[:100]] = -1
    slots = slots.cuda()
    caches = [torch.zeros(num_blocks, bs, kvh, d, dtype=E4M3, device="cuda") for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *want, slots, scale, scale / 2)
    triton_cache.reshape_and_cache(key, value, *caches, slots, scale, scale / 2)
    for got, expected in zip(caches, want, strict=True):
        mismatches = int((got.view(torch.uint8) != expected.view(torch.uint8)).sum())
        assert mismatches == 0, f"seed {seed}: {mismatches} bytes differ"
    assert float(want[0].float().abs().max()) == 448.0  # the clamp was exercised


@GPU
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["default", "split4", "deterministic"])
def test_paged_attention_fp8_on_llama3_8b_shapes(seed, name, mode):
    import kernels
    from kernels import reference, triton_attention
    from kernels.testing import make_paged_case, relative_error

    seq_lens, query_lens = CASES[name]
    case = make_paged_case(seq_lens, query_lens, *LLAMA3_8B.values(), torch.bfloat16, "cuda", seed)
    key_bf16, value_bf16 = case.key_cache, case.value_cache * 0.05
    k_scale, v_scale = 2.0**-6, 0.05 * 2.0**-6
    key_cache, value_cache = (torch.empty_like(c, dtype=E4M3) for c in (key_bf16, value_bf16))
    slots = torch.arange(key_bf16.shape[0] * key_bf16.shape[1], device="cuda")
    kernels.reshape_and_cache(key_bf16.flatten(0, 1), value_bf16.flatten(0, 1), key_cache, value_cache, slots,
                              k_scale, v_scale)
    rest = case.args()[3:]
    extra = {"num_splits": 4} if mode == "split4" else {"deterministic": mode == "deterministic"}
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    out = triton_attention.paged_attention(case.query, key_cache, value_cache, *rest, **scales, **extra)
    ref = reference.paged_attention(case.query, key_cache, value_cache, *rest, **scales)
    unquantized = reference.paged_attention(case.query, key_bf16, value_bf16, *rest)
    err_ref, err_bf16 = relative_error(out, ref), relative_error(out, unquantized)
    print(json.dumps({"case": name, "mode": mode, "vs_reference_same_cache": err_ref,
                      "vs_bf16_cache": err_bf16}))
    assert err_ref < 1e-2, f"seed {seed}"
    assert err_bf16 < E4M3_REL, f"seed {seed}"


@GPU
def test_block_copy_and_swap_move_fp8_bytes(seed):
    import kernels
    from kernels import reference
    from kernels.testing import random_block_pairs

    gen = torch.Generator().manual_seed(seed)

    def random_fp8(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(E4M3)

    kv = random_fp8(4, 2, 64, 16, 8, 128).cuda()
    mapping = random_block_pairs(gen, 64, 64, 20, disjoint=True)
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    kernels.copy_blocks(kv, mapping)
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8))
    cpu = random_fp8(4, 2, 25, 16, 8, 128).pin_memory()
    out_map = random_block_pairs(gen, 64, 25, 12, disjoint=False)
    want_cpu = cpu.clone()
    reference.swap_blocks(kv, want_cpu, out_map)
    kernels.swap_blocks(kv, cpu, out_map)
    torch.cuda.synchronize()
    assert torch.equal(cpu.view(torch.uint8), want_cpu.view(torch.uint8))


# ---- a medium model --------------------------------------------------------------------------------


def _worker(model_dir: str, device: str, kv_cache_dtype: str):
    from executor_svc.worker.worker import Worker, WorkerConfig

    return Worker(WorkerConfig(
        model_dir=model_dir, device=device, dtype="bfloat16" if device.startswith("cuda") else "float32",
        num_gpu_blocks=len(PROMPT_LENS) * 32, num_cpu_blocks=0, kv_cache_dtype=kv_cache_dtype,
        # graphs for the buckets up to this batch only (4 captures per worker, not ~22): three workers
        # capturing every bucket took this test past its budget on the H100
        max_num_seqs=len(PROMPT_LENS),
    ))


def _figures(ref_logits, ref_tokens, logits, free_tokens) -> dict:
    diff = (logits - ref_logits).abs()  # [steps, S, V]
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    agree = logits.argmax(-1) == ref_logits.argmax(-1)
    sigma = float(ref_logits.std())
    clear = margin > CLEAR_MARGIN * sigma
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
              for a, b in zip(free_tokens, ref_tokens, strict=True)]
    return {
        "logit_std": round(sigma, 4),
        "logits_relative_error": round(float((logits - ref_logits).norm() / ref_logits.norm()), 5),
        "mean_abs_diff_sigma": round(float(diff.mean()) / sigma, 5),
        "max_abs_diff_sigma": round(float(diff.max()) / sigma, 5),
        "argmax_agreement": round(float(agree.float().mean()), 4),
        "argmax_agreement_clear_margin": float(agree[clear].float().mean()) if clear.any() else None,
        "rows_with_clear_margin": int(clear.sum()),
        "free_running_identical_seqs": f"{sum(p == len(b) for p, b in zip(prefix, ref_tokens, strict=True))}"
                                       f"/{len(ref_tokens)}",
        "free_running_positions_before_divergence": f"{sum(prefix)}/{sum(len(b) for b in ref_tokens)}",
    }


def compare(model_dir: pathlib.Path, device: str) -> dict:
    """The model's figures with the FP8 cache (calibrated scales, and scales of 1.0) against the
    cache in the model's dtype."""
    from executor_svc.runner.kv_calibration import attention_layers

    ref = _worker(str(model_dir), device, "auto")
    ref_logits, ref_tokens = run_greedy(ref, None)
    del ref
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "model_dtype": "bfloat16" if device.startswith("cuda") else "float32",
        "steps": int(ref_logits.shape[0]), "seqs": int(ref_logits.shape[1]),
    }
    for label in ("calibrated", "unit_scales"):
        fp8 = _worker(str(model_dir), device, "fp8")
        if label == "unit_scales":  # before the cache and the decode graphs are made
            for layer in attention_layers(fp8.model):
                layer.k_scale = layer.v_scale = 1.0
        else:
            k_scales, v_scales = zip(*fp8.kv_scales, strict=True)
            report["scales"] = {"k": [min(k_scales), max(k_scales)], "v": [min(v_scales), max(v_scales)]}
        logits, _ = run_greedy(fp8, ref_tokens)
        _, free_tokens = run_greedy(fp8, None)
        report[f"fp8_{label}"] = _figures(ref_logits, ref_tokens, logits, free_tokens)
        del fp8
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return report


def check(report: dict) -> None:
    """Bounds on the calibrated FP8 cache against the model-dtype cache, teacher-forced, set from
    the fp32 CPU dry run (logits relative error 0.0416, mean |diff| 0.033 sigma, max 0.25 sigma,
    argmax agreement 0.92 over all 264 rows, free-running 103 of 264 positions before the first
    divergence, 1 of 8 sequences identical; scales of 1.0 gave the same figures, this model's K and
    V amax being 3.5-7) with room for bf16's own rounding on the GPU (2^-9 relative, small beside
    e4m3's 2^-4). Not yet checked on a GPU."""
    fig = report["fp8_calibrated"]
    assert fig["logits_relative_error"] < E4M3_REL
    assert fig["mean_abs_diff_sigma"] < 0.05
    assert fig["max_abs_diff_sigma"] < 0.4
    assert fig["argmax_agreement"] >= 0.85
    assert fig["argmax_agreement_clear_margin"] is None or fig["argmax_agreement_clear_margin"] >= 0.98


@GPU
def test_fp8_cache_follows_the_bf16_cache_on_a_medium_model(tmp_path):
    report = compare(make_medium_model(tmp_path / "medium"), "cuda:0")
    print("FP8_KV_VS_BF16", json.dumps(report), flush=True)
    check(report)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description="FP8 vs model-dtype KV cache on a medium random model")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        device = "cuda:0" if args.device == "cuda" else "cpu"
        report = compare(make_medium_model(pathlib.Path(tmp) / "medium"), device)
    print(json.dumps(report))
    check(report)


if __name__ == "__main__":
    main()
