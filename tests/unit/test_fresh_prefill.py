"""The fresh-K/V prefill launch (kernels/triton_attention.py `fresh_prefill`, paged_attention's
`fresh_kv`) against the torch reference on CPU under the Triton interpreter: prefill rows read the
cached prefix through the block table and the step's own K/V from strided views of a QKV buffer (as
the model's projection leaves them), decode rows of a mixed step go through the decode launch.
"""

import dataclasses
import importlib
import itertools
import os
import random

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_fresh_prefill_gpu.py runs the compiled kernels",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference, triton_attention  # noqa: E402
from kernels.testing import fresh_qkv, make_paged_case, relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_attention = importlib.reload(triton_attention)

patch_interpreter_for_numpy()

FreshTuning = triton_attention.FreshTuning
SMALL = FreshTuning(block_m=16, block_n=16, num_warps=1, num_stages=1)
SMALL_PACKED = FreshTuning(block_m=16, block_n=16, num_warps=1, num_stages=1, packed=True)
WIDE_N = FreshTuning(block_m=16, block_n=32, num_warps=1, num_stages=1)
SMALL_PAIRED = FreshTuning(block_m=16, block_n=16, num_warps=1, num_stages=1, paired=True)
PACKED_PAIRED = FreshTuning(block_m=16, block_n=16, num_warps=1, num_stages=1, packed=True, paired=True)
BULK_PREFIX = FreshTuning(block_m=16, block_n=16, num_warps=1, num_stages=1, prefix_bulk=True)
BULK_WIDE_M = FreshTuning(block_m=32, block_n=16, num_warps=1, num_stages=1, paired=True, prefix_bulk=True)

# (seq_lens, query_lens): a prompt without prefix, a chunk after a 45-token cached prefix (not a
# multiple of the tile), two decode rows, a two-token chunk after a long prefix
MIXED = ([53, 115, 9, 1, 66], [53, 70, 1, 1, 2])


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


def fresh_views(case, heads, kv_heads, dim):
    q, k, v = fresh_qkv(case)
    assert k.shape == (case.query.shape[0], kv_heads, dim) and q.shape[1] == heads
    return q, k, v


def run(case, q, k, v, tuning, **kwargs):
    args = (q,) + case.args()[1:]
    return triton_attention.paged_attention(*args, fresh_kv=(k, v), fresh_tuning=tuning, **kwargs)


@pytest.mark.parametrize(
    "tuning", [SMALL, SMALL_PACKED, WIDE_N, SMALL_PAIRED, PACKED_PAIRED, BULK_PREFIX, BULK_WIDE_M],
    ids=["per_head", "packed", "block_n_32", "paired", "packed_paired", "prefix_bulk",
         "prefix_bulk_paired_m32"],
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the GPU test (the interpreter)
@pytest.mark.parametrize("lookup", ["at_once", "binary_search"])
def test_mixed_step_matches_reference(seed, tuning, heads, kv_heads, dtype, lookup, monkeypatch):
    """Every tile of every prefill row is computed once (paired tiles of sequences of 4 and 5 query
    tiles: the middle tile of the odd one is its own pair), whichever way programs find their sequence."""
    if lookup == "binary_search":
        monkeypatch.setattr(triton_attention, "FRESH_LOOKUP_MAX_SEQS", 2)  # MIXED has 5 sequences
    case = make_paged_case(*MIXED, heads, kv_heads, 16, 16, dtype, "cpu", seed)
    q, k, v = fresh_views(case, heads, kv_heads, 16)
    out = run(case, q, k, v, tuning)
    ref = reference.paged_attention(*case.args())
    err = relative_error(out, ref)
    assert err < (1e-5 if dtype == torch.float32 else 2e-3), f"seed {seed}: relative error {err}"


def test_prefill_rows_read_the_fresh_kv_not_the_cache(seed):
    """Fresh K/V that differ from the cache: the prefill rows' answer is the one computed with the
    fresh values at the step's positions (the cache's prefix positions still from the cache), and the
    decode rows' answer the cache's."""
    heads, kv_heads, dim = 4, 2, 16
    case = make_paged_case(*MIXED, heads, kv_heads, dim, 16, torch.float32, "cpu", seed)
    q, k, v = fresh_views(case, heads, kv_heads, dim)
    k.mul_(-0.5)
    v.add_(1.0)
    out = run(case, q, k, v, SMALL)
    # the expected answer: the fresh values written into a copy of the cache at the prefill rows' slots
    key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
    starts = case.query_start_loc.tolist()
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        for i in range(q_len if q_len > 1 else 0):
            pos = seq_len - q_len + i
            block = int(case.block_tables[s, pos // 16])
            key_cache[block, pos % 16] = k[starts[s] + i]
            value_cache[block, pos % 16] = v[starts[s] + i]
    args = list(case.args())
    args[1], args[2] = key_cache, value_cache
    expected = reference.paged_attention(*args)
    assert relative_error(out, expected) < 1e-5
    decode_rows = [starts[2], starts[3]]
    plain = reference.paged_attention(*case.args())
    assert torch.allclose(out[decode_rows], plain[decode_rows], atol=1e-5)
    prefill_rows = list(range(starts[1], starts[2]))
    assert not torch.allclose(out[prefill_rows], plain[prefill_rows], atol=1e-2)


@pytest.mark.parametrize("tuning", [SMALL, SMALL_PAIRED], ids=["per_head", "paired"])
def test_prefix_free_compile_when_no_row_has_a_prefix(seed, tuning):
    """fresh_prefill(prefix=False), for a caller that knows no prefill row has a cached prefix: the
    kernel compiled without the prefix loop writes the same rows as with it."""
    case = make_paged_case([40, 17, 64], [40, 17, 64], 8, 2, 16, 16, torch.float32, "cpu", seed)
    q, k, v = fresh_views(case, 8, 2, 16)
    outs = []
    for prefix in (True, False):
        out = torch.full_like(q, 7.0)
        triton_attention.fresh_prefill(
            out, q, k, v, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
            case.query_start_loc, case.scale, tuning, prefix=prefix,
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[1], reference.paged_attention(*case.args())) < 1e-5


@pytest.mark.parametrize(
    "tuning", [SMALL, BULK_PREFIX, WIDE_N], ids=["per_head", "prefix_bulk", "block_n_32"]
)
def test_cache_slots_outside_the_sequences_may_hold_nan(seed, tuning):
    """A prefix tile that runs past the prefix reads rows it then masks out (block 0's for positions
    past the prefix): their V rows must weigh nothing even when the cache holds NaN there (a cache's
    unused slots are never cleared). Every slot outside the sequences' positions is NaN here."""
    case = make_paged_case(*MIXED, 8, 2, 16, 16, torch.float32, "cpu", seed)
    # block 0's contents move to a new last block: block 0, where masked rows read, is then unused
    spare = case.key_cache.shape[0]
    case = dataclasses.replace(
        case, key_cache=torch.cat([case.key_cache, case.key_cache[:1]]),
        value_cache=torch.cat([case.value_cache, case.value_cache[:1]]),
        block_tables=torch.where(case.block_tables == 0, spare, case.block_tables).to(torch.int32),
    )
    block_size = case.key_cache.shape[1]
    live = torch.zeros(case.key_cache.shape[0] * block_size, dtype=torch.bool)
    for seq, seq_len in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        live[case.block_tables[seq, pos // block_size].long() * block_size + pos % block_size] = True
    for cache in (case.key_cache, case.value_cache):
        cache.view(-1, *cache.shape[2:])[~live] = float("nan")
    q, k, v = fresh_views(case, 8, 2, 16)
    out = run(case, q, k, v, tuning)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-5


def test_decode_launch_skips_prefill_rows():
    """A mixed step's decode launch writes only the rows of one-token sequences."""
    case = make_paged_case(*MIXED, 4, 2, 16, 16, torch.float32, "cpu", 3)
    out = torch.full_like(case.query, 7.0)
    args = list(case.args())
    args[6] = 1  # max_query_len 1: the decode launch
    triton_attention.paged_attention(*args, out=out)
    starts = case.query_start_loc.tolist()
    ref = reference.paged_attention(*case.args())
    for s in range(len(MIXED[0])):
        rows = slice(starts[s], starts[s + 1])
        if starts[s + 1] - starts[s] == 1:
            assert torch.allclose(out[rows], ref[rows], atol=1e-5)
        else:
            assert (out[rows] == 7.0).all()


def test_default_tuning_by_shape():
    assert triton_attention.fresh_tuning_for(8192, 1) == triton_attention.LONG_FRESH_TUNING
    assert triton_attention.fresh_tuning_for(4 * 2048, 4) == triton_attention.DEFAULT_FRESH_TUNING
    assert triton_attention.fresh_tuning_for(4096, 20) == triton_attention.DEFAULT_FRESH_TUNING


@pytest.mark.parametrize("why", ["window", "softcap", "deterministic", "fp8", "odd_dim", "no_fresh"])
def test_unusable_fresh_kv_falls_back(why):
    """Where the fresh launch does not apply, the varlen kernel answers (and the answer is right)."""
    heads, kv_heads, dim = 4, 2, 24 if why == "odd_dim" else 16
    case = make_paged_case(*MIXED, heads, kv_heads, dim, 16, torch.float32, "cpu", 5)
    q, k, v = fresh_views(case, heads, kv_heads, dim)
    kwargs, ref_extra = {}, ()
    if why == "window":
        kwargs = dict(sliding_window=20)
        ref_extra = (20,)
    elif why == "softcap":
        kwargs = dict(logit_softcap=5.0)
        ref_extra = (0, 5.0)
    elif why == "deterministic":
        kwargs = dict(deterministic=True)
    fresh = None if why == "no_fresh" else (k, v)
    key_cache = case.key_cache.to(torch.float8_e4m3fn) if why == "fp8" else case.key_cache
    assert not triton_attention.fresh_kv_usable(
        q, key_cache, fresh, kwargs.get("sliding_window", 0), kwargs.get("logit_softcap", 0.0),
        kwargs.get("deterministic", False))
    if why == "fp8":
        return
    args = (q,) + case.args()[1:]
    out = triton_attention.paged_attention(*args, fresh_kv=fresh, **kwargs)
    ref = reference.paged_attention(*case.args(), *ref_extra)
    assert relative_error(out, ref) < 1e-5


def test_fresh_tuning_validates():
    for bad in (dict(block_m=24), dict(block_n=512), dict(num_warps=3), dict(num_stages=0),
                dict(prefix_stages=9), dict(prefix_stages=1.5), dict(num_stages=True), dict(paired="yes"),
                dict(prefix_bulk=1), dict(packed=None)):
        with pytest.raises(ValueError):
            FreshTuning(**bad)
    case = make_paged_case(*MIXED, 4, 2, 16, 16, torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match="fresh_tuning"):
        triton_attention.paged_attention(*case.args(), fresh_tuning=SMALL)  # no fresh_kv


def test_the_decode_launch_of_a_mixed_step_is_not_split(monkeypatch):
    """A split's reduce runs over every token of the launch: a mixed step's decode launch must not
    split (it would reduce all the prefill rows too), even where the split rule would."""
    monkeypatch.setattr(triton_attention, "choose_num_splits", lambda *a: 4)

    class NoReduce:
        def __getitem__(self, grid):
            raise AssertionError("the split reduce ran")

    monkeypatch.setattr(triton_attention, "_reduce_splits_kernel", NoReduce())
    case = make_paged_case(*MIXED, 4, 2, 16, 16, torch.float32, "cpu", 9)
    q, k, v = fresh_views(case, 4, 2, 16)
    out = run(case, q, k, v, SMALL)
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-5


def test_padding_rows_as_rotary_and_cache_leaves_them(seed):
    """A CUDA graph's step has padding tokens after the last sequence (query_start_loc[-1] < T) whose
    projections may hold NaN; rotary_and_cache(rotate_key_in_place=True) zeroes their K/V rows
    (tests/unit/test_rotary_and_cache.py), and with rows like that the last sequence's diagonal tile,
    which reads them, stays exact. (The kernel's contract: finite fresh rows; NaN rows give NaN.)"""
    heads, kv_heads, dim = 4, 2, 16
    case = make_paged_case(*MIXED, heads, kv_heads, dim, 16, torch.float32, "cpu", seed)
    q, k, v = fresh_views(case, heads, kv_heads, dim)
    pad = 21
    qkv = torch.cat([q._base, torch.full((pad, q._base.shape[1]), float("nan"))])
    width_q, width_kv = heads * dim, kv_heads * dim
    qkv[-pad:, width_q:] = 0.0  # K and V of the padding rows as rotary_and_cache leaves them; Q stays NaN
    q2 = qkv[:, :width_q].view(-1, heads, dim)
    k2 = qkv[:, width_q : width_q + width_kv].view(-1, kv_heads, dim)
    v2 = qkv[:, width_q + width_kv :].view(-1, kv_heads, dim)
    real = case.query.shape[0]
    ref = reference.paged_attention(*case.args())
    for tuning in (SMALL, WIDE_N):
        out = triton_attention.paged_attention(q2, *case.args()[1:], fresh_kv=(k2, v2), fresh_tuning=tuning)
        assert relative_error(out[:real], ref) < 1e-5


@pytest.mark.parametrize("bad", ["tokens", "heads", "dim", "dtype", "value"])
def test_fresh_kv_of_the_wrong_shape_or_dtype_is_refused(bad):
    case = make_paged_case(*MIXED, 4, 2, 16, 16, torch.float32, "cpu", 4)
    q, k, v = fresh_views(case, 4, 2, 16)
    if bad == "tokens":
        k = k[1:]
    elif bad == "heads":
        k = torch.cat([k, k], dim=1)
    elif bad == "dim":
        k = k[..., :8]
    elif bad == "dtype":
        k = k.to(torch.float16)
    else:
        v = v[:-1]
    with pytest.raises(ValueError, match="fresh_kv must be"):
        triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v))


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_an_out_tensor_of_the_wrong_shape_or_dtype_is_refused(bad):
    case = make_paged_case(*MIXED, 4, 2, 16, 16, torch.float32, "cpu", 6)
    out = torch.empty_like(case.query)
    out = out[:-1] if bad == "shape" else out.to(torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        triton_attention.paged_attention(*case.args(), out=out)


def test_no_cached_prefix_hint(seed):
    """paged_attention(fresh_kv, no_cached_prefix=True): prompts without a cached prefix and a decode
    row; on the CPU (no sm_90, so not the Gluon kernel) the prefix-free compile, the same rows as
    without the hint; with a forced fresh_tuning too."""
    case = make_paged_case([40, 1, 17, 64], [40, 1, 17, 64], 8, 2, 16, 16, torch.float32, "cpu", seed)
    q, k, v = fresh_views(case, 8, 2, 16)
    ref = reference.paged_attention(*case.args())
    plain = triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v), fresh_tuning=SMALL)
    hinted = triton_attention.paged_attention(
        q, *case.args()[1:], fresh_kv=(k, v), fresh_tuning=SMALL, no_cached_prefix=True
    )
    assert torch.equal(plain, hinted)
    assert relative_error(hinted, ref) < 1e-5
    auto = triton_attention.paged_attention(q, *case.args()[1:], fresh_kv=(k, v), no_cached_prefix=True)
    assert relative_error(auto, ref) < 1e-5


def test_no_cached_prefix_needs_fresh_kv():
    case = make_paged_case([40, 17], [40, 17], 4, 2, 16, 16, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="needs fresh_kv"):
        triton_attention.paged_attention(*case.args(), no_cached_prefix=True)


def test_gluon_kernel_is_sm90_only_and_validates():
    """kernels/gluon_prefill.py: not for CPU tensors (a clear error, and paged_attention does not pick
    it); the GPU test (tests/gpu/test_gluon_prefill_gpu.py) runs it."""
    from kernels import gluon_prefill

    case = make_paged_case([40, 17], [40, 17], 8, 2, 16, 16, torch.bfloat16, "cpu", 0)
    q, k, v = fresh_views(case, 8, 2, 16)
    assert not gluon_prefill.supported(q, k)
    with pytest.raises(ValueError, match="needs sm_90"):
        gluon_prefill.gluon_fresh_prefill(torch.empty_like(q), q, k, v, case.query_start_loc, case.scale)


def test_prefill_tile_starts_by_hand():
    """The Gluon kernel's work list: 128-row query tiles of the sequences with >= 2 query tokens,
    cumulative; decode rows and empty (padding) sequences have none."""
    import kernels

    assert kernels.PREFILL_TILE_ROWS == 128
    lens = [1, 128, 129, 0, 2, 1, 300, 0]  # tiles 0, 1, 2, 0, 1, 0, 3, 0
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    got = kernels.prefill_tile_starts(starts)
    assert got.dtype == torch.int32 and got.tolist() == [0, 0, 1, 3, 3, 4, 4, 7, 7]
    assert kernels.prefill_tile_starts(starts.long()).tolist() == got.tolist()  # int64 offsets too
    assert kernels.prefill_tile_starts(torch.zeros(1, dtype=torch.int32)).tolist() == [0]  # no sequence

