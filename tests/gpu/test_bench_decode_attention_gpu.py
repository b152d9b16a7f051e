"""`clients.bench.decode_attention` on a GPU: a row a step size, the engine's launch, the reference met."""

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from clients.bench import decode_attention  # noqa: E402


@pytest.mark.parametrize("addressing", ["32", "64"])
def test_rows_for_two_step_sizes(capsys, monkeypatch, addressing):
    monkeypatch.setenv("PAGEDSERVE_KV_ADDRESSING", addressing)
    assert decode_attention.main(["--seqs", "18,257", "--layers", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["seqs"] for r in rows] == [18, 257] and [r["bucket"] for r in rows] == [24, 256 + 32]
    for row in rows:
        assert row["us_per_layer"] > 0 and row["rel_error_vs_reference"] < 2e-2
        assert row["launch"]["OFFSET32"] is (addressing == "32")
    assert rows[1]["launch"]["ORDERED"] and not rows[1]["launch"]["BALANCED"]
