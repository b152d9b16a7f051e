"""The FP8 (e4m3) KV cache on CPU (`--kv-cache-dtype fp8`): the references' quantization and
attention, block moves, the flag, the worker's cache size and calibrated scales, and a tiny model's
greedy tokens against an fp32 cache. The Triton kernels: tests/unit/test_fp8_kv_triton.py
(interpreter) and tests/gpu/test_fp8_kv_gpu.py.

What e4m3 rounding implies: 3 mantissa bits, rounded to nearest, so a normal value (|x| / scale in
[2^-6, 448]) comes back within 2^-4 of itself, relatively, and one below within half a subnormal
step (2^-10 * scale). Over random data the error is about uniform in +-half an ulp: an rms of
2^-3 / sqrt(12) / 1.44 (the mean mantissa) ~ 2.5 % of a value. Attention's output averages V rows
(each off by ~2.5 %, independently) with weights from scores that K's error shifts by ~2.5 % of a
score's spread, so its relative error is ~3.5 % for scores of unit spread (measured: 2.7-3.5 % over
450 random cases); the tests bound it by 2^-4. Sharper softmaxes amplify K's share (4.4 % on average
at a score spread of 4).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import kernels
from clients.cli import serve as launcher
from executor_svc.layers.attention import AttentionMetadata
from executor_svc.runner.cache_config import CacheConfig
from executor_svc.runner.kv_cache import GIB, bytes_per_block, kv_cache_dtype
from executor_svc.runner.kv_calibration import HEADROOM, attention_layers, fp8_scale
from executor_svc.server import main as executor_main
from executor_svc.server.main import ExecutorOptions
from executor_svc.worker.config import WorkerConfig
from executor_svc.worker.memory_profile import blocks_that_fit
from executor_svc.worker.worker import Worker
from kernels.reference import FP8_E4M3_MAX
from kernels.testing import make_paged_case, relative_error
from scheduler_svc.wire.options import from_args
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import NewSequence, StepPlan
from tests.helpers.worker import prompts, run

E4M3 = torch.float8_e4m3fn
E4M3_REL = 2.0**-4  # largest relative rounding error of a normal e4m3 value
HALF_SUBNORMAL_STEP = 2.0**-10


@pytest.fixture
def gen(request):
    seed = torch.seed() % 2**31
    print(f"{request.node.name}: seed {seed}")
    return torch.Generator().manual_seed(seed)


def write_all(key_cache_f32, value_cache_f32, k_scale, v_scale):
    """Caches of [N, bs, KV, D] written slot by slot into new FP8 caches through the kernels API."""
    key_cache, value_cache = (torch.zeros(key_cache_f32.shape, dtype=E4M3) for _ in range(2))
    slots = torch.arange(key_cache_f32.shape[0] * key_cache_f32.shape[1])
    kernels.reshape_and_cache(
        key_cache_f32.flatten(0, 1), value_cache_f32.flatten(0, 1), key_cache, value_cache, slots,
        k_scale, v_scale,
    )
    return key_cache, value_cache


# ---- the references --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.05, 2.0**-5])
def test_a_value_written_with_scale_s_reads_back_within_e4m3_precision(gen, scale):
    num_blocks, block_size, kvh, d, num_tokens = 6, 4, 2, 16, 20
    magnitude = 10.0 ** (torch.rand(num_tokens, 1, 1, generator=gen) * 6 - 5)  # 1e-5 .. 10 per token
    key = torch.randn(num_tokens, kvh, d, generator=gen) * magnitude * scale * 8  # |key| / s < 448
    key[0, 0, :4] = torch.tensor([450.0, -1000.0, 448.0, 447.0]) * scale  # two beyond 448 * s
    value = -key
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1
    key_cache, value_cache = (torch.zeros(num_blocks, block_size, kvh, d, dtype=E4M3) for _ in range(2))
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, scale, scale)

    written = slots >= 0
    s = slots[written]
    stored_k = key_cache[s // block_size, s % block_size].float()  # [T', KV, D] e4m3 values
    stored_v = value_cache[s // block_size, s % block_size].float()
    want = key[written]
    assert torch.equal(stored_v, -stored_k)  # rounding to nearest is symmetric
    inside = want.abs() <= FP8_E4M3_MAX * scale
    err = (stored_k * scale - want).abs()
    bound = torch.maximum(E4M3_REL * want.abs(), torch.full_like(want, HALF_SUBNORMAL_STEP * scale))
    assert (err[inside] <= bound[inside] * (1 + 1e-6)).all(), float((err - bound)[inside].max())
    assert torch.equal(stored_k[~inside], FP8_E4M3_MAX * want[~inside].sign())  # clamped, never NaN
    assert int((~inside).sum()) == 2 and stored_k[0, 0, 2:4].tolist() == [448.0, 448.0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[s] = False
    assert (key_cache.flatten(0, 1)[untouched].float() == 0).all()  # slot -1 and the rest: unwritten


def test_scales_belong_to_fp8_caches_only():
    cache = torch.zeros(2, 4, 1, 8)
    kv = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="not scaled"):
        kernels.reshape_and_cache(kv, kv, cache, cache.clone(), torch.tensor([0]), 0.5, 1.0)
    fp8 = cache.to(E4M3)
    with pytest.raises(ValueError, match="positive and finite"):
        kernels.reshape_and_cache(kv, kv, fp8, fp8.clone(), torch.tensor([0]), 0.0, 1.0)
    case = make_paged_case([5], [5], 2, 1, 8, 4, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="not scaled"):
        kernels.paged_attention(*case.args(), v_scale=2.0)


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(0, 0.0), (7, 0.0), (0, 5.0)])
def test_paged_attention_over_an_fp8_cache(gen, sliding_window, logit_softcap):
    """Mixed prefill / decode batch: the FP8 path equals attention over the dequantized cache (the
    scales folded in right, before the softcap), and is within the e4m3 bound of the fp32 cache."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    case = make_paged_case([29, 1, 33, 16, 40], [11, 1, 1, 16, 1], 8, 2, 32, 8, torch.float32, "cpu", seed)
    key_f32, value_f32 = case.key_cache, case.value_cache * 0.03  # scores of unit spread, V ~ +-0.1
    k_scale, v_scale = fp8_scale(float(key_f32.abs().max())), 0.001  # a power of two, and not one
    key_cache, value_cache = write_all(key_f32, value_f32, k_scale, v_scale)
    args = (case.block_tables, case.seq_lens, case.query_start_loc, case.max_query_len, case.max_seq_len,
            case.scale, sliding_window, logit_softcap)
    out = kernels.paged_attention(case.query, key_cache, value_cache, *args, k_scale=k_scale, v_scale=v_scale)
    dequantized = kernels.paged_attention(
        case.query, key_cache.float() * k_scale, value_cache.float() * v_scale, *args
    )
    exact = kernels.paged_attention(case.query, key_f32, value_f32, *args)
    assert relative_error(out, dequantized) < 1e-6
    err = relative_error(out, exact)
    print(f"fp8 cache vs fp32 cache: relative error {err:.4f}")
    assert 1e-3 < err < E4M3_REL


def test_block_moves_copy_fp8_bytes_unchanged(gen):
    def random_fp8(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(E4M3)

    kv = random_fp8(2, 2, 8, 4, 2, 8)  # [L, 2, blocks, bs, KV, D], every bit pattern (NaNs too)
    want = kv.view(torch.uint8).clone()
    want[:, :, [5, 0]] = want[:, :, [1, 7]]
    kernels.copy_blocks(kv, torch.tensor([[1, 5], [7, 0]]))
    assert torch.equal(kv.view(torch.uint8), want)
    src, dst = random_fp8(2, 2, 6, 4, 2, 8), random_fp8(2, 2, 3, 4, 2, 8)
    want = dst.view(torch.uint8).clone()
    want[:, :, [0, 2]] = src.view(torch.uint8)[:, :, [4, 1]]
    kernels.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(dst.view(torch.uint8), want)


# ---- sizes, the flag, the worker -------------------------------------------------------------------


def test_an_fp8_block_takes_half_the_bytes_of_a_bf16_one_so_twice_the_blocks_fit():
    shape = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)
    bf16, fp8 = bytes_per_block(**shape, dtype=torch.bfloat16), bytes_per_block(**shape, dtype=E4M3)
    assert (bf16, fp8) == (2 << 20, 1 << 20)
    cc = CacheConfig(cpu_kv_gib=3.0, swap_space_gib=1.0)
    assert blocks_that_fit(cc, torch.device("cpu"), bf16, None) == (3 * GIB // bf16, GIB // bf16)
    assert blocks_that_fit(cc, torch.device("cpu"), fp8, None) == (6 * GIB // bf16, 2 * GIB // bf16)


def test_kv_cache_dtype_names_and_where_fp8_is_refused(monkeypatch):
    cpu = torch.device("cpu")
    assert kv_cache_dtype("auto", torch.bfloat16, cpu) is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32, cpu) is E4M3
    with pytest.raises(ValueError, match="auto or fp8"):
        kv_cache_dtype("int8", torch.float32, cpu)
    with pytest.raises(ValueError, match="auto or fp8"):
        WorkerConfig(model_dir="m", kv_cache_dtype="fp16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*A100 is 8.0"):
        kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) is torch.bfloat16


def test_serve_passes_the_kv_cache_dtype_to_its_executors():
    parser = launcher.argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--kv-cache-dtype", "fp8"])
    argv = launcher.executor_command(args, "/m", 0, 5001, 5999)[3:]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    executor_parser = launcher.argparse.ArgumentParser()
    executor_main.add_arguments(executor_parser)
    assert from_args(ExecutorOptions, executor_parser.parse_args(argv)).worker.kv_cache_dtype == "fp8"
    assert "--kv-cache-dtype" not in launcher.executor_command(parser.parse_args([]), "/m", 0, 1, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_fp8_scale_is_the_power_of_two_that_leaves_the_headroom():
    assert fp8_scale(224.0) == 1.0  # 224 * 2 / 448 = 1
    assert fp8_scale(3.5) == 2.0**-6 and fp8_scale(3.6) == 2.0**-5
    assert fp8_scale(0.0) == fp8_scale(float("nan")) == fp8_scale(float("inf")) == 1.0
    for amax in 10.0 ** torch.linspace(-5, 4, 97):
        scale = fp8_scale(float(amax))
        assert math.log2(scale).is_integer()
        assert HEADROOM * amax <= FP8_E4M3_MAX * scale * (1 + 1e-12) < 2 * HEADROOM * amax


def fp8_and_fp32_workers(model_dir, **options):
    make = lambda kv: Worker(str(model_dir), device="cpu", dtype="float32", kv_cache_dtype=kv, **options)  # noqa: E731
    return make("fp8"), make("auto")


def test_the_worker_sizes_an_fp8_cache_and_calibrates_each_layer(tiny_llama_dir):
    fp8, fp32 = fp8_and_fp32_workers(tiny_llama_dir, block_size=4)
    assert fp8.block_bytes * 4 == fp32.block_bytes  # on CPU the model runs in fp32: a quarter
    assert fp8.capacity_gpu_blocks == 4 * fp32.capacity_gpu_blocks
    assert fp8.describe().dtype == "float32" and fp32.kv_scales == []
    cache = fp8.kv_cache
    assert cache.device_cache.dtype == cache.cpu_cache.dtype == E4M3
    layers = attention_layers(fp8.model)
    assert len(layers) == fp8.model_config.num_layers == len(fp8.kv_scales)
    assert [(a.k_scale, a.v_scale) for a in layers] == fp8.kv_scales
    assert all(a.k_scale == a.v_scale == 1.0 for a in attention_layers(fp32.model))

    # a real prompt's K/V land inside the calibrated range: nothing clamps, and the range is used
    prompt = prompts(7, [24])[0]
    plan = StepPlan(0, new_seqs=[NewSequence(1, prompt, 0, len(prompt), list(range(6)),
                                             SamplingParams(temperature=0.0))])
    fp8.execute(plan)
    written = cache.device_cache[:, :, :6].float().abs()  # [L, 2, 6 blocks, bs, KV, D]
    per_layer_max = written.amax(dim=(2, 3, 4, 5))  # [L, K / V]
    assert (per_layer_max < FP8_E4M3_MAX).all() and (per_layer_max > FP8_E4M3_MAX / 16).all(), per_layer_max


@torch.inference_mode()
def prefill_logits(worker: Worker, token_ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of every position of one prefill through the worker's own cache."""
    n, block_size = len(token_ids), worker.cache_config.block_size
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(-(-n // block_size), **i32)[None],
        seq_lens=torch.tensor([n], **i32),
        query_start_loc=torch.tensor([0, n], **i32),
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = worker.model(torch.tensor(token_ids), torch.arange(n), worker.kv_cache.device_cache, meta)
    return worker.model.compute_logits(hidden).float()


def test_greedy_tokens_with_an_fp8_cache_follow_the_fp32_cache(tiny_llama_dir):
    """A tiny random llama served by the real scheduler and worker (prefix caching, chunked prefill,
    16-token steps), greedy, with the FP8 cache and with the fp32 cache; then both caches'
    logits over the same tokens (each prompt and the fp32 run's continuation, one prefill).

    The logits differ by ~3 % (relative norm; the attention outputs' e4m3 error carried through
    two layers), the bound is 2^-4. That flips the argmax where the fp32 top two are close, and
    a random tiny model's are (median margin ~0.9 for logits of std 4): ~94 % of positions agree
    given the same tokens, and a greedy run diverges at its first flip (about 40 % of the positions
    come before the first divergence here), after which the two runs continue different texts."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    requests = {f"r{i}": (p, params) for i, p in enumerate(prompts(3, [5, 9, 14, 20, 31, 40, 3, 11]))}
    fp8_tokens, _, _ = run(tiny_llama_dir, requests, kv_cache_dtype="fp8")
    fp32_tokens, _, _ = run(tiny_llama_dir, requests)
    fp8, fp32 = fp8_and_fp32_workers(tiny_llama_dir, block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    report = dict.fromkeys(["positions", "before_first_divergence", "same_first_token",
                            "same_argmax_given_the_same_tokens"], 0)
    errors = []
    for rid, (prompt, _) in requests.items():
        a, b = fp8_tokens[rid][0], fp32_tokens[rid][0]
        assert len(a) == len(b) == params.max_tokens
        report["positions"] += len(b)
        diverged = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        report["before_first_divergence"] += diverged[0] if diverged else len(b)
        report["same_first_token"] += a[0] == b[0]
        logits8, logits32 = (prefill_logits(w, prompt + b)[len(prompt) - 1 : -1] for w in (fp8, fp32))
        assert logits32.argmax(-1).tolist() == b  # the fp32 cache's prefill agrees with its own run
        report["same_argmax_given_the_same_tokens"] += int((logits8.argmax(-1) == logits32.argmax(-1)).sum())
        errors.append(relative_error(logits8, logits32))
    report["max_logits_relative_error"] = round(max(errors), 4)
    print(json.dumps(report))
    assert max(errors) < E4M3_REL
    assert report["same_argmax_given_the_same_tokens"] >= 0.85 * report["positions"]
