"""Rope scalings against transformers' own (modeling_rope_utils): the inverse frequencies and the
cos / sin scale of every rope type we serve, on several parameter sets; unknown or broken ones refused."""

from __future__ import annotations

import pytest
import torch

from executor_svc.layers.rotary import attention_scaling, inverse_frequencies
from executor_svc.models.config import ModelConfig, ModelConfigError

HEAD_DIM = 64
CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 256},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 2048, "truncate": False},
}


def _hf_config(rope_parameters: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=4096,
                       rope_parameters=dict(rope_parameters))


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_and_scale_equal_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = CASES[case]
    hf_config = _hf_config(rope_parameters)
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_inv, hf_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        hf_inv, hf_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    ours = ModelConfig.from_hf_dict(hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]}).rope
    assert ours.rope_type == rope_type
    torch.testing.assert_close(inverse_frequencies(HEAD_DIM, ours), hf_inv.float(), rtol=1e-6, atol=0)
    assert attention_scaling(ours) == pytest.approx(hf_scale, rel=1e-12)


@pytest.mark.parametrize(
    "rope_parameters, match",
    [
        ({"rope_type": "longrope-ish", "factor": 2.0}, "not supported"),
        ({"rope_type": "yarn", "factor": -1.0}, "factor"),
        ({"rope_type": "linear", "factor": 0.0}, "factor"),
        ({"rope_type": "yarn", "factor": float("nan")}, "factor"),
        ({"rope_type": "default", "rope_theta": 0.5}, "theta"),
    ],
)
def test_broken_rope_parameters_are_refused(rope_parameters, match):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 8, "rope_parameters": rope_parameters}
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(hf)
