"""`--deterministic` reaches the kernels: the flag of serve and bench becomes the executor's
WorkerConfig.deterministic, the Worker sets the process-wide switch before it builds the model, and
the attention layer passes the switch to the kernel."""

import argparse

import pytest
import torch

import kernels
from clients.cli.serve import add_arguments, executor_command
from executor_svc.layers import determinism
from executor_svc.layers.attention import AttentionMetadata, PagedAttention
from executor_svc.worker import worker as worker_module


@pytest.fixture(autouse=True)
def default_mode_after():
    yield
    determinism.set_deterministic(False)


def test_serve_passes_the_flag_to_the_executor():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    on = executor_command(parser.parse_args(["--model", "m", "--deterministic"]), "m", 0, 1, 2)
    off = executor_command(parser.parse_args(["--model", "m"]), "m", 0, 1, 2)
    assert "--deterministic" in on and "--deterministic" not in off


@pytest.mark.parametrize("on", [True, False])
def test_the_worker_sets_the_switch_before_building_the_model(tiny_llama_dir, monkeypatch, on):
    determinism.set_deterministic(not on)
    seen = []
    load_model = worker_module.load_model

    def recording_load_model(*args):
        seen.append(determinism.deterministic())
        return load_model(*args)

    monkeypatch.setattr(worker_module, "load_model", recording_load_model)
    worker_module.Worker(str(tiny_llama_dir), device="cpu", dtype="float32", deterministic=on)
    assert seen == [on] and determinism.deterministic() == on


@pytest.mark.parametrize("on", [True, False])
def test_the_attention_layer_passes_the_switch_to_the_kernel(monkeypatch, on):
    calls = []
    monkeypatch.setattr(kernels, "paged_attention", lambda *args, **kwargs: calls.append(kwargs) or args[0])
    determinism.set_deterministic(on)
    num_tokens, heads, head_dim = 3, 2, 8
    layer = PagedAttention(heads, heads, head_dim, 1.0)
    q = torch.zeros(num_tokens, heads, head_dim)
    kv = torch.zeros(num_tokens, heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32), max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    layer(q, kv, kv, torch.zeros(2, 1, 4, heads, head_dim), meta)
    assert len(calls) == 1 and calls[0]["deterministic"] is on
