"""The decode attention launch with the rotary and the K/V cache write inside (paged_attention's
`rotary`, what kernels.rotary_cache_and_attention runs for a decode step on CUDA), compiled on the GPU
(skipped without CUDA): the bits of rotary_and_cache then paged_attention (output, key and value
caches), at llama3-8b's attention shapes (32 query / 8 KV heads, head_dim 128, blocks of 16):

* bf16 at 1 to 256 sequences of 300 to 4,000 positions (split and unsplit launches), an FP8 cache
  with scales (compute capability 8.9+), five draws each;
* inside a CUDA graph, replayed 20 times on new inputs copied into the captured tensors: the program
  that writes a token's K/V reads it back after a barrier, so a missing or wrong barrier would show
  here as differing bits.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
E4M3 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    differ = int((_bits(got) != _bits(want)).sum())
    assert differ == 0, f"{what}: {differ} of {got.numel()} elements differ"


def _case(num_seqs: int, context: int, seed: int, cache_dtype: torch.dtype):
    from kernels.testing import decode_rotary_inputs, make_paged_case

    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(max(2, context // 2), context + 1, (num_seqs,), generator=gen).tolist()
    case = make_paged_case(seq_lens, [1] * num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                           torch.bfloat16, "cuda", seed)
    if cache_dtype != torch.bfloat16:
        case = type(case)(**{**case.__dict__, "key_cache": (case.key_cache * 8).to(cache_dtype),
                             "value_cache": (case.value_cache * 8).to(cache_dtype)})
    return case, decode_rotary_inputs(case, seed + 1)


def _run(case, inputs, fused: bool, key_cache, value_cache, scales):
    from kernels import triton_attention, triton_layers

    attention = (case.block_tables, case.seq_lens, case.query_start_loc, 1, case.max_seq_len, case.scale)
    if fused:
        rotary = (inputs["positions"], inputs["k"], inputs["v"], inputs["slot_mapping"], inputs["cos"],
                  inputs["sin"])
        return triton_attention.paged_attention(
            inputs["q"], key_cache, value_cache, *attention, k_scale=scales[0], v_scale=scales[1],
            rotary=rotary,
        )
    q = triton_layers.rotary_and_cache(
        inputs["positions"], inputs["q"], inputs["k"], inputs["v"], key_cache, value_cache,
        inputs["slot_mapping"], inputs["cos"], inputs["sin"], *scales,
    )
    return triton_attention.paged_attention(
        q, key_cache, value_cache, *attention, k_scale=scales[0], v_scale=scales[1]
    )


def _compare(case, inputs, scales, what):
    results = []
    for fused in (True, False):
        key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
        out = _run(case, inputs, fused, key_cache, value_cache, scales)
        results.append((out, key_cache, value_cache))
    (out, kc, vc), (want, kw, vw) = results
    _assert_same_bits(out, want, f"{what}: output")
    _assert_same_bits(kc, kw, f"{what}: key cache")
    _assert_same_bits(vc, vw, f"{what}: value cache")
    assert not torch.equal(kc, case.key_cache), f"{what}: nothing written"


@pytest.mark.parametrize(("num_seqs", "context"), [(1, 4000), (16, 1000), (40, 768), (128, 400), (256, 300)])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_fused_decode_matches_rotary_and_cache_then_attention(num_seqs, context, cache):
    if cache == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs compute capability 8.9+")
    cache_dtype, scales = (E4M3, (0.125, 0.25)) if cache == "fp8" else (torch.bfloat16, (1.0, 1.0))
    for seed in range(5):
        case, inputs = _case(num_seqs, context, 100 * num_seqs + seed, cache_dtype)
        _compare(case, inputs, scales, f"{num_seqs} x {context} {cache} seed {seed}")


@pytest.mark.parametrize(("num_seqs", "context"), [(8, 2000), (64, 500)])
def test_fused_decode_in_a_cuda_graph(num_seqs, context):
    """Captured once; each replay gets new q / k / v and a fresh copy of the caches; its output and
    caches must be the unfused eager launches' on the same inputs."""
    case, inputs = _case(num_seqs, context, 7, torch.bfloat16)
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(case, inputs, True, key_cache, value_cache, (1.0, 1.0))  # compile and warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(case, inputs, True, key_cache, value_cache, (1.0, 1.0))
    qkv = inputs["q"]._base
    gen = torch.Generator(device="cuda").manual_seed(11)
    for replay in range(20):
        qkv.copy_(torch.randn(qkv.shape, generator=gen, device="cuda"))
        key_cache.copy_(case.key_cache)
        value_cache.copy_(case.value_cache)
        graph.replay()
        want_k, want_v = case.key_cache.clone(), case.value_cache.clone()
        want = _run(case, inputs, False, want_k, want_v, (1.0, 1.0))
        torch.cuda.synchronize()
        _assert_same_bits(out, want, f"replay {replay}: output")
        _assert_same_bits(key_cache, want_k, f"replay {replay}: key cache")
        _assert_same_bits(value_cache, want_v, f"replay {replay}: value cache")
