"""Weight loading: sharded safetensors, tied embeddings, dtypes, dummy weights, checkpoint errors,
tensor-parallel shards, and config.json parsing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from executor_svc.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from executor_svc.models.config import ModelConfig, ModelConfigError
from executor_svc.models.loader import WeightLoadError, load_model
from tests.helpers.checkpoints import copy_with

CPU = torch.device("cpu")


def load(model_dir, dtype=torch.float32, load_format="auto", seed=0):
    return load_model(model_dir, ModelConfig.from_dir(model_dir), dtype, CPU, load_format, seed=seed)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["llama"]
    weights = load_file(str(src / "model.safetensors"))
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(dst / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    one, two = state(load(src)), state(load(dst))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    # The fused projections hold the HF tensors in order.
    q, k, v = (weights[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(two["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    gate, up = (weights[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert torch.equal(two["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate, up]))


@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_tied_embeddings_share_one_tensor_and_a_saved_lm_head_is_ignored(family, tiny_model_dirs, tmp_path):
    model = load(tiny_model_dirs[family])
    assert (
        model.lm_head.weight
        is model.get_submodule(
            "model.embed_tokens" if family == "qwen2" else "model.decoder.embed_tokens"
        ).weight
    )
    weights = load_file(str(tiny_model_dirs[family] / "model.safetensors"))
    assert "lm_head.weight" not in weights
    embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    with_head = copy_with(tmp_path, tiny_model_dirs[family], weights | {"lm_head.weight": embed + 1})
    assert torch.equal(load(with_head).lm_head.weight, embed)


def test_untied_lm_head_is_loaded(tiny_model_dirs):
    weights = load_file(str(tiny_model_dirs["llama"] / "model.safetensors"))
    model = load(tiny_model_dirs["llama"])
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_checkpoint_errors_name_the_tensor(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen3"]
    weights = load_file(str(src / "model.safetensors"))
    missing = dict(weights)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(WeightLoadError, match="k_norm"):
        load(copy_with(tmp_path / "a", src, missing))
    with pytest.raises(WeightLoadError, match="surprise"):
        load(copy_with(tmp_path / "b", src, weights | {"model.surprise.weight": torch.zeros(2)}))
    wrong = weights | {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}
    with pytest.raises(WeightLoadError, match="down_proj.*exceeds"):
        load(copy_with(tmp_path / "c", src, wrong))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_load_and_agree_with_fp32(dtype, tiny_model_dirs):
    src = tiny_model_dirs["llama"]
    full, half = load(src), load(src, dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    assert half.model.layers[0].self_attn.rotary_emb.cos_cache.dtype == torch.float32
    w_full = full.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(half.model.layers[0].mlp.gate_up_proj.weight, w_full.to(dtype))


def test_dummy_weights_have_real_shapes_and_are_seeded(tiny_model_dirs):
    src = tiny_model_dirs["qwen2"]
    real, dummy, again, other = (
        load(src),
        load(src, load_format="dummy"),
        load(src, load_format="dummy"),
        None,
    )
    other = load(src, load_format="dummy", seed=1)
    r, d, a, o = state(real), state(dummy), state(again), state(other)
    assert {k: v.shape for k, v in r.items()} == {k: v.shape for k, v in d.items()}
    assert all(torch.equal(d[k], a[k]) for k in d)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(d[w], r[w]) and not torch.equal(d[w], o[w])
    assert abs(d[w].std().item() - 0.02) < 0.005
    assert torch.all(d["model.norm.weight"] == 1) and torch.all(
        d["model.layers.0.self_attn.qkv_proj.bias"] == 0
    )


def test_tensor_parallel_shards_reassemble_the_full_layers():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    w1, w2 = torch.randn(32, 16, generator=gen), torch.randn(16, 32, generator=gen)
    b2 = torch.randn(16, generator=gen)
    partial = []
    for rank in range(2):
        col = ColumnParallelLinear(16, 32, False, rank, 2)
        col.weight.weight_loader(col.weight, w1)
        row = RowParallelLinear(32, 16, False, rank, 2)
        row.weight.weight_loader(row.weight, w2)
        partial.append(F.linear(F.relu(col(x)), row.weight))  # what each rank adds into the all-reduce
    assert torch.allclose(sum(partial) + b2, F.linear(F.relu(F.linear(x, w1)), w2) + b2, atol=1e-5)

    # QKV with 4 query heads and 2 KV heads (head_dim 4) over 2 ranks: rank r has q heads 2r, 2r+1, kv head r.
    q, k, v = (
        torch.randn(16, 16, generator=gen),
        torch.randn(8, 16, generator=gen),
        torch.randn(8, 16, generator=gen),
    )
    for rank in range(2):
        qkv = QKVParallelLinear(16, 4, 4, 2, False, rank, 2)
        for shard, full in zip("qkv", (q, k, v), strict=True):
            qkv.weight.weight_loader(qkv.weight, full, shard)
        expected = torch.cat(
            [q[8 * rank : 8 * rank + 8], k[4 * rank : 4 * rank + 4], v[4 * rank : 4 * rank + 4]]
        )
        assert torch.equal(qkv.weight, expected)
    # Fewer KV heads than ranks: KV heads are replicated.
    qkv = QKVParallelLinear(16, 4, 4, 1, False, 3, 4)
    qkv.weight.weight_loader(qkv.weight, k[:4], "k")
    assert torch.equal(qkv.weight[4:8], k[:4])

    gate, up = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    merged = MergedColumnParallelLinear(16, [8, 8], False, 1, 2)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[4:], up[4:]]))

    table = torch.randn(7, 4, generator=gen)  # 7 rows over 2 ranks: 4 + 3 (+1 zero pad row)
    shard = VocabParallelEmbedding(7, 4, 1, 2)
    shard.weight.weight_loader(shard.weight, table)
    assert torch.equal(shard.weight[:3], table[4:]) and torch.all(shard.weight[3] == 0)


def test_config_parsing_legacy_rope_scaling_and_refusals():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=4096,
    )
    legacy = base | dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    config = ModelConfig.from_hf_dict(legacy)
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == ("llama3", 500000.0, 8.0)
    assert (config.head_dim, config.num_kv_heads, config.family) == (8, 2, "llama")
    mistral = ModelConfig.from_hf_dict(base | dict(architectures=["MistralForCausalLM"], eos_token_id=[2, 3]))
    assert mistral.family == "llama" and mistral.eos_token_ids == (2, 3)
    with pytest.raises(ModelConfigError, match="sliding"):
        ModelConfig.from_hf_dict(base | dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True))
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_hf_dict(base | dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelConfigError, match="multiple"):
        ModelConfig.from_hf_dict(base | dict(num_key_value_heads=3))
