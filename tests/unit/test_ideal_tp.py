"""The bench's ideal time at tensor-parallel size > 1 (clients/bench/report.py `ideal_time`): one
rank's share of the weights, K/V and FLOPs, and the all-reduces every step pays."""

from __future__ import annotations

import math

import pytest

from clients.bench.report import AllReduceRates, DeviceRates, ideal_time
from scheduler_svc.sim.models import ModelSpec

SPEC = ModelSpec(2, 8, 2, 2, 16, 200, 64, gated_mlp=True)  # 2 KV heads: they split over 2 ranks
PROMPTS, OUTPUTS = [2, 3], [3, 1]
FREE_ALL_REDUCE = AllReduceRates(latency_s=0.0, bus_bytes_per_s=math.inf, world_size=2)
BYTES_BOUND = DeviceRates("test", copy_bytes_per_s=1.0, matmul_flops_per_s=1e30)
FLOPS_BOUND = DeviceRates("test", copy_bytes_per_s=1e30, matmul_flops_per_s=1.0)


def test_tp1_is_the_one_gpu_formula():
    rates = DeviceRates("test", copy_bytes_per_s=1e6, matmul_flops_per_s=1e6)
    matmul_params = SPEC.num_params - 200 * 8
    attn = 4 * 8 * 2
    prefill = 2 * matmul_params * 5 + attn * (2 * 3 / 2 + 3 * 4 / 2)
    decode = 0.0
    for k in (1, 2):  # the first request alone
        context = 2 + k
        decode += max((2 * matmul_params + context * SPEC.kv_bytes_per_token) / 1e6,
                      (2 * matmul_params + attn * context) / 1e6)
    expected = {"prefill_s": round(prefill / 1e6, 4), "decode_s": round(decode, 4),
                "total_s": round(prefill / 1e6 + decode, 4)}
    assert ideal_time(SPEC, PROMPTS, OUTPUTS, rates) == expected
    assert ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 1, None, max_num_batched_tokens=2) == expected


def test_tp2_with_a_free_all_reduce_halves_the_bytes_and_the_flops():
    for rates in (BYTES_BOUND, FLOPS_BOUND):
        one = ideal_time(SPEC, PROMPTS, OUTPUTS, rates)
        two = ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 2, FREE_ALL_REDUCE)
        assert two["decode_s"] == one["decode_s"] / 2 > 0
        assert two["all_reduce_s"] == 0.0
    # bytes bound: decode = weights + K/V, exactly; prefill is FLOPs only
    weights = (SPEC.num_params - 200 * 8) * 2
    two = ideal_time(SPEC, PROMPTS, OUTPUTS, BYTES_BOUND, 2, FREE_ALL_REDUCE)
    assert two["decode_s"] == (weights * 2 + (3 + 4) * SPEC.kv_bytes_per_token) / 2
    flops_two = ideal_time(SPEC, PROMPTS, OUTPUTS, FLOPS_BOUND, 2, FREE_ALL_REDUCE)
    assert flops_two["prefill_s"] == ideal_time(SPEC, PROMPTS, OUTPUTS, FLOPS_BOUND)["prefill_s"] / 2


def test_all_reduce_time_by_hand():
    # 2 layers: 5 all-reduces a step of [tokens, 8] bf16 = 16 bytes a token; at t = 2 a ring moves
    # 2 (t - 1) / t = 1 x the bytes; compute is free.
    all_reduce = AllReduceRates(latency_s=1e-3, bus_bytes_per_s=1e3, world_size=2)
    assert all_reduce.time_s(16) == pytest.approx(0.017)
    free = DeviceRates("test", copy_bytes_per_s=1e30, matmul_flops_per_s=1e30)
    out = ideal_time(SPEC, [3], [2], free, 2, all_reduce, max_num_batched_tokens=2)
    prefill = 5 * (1e-3 + 32 / 1e3) + 5 * (1e-3 + 16 / 1e3)  # prompt steps of 2 and 1 tokens
    decode = 5 * (1e-3 + 16 / 1e3)  # one decode step of 1 token
    assert (out["prefill_s"], out["decode_s"]) == (round(prefill, 4), round(decode, 4))
    assert out["all_reduce_s"] == out["total_s"] == round(prefill + decode, 4)
    one_step = ideal_time(SPEC, [3], [2], free, 2, all_reduce)  # the whole prompt in one step
    assert one_step["prefill_s"] == round(5 * (1e-3 + 48 / 1e3), 4)
    four = AllReduceRates(latency_s=1e-3, bus_bytes_per_s=1e3, world_size=4)  # 2 (t - 1) / t = 1.5
    assert four.time_s(16) == pytest.approx(1e-3 + 1.5 * 16 / 1e3)


def test_fewer_kv_heads_than_ranks_replicates_them():
    gqa = ModelSpec(2, 8, 2, 1, 16, 200, 64, gated_mlp=True)  # 1 KV head, held whole by both ranks
    long_prompts = [p + 10 for p in PROMPTS]

    def kv_share(spec: ModelSpec, tp: int) -> float:
        """Decode seconds that 10 more context tokens per request add at 1 byte/s: their K/V bytes."""
        args = (BYTES_BOUND, tp, FREE_ALL_REDUCE if tp > 1 else None)
        return (ideal_time(spec, long_prompts, OUTPUTS, *args)["decode_s"]
                - ideal_time(spec, PROMPTS, OUTPUTS, *args)["decode_s"])

    assert kv_share(gqa, 1) == kv_share(gqa, 2) == 2 * 10 * gqa.kv_bytes_per_token  # 2 steps, 1 request
    assert kv_share(SPEC, 2) == kv_share(SPEC, 1) / 2
    # the K/V projections are replicated too: a rank reads half of the rest and all of them
    kv_proj = 2 * 2 * 8 * 4  # layers x (K, V) x hidden x head_dim
    weights = ((gqa.num_params - 200 * 8 - kv_proj) / 2 + kv_proj) * 2
    out = ideal_time(gqa, PROMPTS, OUTPUTS, BYTES_BOUND, 2, FREE_ALL_REDUCE)
    assert out["decode_s"] == 2 * weights + (3 + 4) * gqa.kv_bytes_per_token


def test_tp_needs_matching_all_reduce_rates_and_a_shape_that_splits():
    rates = DeviceRates("test", 1.0, 1.0)
    with pytest.raises(ValueError, match="all-reduce rates measured over 2 GPUs"):
        ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 2)
    with pytest.raises(ValueError, match="over 4 GPUs"):
        ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 4, FREE_ALL_REDUCE)
    with pytest.raises(ValueError, match="over 1 GPUs"):
        ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 1, FREE_ALL_REDUCE)
    three = AllReduceRates(0.0, 1.0, world_size=3)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        ideal_time(SPEC, PROMPTS, OUTPUTS, rates, 3, three)
    with pytest.raises(ValueError, match="bad all-reduce rates"):
        AllReduceRates(0.0, 1.0, world_size=1)


def test_add_ideal_skips_with_a_reason_when_the_machine_has_fewer_gpus_than_ranks(monkeypatch, capsys):
    import torch

    from clients.bench.peers import add_ideal

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    runs = {2: {"wall_s": 1.0}}
    assert add_ideal(SPEC, {2: []}, runs, tensor_parallel_size=2) is None
    assert runs == {2: {"wall_s": 1.0}}
    assert "tensor-parallel size 2 needs 2 GPUs" in capsys.readouterr().err
