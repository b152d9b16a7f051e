"""make_tiny_model writes a real, deterministic HF model folder that transformers loads."""

from __future__ import annotations

import json

import pytest

from executor_svc.models.tiny import CORPUS, FAMILIES, make_tiny_model


def test_corpus_is_a_real_text_of_the_stated_size():
    text = CORPUS.read_text()
    assert 5_000 <= len(text.encode()) <= 20_000
    assert "block table" in text


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_model_dirs):
    again = make_tiny_model(tmp_path / "again", "qwen2", seed=0)
    other = make_tiny_model(tmp_path / "other", "qwen2", seed=1)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dirs["qwen2"] / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_folder(family, tiny_model_dirs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dirs[family]
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "The scheduler swaps blocks to the CPU when memory runs out."
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text) // 2  # merges were learned
    assert len(tokenizer) <= config["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
    )
    assert (ids[0] == config["bos_token_id"]) == (family in ("llama", "opt", "mixtral"))
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    logits = model(torch.tensor([ids])).logits[0, -1]
    assert 2.0 < logits.std().item() < 8.0  # spread enough that greedy ties are improbable


def test_the_cli_offers_every_tiny_family():
    from clients.cli.make_tiny_model import TINY_FAMILIES

    assert TINY_FAMILIES == FAMILIES
