"""Model families, one file each; `model_class(config)` picks the class for a config."""

from __future__ import annotations

from executor_svc.models.config import ModelConfig


def model_class(config: ModelConfig):
    if config.family == "llama":
        from executor_svc.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if config.family == "qwen2":
        from executor_svc.models.qwen2 import Qwen2ForCausalLM

        return Qwen2ForCausalLM
    if config.family == "qwen3":
        from executor_svc.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    if config.family == "opt":
        from executor_svc.models.opt import OPTForCausalLM

        return OPTForCausalLM
    if config.family == "mixtral":
        from executor_svc.models.mixtral import MixtralForCausalLM

        return MixtralForCausalLM
    if config.family == "qwen3_moe":
        from executor_svc.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if config.family == "qwen2_moe":
        from executor_svc.models.qwen2_moe import Qwen2MoeForCausalLM

        return Qwen2MoeForCausalLM
    if config.family == "gemma2":
        from executor_svc.models.gemma2 import Gemma2ForCausalLM

        return Gemma2ForCausalLM
    if config.family == "gemma3":
        from executor_svc.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.family == "phi3":
        from executor_svc.models.phi3 import Phi3ForCausalLM

        return Phi3ForCausalLM
    if config.family == "granite":
        from executor_svc.models.granite import GraniteForCausalLM

        return GraniteForCausalLM
    raise ValueError(f"no model for family {config.family!r}")
