"""PrefillTuning (kernels/triton_attention.py), the prefill candidates that kernels/bench_prefill.py
sweeps on the GPU, against the torch reference on CPU under the Triton interpreter: every sweep
candidate as the sweep launches it, and each switch alone on small tiles (several unmasked K/V tiles
before the causal diagonal) through prefill with and without a cached prefix, mixed batches with
decode rows, GQA and MHA, split-K, sliding windows and soft-capping. Decode launches ignore a tuning;
deterministic mode refuses one.
"""

import dataclasses
import importlib
import os
import random

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py runs the compiled kernels",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference, triton_attention  # noqa: E402
from kernels.testing import make_paged_case, relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_attention = importlib.reload(triton_attention)

from kernels.bench_prefill import PREFILL_CANDIDATES  # noqa: E402  (after the reload: same module object)

patch_interpreter_for_numpy()

PrefillTuning = triton_attention.PrefillTuning

# (seq_lens, query_lens): a prefill without prefix, a chunk after a cached prefix, two decode rows;
# 208 = 13 blocks of 16: with BLOCK_N 64, three unmasked tiles before the diagonal of the last rows
MIXED = ([208, 150, 1, 97], [208, 70, 1, 1])


@pytest.fixture
def seed(request):
    value = random.randrange(2**31)
    print(f"{request.node.name}: seed {value}")
    return value


@pytest.mark.parametrize("name", [n for n, kwargs in PREFILL_CANDIDATES.items() if kwargs])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (2, 2)])
def test_each_sweep_candidate_matches_reference(seed, name, num_heads, num_kv_heads):
    """The candidates' own tiles (64 or 128 rows, BLOCK_N 32-128) at head_dim 128 (no D padding)."""
    case = make_paged_case(*MIXED, num_heads, num_kv_heads, 128, 16, torch.float32, "cpu", seed)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), **PREFILL_CANDIDATES[name])
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


SMALL = dict(block_m=16, block_n=16, bulk_block_n=32)  # many unmasked tiles at small sizes
SWITCHES = {
    "plain": PrefillTuning(**SMALL),
    "block_addressing": PrefillTuning(**SMALL, block_addressing=True),
    "fma_softmax": PrefillTuning(**SMALL, fma_softmax=True),
    "bulk_smaller_than_diagonal": PrefillTuning(
        block_m=32, block_n=32, bulk_block_n=16, block_addressing=True
    ),
    "all": PrefillTuning(**SMALL, block_addressing=True, fma_softmax=True),
}
CASES = {  # name: (seq_lens, query_lens)
    "prefill_no_prefix": ([70, 16, 3], [70, 16, 3]),
    "prefill_with_cached_prefix": ([130, 40], [50, 8]),
    "mixed_chunks_and_decodes": ([29, 1, 96, 16], [11, 1, 1, 16]),
}


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("case_name", list(CASES))
def test_each_switch_matches_reference(seed, switch, case_name):
    """Block size 8, head_dim 24 (padded to 32: the masked loads), GQA 3 (padded to 4 rows a token).
    Queries x 8: scores of several units, so the running max moves from tile to tile and a wrong
    rescale (of acc, l or the FMA softmax's scaled max) shows."""
    case = make_paged_case(*CASES[case_name], 6, 2, 24, 8, torch.float32, "cpu", seed)
    case = dataclasses.replace(case, query=case.query * 8)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(*case.args(), prefill_tuning=SWITCHES[switch])
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "num_splits"),
    [
        ([300], [9], None),  # 3 tiles x 1 KV head: split 2 ways by default (8 slots on a CPU), evenly
        ([130, 1, 40], [50, 1, 40], 3),  # forced: partitions of 44 positions, not block-aligned
    ],
)
def test_tuning_with_split_k(seed, seq_lens, query_lens, num_splits):
    """Even partitions start at whole BLOCK_N tiles, so block addressing holds (the interpreter checks
    the kernel's tl.assume); forced ones start anywhere, and the host turns it off."""
    if num_splits is None:
        assert triton_attention.choose_num_splits(3, 300, 8) == 2
    case = make_paged_case(seq_lens, query_lens, 4, 1, 32, 8, torch.float32, "cpu", seed)
    case = dataclasses.replace(case, query=case.query * 8)
    ref = reference.paged_attention(*case.args())
    out = triton_attention.paged_attention(
        *case.args(), num_splits=num_splits, prefill_tuning=SWITCHES["all"]
    )
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize(
    ("window", "softcap", "num_splits"), [(37, 0.0, None), (5, 0.0, None), (0, 2.0, None), (20, 5.0, None)]
)
def test_tuning_with_sliding_window_and_softcap(seed, window, softcap, num_splits):
    """The tuned loop after the window's masked edge (block addressing then falls back to per-position
    addresses: the unmasked part starts anywhere), and with soft-capped scores."""
    case = make_paged_case([130, 5, 61], [40, 1, 61], 8, 2, 32, 8, torch.float32, "cpu", seed)
    case = dataclasses.replace(case, query=case.query * 8)
    tuning = PrefillTuning(**SMALL, block_addressing=True, fma_softmax=True)
    ref = reference.paged_attention(*case.args(), window, softcap)
    out = triton_attention.paged_attention(*case.args(), window, softcap, num_splits=num_splits,
                                           prefill_tuning=tuning)
    err = relative_error(out, ref)
    assert err < 1e-5, f"seed {seed}: relative error {err}"
    assert relative_error(reference.paged_attention(*case.args()), ref) > 1e-3  # the window/cap matter


def test_decode_launch_ignores_the_tuning(seed):
    case = make_paged_case([40, 17, 1], [1, 1, 1], 8, 2, 32, 8, torch.float32, "cpu", seed)
    tuning = PrefillTuning(block_m=128, num_warps=8)
    tuned = triton_attention.paged_attention(*case.args(), prefill_tuning=tuning)
    assert torch.equal(tuned, triton_attention.paged_attention(*case.args()))


def test_tuning_refused_with_deterministic_tile_or_block_m():
    case = make_paged_case([20], [20], 4, 2, 16, 8, torch.float32, "cpu", 0)
    for extra in (dict(deterministic=True), dict(tile=(16, 4, 2)), dict(block_m=16)):
        with pytest.raises(ValueError, match="prefill_tuning"):
            triton_attention.paged_attention(*case.args(), prefill_tuning=PrefillTuning(), **extra)
    with pytest.raises(TypeError, match="PrefillTuning"):
        triton_attention.paged_attention(*case.args(), prefill_tuning={"block_m": 64})


@pytest.mark.parametrize("bad", [
    dict(block_m=48), dict(block_n=8), dict(bulk_block_n=0), dict(block_m=True), dict(num_warps=3),
    dict(num_warps=32), dict(num_stages=0), dict(num_stages=9), dict(maxnreg=300), dict(maxnreg=16),
    dict(num_stages=True), dict(block_addressing="yes"), dict(fma_softmax=1),
])
def test_prefill_tuning_checks_its_fields(bad):
    with pytest.raises(ValueError, match="PrefillTuning." + next(iter(bad))):
        PrefillTuning(**bad)


class _LaunchSpy:
    """Stands in for the attention kernel: records each launch's compile-time choices, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({k: kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "BULK_N", "BLOCK_ADDR",
                                                              "FMA_SOFTMAX", "num_warps", "maxnreg")})
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize(("kwargs", "want"), [
    ({}, dict(BLOCK_M=128, BULK_N=64, BLOCK_ADDR=True, FMA_SOFTMAX=True, num_warps=8, maxnreg=128)),
    ({"tile": (64, 4, 2)}, dict(BLOCK_M=64, BULK_N=0, num_warps=4, maxnreg=None)),
    ({"deterministic": True}, dict(BLOCK_M=16, BULK_N=0, maxnreg=None)),
])
def test_prefill_launches_take_the_default_tuning_unless_told_otherwise(monkeypatch, seed, kwargs, want):
    """A prefill or mixed launch of the default mode runs DEFAULT_PREFILL_TUNING (the H100 sweep's
    fastest); a forced tile, block_m or deterministic mode keep their own launch; decode keeps its own
    tile."""
    spy = _LaunchSpy(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", spy)
    case = make_paged_case(*MIXED, 8, 2, 128, 16, torch.float32, "cpu", seed)
    out = triton_attention.paged_attention(*case.args(), **kwargs)
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-5
    assert spy.launches and {k: spy.launches[0][k] for k in want} == want
    decode = make_paged_case([40, 17], [1, 1], 8, 2, 128, 16, torch.float32, "cpu", seed)
    spy.launches.clear()
    triton_attention.paged_attention(*decode.args())
    block_n, num_warps, _ = triton_attention.UNSPLIT_DECODE_TILE  # the decode launch's tile (unsplit)
    launch = spy.launches[0]
    assert (launch["BLOCK_M"], launch["BULK_N"], launch["num_warps"]) == (16, block_n, num_warps)


def test_a_launch_of_mostly_decode_rows_keeps_the_64_row_tile(monkeypatch, seed):
    """Fewer than PREFILL_TUNING_MIN_TOKENS_PER_SEQ tokens a sequence (a mixed step of many decodes,
    or a mixed-step graph's bucket): the untuned 64-row launch, still correct."""
    spy = _LaunchSpy(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", spy)
    seq_lens, query_lens = [60] + [33] * 7, [40] + [1] * 7  # 47 tokens, 8 sequences
    assert sum(query_lens) < triton_attention.PREFILL_TUNING_MIN_TOKENS_PER_SEQ * len(seq_lens)
    case = make_paged_case(seq_lens, query_lens, 8, 2, 128, 16, torch.float32, "cpu", seed)
    out = triton_attention.paged_attention(*case.args())
    assert relative_error(out, reference.paged_attention(*case.args())) < 1e-5
    assert spy.launches[0]["BLOCK_M"] == 64 and spy.launches[0]["BULK_N"] == 0
