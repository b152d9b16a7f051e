"""`clients.bench.decode_attention` on CPU: the graph padding, the argument checks and the refusal
without CUDA (the timing itself: tests/gpu/test_bench_decode_attention_gpu.py)."""

import pytest
import torch

from clients.bench import decode_attention
from executor_svc.runner.cuda_graphs import DECODE_BUCKETS


def test_lengths_pad_to_the_decode_bucket_with_empty_sequences():
    assert decode_attention.padded_lengths([5, 9, 3]) == [5, 9, 3, 0]  # the 4 bucket
    for n in (17, 33, 257):
        padded = decode_attention.padded_lengths(list(range(1, n + 1)))
        assert len(padded) == min(b for b in DECODE_BUCKETS if b >= n)
        assert padded[:n] == list(range(1, n + 1)) and set(padded[n:]) <= {0}
    past = [7] * (DECODE_BUCKETS[-1] + 1)  # past the largest bucket: eager, unpadded
    assert decode_attention.padded_lengths(past) == past


@pytest.mark.parametrize("argv", [["--seqs", "0"], ["--seqs", "x,2"], ["--seqs", "401"], ["--layers", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode_attention.main(argv)
    assert exit_info.value.code == 2
    assert "--seqs" in capsys.readouterr().err or "--layers" in " ".join(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_refuses_to_run_without_cuda(capsys):
    assert decode_attention.main(["--seqs", "4"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_step_row_on_cpu(monkeypatch):
    """The row's plumbing on CPU (kernels.paged_attention takes the reference there; one eager call
    stands for the graph's timing): the real contexts' bytes, the bucket, the reference met."""
    timed = []
    monkeypatch.setattr(decode_attention, "graph_call_us", lambda calls: timed.append(len(calls)) or 12.5)
    lengths = [40, 7, 100]
    row = decode_attention.bench_step(lengths, 3, 8192, torch.Generator().manual_seed(0), device="cpu")
    assert timed == [3]
    assert row["seqs"] == 3 and row["bucket"] == 4 and row["longest"] == 100
    assert row["kv_bytes"] == 2 * 147 * 8 * 128 * 2 and row["us_per_layer"] == 12.5
    assert row["rel_error_vs_reference"] < 1e-6
