"""config.json that the executor cannot honour is refused with a clear error (never approximated):
unsupported architectures name what is supported, in the executor and in the launcher (before it
reads any field); Mistral's sliding window is read (a window as long as the context is none)."""

from __future__ import annotations

import pytest

from executor_svc.models.config import ModelConfig, ModelConfigError
from executor_svc.models.families import ARCHITECTURE_FAMILIES


def _hf_dict(config_class_name: str, **kwargs) -> dict:
    import transformers

    config = getattr(transformers, config_class_name)(**kwargs)
    hf = config.to_dict()
    hf["architectures"] = [config_class_name.replace("Config", "ForCausalLM")]
    return hf


def _tiny_mistral(**kwargs) -> dict:
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return _hf_dict("MistralConfig", vocab_size=512, num_key_value_heads=2, **sizes, **kwargs)


@pytest.mark.parametrize("config_class_name", ["GPT2Config", "FalconConfig", "GPTNeoXConfig", "BloomConfig"])
def test_unsupported_architecture_names_what_is_supported(config_class_name):
    from clients.cli.serve import spec_from_hf_config

    hf = _hf_dict(config_class_name)
    with pytest.raises(ModelConfigError, match="unsupported architecture") as err:
        ModelConfig.from_hf_dict(hf)
    assert all(arch in str(err.value) for arch in ARCHITECTURE_FAMILIES)
    with pytest.raises(SystemExit, match="unsupported architecture.*supported: LlamaForCausalLM"):
        spec_from_hf_config(hf)  # the launcher, before it reads num_attention_heads / ffn_dim


@pytest.mark.parametrize(
    "hf",
    [
        {},
        {"architectures": "LlamaForCausalLM"},  # a string, not a list: still no KeyError / TypeError
        {"architectures": [None, 3], "model_type": 7},
        {"architectures": [], "model_type": ["llama"]},
    ],
)
def test_malformed_architecture_fields_are_a_clear_error(hf):
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize("window, served", [(None, 0), (32, 32), (2047, 2047), (2048, 0), (4096, 0)])
def test_mistral_sliding_window_is_read(window, served):
    config = ModelConfig.from_hf_dict(_tiny_mistral(sliding_window=window, max_position_embeddings=2048))
    assert (config.family, config.sliding_window) == ("llama", served)


@pytest.mark.parametrize("window", [0, -1, 3.5, "32", True])
def test_malformed_sliding_window_is_refused(window):
    with pytest.raises(ModelConfigError, match="sliding_window"):
        ModelConfig.from_hf_dict(_tiny_mistral() | {"sliding_window": window})  # as a config.json may hold


def _tiny_gemma(family: str) -> dict:
    from executor_svc.models.tiny import tiny_config

    return tiny_config(family)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_config_is_read(family):
    config = ModelConfig.from_hf_dict(_tiny_gemma(family))
    assert config.family == family and config.gemma is not None
    assert config.gemma.layer_windows == (8, 0) and config.gemma.query_pre_attn_scalar == 24
    assert config.qk_norm == (family == "gemma3") and config.tie_word_embeddings
    if family == "gemma3":
        assert config.gemma.local_rope is not None and config.gemma.local_rope.theta == 10000.0
        assert (config.rope.rope_type, config.rope.factor) == ("linear", 8.0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        ({"layer_types": "sliding_attention"}, "layer_types"),
        ({"sliding_window": -4}, "sliding_window"),
        ({"sliding_window": 2.5}, "sliding_window"),
        ({"final_logit_softcapping": -1.0}, "soft-capping"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ],
)
def test_broken_gemma_configs_are_refused(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(_tiny_gemma("gemma2") | change)


def test_gemma3_layer_pattern_without_layer_types():
    hf = _tiny_gemma("gemma3") | {"num_hidden_layers": 12, "sliding_window_pattern": 6}
    del hf["layer_types"]
    windows = ModelConfig.from_hf_dict(hf).gemma.layer_windows
    assert windows == (8, 8, 8, 8, 8, 0) * 2


def test_phi3_and_granite_configs_are_read():
    from executor_svc.models.tiny import tiny_config

    phi3 = ModelConfig.from_hf_dict(tiny_config("phi3") | {"sliding_window": 16})
    assert (phi3.family, phi3.sliding_window) == ("phi3", 16)
    granite = ModelConfig.from_hf_dict(tiny_config("granite")).granite
    assert granite is not None and (granite.embedding_multiplier, granite.logits_scaling) == (6.0, 2.0)


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
         "longrope"),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ("granite", {"logits_scaling": 0.0}, "logits_scaling"),
        ("granite", {"residual_multiplier": float("nan")}, "multipliers"),
        ("granite", {"embedding_multiplier": float("inf")}, "multipliers"),
    ],
)
def test_phi3_and_granite_configs_we_cannot_serve_are_refused(family, change, match):
    from executor_svc.models.tiny import tiny_config

    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_hf_dict(tiny_config(family) | change)
