"""The compiled Triton kernels against the torch references on CUDA, in bf16 (skipped without CUDA)."""

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kernels  # noqa: E402
from kernels import reference, triton_attention, triton_cache  # noqa: E402
from kernels.bench import PREFILL_TILES  # noqa: E402
from kernels.bench_prefill import PREFILL_CANDIDATES  # noqa: E402
from kernels.testing import make_paged_case, random_block_pairs, relative_error  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


ATTENTION_CASES = {
    # name: (seq_lens, query_lens); 64, 512 and 1024 are exact multiples of block sizes 16 and 32
    "decode_ragged": ([1, 37, 64, 513, 1000, 2047], [1] * 6),
    "decode_few_long": ([5000, 3001], [1, 1]),  # few sequences, long contexts: split-K by default
    "prefill_no_prefix": ([300, 64, 7, 129], [300, 64, 7, 129]),
    "prefill_with_cached_prefix": ([700, 96, 1030], [50, 32, 300]),
    "mixed_chunks_and_decodes": ([400, 1, 1024, 77, 2500], [120, 1, 1, 77, 1]),
}

HEAD_CONFIGS = [  # (num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 4, 8
    (8, 8, 128, 16),
    (32, 8, 128, 16),
    (32, 4, 128, 32),
    (16, 4, 64, 32),
    (8, 1, 64, 16),
    (4, 4, 64, 32),
]


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), HEAD_CONFIGS)
@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_attention_bf16_matches_reference(
    seed, name, num_heads, num_kv_heads, head_dim, block_size, num_splits
):
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, DEVICE, seed
    )
    ref = reference.paged_attention(*case.args())  # float32 math on the same bf16 inputs
    out = triton_attention.paged_attention(*case.args(), num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), HEAD_CONFIGS[1:4])
@pytest.mark.parametrize("window", [1, 100, 512, 4096])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_attention_sliding_window_bf16_matches_reference(
    seed, name, num_heads, num_kv_heads, head_dim, block_size, window, num_splits
):
    """Mistral / Gemma sliding windows: keys `window` or more positions back are masked, decode and
    prefill, split and unsplit (default split-K partitions only the window)."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, DEVICE, seed
    )
    ref = reference.paged_attention(*case.args(), window)
    out = triton_attention.paged_attention(*case.args(), window, num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize(("window", "softcap"), [(0, 50.0), (0, 1.0), (512, 5.0)])
def test_paged_attention_logit_softcap_bf16_matches_reference(seed, name, window, softcap):
    """Gemma 2's attention soft-capping, alone and with its sliding window."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 16, 8, 128, 16, torch.bfloat16, DEVICE, seed)
    ref = reference.paged_attention(*case.args(), window, softcap)
    out = triton_attention.paged_attention(*case.args(), window, softcap)
    err = relative_error(out, ref)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


def test_default_split_k_is_taken_for_few_long_sequences():
    programs = 2 * 8  # two sequences, 8 KV heads
    slots = triton_attention.split_slots(torch.device(DEVICE))
    assert triton_attention.choose_num_splits(programs, 5000, slots) > 1


@pytest.mark.parametrize(("block_m", "tile"), PREFILL_TILES)
@pytest.mark.parametrize("name", ["prefill_with_cached_prefix", "mixed_chunks_and_decodes"])
def test_prefill_tile_candidates_match_reference(seed, name, block_m, tile):
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, DEVICE, seed)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), tile=tile, block_m=block_m)
    err = relative_error(out, ref)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize("variant", [name for name, kwargs in PREFILL_CANDIDATES.items() if kwargs])
@pytest.mark.parametrize(
    "name", ["prefill_no_prefix", "prefill_with_cached_prefix", "mixed_chunks_and_decodes"]
)
def test_prefill_sweep_candidates_match_reference(seed, name, variant):
    """Each candidate of `python -m kernels.bench --only prefill --sweep`, compiled, llama3-8b heads."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, DEVICE, seed)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), **PREFILL_CANDIDATES[variant])
    err = relative_error(out, ref)
    assert err < 1e-2, f"seed {seed}: relative error {err}"


def test_dispatcher_runs_triton_on_cuda(seed):
    case = make_paged_case([100, 33], [1, 1], 8, 2, 64, 16, torch.bfloat16, DEVICE, seed)
    out = kernels.paged_attention(*case.args())
    assert torch.equal(out, triton_attention.paged_attention(*case.args()))
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-2, f"seed {seed}"


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(8, 128, 16), (2, 64, 32), (40, 128, 16)]
)
def test_reshape_and_cache_bf16(seed, num_kv_heads, head_dim, block_size):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    num_blocks, num_tokens = 300, 2000
    qkv = torch.randn(num_tokens, 6 * num_kv_heads, head_dim, generator=gen, device=DEVICE).bfloat16()
    key = qkv[:, 4 * num_kv_heads : 5 * num_kv_heads]  # [T, kvh, d], strided like a fused QKV output
    value = qkv[:, 5 * num_kv_heads :]
    cpu_gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=cpu_gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=cpu_gen)[:100]] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen, device=DEVICE).bfloat16() for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *want, slots)
    kernels.reshape_and_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1]), f"seed {seed}"


def test_copy_blocks_bf16(seed):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 64, 16, 8, 128, generator=gen).bfloat16().to(DEVICE)  # [L, 2, blocks, bs, kvh, d]
    mapping = random_block_pairs(gen, 64, 64, 20, disjoint=True)
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    kernels.copy_blocks(kv, mapping)
    assert torch.equal(kv, want), f"seed {seed}"


@pytest.mark.parametrize("pinned", [True, False])
def test_swap_out_and_in_bf16(seed, pinned):
    gen = torch.Generator().manual_seed(seed)
    gpu = torch.randn(3, 2, 40, 16, 4, 64, generator=gen).bfloat16().to(DEVICE)
    cpu = torch.randn(3, 2, 25, 16, 4, 64, generator=gen).bfloat16()
    cpu = cpu.pin_memory() if pinned else cpu
    out_map = random_block_pairs(gen, 40, 25, 12, disjoint=False)
    want_cpu = cpu.clone()
    reference.swap_blocks(gpu, want_cpu, out_map)
    kernels.swap_blocks(gpu, cpu, out_map)
    torch.cuda.synchronize()
    assert torch.equal(cpu, want_cpu), f"seed {seed}: swap out"

    in_map = random_block_pairs(gen, 25, 40, 9, disjoint=False)
    want_gpu = gpu.clone()
    reference.swap_blocks(cpu, want_gpu, in_map)
    kernels.swap_blocks(cpu, gpu, in_map)
    assert torch.equal(gpu, want_gpu), f"seed {seed}: swap in"


def test_swap_uses_the_zero_copy_kernel_only_for_pinned_memory():
    gpu = torch.empty(1, 2, 2, 16, 1, 64, device=DEVICE)
    assert triton_cache._cpu_side_is_pinned(gpu, torch.empty(1, 2, 2, 16, 1, 64).pin_memory())
    assert not triton_cache._cpu_side_is_pinned(gpu, torch.empty(1, 2, 2, 16, 1, 64))
