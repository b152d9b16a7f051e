"""The Triton kernels with an FP8 (e4m3) KV cache against the references, under the Triton interpreter.

The interpreter (triton 3.6) converts float32 to e4m3 by truncating the mantissa and adding the
cut-off bit, without a carry into the exponent and without rounding subnormals (1.95 becomes 1.0,
0.0019 becomes 0): not the GPU's round-to-nearest-even. So the inputs written here are e4m3 values
times a power-of-two scale, which every conversion gives back exactly, plus values beyond 448 * scale
(the clamp); the rounding of arbitrary values is compared bit for bit on the GPU
(tests/gpu/test_fp8_kv_gpu.py). e4m3 -> float32 is exact in the interpreter, so attention is
compared on arbitrary caches. Module setup as in tests/unit/test_kernels_triton.py.
"""

import importlib
import os
import random

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference, triton_attention, triton_cache  # noqa: E402
from kernels.testing import make_paged_case, random_block_pairs, relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_attention = importlib.reload(triton_attention)
    triton_cache = importlib.reload(triton_cache)

patch_interpreter_for_numpy()

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


def random_e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """float32 values drawn from every finite e4m3 value (subnormals and +-448 included)."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    return codes.view(E4M3).float()


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (2.0**-5, 4.0)])
def test_reshape_and_cache_fp8_matches_reference(seed, k_scale, v_scale):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 7, 8, 3, 16, 13
    qkv = torch.zeros(num_tokens, 5 * num_kv_heads, head_dim)  # [T, q+k+v heads, d]
    key = qkv[:, 3 * num_kv_heads : 4 * num_kv_heads]  # strided views, as a model produces them
    value = qkv[:, 4 * num_kv_heads :]
    key.copy_(random_e4m3(gen, num_tokens, num_kv_heads, head_dim) * k_scale)
    value.copy_(random_e4m3(gen, num_tokens, num_kv_heads, head_dim) * v_scale)
    key[0, 0, :3] = torch.tensor([500.0, -2000.0, 449.0]) * k_scale  # beyond 448 * scale: clamped
    value[1, 2, :2] = torch.tensor([-460.0, 1e6]) * v_scale
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:3]] = -1
    caches = [random_e4m3(gen, num_blocks, block_size, num_kv_heads, head_dim).to(E4M3) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *want, slots, k_scale, v_scale)
    triton_cache.reshape_and_cache(key, value, *caches, slots, k_scale, v_scale)
    for got, expected in zip(caches, want, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"seed {seed}"
    assert want[0].float().abs().max() == 448.0


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [([1, 17, 16, 40], [1, 1, 1, 1]), ([29, 1, 32, 16], [11, 1, 1, 16]), ([130, 5], [40, 1])],
)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.25, 0.01)])
def test_paged_attention_fp8_matches_reference(seed, seq_lens, query_lens, num_splits, k_scale, v_scale):
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    key_cache, value_cache = (c.clamp(-448, 448).to(E4M3) for c in (case.key_cache * 4, case.value_cache))
    args = (case.query, key_cache, value_cache, *case.args()[3:])
    ref = reference.paged_attention(*args, k_scale=k_scale, v_scale=v_scale)
    out = triton_attention.paged_attention(*args, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


def test_paged_attention_fp8_deterministic_mode_matches_reference(seed):
    case = make_paged_case([29, 1, 33], [11, 1, 1], 8, 2, 32, 8, torch.float32, "cpu", seed)
    key_cache, value_cache = case.key_cache.to(E4M3), case.value_cache.to(E4M3)
    args = (case.query, key_cache, value_cache, *case.args()[3:])
    ref = reference.paged_attention(*args, k_scale=0.5, v_scale=3.0)
    out = triton_attention.paged_attention(*args, deterministic=True, k_scale=0.5, v_scale=3.0)
    assert relative_error(out, ref) < 1e-5, f"seed {seed}"


def test_block_copy_and_swap_move_fp8_bytes(seed):
    gen = torch.Generator().manual_seed(seed)

    def random_fp8(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(E4M3)

    kv = random_fp8(3, 2, 12, 8, 2, 16)  # [L, 2, blocks, bs, kvh, d], every bit pattern
    mapping = random_block_pairs(gen, 12, 12, 5, disjoint=True)
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    triton_cache.copy_blocks(kv, mapping)
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"
    src, dst = random_fp8(2, 2, 10, 8, 2, 16), random_fp8(2, 2, 6, 8, 2, 16)
    mapping = random_block_pairs(gen, 10, 6, 4, disjoint=False)
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    triton_cache.swap_blocks(src, dst, mapping)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), f"seed {seed}"


@pytest.mark.parametrize(("seq_lens", "query_lens"), [([1, 17, 40], [1, 1, 1]), ([29, 1, 33], [11, 1, 16])])
def test_paged_attention_fp8_bf16_query_computes_in_f16(seed, seq_lens, query_lens):
    """A bf16 query over an e4m3 cache runs its dots in f16 (Q_F16): as close to the fp32 reference as
    the bf16 computation it replaces, and a query beyond f16's range is clamped, not turned into inf."""
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    key_cache, value_cache = (c.clamp(-448, 448).to(E4M3) for c in (case.key_cache * 4, case.value_cache))
    query = case.query.to(torch.bfloat16)
    query[0, 0, 0] = 1e6  # beyond f16's 65504: clamped
    args = (query, key_cache, value_cache, *case.args()[3:])
    ref = reference.paged_attention(query.float(), *args[1:], k_scale=2.0**-12, v_scale=0.5)
    f16 = triton_attention.paged_attention(*args, k_scale=2.0**-12, v_scale=0.5)
    bf16 = triton_attention.paged_attention(*args, k_scale=2.0**-12, v_scale=0.5, fp8_f16=False)
    assert torch.isfinite(f16).all()
    f16[0, 0], bf16[0, 0], ref[0, 0] = 0, 0, 0  # the clamped row differs from the reference by design
    err_f16, err_bf16 = relative_error(f16.float(), ref), relative_error(bf16.float(), ref)
    assert not torch.equal(f16, bf16)  # the f16 path ran (its PV dot rounds the weights differently)
    assert err_f16 < 2e-2, f"seed {seed}: {err_f16}"
    assert err_f16 <= err_bf16 * 1.5 + 1e-3, f"seed {seed}: f16 {err_f16} vs bf16 {err_bf16}"
