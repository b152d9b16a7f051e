"""kernels/bench_prefill.py on CPU at toy sizes (the kernels under the Triton interpreter, SDPA's math
backend, a wall-clock timer): the SDPA baseline of a chunk after a cached prefix is masked
bottom-right like our kernel (the two agree), the causal pair count is the mask's, and a sweep's
table names every candidate."""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: `python -m kernels.bench --only prefill` runs on the GPU",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import bench_prefill, triton_attention  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    importlib.reload(triton_attention)  # the same module object that bench_prefill holds

patch_interpreter_for_numpy()


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(bench_prefill, "DEV", "cpu")
    monkeypatch.setattr(bench_prefill, "DTYPE", torch.float32)
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=32, num_layers=1)
    monkeypatch.setattr(bench_prefill, "LLAMA3_8B", heads)
    monkeypatch.setattr(bench_prefill, "time_graph_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench_prefill, "PREFILL_CANDIDATES", {
        "default": {},
        "small_tuned": dict(prefill_tuning=triton_attention.PrefillTuning(
            block_m=16, block_n=16, bulk_block_n=16, block_addressing=True, fma_softmax=True)),
    })
    fresh = triton_attention.FreshTuning
    monkeypatch.setattr(bench_prefill, "FRESH_CANDIDATES", {
        "small_fresh": fresh(block_m=16, block_n=16, num_warps=1, num_stages=1),
        "small_fresh_packed": fresh(block_m=16, block_n=16, num_warps=1, num_stages=1, packed=True),
    })


@pytest.mark.parametrize(("batch", "new_tokens", "prefix"), [(2, 48, 0), (2, 32, 32)])
def test_ours_agrees_with_the_sdpa_baseline(on_cpu, batch, new_tokens, prefix):
    gen = torch.Generator().manual_seed(0)
    row = bench_prefill.bench_prefill_shape("toy", batch, new_tokens, prefix, gen, sweep=True)
    assert row["rel_error_vs_sdpa"] < 1e-5, row
    for variant in ("small_tuned", "small_fresh", "small_fresh_packed"):
        assert row["sweep"][variant]["rel_error_vs_sdpa"] < 1e-5, row["sweep"]
    assert row["varlen_ms"] > 0 and row["varlen_speed_vs_sdpa"] > 0
    if prefix:  # the explicit bottom-right mask is among the forms that ran and agreed
        assert any("bool_mask" in name for name in row["sdpa_all_ms"]), row["sdpa_all_ms"]
    table = bench_prefill.prefill_table([row])
    assert all(name in table for name in ("small_tuned", "default", "small_fresh", "small_fresh_packed"))


def test_ours_is_the_fresh_kv_launch(on_cpu, monkeypatch):
    """The headline figure times the fresh-K/V launch (counted), with views of one QKV buffer
    holding what the cache holds for the new tokens, as a model's attention layer has them."""
    calls = []
    real = triton_attention.fresh_prefill
    monkeypatch.setattr(triton_attention, "fresh_prefill",
                        lambda *a, **k: (calls.append(a[4]), real(*a, **k)))
    gen = torch.Generator().manual_seed(2)
    args = bench_prefill.prefill_inputs(2, 32, 16, gen)
    query, (key, value) = bench_prefill.fresh_inputs(args, 2, 32, 16)
    assert key._base is query._base is value._base  # one QKV buffer
    out = triton_attention.paged_attention(query, *args[1:], fresh_kv=(key, value))
    assert len(calls) == 1
    assert bench_prefill.relative_error(out, triton_attention.paged_attention(*args)) < 1e-5


def test_a_top_left_causal_mask_would_disagree_with_a_prefix(on_cpu):
    """The check the baseline relies on: SDPA's is_causal (aligned top-left) is a different attention
    from ours once a prefix is cached, so only a bottom-right mask makes it a fair baseline."""
    gen = torch.Generator().manual_seed(1)
    args = bench_prefill.prefill_inputs(1, 32, 32, gen)
    q = args[0].view(1, 32, 4, 32).transpose(1, 2)
    key = bench_prefill.contiguous_kv(args[1], args[3])
    value = bench_prefill.contiguous_kv(args[2], args[3])
    ours = triton_attention.paged_attention(*args).view(1, 32, 4, 32).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    top_left = sdpa(q, key, value, is_causal=True, enable_gqa=True)
    _, _, best = bench_prefill.time_sdpa_prefill(q, key, value, prefix=32)
    assert bench_prefill.relative_error(ours, best) < 1e-5
    assert bench_prefill.relative_error(ours, top_left) > 1e-2


@pytest.mark.parametrize(("batch", "new_tokens", "prefix"), [(1, 5, 0), (3, 4, 7), (2, 16, 16)])
def test_causal_pairs_count_the_mask(batch, new_tokens, prefix):
    context = prefix + new_tokens
    allowed = torch.ones(new_tokens, context, dtype=torch.bool).tril(diagonal=prefix)
    assert bench_prefill.causal_pairs(batch, new_tokens, prefix) == batch * int(allowed.sum())
