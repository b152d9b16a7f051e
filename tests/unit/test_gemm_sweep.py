"""The GEMM tile sweep (tests/gpu/gemm_sweep.py, run on a GPU as `python -m
tests.gpu.test_batch_invariant_gpu --configs`) on CPU: its candidates keep BLOCK_M and BLOCK_K and fit
shared memory, its selection on fake timings never picks a config that changed bits and splits M into
the buckets the timings call for, the table it prints is a valid TILE_TABLE, and one shape swept under
the Triton interpreter records a config of another BLOCK_K as changing bits."""

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch

from kernels import triton_batch_invariant
from kernels.triton_batch_invariant import TileConfig, check_tile_table, tile_config
from tests.gpu import gemm_sweep

CUDA = torch.device("cuda")  # tile_config reads the device type only
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(**changes) -> TileConfig:
    return TileConfig(**{**dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4), **changes})


NARROW, WIDE, MID = _cfg(block_n=32, num_stages=5), _cfg(block_n=128), _cfg(block_n=64)
CHANGER = _cfg(block_n=256, num_stages=3)  # fastest everywhere, but its bits differ at one M
BIG = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
TABLE = (
    (4096, ((64, NARROW), (None, WIDE))),
    (None, ((None, BIG),)),
)


def _case(shape, n, m, us: dict, cublas_us=10.0, changed=(), errors=()):
    """A recorded case with fake times (us per config); `changed` configs differ from today's bits."""
    current = tile_config(n, m, CUDA, table=TABLE)
    return dict(shape=shape, n=n, k=4096, m=m, cublas_us=cublas_us, current=gemm_sweep.label(current),
                current_rows_equal_small_batch=True, candidates=[
                    dict(label=gemm_sweep.label(config), config=dataclasses.asdict(config),
                         us=None if config in errors else time_us,
                         equal_current=None if config in errors else config not in changed,
                         equal_small_batch=None if config in errors else True,
                         error="OutOfResources: shared memory" if config in errors else None)
                    for config, time_us in us.items()
                ])


MS = (16, 64, 256, 1024)
US = {NARROW: (10, 12, 40, 160), WIDE: (14, 15, 30, 100), MID: (11, 13, 35, 120), CHANGER: (5, 5, 5, 5)}


def _cases(shape="o_proj", skip_m=None):
    cases = [_case(shape, 4096, m, {c: t[i] for c, t in US.items()}, changed=(CHANGER,) if m == 256 else ())
             for i, m in enumerate(MS)]
    if skip_m is not None:
        cases = [c if c["m"] != skip_m else dict(shape=shape, n=4096, k=4096, m=skip_m, skipped="deadline")
                 for c in cases]
    return cases


def test_candidates_keep_block_m_and_block_k_and_fit_shared_memory():
    for block_m, block_k in ((64, 128), (128, 64)):
        configs = gemm_sweep.candidate_configs(block_m, block_k)
        assert configs and len(set(configs)) == len(configs)
        assert {(c.block_m, c.block_k) for c in configs} == {(block_m, block_k)}
        assert all(gemm_sweep.shared_memory_bytes(c) <= gemm_sweep.SHARED_MEMORY_LIMIT for c in configs)
        assert {c.group_m for c in configs} == {8}
    narrow_k = gemm_sweep.candidate_configs(64, 128)
    assert len(narrow_k) == 16 and max(c.block_n for c in narrow_k) == 128  # BLOCK_N 256 needs > 220 KiB
    wide_n = [c for c in gemm_sweep.candidate_configs(128, 64) if c.block_n == 256]
    assert wide_n == [TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)]


def test_candidates_start_with_todays_configs_and_refuse_another_block_k():
    today = (_cfg(block_n=64, num_stages=6), WIDE)  # the first does not fit the limit: kept anyway
    configs = gemm_sweep.candidate_configs(64, 128, keep=today)
    assert configs[:2] == list(today) and configs.count(WIDE) == 1
    with pytest.raises(ValueError, match="BLOCK_K 64"):
        gemm_sweep.candidate_configs(64, 64, keep=today)


def test_todays_table_configs_are_among_the_candidates():
    """The sweep times today's configs as candidates too (its 'now' column)."""
    for _, buckets in triton_batch_invariant.TILE_TABLE:
        for _, config in buckets:
            assert config in gemm_sweep.candidate_configs(config.block_m, config.block_k)


def test_recommend_splits_m_where_the_best_config_changes_and_never_picks_a_bit_changer():
    cases = _cases()
    rec = gemm_sweep.recommend(cases, table=TABLE)
    assert [e["shapes"] for e in rec] == [["o_proj"], []]
    buckets = rec[0]["buckets"]
    assert [(b["max_m"], b["label"]) for b in buckets] == [(64, gemm_sweep.label(NARROW)),
                                                          (None, gemm_sweep.label(WIDE))]
    assert buckets[0]["ms"] == [16, 64] and buckets[1]["ms"] == [256, 1024]
    assert buckets[1]["ratio"] == {256: 3.0, 1024: 10.0}  # time over cuBLAS's 10 us
    assert buckets[0]["current_ratio"] == {16: 1.0, 64: 1.2}  # today: NARROW up to 64, WIDE above
    assert rec[1]["buckets"] is None
    assert gemm_sweep.best_candidate(cases[0])["label"] == gemm_sweep.label(CHANGER)  # fine at M = 16 alone
    assert gemm_sweep.best_candidate(cases[2])["label"] == gemm_sweep.label(WIDE)
    assert gemm_sweep.bit_changes(cases) == [dict(shape="o_proj", m=256, label=gemm_sweep.label(CHANGER),
                                                  equal_current=False, equal_small_batch=True)]


def test_recommend_with_one_bucket_takes_the_best_config_over_all_m():
    rec = gemm_sweep.recommend(_cases(), table=TABLE, max_buckets=1)
    assert [(b["max_m"], b["label"]) for b in rec[0]["buckets"]] == [(None, gemm_sweep.label(MID))]
    with pytest.raises(ValueError, match="max_buckets"):
        gemm_sweep.recommend(_cases(), table=TABLE, max_buckets=0)


def test_an_extra_bucket_must_gain_more_than_min_gain():
    near = {NARROW: (10.0, 10.0), WIDE: (10.1, 9.95)}  # WIDE is 0.5 % faster at M = 64 only
    cases = [_case("o_proj", 4096, m, {c: t[i] for c, t in near.items()}) for i, m in enumerate((16, 64))]
    one = gemm_sweep.recommend(cases, table=TABLE)[0]["buckets"]
    assert [(b["max_m"], b["label"]) for b in one] == [(None, gemm_sweep.label(NARROW))]
    two = gemm_sweep.recommend(cases, table=TABLE, min_gain=0.0)[0]["buckets"]
    assert [b["label"] for b in two] == [gemm_sweep.label(NARROW), gemm_sweep.label(WIDE)]


def test_recommend_weights_shapes_by_their_count_per_forward():
    """o_proj prefers NARROW a little, down prefers WIDE a lot: o_proj's 32 layers against down's 1 pick
    NARROW, equal counts pick WIDE."""
    cases = [_case("o_proj", 4096, 16, {NARROW: 10, WIDE: 11}),
             _case("down", 4096, 16, {NARROW: 20, WIDE: 10})]
    picks = {
        weight: gemm_sweep.recommend(cases, table=TABLE, weights={"o_proj": 32, "down": weight})[0]["buckets"]
        for weight in (1, 32)
    }
    assert picks[1][0]["label"] == gemm_sweep.label(NARROW)
    assert picks[32][0]["label"] == gemm_sweep.label(WIDE)


def test_recommend_skips_configs_that_failed_and_m_values_not_swept_for_every_shape():
    errors = _cases("o_proj") + _cases("down", skip_m=1024)
    errors[2]["candidates"] = [c if c["label"] != gemm_sweep.label(WIDE) else
                               dict(c, us=None, equal_current=None, equal_small_batch=None, error="boom")
                               for c in errors[2]["candidates"]]  # WIDE failed at o_proj M = 256
    entry = gemm_sweep.recommend(errors, table=TABLE)[0]
    assert entry["shapes"] == ["o_proj", "down"] and entry["ms"] == [16, 64, 256]
    labels = {b["label"] for b in entry["buckets"]}
    assert gemm_sweep.label(WIDE) not in labels and gemm_sweep.label(CHANGER) not in labels
    assert "Skipped (deadline): down M=1024" in gemm_sweep.summary_text([entry, dict(
        max_n=None, name="n > 4096", shapes=[], ms=[], buckets=None)], errors)


def test_recommend_takes_only_configs_of_the_class_block_m_and_block_k():
    other_k = _cfg(block_k=64)  # even with the same bits here: another reduction order
    cases = [_case("o_proj", 4096, m, {NARROW: 10, other_k: 1}) for m in (16, 64)]
    entry = gemm_sweep.recommend(cases, table=TABLE)[0]
    assert [b["label"] for b in entry["buckets"]] == [gemm_sweep.label(NARROW)]
    entry["buckets"] = [dict(entry["buckets"][0], max_m=16),  # a hand-edited recommendation
                        dict(entry["buckets"][0], max_m=None, config=dataclasses.asdict(other_k))]
    with pytest.raises(ValueError, match="must share BLOCK_K"):
        gemm_sweep.table_text([entry, dict(buckets=None, shapes=[])], table=TABLE)


def test_table_text_is_a_tile_table_that_gives_the_recommended_configs():
    rec = gemm_sweep.recommend(_cases(), table=TABLE)
    text = gemm_sweep.table_text(rec, table=TABLE)
    namespace = {"TileConfig": TileConfig, "TileTable": triton_batch_invariant.TileTable}
    exec(text, namespace)  # what one pastes into kernels/triton_batch_invariant.py
    pasted = namespace["TILE_TABLE"]
    check_tile_table(pasted)
    assert tile_config(4096, 64, CUDA, table=pasted) == NARROW
    assert tile_config(4096, 65, CUDA, table=pasted) == WIDE
    assert tile_config(4096, 100000, CUDA, table=pasted) == WIDE
    assert pasted[1] == TABLE[1]  # the class not swept keeps today's buckets
    assert "# today's buckets" in text and "# o_proj" in text


def test_summary_and_case_lines_report_bit_changes():
    cases = _cases()
    rec = gemm_sweep.recommend(cases, table=TABLE)
    summary = gemm_sweep.summary_text(rec, cases)
    assert "CANDIDATES THAT CHANGED BITS (never recommended): 1" in summary
    assert f"o_proj M=256 {gemm_sweep.label(CHANGER)}" in summary
    assert "m <= 64" in summary and "larger m" in summary and "(now 1.20x)" in summary
    line = gemm_sweep._case_line(cases[2])
    assert "CHANGED: " + gemm_sweep.label(CHANGER) in line and "3/4 same bits" in line
    assert "best " + gemm_sweep.label(WIDE) in line and "3.00x" in line and "now 3.00x" in line


def test_sweep_shape_under_the_interpreter_finds_a_config_that_changes_bits(monkeypatch):
    if type(triton_batch_invariant._matmul_kernel).__name__ != "InterpretedFunction":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, no CUDA)")
    from tests.helpers.triton_interpreter import patch_interpreter_for_numpy

    patch_interpreter_for_numpy()
    today = TileConfig()  # tile_config's off-CUDA answer
    other_k = TileConfig(block_k=16)
    monkeypatch.setattr(gemm_sweep, "DTYPE", torch.float32)  # float32 out: a changed sum order shows
    broken = TileConfig(block_n=128)  # as if it had failed to compile for an earlier shape
    monkeypatch.setattr(gemm_sweep, "candidate_configs",
                        lambda bm, bk, keep: [*keep, TileConfig(block_n=32, group_m=2), other_k, broken])
    failed = {gemm_sweep.label(broken): "OutOfResources: shared memory"}
    gen = torch.Generator().manual_seed(0)
    timer = lambda fn: (fn(), 0.002)[1]  # 2 us each
    warm_ups = []
    cases = gemm_sweep.sweep_shape("tiny", 24, 80, (3, 20), timer, time.monotonic() + 600, failed, gen,
                                   warm_up=lambda: warm_ups.append(1))
    assert [c["m"] for c in cases] == [3, 20] and len(failed) == 1 and warm_ups == [1]
    for case in cases:
        assert case["current"] == gemm_sweep.label(today) and case["current_rows_equal_small_batch"]
        assert case["cublas_us"] == 2.0
        bits = {c["label"]: (c["equal_current"], c["equal_small_batch"], c["us"]) for c in case["candidates"]}
        assert bits[gemm_sweep.label(today)] == (True, True, 2.0)
        assert bits[gemm_sweep.label(TileConfig(block_n=32, group_m=2))] == (True, True, 2.0)
        assert bits[gemm_sweep.label(broken)] == (None, None, None)
        assert case["candidates"][-1]["error"] == "OutOfResources: shared memory"
    assert any(not c["equal_current"] for case in cases for c in case["candidates"]
               if c["label"] == gemm_sweep.label(other_k))
    late = gemm_sweep.sweep_shape("tiny", 24, 80, (3,), timer, time.monotonic() - 1, failed, gen)
    assert late == [dict(shape="tiny", n=24, k=80, m=3, skipped="deadline")]


def test_a_config_that_cannot_run_is_recorded_not_raised():
    failed = {}
    x, weight = torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float64)  # mismatched dtypes
    assert gemm_sweep._try_matmul(x, weight, TileConfig(), failed) is None
    assert failed[gemm_sweep.label(TileConfig())].startswith("ValueError: matmul of x (2, 8)")


def test_parse_args_refuses_careless_flags():
    opts = gemm_sweep.parse_args(["--configs", "--ms", "256,16,16", "--shapes", "qkv,lm_head", "--out", "x"])
    assert opts.ms == (16, 256) and opts.shapes == ("qkv", "lm_head") and opts.out == "x"
    assert gemm_sweep.parse_args([]).configs is False
    for argv in (["--out", "x"], ["--configs", "--ms", "0,16"], ["--configs", "--ms", "a"],
                 ["--configs", "--shapes", "qkv,bogus"], ["--configs", "--rep-ms", "0"],
                 ["--configs", "--max-buckets", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            gemm_sweep.parse_args(argv)
        assert exit_info.value.code == 2, argv


def test_the_module_parses_help_and_refuses_the_sweep_without_cuda():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tests.gpu.test_batch_invariant_gpu", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    helped = run("--help")
    assert helped.returncode == 0 and "--configs" in helped.stdout and "--out" in helped.stdout
    if not torch.cuda.is_available():
        refused = run("--configs", "--ms", "16")
        assert refused.returncode == 1 and "--configs needs a CUDA device" in refused.stderr
