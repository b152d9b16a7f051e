"""Mixture-of-experts shapes: parameter counts of the named benchmark shapes, the bytes a step reads
(only the experts its tokens touch), the ideal time by hand, the configs those shapes write (read by
our ModelConfig and by transformers), dummy weights, MoE config refusals, and the loader's checks of
expert tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from clients.bench.report import DeviceRates, ideal_time
from executor_svc.models.config import ModelConfig, ModelConfigError
from executor_svc.models.loader import WeightLoadError, load_model, load_safetensors
from scheduler_svc.sim.models import BYTES_PER_PARAM, MODELS, ModelSpec, StepTimeModel
from tests.helpers.checkpoints import copy_with


def test_named_moe_shapes_count_total_and_active_parameters():
    qwen, mixtral = MODELS["qwen3-30b-a3b"], MODELS["mixtral-8x7b"]
    assert qwen.num_params == pytest.approx(30.5e9, rel=0.01)
    assert qwen.num_active_params == pytest.approx(3.35e9, rel=0.01)
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=0.01)
    assert qwen.head_dim == 128 and qwen.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_a_step_reads_the_dense_weights_and_the_experts_its_tokens_touch():
    spec = ModelSpec(2, 8, 2, 1, 4, 10, 64, gated_mlp=True, num_experts=4, num_experts_per_tok=2,
                     family="mixtral")
    expert = 3 * 8 * 4
    assert spec.params_per_expert == expert
    assert spec.num_params - spec.num_active_params == 2 * 2 * expert  # 2 idle experts per layer
    assert spec.params_read(1) == spec.num_active_params  # one token: its 2 experts
    assert spec.params_read(2) == pytest.approx(spec.num_params - 2 * 4 * 0.25 * expert)  # 4 (1 - 1/4)
    reads = [spec.params_read(t) for t in (1, 2, 4, 64)]
    assert reads == sorted(reads) and reads[-1] == pytest.approx(spec.num_params)
    dense = MODELS["llama3-8b"]
    assert dense.params_read(7) == dense.num_params == dense.num_active_params
    model = StepTimeModel(spec, overhead_s=0.0, hbm_bytes_per_s=1.0, flops_per_s=1e30)
    assert model.step_time_s(1, 0) == pytest.approx(spec.num_active_params * BYTES_PER_PARAM)


def test_ideal_time_of_an_moe_shape_by_hand():
    spec = ModelSpec(1, 8, 2, 1, 16, 200, 64, gated_mlp=True, num_experts=4, num_experts_per_tok=1,
                     family="qwen3_moe")
    rates = DeviceRates("test", copy_bytes_per_s=1e6, matmul_flops_per_s=1e6)
    active = spec.num_active_params - 200 * 8
    prefill = 2 * active * 5 + 4 * 8 * (2 * 3 / 2 + 3 * 4 / 2)
    decode = 0.0
    for k in (1, 2):  # the first request alone: one token, one expert read
        context = 2 + k
        bytes_moved = 2 * active + context * spec.kv_bytes_per_token  # one expert per layer read
        decode += max(bytes_moved / 1e6, (2 * active + 4 * 8 * context) / 1e6)
    out = ideal_time(spec, [2, 3], [3, 1], rates)
    assert out["prefill_s"] == round(prefill / 1e6, 4)
    assert out["decode_s"] == round(decode, 4)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_named_moe_shapes_write_configs_both_stacks_read(name):
    from transformers import AutoConfig

    spec = MODELS[name]
    hf = spec.hf_config()
    ours = ModelConfig.from_hf_dict(hf)
    assert ours.moe is not None and ours.family == spec.family
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.intermediate_size, ours.moe.renormalize) == (
        spec.num_experts, spec.num_experts_per_tok, spec.ffn_size, True
    )
    assert ours.head_dim == spec.head_dim and ours.num_kv_heads == spec.num_kv_heads
    theirs = AutoConfig.for_model(**hf)
    assert theirs.num_experts_per_tok == spec.num_experts_per_tok


def test_moe_configs_are_checked():
    base = MODELS["mixtral-8x7b"].hf_config()
    for change, message in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
        ({"sliding_window": 4096}, "sliding_window"),
    ):
        with pytest.raises(ModelConfigError, match=message):
            ModelConfig.from_hf_dict(base | change)
    assert ModelConfig.from_hf_dict(base | {"sliding_window": 8192}).moe is not None  # the whole context
    qwen = MODELS["qwen3-30b-a3b"].hf_config()
    with pytest.raises(ModelConfigError, match="decoder_sparse_step"):
        ModelConfig.from_hf_dict(qwen | {"decoder_sparse_step": 0})
    without_width = {k: v for k, v in qwen.items() if k != "moe_intermediate_size"}
    with pytest.raises(ModelConfigError, match="qwen3_moe config.json needs 'moe_intermediate_size'"):
        ModelConfig.from_hf_dict(without_width)
    dense_qwen = ModelConfig.from_hf_dict(qwen | {"mlp_only_layers": [0, 5], "decoder_sparse_step": 2})
    assert [dense_qwen.moe.is_sparse(i) for i in range(6)] == [False, True, False, True, False, False]


def test_dummy_weights_fill_the_stacked_experts(tiny_model_dirs):
    folder = tiny_model_dirs["qwen2_moe"]
    config = ModelConfig.from_dir(folder)
    model = load_model(folder, config, torch.float32, torch.device("cpu"), load_format="dummy", seed=3)
    block = model.model.layers[0].mlp
    assert block.experts.w13_weight.shape == (4, 2 * 32, 64) and block.experts.w2_weight.shape == (4, 64, 32)
    assert 0.015 < float(block.experts.w13_weight.std()) < 0.025
    assert block.shared_expert is not None and block.shared_expert_gate.weight.shape == (1, 64)


def test_expert_tensors_load_per_rank_and_missing_or_extra_experts_fail(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["mixtral"]
    config = ModelConfig.from_dir(folder)
    weights = load_file(str(folder / "model.safetensors"))
    full = load_model(folder, config, torch.float32, torch.device("cpu"))
    w1 = weights["model.layers.1.block_sparse_moe.experts.3.w1.weight"]  # [I, H]
    w2 = weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]  # [H, I]
    cpu = torch.device("cpu")
    shards = [load_model(folder, config, torch.float32, cpu, tp_rank=r, tp_size=2) for r in (0, 1)]
    inter = w1.shape[0] // 2
    for rank, model in enumerate(shards):
        experts = model.model.layers[1].mlp.experts
        assert torch.equal(experts.w13_weight[3, :inter], w1[rank * inter : (rank + 1) * inter])
        assert torch.equal(experts.w2_weight[3], w2[:, rank * inter : (rank + 1) * inter])
    assert torch.equal(full.model.layers[1].mlp.experts.w13_weight[3, :32], w1)

    missing = {k: v for k, v in weights.items() if k != "model.layers.0.block_sparse_moe.experts.2.w3.weight"}
    with pytest.raises(WeightLoadError, match="7 of the 8 expert tensors"):
        load_safetensors(full, copy_with(tmp_path / "missing", folder, missing))
    extra = weights | {"model.layers.0.block_sparse_moe.experts.4.w1.weight": w1.clone()}
    with pytest.raises(WeightLoadError, match="expert 4 out of range"):
        load_safetensors(full, copy_with(tmp_path / "extra", folder, extra))
    config_json = json.loads((folder / "config.json").read_text())
    assert config_json["num_local_experts"] == 4


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_the_shape_counts_the_parameters_of_the_model_we_build(name):
    from executor_svc.models.registry import model_class

    spec = MODELS[name]
    config = ModelConfig.from_hf_dict(spec.hf_config())
    with torch.device("meta"):
        model = model_class(config)(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    assert sum(p.numel() for p in model.parameters()) - norms == spec.num_params


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "qwen3"])
def test_the_launcher_reads_the_shape_of_a_model_folder(family, tiny_model_dirs):
    """A served folder's spec (ideal time, KV bytes) counts the parameters of the model we build
    (experts, Qwen2-MoE's shared expert, Qwen3's explicit head_dim)."""
    from clients.cli.serve import spec_from_hf_config
    from executor_svc.models.registry import model_class

    hf = json.loads((tiny_model_dirs[family] / "config.json").read_text())
    spec = spec_from_hf_config(hf | {"mlp_only_layers": []})
    config = ModelConfig.from_hf_dict(hf | {"mlp_only_layers": []})
    with torch.device("meta"):
        model = model_class(config)(config)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    tied_head = spec.vocab_size * spec.hidden_size if hf["tie_word_embeddings"] else 0  # one tensor twice
    assert matrices + tied_head == spec.num_params
    assert spec.head_dim == config.head_dim
