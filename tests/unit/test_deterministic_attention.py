"""Deterministic paged attention (kernels/triton_attention.py, deterministic=True) on CPU under the
Triton interpreter: a row's output bits do not depend on the other sequences of its step, on its
place in the batch, on whether it is decoded or is a row of a prefill (whole, as after recompute, or
chunked), nor on which blocks hold its K/V (as after a swap). Each case also matches the reference.

Every step here reads one random cache: sequence s's K/V at all its positions and a query per
position, so the same row computed in different steps gets the same inputs (in a model, the
batch-invariant linear layers see to that).
"""

import importlib
import os
import random

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_deterministic_gpu.py covers the compiled kernels",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference, triton_attention  # noqa: E402
from kernels.testing import PagedCase, make_paged_case, relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_attention = importlib.reload(triton_attention)

patch_interpreter_for_numpy()

SEQ_LENS = [150, 37, 200, 64]  # sequence 0 is the one followed; 150: three K/V tiles of 64, the last partial
HEADS = {"gqa_group_4": (8, 2), "mha": (2, 2)}  # (query heads, KV heads)
WINDOWS = {"full": 0, "sliding_40": 40}
HEAD_DIM, BLOCK_SIZE = 32, 16

Entry = tuple[int, int, int]  # (sequence, first query position, end): positions [first, end), seq_len end


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


def make_case(heads: str, seed: int) -> PagedCase:
    """Every sequence of SEQ_LENS prefilled whole: its queries at all positions, its K/V in the cache."""
    num_heads, num_kv_heads = HEADS[heads]
    return make_paged_case(
        SEQ_LENS, SEQ_LENS, num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, torch.float32, "cpu", seed
    )


def attend(
    case: PagedCase, entries: list[Entry], window: int, impl=triton_attention, block_tables=None, caches=None
) -> list[torch.Tensor]:
    """One step over `entries` (each a sequence's query positions [first, end) with context end);
    the output rows [end - first, H, D] of each entry."""
    starts = [sum(SEQ_LENS[:s]) for s in range(len(SEQ_LENS))]
    query = torch.cat([case.query[starts[s] + first : starts[s] + end] for s, first, end in entries])
    q_lens = [end - first for _, first, end in entries]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = case.block_tables if block_tables is None else block_tables
    key_cache, value_cache = (case.key_cache, case.value_cache) if caches is None else caches
    args = (
        query, key_cache, value_cache, tables[[s for s, _, _ in entries]],
        torch.tensor([end for _, _, end in entries], dtype=torch.int32), query_start_loc,
        max(q_lens), max(end for _, _, end in entries), case.scale, window,
    )
    if impl is triton_attention:
        out = impl.paged_attention(*args, deterministic=True)
    else:
        out = impl.paged_attention(*args)
    return list(out.split(q_lens))


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str, seed: int) -> None:
    differ = (got != want).any(dim=-1).any(dim=-1).nonzero().flatten().tolist()  # rows that differ
    assert not differ, f"seed {seed}: {what}: rows {differ[:8]} differ (of {got.shape[0]})"


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_a_decode_row_is_the_same_alone_and_in_any_batch(seed, heads, window):
    case, w = make_case(heads, seed), WINDOWS[window]
    last = SEQ_LENS[0]
    alone = attend(case, [(0, last - 1, last)], w)[0]
    batch = attend(case, [(1, 36, 37), (0, last - 1, last), (2, 199, 200)], w)[1]
    other_batch = attend(case, [(2, 150, 151), (3, 63, 64), (1, 20, 21), (0, last - 1, last)], w)[3]
    with_prefills = attend(case, [(3, 0, 64), (0, last - 1, last), (2, 100, 180)], w)[1]
    assert_bitwise_equal(batch, alone, "decoded in a batch vs alone", seed)
    assert_bitwise_equal(other_batch, alone, "decoded last in another batch vs alone", seed)
    assert_bitwise_equal(with_prefills, alone, "decoded beside prefills vs alone", seed)
    want = attend(case, [(0, last - 1, last)], w, impl=reference)[0]
    assert relative_error(alone, want) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("heads", list(HEADS))
def test_every_row_is_the_same_decoded_as_in_a_whole_or_chunked_prefill(seed, heads, window):
    """Row p of sequence 0 computed: as a decode step with context p + 1 (one step decodes all
    positions, as sequences sharing the block table), as a row of the whole prompt's prefill (a
    recompute), and as a row of a chunked prefill, in chunks of 32 and in two uneven chunks beside
    other sequences."""
    case, w = make_case(heads, seed), WINDOWS[window]
    last = SEQ_LENS[0]
    whole = attend(case, [(0, 0, last)], w)[0]  # [L, H, D]
    decoded = torch.cat(attend(case, [(0, p, p + 1) for p in range(last)], w))
    chunks_of_32 = torch.cat([attend(case, [(0, a, min(a + 32, last))], w)[0] for a in range(0, last, 32)])
    first_chunk = attend(case, [(1, 36, 37), (0, 0, 70)], w)[1]
    second_chunk = attend(case, [(2, 0, 50), (3, 63, 64), (0, 70, last)], w)[2]
    assert_bitwise_equal(decoded, whole, "decode vs whole prefill", seed)
    assert_bitwise_equal(chunks_of_32, whole, "chunks of 32 vs whole prefill", seed)
    two_chunks = torch.cat([first_chunk, second_chunk])
    assert_bitwise_equal(two_chunks, whole, "chunks 70 + 80 in batches vs whole", seed)
    want = attend(case, [(0, 0, last)], w, impl=reference)[0]
    assert relative_error(whole, want) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("heads", list(HEADS))
def test_rows_are_the_same_after_the_blocks_move(seed, heads):
    """A swap out and back in (or a recompute into fresh blocks) puts the same K/V in other blocks."""
    case = make_case(heads, seed)
    num_blocks = case.key_cache.shape[0]
    moved_to = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))  # old id -> new id
    key_cache, value_cache = torch.empty_like(case.key_cache), torch.empty_like(case.value_cache)
    key_cache[moved_to], value_cache[moved_to] = case.key_cache, case.value_cache
    tables = moved_to[case.block_tables.long()].to(torch.int32)
    assert not torch.equal(tables[0], case.block_tables[0])
    last = SEQ_LENS[0]
    before = attend(case, [(0, last - 1, last), (0, 0, 90)], 0)
    moved = dict(block_tables=tables, caches=(key_cache, value_cache))
    after = attend(case, [(0, last - 1, last), (0, 0, 90)], 0, **moved)
    assert_bitwise_equal(after[0], before[0], "decode after the move", seed)
    assert_bitwise_equal(after[1], before[1], "prefill after the move", seed)


def test_deterministic_mode_takes_no_split_or_other_tile():
    case = make_case("mha", 0)
    for forced in ({"num_splits": 2}, {"tile": (32, 4, 2)}, {"block_m": 32}):
        with pytest.raises(ValueError, match="one tile shape and no split"):
            triton_attention.paged_attention(*case.args(), deterministic=True, **forced)
