"""Which Hugging Face architectures pagedserve serves: `architectures` / `model_type` of config.json
-> our family (one model file each, picked in registry.py). Imports no torch: the launcher checks a
model folder with it before it starts any process."""

from __future__ import annotations

# HF `architectures[0]` -> our family name.
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "OPTForCausalLM": "opt",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
}
# HF `model_type` -> our family name (for a config.json without `architectures`).
MODEL_TYPE_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "opt": "opt",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "granite": "granite",
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture no model file of ours implements."""


def family_of(hf: dict) -> str:
    """Our family for a config.json's contents; raises UnsupportedArchitectureError naming what is
    supported."""
    archs = hf.get("architectures") or ()
    for arch in archs if isinstance(archs, list) else ():
        if isinstance(arch, str) and arch in ARCHITECTURE_FAMILIES:
            return ARCHITECTURE_FAMILIES[arch]
    model_type = hf.get("model_type", "")
    if isinstance(model_type, str) and model_type in MODEL_TYPE_FAMILIES:
        return MODEL_TYPE_FAMILIES[model_type]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {archs or None} / model_type {model_type!r}; supported: "
        f"{', '.join(ARCHITECTURE_FAMILIES)} (model_type {', '.join(MODEL_TYPE_FAMILIES)})"
    )
