"""The Triton kernels against the torch references on CPU, under the Triton interpreter (small shapes).

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels (triton 3.6 decides between a
compiled and an interpreted function at decoration time), so this module sets it before importing
kernels.triton_*; nothing on a CPU-only machine imports those modules earlier (the dispatcher sends CPU
tensors to the reference). With CUDA present, tests/gpu covers the compiled kernels instead.
"""

import dataclasses
import importlib
import os
import random

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from kernels import reference, triton_attention, triton_cache, triton_layers  # noqa: E402
from kernels.testing import make_paged_case, random_block_pairs, relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_attention = importlib.reload(triton_attention)
    triton_cache = importlib.reload(triton_cache)
    triton_layers = importlib.reload(triton_layers)

patch_interpreter_for_numpy()


def test_kernels_are_interpreted():
    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"
    assert type(triton_cache._copy_blocks_kernel).__name__ == "InterpretedFunction"
    assert type(triton_layers._rms_norm_kernel).__name__ == "InterpretedFunction"


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


ATTENTION_CASES = {
    # name: (seq_lens, query_lens); 16 and 32 are exact multiples of the block sizes 8 and 16
    "decode": ([1, 17, 16, 40], [1, 1, 1, 1]),
    "prefill_no_prefix": ([20, 16, 3], [20, 16, 3]),
    "prefill_with_cached_prefix": ([33, 24, 9], [12, 8, 9]),
    "mixed_chunk_and_decodes": ([29, 1, 32, 16], [11, 1, 1, 16]),
    "long_decode": ([150, 70], [1, 1]),  # several K/V tiles per program
    "long_chunk_after_prefix": ([130, 5], [40, 1]),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(2, 2, 16, 8), (8, 2, 32, 16), (6, 2, 16, 16), (4, 2, 24, 16)],  # 24: padded to 32 (masked loads)
)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_attention_matches_reference(
    seed, name, num_heads, num_kv_heads, head_dim, block_size, num_splits
):
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu", seed
    )
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize(("block_m", "tile"), [(128, (32, 4, 3)), (16, (16, 4, 2))])
@pytest.mark.parametrize("name", ["long_chunk_after_prefix", "mixed_chunk_and_decodes"])
def test_paged_attention_other_tile_shapes(seed, name, block_m, tile):
    """Small K/V tiles: many unmasked tiles before the causal diagonal, several masked ones on it."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), tile=tile, block_m=block_m)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "num_programs"),
    # decode (4 tiles); a prefill chunk among decodes (13 tokens in tiles of 8 rows: 3 tiles)
    [([600, 150, 70, 1], [1, 1, 1, 1], 4), ([600, 33], [1, 12], 3)],
)
def test_paged_attention_splits_each_context_evenly(seed, seq_lens, query_lens, num_programs):
    """max_seq_len far above every context, as a CUDA graph captures it: the split count comes from
    the grid (2 or 3 here, 8 slots on a CPU), and each tile divides its own context into that many
    partitions (the 600-token sequence uses all of them, the short ones leave some empty)."""
    case = make_paged_case(seq_lens, query_lens, 8, 1, 32, 16, torch.float32, "cpu", seed)
    case = dataclasses.replace(case, max_seq_len=4096)
    assert triton_attention.choose_num_splits(num_programs, 4096, 8) in (2, 3)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args())
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


def record_attention_launches(monkeypatch, fields) -> list:
    """Launches of _paged_attention_kernel run as before; each appends fields(grid, kwargs) to the list
    returned."""
    real = triton_attention._paged_attention_kernel
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            launch = real[grid]

            def call(*args, **kwargs):
                seen.append(fields(grid, kwargs))
                return launch(*args, **kwargs)
            return call

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Recorder())
    return seen


def test_split_decode_launch_caps_registers(monkeypatch):
    """The decode launch with even splits is held to EVEN_SPLIT_DECODE_MAXNREG registers (Triton gives
    it ~166 for sm_90, three programs an SM where the split rule counts four: 16 x 16384 took 424 us
    against 375 capped on an H100); the unsplit launch keeps the compiler's choice. (Balanced decode
    off: by default a launch that would split in two runs balanced.)"""
    monkeypatch.setenv(kernels.BALANCED_DECODE_ENV, "0")
    seen = record_attention_launches(
        monkeypatch, lambda grid, kw: (grid[2], kw["EVEN_SPLITS"], kw.get("maxnreg")))
    case = make_paged_case([600, 150, 70, 1], [1, 1, 1, 1], 8, 1, 32, 16, torch.float32, "cpu", 4)
    case = dataclasses.replace(case, max_seq_len=4096)  # as a decode graph: the split rule splits
    ref = reference.paged_attention(*case.args())
    for kwargs in ({}, {"num_splits": 1}):
        out = triton_attention.paged_attention(*case.args(), **kwargs)
        assert relative_error(out, ref) < 1e-5
    (splits, even, maxnreg), (one, even_unsplit, maxnreg_unsplit) = seen
    assert splits > 1 and even and maxnreg == triton_attention.EVEN_SPLIT_DECODE_MAXNREG == 128
    assert one == 1 and not even_unsplit and maxnreg_unsplit is None


@pytest.mark.parametrize(("window", "softcap", "head_dim"), [(0, 0.0, 32), (5, 0.0, 32), (0, 30.0, 96)])
def test_unsplit_decode_takes_the_bulk_tile(monkeypatch, window, softcap, head_dim):
    """An unsplit decode launch over a cache of the query's dtype runs UNSPLIT_DECODE_TILE through
    _attend_bulk (BULK_N = its BLOCK_N; block-aligned addresses unless a window masks the start); a
    split one keeps the (64, 4, 3) tile; both match the reference, with a sliding window, a logit
    soft-cap and a head_dim below its power of two too."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (
        grid[2], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["BULK_N"], kw["BLOCK_ADDR"]))
    case = make_paged_case([600, 150, 70, 33], [1, 1, 1, 1], 8, 2, head_dim, 16, torch.float32, "cpu", 5)
    ref = reference.paged_attention(*case.args(), window, softcap)
    for kwargs in ({"num_splits": 1}, {"num_splits": 3}):
        out = triton_attention.paged_attention(*case.args(), window, softcap, **kwargs)
        assert relative_error(out, ref) < 1e-5, kwargs
    unsplit, split = seen
    tile = triton_attention.UNSPLIT_DECODE_TILE
    assert unsplit == (1, *tile, tile[0], window == 0)
    assert split[:5] == (3, 64, 4, 3, 0)


def poison_unused_slots(case):
    """The case with a block 0 of NaN that no sequence uses (a masked block-table load reads block 0)
    and NaN in every other slot no context holds (the rest of a last block, the spare blocks)."""
    nan = torch.full_like(case.key_cache[:1], float("nan"))
    case = dataclasses.replace(case, key_cache=torch.cat([nan, case.key_cache]),
                               value_cache=torch.cat([nan, case.value_cache]),
                               block_tables=case.block_tables + 1)
    block_size = case.key_cache.shape[1]
    used = torch.zeros(case.key_cache.shape[:2], dtype=torch.bool)
    for seq, length in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(length)
        used[case.block_tables[seq, pos // block_size].long(), pos % block_size] = True
    case.key_cache[~used] = float("nan")
    case.value_cache[~used] = float("nan")
    return case


@pytest.mark.parametrize(("head_dim", "block_size", "softcap"), [(32, 16, 0.0), (32, 8, 2.0), (24, 16, 0.0)])
def test_decode_reads_its_last_partial_tile_block_aligned(monkeypatch, seed, head_dim, block_size, softcap):
    """An unsplit decode launch takes its partial last K/V tile through _attend_bulk's TAIL (BULK_TAIL),
    in int32 offsets (OFFSET32), without head-dim masks when head_dim is a power of two (EVEN_D): every
    context length around the tile's and the blocks' sizes matches the reference with NaN in every slot
    past the contexts and in block 0 (the TAIL loads those rows' K unmasked: their scores are masked, their
    V zeroed), with a logit soft-cap too (small, so that a mask put before it, which maps -inf to -cap,
    would give those positions weight)."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (
        kw["BULK_N"], kw["BLOCK_ADDR"], kw["BULK_TAIL"], kw["OFFSET32"], kw["EVEN_D"]))
    lens = [1, 7, 15, 16, 17, 31, 32, 33, 47, 100]
    case = make_paged_case(lens, [1] * len(lens), 8, 2, head_dim, block_size, torch.float32, "cpu", seed)
    case = poison_unused_slots(case)
    ref = reference.paged_attention(*case.args(), 0, softcap)
    out = triton_attention.paged_attention(*case.args(), 0, softcap, num_splits=1)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"
    assert seen == [(triton_attention.UNSPLIT_DECODE_TILE[0], True, True, True, head_dim == 32)]


def test_decode_offsets_in_int64_for_a_cache_past_int32(monkeypatch, seed):
    """A cache of more than 2^31 - 1 elements keeps 64-bit K/V offsets (OFFSET32 off): the same bits as
    the 32-bit ones (the same elements are read), here by lowering the bound below a small cache."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: kw["OFFSET32"])
    case = make_paged_case([150, 70, 33, 9], [1, 1, 1, 1], 8, 2, 32, 16, torch.float32, "cpu", seed)
    narrow = triton_attention.paged_attention(*case.args(), num_splits=1)
    monkeypatch.setattr(triton_attention, "OFFSET32_MAX_ELEMENTS", case.key_cache.numel() - 1)
    wide = triton_attention.paged_attention(*case.args(), num_splits=1)
    assert seen == [True, False]
    assert torch.equal(narrow, wide)
    assert relative_error(wide, reference.paged_attention(*case.args())) < 1e-5


def test_kv_addressing_env_gives_the_form_before(monkeypatch, seed):
    """PAGEDSERVE_KV_ADDRESSING=64: 64-bit offsets, the last tile masked through _attend_tiles, head-dim
    masks (round 31's launch, for paired comparisons), the same result within rounding; another value
    is refused by name."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (
        kw["OFFSET32"], kw["BULK_TAIL"], kw["EVEN_D"], kw["BULK_N"], kw["BLOCK_ADDR"]))
    case = make_paged_case([150, 70, 33, 9], [1, 1, 1, 1], 8, 2, 32, 16, torch.float32, "cpu", seed)
    new = triton_attention.paged_attention(*case.args(), num_splits=1)
    monkeypatch.setenv(kernels.KV_ADDRESSING_ENV, "64")
    old = triton_attention.paged_attention(*case.args(), num_splits=1)
    bulk_n = triton_attention.UNSPLIT_DECODE_TILE[0]
    assert seen == [(True, True, True, bulk_n, True), (False, False, False, bulk_n, True)]
    assert relative_error(new, old) < 1e-6
    monkeypatch.setenv(kernels.KV_ADDRESSING_ENV, "16")
    with pytest.raises(ValueError, match="PAGEDSERVE_KV_ADDRESSING='16'"):
        triton_attention.paged_attention(*case.args(), num_splits=1)


def test_offsets_fit_int32_at_the_bound():
    meta = dict(device="meta", dtype=torch.bfloat16)
    assert triton_attention.offsets_fit_int32(torch.empty(1, 1, 1, 2**31 - 1, **meta))
    assert not triton_attention.offsets_fit_int32(torch.empty(1, 1, 1, 2**31, **meta))
    # llama3-8b's layers (16 slots x 8 KV heads x 128 a block): 120 GB of cache in 32 layers is 57,220
    # blocks a layer (0.94 G elements) and fits; 2^17 blocks are 2^31 elements and do not
    assert triton_attention.offsets_fit_int32(torch.empty(57_220, 16, 8, 128, **meta))
    assert not triton_attention.offsets_fit_int32(torch.empty(2**17, 16, 8, 128, **meta))


@pytest.mark.parametrize(("cache_dtype", "window", "softcap"), [
    (torch.float8_e4m3fn, 0, 0.0), (torch.float32, 6, 0.0), (torch.float32, 0, 30.0)])
def test_mixed_launch_runs_its_decode_rows_through_the_decode_launch(
    monkeypatch, cache_dtype, window, softcap
):
    """A mixed launch without GQA that cannot read fresh K/V (an FP8 cache; a window or a softcap) is
    two launches: the varlen tile with SKIP_DECODE for the sequences of several tokens, then the
    decode launch (its tile, no split) for the others, also after a split varlen launch, whose reduce
    writes every row. With GQA (unless over an FP8 cache with many sequences), in deterministic mode
    and with a forced split it stays one varlen launch. All match the reference, and the decode rows
    have the bits of a decode launch of them alone."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (
        kw["IS_DECODE"], kw["SKIP_DECODE"], grid[2], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]))
    case = make_paged_case([29, 70, 1, 40, 200], [11, 1, 1, 16, 1], 4, 4, 32, 8, torch.float32, "cpu", 3)
    fp8 = cache_dtype != torch.float32
    scales = dict(k_scale=0.5, v_scale=2.0) if fp8 else {}
    key_cache, value_cache = ((c.clamp(-448, 448).to(cache_dtype) for c in (case.key_cache, case.value_cache))
                              if fp8 else (case.key_cache, case.value_cache))
    args = (case.query, key_cache, value_cache, *case.args()[3:], window, softcap)
    ref = reference.paged_attention(*args, **scales)
    out = triton_attention.paged_attention(*args, **scales)
    assert relative_error(out, ref) < 1e-5
    decode_tile = triton_attention.FP8_MHA_DECODE_TILE if fp8 else triton_attention.UNSPLIT_DECODE_TILE
    assert seen == [(False, True, 1, 64, 4, 2), (True, False, 1, *decode_tile)]
    # the decode rows (tokens 11, 12 and 29 of the step) as a decode launch of those sequences alone
    rows, seqs = [11, 12, 29], [1, 2, 4]
    alone = triton_attention.paged_attention(
        case.query[rows], key_cache, value_cache, case.block_tables[seqs], case.seq_lens[seqs],
        torch.arange(4, dtype=torch.int32), 1, case.max_seq_len, case.scale, window, softcap,
        num_splits=1, **scales)
    assert torch.equal(out[rows], alone)
    # a small grid (2 programs, 8 slots on a CPU) and a graph's max_seq_len: the varlen launch splits
    small = dataclasses.replace(make_paged_case([600, 33], [1, 12], 1, 1, 32, 16, torch.float32, "cpu", 4),
                                max_seq_len=4096)
    if fp8:
        small = dataclasses.replace(small, key_cache=small.key_cache.to(cache_dtype),
                                    value_cache=small.value_cache.to(cache_dtype))
    seen.clear()
    split = triton_attention.paged_attention(*small.args(), window, softcap, **scales)
    assert [launch[:3] for launch in seen] == [(False, True, 4), (True, False, 1)]
    assert relative_error(split, reference.paged_attention(*small.args(), window, softcap, **scales)) < 1e-5
    for kwargs in ({"deterministic": True}, {"num_splits": 2}):
        seen.clear()
        out = triton_attention.paged_attention(*args, **scales, **kwargs)
        assert relative_error(out, ref) < 1e-5, kwargs
        assert [launch[:2] for launch in seen] == [(False, False)], kwargs
    # with GQA (4 query heads a KV head) the decode rows stay in the varlen launch, but for an FP8 cache
    # from FP8_GQA_SPLIT_DECODE_MIN_PROGRAMS programs of them (sequences x KV heads) on
    gqa = make_paged_case([29, 70, 1, 40, 200], [11, 1, 1, 16, 1], 8, 2, 32, 8, torch.float32, "cpu", 5)
    if fp8:
        gqa = dataclasses.replace(gqa, key_cache=gqa.key_cache.clamp(-448, 448).to(cache_dtype),
                                  value_cache=gqa.value_cache.clamp(-448, 448).to(cache_dtype))
    gqa_args = (*gqa.args(), window, softcap)
    gqa_ref = reference.paged_attention(*gqa_args, **scales)
    for min_programs, two_launches in ((11, False), (10, fp8)):  # 5 sequences x 2 KV heads
        monkeypatch.setattr(triton_attention, "FP8_GQA_SPLIT_DECODE_MIN_PROGRAMS", min_programs)
        seen.clear()
        out = triton_attention.paged_attention(*gqa_args, **scales)
        want = [(False, True), (True, False)] if two_launches else [(False, False)]
        assert [launch[:2] for launch in seen] == want, min_programs
        assert relative_error(out, gqa_ref) < 1e-5


def test_fp8_decode_without_gqa_takes_the_mha_tile_split(monkeypatch):
    """A decode launch over an FP8 cache: with GQA FP8_DECODE_TILE and the grid's split count (none for
    a large grid); without (one KV head a query head) FP8_MHA_DECODE_TILE, split at least
    FP8_MHA_MIN_SPLITS ways where max_seq_len allows; all match the reference."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (
        grid[2], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["EVEN_SPLITS"]))
    for heads, kv_heads, max_seq_len, want in (
        (8, 2, 4096, (1, *triton_attention.FP8_DECODE_TILE, False)),
        (4, 4, 4096, (triton_attention.FP8_MHA_MIN_SPLITS, *triton_attention.FP8_MHA_DECODE_TILE, True)),
        (4, 4, 250, (1, *triton_attention.FP8_MHA_DECODE_TILE, False)),  # one partition of >= 256
    ):
        case = make_paged_case([150, 70, 33, 250], [1] * 4, heads, kv_heads, 32, 16, torch.float32, "cpu", 7)
        e4m3 = torch.float8_e4m3fn
        case = dataclasses.replace(case, max_seq_len=max_seq_len, key_cache=case.key_cache.to(e4m3),
                                   value_cache=case.value_cache.to(e4m3))
        seen.clear()
        out = triton_attention.paged_attention(*case.args(), k_scale=0.5, v_scale=2.0)
        assert seen == [want], (heads, kv_heads, max_seq_len)
        ref = reference.paged_attention(*case.args(), k_scale=0.5, v_scale=2.0)
        assert relative_error(out, ref) < 1e-5


def test_split_count_follows_grid_size():
    choose = triton_attention.choose_num_splits
    # min_splits: at least that many where max_seq_len holds them, whatever the grid
    assert choose(num_programs=512, max_seq_len=4096, num_slots=264, min_splits=2) == 2
    assert choose(num_programs=512, max_seq_len=300, num_slots=264, min_splits=4) == 2
    assert choose(num_programs=512, max_seq_len=200, num_slots=264, min_splits=2) == 1
    assert choose(num_programs=8, max_seq_len=4096, num_slots=264, min_splits=2) == \
        choose(num_programs=8, max_seq_len=4096, num_slots=264)  # the grid's count is more
    assert choose(num_programs=512, max_seq_len=4096, num_slots=264) == 1  # a wave or more: no split
    assert choose(num_programs=200, max_seq_len=16384, num_slots=264) == 1  # >= 3/4 of a wave: no split
    assert choose(num_programs=190, max_seq_len=16384, num_slots=264) == 2  # 380 >= 0.9 x 264
    assert choose(num_programs=128, max_seq_len=16384, num_slots=264) == 2  # 256 programs
    assert choose(num_programs=96, max_seq_len=16384, num_slots=264) == 3  # 192 < 237.6 <= 288
    assert choose(num_programs=32, max_seq_len=16384, num_slots=264) == 8  # 4 sequences: 256 programs
    assert choose(num_programs=8, max_seq_len=300, num_slots=264) == 2  # capped by the partition size
    # the FP8 cache's one-warp decode tile: 1.5 x num_slots programs, the last wave >= 90 % full
    assert choose(num_programs=128, max_seq_len=16384, num_slots=264, fp8_decode=True) == 4
    assert choose(num_programs=190, max_seq_len=16384, num_slots=264, fp8_decode=True) == 4


def test_reshape_and_cache_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 7, 8, 3, 16, 13
    qkv = torch.randn(num_tokens, 5 * num_kv_heads, head_dim, generator=gen)  # [T, q+k+v heads, d]
    key = qkv[:, 3 * num_kv_heads : 4 * num_kv_heads]  # strided views, as a model produces them
    value = qkv[:, 4 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:3]] = -1
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *want, slots)
    triton_cache.reshape_and_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1]), f"seed {seed}"


def test_copy_blocks_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, 12, 8, 2, 16, generator=gen)  # [L, 2, blocks, bs, kvh, d]
    mapping = random_block_pairs(gen, 12, 12, 5, disjoint=True)
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    triton_cache.copy_blocks(kv, mapping)
    assert torch.equal(kv, want), f"seed {seed}"


def test_swap_blocks_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(2, 2, 10, 8, 2, 16, generator=gen)
    dst = torch.randn(2, 2, 6, 8, 2, 16, generator=gen)
    mapping = random_block_pairs(gen, 10, 6, 4, disjoint=False)
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    triton_cache.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, want), f"seed {seed}"


# ---- layer kernels (kernels/triton_layers.py) ------------------------------------------------------

LAYER_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, dim, with_residual):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim, generator=g).to(dtype)
    residual = torch.randn(5, dim, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    y, res = triton_layers.rms_norm(x, weight, 1e-5, residual)
    y_ref, res_ref = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(res, res_ref)  # the residual stream: one rounded add, as in torch
    assert relative_error(y, y_ref) < LAYER_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_rotary_embedding_matches_reference_on_views_of_a_fused_qkv(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    num_tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2, generator=g)[None]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 100, (num_tokens,), generator=g)
    q_out, k_out = triton_layers.rotary_embedding(positions, q, k, cos, sin)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cos, sin)
    assert relative_error(q_out, q_ref) < LAYER_TOLERANCE[dtype]
    assert relative_error(k_out, k_ref) < LAYER_TOLERANCE[dtype]
    assert not torch.equal(q_out, q)  # positions > 0 rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [48, 1100])  # one partial chunk; two chunks of 1024
def test_silu_and_mul_matches_reference(dtype, inter):
    x = torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype)
    assert relative_error(triton_layers.silu_and_mul(x), reference.silu_and_mul(x)) < LAYER_TOLERANCE[dtype]


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
@pytest.mark.parametrize("window", [1, 5, 16, 37, 64])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_attention_sliding_window_matches_reference(seed, name, window, num_splits):
    """Keys `window` or more positions before a query are masked, for decode and prefill rows, in
    unsplit and split launches (partitions wholly before a window stay empty)."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    ref = reference.paged_attention(*case.args(), window)
    out = triton_attention.paged_attention(*case.args(), window, num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"
    if window < min(seq_lens):  # the window changes the result: the test would see a kernel ignore it
        assert relative_error(reference.paged_attention(*case.args()), ref) > 1e-3


@pytest.mark.parametrize("window", [1, 3, 20])
def test_reference_sliding_window_is_attention_over_the_last_window_keys(seed, window):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 4, 16, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(30, 2, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    windowed = reference.attend_one_sequence(query, key, value, 0.25, sliding_window=window)
    sliced = reference.attend_one_sequence(query, key[-window:], value[-window:], 0.25)
    torch.testing.assert_close(windowed, sliced)


def test_paged_attention_sliding_window_with_a_small_tile(seed):
    """Tiles of 16 positions: whole tiles before the last row's window, several masked ones at its
    edge, unmasked ones inside, the causal diagonal."""
    seq_lens, query_lens = ATTENTION_CASES["long_chunk_after_prefix"]
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    ref = reference.paged_attention(*case.args(), 45)
    out = triton_attention.paged_attention(*case.args(), 45, tile=(16, 4, 2), block_m=16)
    assert relative_error(out, ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize(
    "name", ["decode", "prefill_with_cached_prefix", "mixed_chunk_and_decodes", "long_decode"]
)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.5), (0, 50.0), (9, 2.0)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_attention_logit_softcap_matches_reference(seed, name, window, softcap, num_splits):
    """Gemma 2's attention logit soft-capping (alone, and with its sliding window)."""
    seq_lens, query_lens = ATTENTION_CASES[name]
    case = make_paged_case(seq_lens, query_lens, 8, 2, 32, 8, torch.float32, "cpu", seed)
    case = dataclasses.replace(case, query=case.query * 8)  # scores of several units: the cap matters
    ref = reference.paged_attention(*case.args(), window, softcap)
    out = triton_attention.paged_attention(*case.args(), window, softcap, num_splits=num_splits)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"
    if softcap < 10:
        assert relative_error(reference.paged_attention(*case.args(), window), ref) > 1e-3


BALANCED_LENGTHS = [5, 300, 40, 1000, 17, 1, 600, 256]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(8, 2, 32, 16), (4, 4, 24, 8), (8, 1, 32, 64)])
@pytest.mark.parametrize(("balance_programs", "balance_chunks"), [(1, 4), (5, 4), (16, 4), (64, 2), (64, 3),
                                                                   (1000, 8)])
def test_balanced_decode_matches_reference(seed, num_heads, num_kv_heads, head_dim, block_size,
                                           balance_programs, balance_chunks):
    """Chunks of whole K/V tiles and blocks (block size 64: 64-position grains), one or several a
    sequence, up to the launch's chunk count; a head_dim below its power of two; a context of one
    position."""
    case = make_paged_case(BALANCED_LENGTHS, [1] * 8, num_heads, num_kv_heads, head_dim, block_size,
                           torch.float32, "cpu", seed)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), balance_programs=balance_programs,
                                           balance_chunks=balance_chunks)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


def test_balanced_decode_chunks_are_the_plans():
    """With every ticket held far below its count (so no chunk is the last), the rows of the sequences
    balanced_chunks gives one chunk are right and those of several stay unwritten: the kernel splits
    where the host-side plan says, and the last chunk's fold is what combines them. Each ticket then
    counts its sequence's chunks; with them back at zero the next launch is right everywhere, and
    leaves them at zero."""
    case = make_paged_case(BALANCED_LENGTHS, [1] * 8, 8, 2, 32, 16, torch.float32, "cpu", 1)
    ref = reference.paged_attention(*case.args())
    part, chunks = triton_attention.balanced_chunks(BALANCED_LENGTHS, 2, 16, 4)
    assert (part, chunks) == (288, [1, 2, 1, 4, 1, 1, 3, 1])
    tickets = triton_attention.balance_tickets(torch.device("cpu"), 16)
    assert not tickets.any()
    held = -1000
    tickets.fill_(held)
    try:
        out = triton_attention.paged_attention(*case.args(), balance_programs=16, balance_chunks=4,
                                               out=torch.full_like(case.query, float("nan")))
        for seq, count in enumerate(chunks):
            assert torch.allclose(out[seq], ref[seq], atol=1e-5, rtol=1e-5) == (count == 1), (seq, count)
            assert torch.isnan(out[seq]).all() == (count > 1), (seq, count)
        taken = (tickets[:16].view(8, 2) - held).tolist()  # (sequence, KV head)
        assert taken == [[c, c] if c > 1 else [0, 0] for c in chunks]
    finally:
        tickets.zero_()
    out = triton_attention.paged_attention(*case.args(), balance_programs=16, balance_chunks=4)
    assert relative_error(out, ref) < 1e-5
    assert not tickets.any()


def test_balanced_decode_with_graph_padding():
    """A decode graph's padding: sequences of length 0 and query length 0 after the real ones, a
    max_seq_len far above every context; their programs exit, the real rows match the reference."""
    case = make_paged_case(BALANCED_LENGTHS, [1] * 8, 8, 2, 32, 16, torch.float32, "cpu", 2)
    ref = reference.paged_attention(*case.args())
    pad = 5
    seq_lens = torch.cat([case.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    starts = torch.cat([case.query_start_loc, torch.full((pad,), 8, dtype=torch.int32)])
    tables = torch.cat([case.block_tables, case.block_tables[:pad]])
    query = torch.cat([case.query, torch.randn(pad, *case.query.shape[1:])])
    out = triton_attention.paged_attention(query, case.key_cache, case.value_cache, tables, seq_lens, starts,
                                           1, 8192, case.scale, balance_programs=16)
    assert relative_error(out[:8], ref) < 1e-5


@pytest.mark.parametrize("launch", ["rule", "unsplit", "fixed_split", "even_split", "balanced", "fp8",
                                    "mixed_no_gqa"])
def test_decode_order_gives_the_same_bits(seed, launch, monkeypatch):
    """A decode launch that takes its sequences in decode_order (one grid axis, the longest context
    first; every launch on PAGEDSERVE_DECODE_ORDER=all) writes the same bits as in their own order,
    whichever way it splits: the balanced rule's choice (balanced here), no split, fixed partitions,
    even splits, balanced chunks, an FP8 cache; and the decode launch after a mixed launch's varlen
    tile (no GQA). Any permutation gives those bits; a decode_order of the wrong shape or dtype is
    refused."""
    monkeypatch.setenv(kernels.DECODE_ORDER_ENV, "all")
    lens, q_lens, heads, kv_heads, kwargs = BALANCED_LENGTHS, [1] * 8, 8, 2, {}
    if launch == "unsplit":
        kwargs = dict(num_splits=1)
    elif launch == "fixed_split":
        kwargs = dict(num_splits=3)
    elif launch == "even_split":
        lens, q_lens, kv_heads = [600, 150], [1, 1], 1  # 2 programs, 8 slots on a CPU: even splits
    elif launch == "balanced":
        kwargs = dict(balance_programs=5, balance_chunks=4)
    elif launch == "mixed_no_gqa":
        lens, q_lens, heads, kv_heads = [29, 1, 300, 16, 90], [11, 1, 1, 16, 1], 4, 4
    case = make_paged_case(lens, q_lens, heads, kv_heads, 32, 16, torch.float32, "cpu", seed)
    extra = dict(k_scale=0.5, v_scale=2.0) if launch == "fp8" else {}
    if launch == "fp8":
        e4m3 = torch.float8_e4m3fn
        case = dataclasses.replace(case, key_cache=case.key_cache.to(e4m3),
                                   value_cache=case.value_cache.to(e4m3))
    order = kernels.decode_order(case.seq_lens)
    assert order.dtype == torch.int32
    assert order.tolist() == sorted(range(len(lens)), key=lambda i: (-lens[i], i))  # longest first, stable
    plain = triton_attention.paged_attention(*case.args(), **extra, **kwargs)
    ref = reference.paged_attention(*case.args(), **extra)
    assert relative_error(plain, ref) < 1e-5
    shuffled = torch.randperm(len(lens), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    for perm in (order, shuffled):
        out = triton_attention.paged_attention(*case.args(), **extra, **kwargs, decode_order=perm)
        assert torch.equal(out, plain), (launch, perm.tolist())
    for bad in (order.long(), order[:-1]):
        with pytest.raises(ValueError, match="decode_order must be int32"):
            triton_attention.paged_attention(*case.args(), **extra, **kwargs, decode_order=bad)


def test_decode_order_env(monkeypatch):
    """PAGEDSERVE_DECODE_ORDER: unset or "rule", the launches that neither split nor run balanced over a
    plain cache take the order; "all" every one, "0" none; anything else is refused at an executor's
    start. needs_decode_order: a step sorts its lengths under the rule only past
    BALANCED_MAX_PROGRAMS_PER_SLOT programs a split slot (the H200's 264 slots: 66 sequences of 8 KV
    heads), never off CUDA."""
    monkeypatch.setattr(triton_attention, "split_slots", lambda device: 264)
    cuda = torch.device("cuda", 0)
    plain_unsplit, uneven = (False, True), [(True, True), (False, False), (True, False)]
    for value in (None, "rule", "all", "0"):
        if value is None:
            monkeypatch.delenv(kernels.DECODE_ORDER_ENV, raising=False)
        else:
            monkeypatch.setenv(kernels.DECODE_ORDER_ENV, value)
        mode = value or "rule"
        assert kernels.decode_order_mode() == mode
        assert kernels.ordered_decode(*plain_unsplit) is (mode != "0")
        assert all(kernels.ordered_decode(*kind) is (mode == "all") for kind in uneven)
        assert kernels.needs_decode_order(67, 8, cuda) is (mode != "0")
        assert kernels.needs_decode_order(66, 8, cuda) is (mode == "all")
        assert kernels.needs_decode_order(1, 1, cuda) is (mode == "all")
        assert kernels.needs_decode_order(67, 8, cuda, plain_cache=False) is (mode == "all")  # FP8
        assert not kernels.needs_decode_order(512, 8, torch.device("cpu"))
    for bad in ("1", "yes"):
        monkeypatch.setenv(kernels.DECODE_ORDER_ENV, bad)
        with pytest.raises(ValueError, match=f"PAGEDSERVE_DECODE_ORDER='{bad}'"):
            kernels.check_launch_env()


class _LaunchRecorder:
    """Stands for a Triton kernel object: records each launch's grid and ORDERED (and in `tiles` its
    BLOCK_N, num_warps and num_stages), then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.tiles = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((tuple(grid), kwargs["ORDERED"]))
            self.tiles.append((kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_default_rule_orders_only_the_plain_unsplit_launch(seed, monkeypatch):
    """With PAGEDSERVE_DECODE_ORDER unset, a decode launch given an order takes it (one grid axis,
    ORDERED) only unsplit and unbalanced over a plain cache without a window; split, balanced and
    windowed launches keep their three-axis grid; every one writes the bits of the unordered launch."""
    monkeypatch.delenv(kernels.DECODE_ORDER_ENV, raising=False)
    recorder = _LaunchRecorder(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", recorder)
    case = make_paged_case(BALANCED_LENGTHS, [1] * 8, 8, 2, 32, 16, torch.float32, "cpu", seed)
    order = kernels.decode_order(case.seq_lens)
    kinds = {"unsplit": (dict(num_splits=1), 0, True), "split": (dict(num_splits=3), 0, False),
             "balanced": (dict(balance_programs=5, balance_chunks=4), 0, False),
             "windowed": (dict(num_splits=1), 100, False)}
    for name, (kwargs, window, ordered) in kinds.items():
        args = (*case.args(), window)  # sliding_window
        plain = triton_attention.paged_attention(*args, **kwargs)
        recorder.launches.clear()
        out = triton_attention.paged_attention(*args, **kwargs, decode_order=order)
        assert torch.equal(out, plain), name
        grid, took = recorder.launches[0]
        assert took is ordered and (len(grid) == 1) is ordered, (name, grid, took)


def test_wide_decode_tile_takes_few_programs_a_slot(seed, monkeypatch):
    """An unbalanced, unsplit decode launch of more than 2 and at most WIDE_DECODE_MAX_PROGRAMS_PER_SLOT
    programs a split slot (a CPU has 8) with GQA over a 16-bit cache without a window runs
    WIDE_DECODE_TILE; balanced (2 a slot), past the limit (5), a float32 cache, a window or no GQA keep
    UNSPLIT_DECODE_TILE. The
    tile attends as the reference does, in any order (float32 here, the tile forced: the interpreter's
    bf16 dots are not the GPU's; tests/gpu/test_balanced_decode_gpu.py checks the compiled bf16 launch)."""
    monkeypatch.delenv(kernels.BALANCED_DECODE_ENV, raising=False)
    recorder = _LaunchRecorder(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", recorder)
    rng = random.Random(seed)
    wide, narrow = triton_attention.WIDE_DECODE_TILE, triton_attention.UNSPLIT_DECODE_TILE
    for num_seqs, dtype, window, tile in [(12, torch.bfloat16, 0, wide), (16, torch.float16, 0, wide),
                                          (8, torch.bfloat16, 0, narrow), (20, torch.bfloat16, 0, narrow),
                                          (12, torch.float32, 0, narrow), (12, torch.bfloat16, 50, narrow)]:
        lens = [rng.randint(1, 400) for _ in range(num_seqs)]
        case = make_paged_case(lens, [1] * num_seqs, 8, 2, 32, 16, dtype, "cpu", seed)
        recorder.tiles.clear()
        triton_attention.paged_attention(*case.args(), window)
        assert recorder.tiles == [tile], (num_seqs, dtype, window)
    mha = make_paged_case([rng.randint(1, 400) for _ in range(12)], [1] * 12, 2, 2, 32, 16, torch.bfloat16,
                          "cpu", seed)  # no GQA: not measured, the narrow tile
    recorder.tiles.clear()
    triton_attention.paged_attention(*mha.args())
    assert recorder.tiles == [narrow]
    monkeypatch.setattr(triton_attention, "UNSPLIT_DECODE_TILE", wide)
    lens = [rng.randint(1, 700) for _ in range(12)]
    case = make_paged_case(lens, [1] * 12, 8, 2, 32, 16, torch.float32, "cpu", seed)
    recorder.tiles.clear()
    out = triton_attention.paged_attention(*case.args())
    assert recorder.tiles == [wide]
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-5
    order = kernels.decode_order(case.seq_lens)
    assert torch.equal(triton_attention.paged_attention(*case.args(), decode_order=order), out)
    # a softcapped model's unwindowed layers (Gemma 2) take the tile too: the cap as the reference's
    recorder.tiles.clear()
    capped = triton_attention.paged_attention(*case.args(), 0, 5.0)
    assert recorder.tiles == [wide]
    assert relative_error(capped, reference.paged_attention(*case.args(), 0, 5.0)) < 1e-5
    assert relative_error(capped, out) > 1e-3  # the cap changed the result: not the uncapped launch


def test_a_model_of_windowed_layers_only_never_sorts(monkeypatch):
    """with_decode_order sorts a step's lengths only for a model with a layer without a sliding window
    (attends_unwindowed): a windowed launch takes no order. needs_decode_order is asked as on a CUDA
    device of 264 split slots, where 67 sequences of 8 KV heads sort under the rule."""
    from torch import nn

    from executor_svc.layers.attention import (
        AttentionMetadata,
        PagedAttention,
        attends_unwindowed,
        with_decode_order,
    )

    monkeypatch.delenv(kernels.DECODE_ORDER_ENV, raising=False)
    monkeypatch.setattr(triton_attention, "split_slots", lambda device: 264)
    on_cuda = kernels.needs_decode_order
    monkeypatch.setattr(kernels, "needs_decode_order",
                        lambda n, kv, device, plain_cache=True: on_cuda(n, kv, torch.device("cuda", 0),
                                                                         plain_cache))
    mistral = nn.ModuleList(PagedAttention(32, 8, 128, 0.1, sliding_window=4096) for _ in range(2))
    gemma = nn.ModuleList(PagedAttention(32, 8, 128, 0.1, sliding_window=w) for w in (4096, 0))
    assert not attends_unwindowed(mistral) and attends_unwindowed(gemma)
    assert attends_unwindowed(nn.ModuleList([PagedAttention(32, 8, 128, 0.1)]))
    lens = torch.randint(1, 2000, (67,), dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(67, dtype=torch.int64), torch.zeros(67, 4, dtype=torch.int32), lens,
                             torch.arange(68, dtype=torch.int32), 1, 2000)
    cache = torch.empty(2, 2, 4, 16, 8, 128, dtype=torch.bfloat16)  # [L, 2, N, bs, KV, D]
    assert with_decode_order(meta, cache, attends_unwindowed(mistral)) is meta
    sorted_meta = with_decode_order(meta, cache, attends_unwindowed(gemma))
    assert torch.equal(sorted_meta.decode_order, kernels.decode_order(lens))
    assert with_decode_order(meta, cache.to(torch.float8_e4m3fn), True) is meta  # FP8: no order taken


def test_balanced_chunks_cover_each_context():
    """However uneven the lengths, each sequence has 1 to max_chunks chunks of one partition size (whole
    32-position tiles, at least _MIN_PARTITION) that cover its context and no more."""
    rng = random.Random(0)
    for _ in range(2000):
        num_seqs = rng.randint(1, 300)
        kv_heads = rng.choice([1, 2, 8, 40])
        programs, max_chunks = rng.randint(1, 600), rng.randint(1, 8)
        lens = [rng.choice([0, 1, rng.randint(1, 100), rng.randint(1, 20000)]) for _ in range(num_seqs)]
        part, chunks = triton_attention.balanced_chunks(lens, kv_heads, programs, max_chunks)
        assert part >= triton_attention._MIN_PARTITION and part % 32 == 0
        assert all(1 <= c <= max_chunks and (c * part >= n > (c - 1) * part or (n == 0 and c == 1))
                   for c, n in zip(chunks, lens, strict=True))


def test_balanced_decode_rule(monkeypatch):
    """By default (and with PAGEDSERVE_BALANCED_DECODE=rule) the decode launches that would not split,
    up to BALANCED_MAX_PROGRAMS_PER_SLOT programs a split slot, and those that would split in two run
    balanced and the other even splits are left; =0 balances none; =all balances both; a forced split
    count, a window, an FP8 cache, deterministic mode and more than BALANCED_MAX_SEQS sequences never
    run balanced; an unknown value is refused."""
    seen = record_attention_launches(monkeypatch, lambda grid, kw: (kw["BALANCED"], grid[2]))
    big = make_paged_case(BALANCED_LENGTHS, [1] * 8, 8, 2, 32, 16, torch.float32, "cpu", 3)  # 16 programs
    small = dataclasses.replace(make_paged_case([600, 150], [1, 1], 8, 1, 32, 16, torch.float32, "cpu", 4),
                                max_seq_len=4096)  # 2 programs, 8 slots on a CPU: split in four
    halves = dataclasses.replace(make_paged_case([600, 150, 40, 300], [1] * 4, 8, 1, 32, 16, torch.float32,
                                                 "cpu", 5), max_seq_len=4096)  # 4 programs: split in two
    e4m3 = torch.float8_e4m3fn
    fp8 = dataclasses.replace(big, key_cache=big.key_cache.to(e4m3), value_cache=big.value_cache.to(e4m3))

    def launches(env, case, *args, kernel_only=None, **kwargs):
        if env is None:
            monkeypatch.delenv(kernels.BALANCED_DECODE_ENV, raising=False)
        else:
            monkeypatch.setenv(kernels.BALANCED_DECODE_ENV, env)
        seen.clear()
        out = triton_attention.paged_attention(*case.args(), *args, **kwargs, **(kernel_only or {}))
        assert relative_error(out, reference.paged_attention(*case.args(), *args, **kwargs)) < 1e-5
        return seen[0]

    chunks = triton_attention.BALANCED_MAX_CHUNKS
    assert launches(None, big) == (True, chunks)  # the default is the rule
    assert launches("0", big) == (False, 1)
    assert launches("rule", big) == (True, chunks)  # 16 programs: 2 a slot, BALANCED_MAX_PROGRAMS_PER_SLOT
    nine = make_paged_case(BALANCED_LENGTHS + [70], [1] * 9, 8, 2, 32, 16, torch.float32, "cpu", 3)
    assert launches("rule", nine) == (False, 1)  # 18 programs: one a sequence and KV head
    assert launches(None, nine) == (False, 1)
    assert launches(None, small)[0] is False
    assert launches("all", nine) == (True, chunks)
    assert launches("rule", small)[0] is False
    assert launches(None, halves) == (True, chunks)
    assert launches("0", halves) == (False, 2)
    assert launches("all", small) == (True, chunks)
    assert launches("all", big, kernel_only=dict(num_splits=1))[0] is False
    assert launches("all", big, 4)[0] is False  # a sliding window of 4
    assert launches("all", fp8, k_scale=0.5, v_scale=2.0)[0] is False
    assert launches("all", big, kernel_only=dict(deterministic=True))[0] is False
    monkeypatch.setattr(triton_attention, "BALANCED_MAX_SEQS", 8)  # more sequences: never balanced
    assert launches("all", nine) == (False, 1)
    with pytest.raises(ValueError, match="at most 8 sequences, got 9"):
        triton_attention.paged_attention(*nine.args(), balance_chunks=2)
    # the benchmarks' kwargs on a launch that cannot run balanced: refused, not silently ignored
    for case, args, kwargs, named in ((big, (4,), {}, "sliding_window 4"),
                                      (fp8, (), dict(k_scale=0.5, v_scale=2.0), "float8_e4m3fn cache"),
                                      (big, (), dict(deterministic=True), "deterministic True")):
        with pytest.raises(ValueError, match=f"balance_programs and balance_chunks take .*{named}"):
            triton_attention.paged_attention(*case.args(), *args, **kwargs, balance_chunks=2)
    monkeypatch.setenv(kernels.BALANCED_DECODE_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_BALANCED_DECODE='yes'"):
        kernels.check_launch_env()
