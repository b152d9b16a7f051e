"""The Hugging Face peers of the benchmarks run and produce exactly the requested tokens."""

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("psutil")

from clients.bench.hf_peers import load_peer_model, run_continuous, run_static  # noqa: E402


@pytest.fixture(scope="module")
def peer_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("peer")
    transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ).save_pretrained(directory)
    return load_peer_model(str(directory), torch.float32, "cpu", dummy=True)


def _requests(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 300) for _ in range(rng.randint(3, 12))] for _ in range(5)]
    return prompts, [rng.randint(2, 7) for _ in prompts]


def test_static_batching_counts_each_request_own_tokens(peer_model):
    prompts, max_tokens = _requests(1)
    result = run_static(peer_model, prompts, max_tokens, batch_size=2)
    assert result.output_tokens == sum(max_tokens)
    assert result.num_requests == 5 and result.elapsed_s > 0


def test_continuous_batching_finishes_every_request(peer_model):
    prompts, max_tokens = _requests(2)
    result = run_continuous(peer_model, prompts, max_tokens, num_blocks=32)
    assert result.output_tokens == sum(max_tokens)
    assert result.as_dict()["output_tok_s"] > 0
