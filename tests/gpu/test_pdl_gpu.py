"""Programmatic dependent launch (kernels.pdl) changes when a kernel's programs start, never what
they compute: a decode step's logits through the CUDA graphs are the same bits with PDL on and off,
and the same on every replay (a program that read its input before the kernel ahead of it finished
would make them differ from run to run). bf16, a tiny llama, batches on the skinny GEMMs (<= 64
rows), the split decode attention and its reduce, and cuBLAS (256 rows)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPLAYS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from executor_svc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("pdl") / "llama", "llama", seed=5)


def _logits(model_dir, monkeypatch, pdl: str) -> dict[int, list[torch.Tensor]]:
    import kernels
    from executor_svc.worker.worker import Worker
    from tests.gpu.test_cuda_graphs import _decode_batch

    monkeypatch.setenv(kernels.PDL_ENV, pdl)
    kernels._pdl_on.cache_clear()
    assert kernels.pdl(torch.device("cuda")) == (pdl == "1" and torch.cuda.get_device_capability()[0] >= 9)
    worker = Worker(str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=2048, num_cpu_blocks=0,
                    eager_mixed_steps=True)
    worker.init_cache(2048, 0)
    runner = worker.runner
    out = {}
    for case, num_seqs in enumerate((3, 16, 48, 256)):
        batch = _decode_batch(worker, num_seqs, seed=case)
        assert runner.decode_graphs.can_run(batch)
        out[num_seqs] = [runner.compute_logits(batch).clone() for _ in range(REPLAYS)]
    kernels._pdl_on.cache_clear()
    return out


def test_pdl_changes_no_bits(model_dir, monkeypatch):
    off = _logits(model_dir, monkeypatch, "0")
    on = _logits(model_dir, monkeypatch, "1")
    for num_seqs, replays in on.items():
        assert torch.isfinite(replays[0]).all()
        for i, logits in enumerate(replays):
            assert torch.equal(logits, replays[0]), (num_seqs, i)
            assert torch.equal(logits, off[num_seqs][i]), (num_seqs, i)
