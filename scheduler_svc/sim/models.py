"""Model shapes and the step-time model of the simulator (no GPU; docs/simulator.md).

Step time on an A100-40GB-like GPU, a roofline with a fixed overhead:

    t_step = OVERHEAD_S
           + max(weight_bytes / HBM_BYTES_PER_S,                      # decode: read every weight once
                 2 * num_active_params * num_tokens / FLOPS_PER_S)     # prefill: matmul-bound
           + kv_context_tokens * kv_bytes_per_token / HBM_BYTES_PER_S  # attention reads the KV cache

`num_tokens` counts the tokens computed in the step, `kv_context_tokens` the context length (cached
+ new tokens) of every scheduled sequence. For a mixture-of-experts shape, `weight_bytes` counts the
experts the step's tokens touch (`ModelSpec.params_read`) and the FLOPs the active parameters. The
rates are A100 peaks (1.555 TB/s HBM2, 312 TFLOP/s bf16) times typical achieved fractions (80 % and
60 %); attention FLOPs, sampling and swap/copy traffic are left out. The constants are a modelling
choice, not a measurement: throughput and latency figures of the simulator compare policies with
each other, they do not predict a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

A100_HBM_BYTES_PER_S = 1.555e12
A100_BF16_FLOPS_PER_S = 312e12
BYTES_PER_PARAM = 2  # bf16 / fp16 weights and KV
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool  # Llama: gate/up/down (3 matrices); OPT: fc1/fc2 (2)
    # Mixture of experts: every layer's MLP is num_experts experts of ffn_size, each token takes
    # num_experts_per_tok of them. 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    shared_expert_ffn_size: int = 0  # Qwen2-MoE: a gated dense expert every token takes
    explicit_head_dim: int = 0  # Qwen3: head_dim != hidden_size / num_heads; 0: hidden / heads
    family: str = ""  # the HF family of hf_config() for MoE shapes: one of MOE_FAMILIES

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_kv_heads, self.ffn_size, self.max_model_len) < 1:
            raise ValueError(f"bad model shape {self}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads do not divide evenly in {self}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts in {self}")
        if self.num_experts and self.family not in MOE_FAMILIES:
            raise ValueError(f"an MoE shape names its family (one of {MOE_FAMILIES}) in {self}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x 2 bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BYTES_PER_PARAM

    @property
    def params_per_expert(self) -> int:
        """One layer's MLP (one expert's, for an MoE shape)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_size

    @property
    def num_params(self) -> int:
        h, q_dim, kv_dim = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * h * q_dim + 2 * h * kv_dim  # q, o, k, v projections
        mlp = max(1, self.num_experts) * self.params_per_expert + h * self.num_experts  # + router
        if self.shared_expert_ffn_size:
            mlp += 3 * h * self.shared_expert_ffn_size + h  # + its sigmoid gate
        return self.num_layers * (attention + mlp) + 2 * self.vocab_size * h  # + embedding, lm head

    @property
    def num_active_params(self) -> int:
        """Parameters one token computes with: all but the experts it does not take."""
        if not self.num_experts:
            return self.num_params
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params - self.num_layers * idle * self.params_per_expert

    def params_read(self, num_tokens: int) -> float:
        """Parameters a step over `num_tokens` tokens reads: every dense one, and of each layer's experts
        the expected number at least one token takes under uniform routing, E (1 - (1 - k / E)^T)
        (<= min(E, T k))."""
        if not self.num_experts:
            return float(self.num_params)
        e, k = self.num_experts, self.num_experts_per_tok
        touched = e * (1.0 - (1.0 - k / e) ** max(0, num_tokens))
        return self.num_params - self.num_layers * (e - touched) * self.params_per_expert

    def num_gpu_blocks(
        self, kv_bytes: float, block_size: int, kv_bytes_per_element: int = BYTES_PER_PARAM
    ) -> int:
        """Blocks of `block_size` tokens in kv_bytes of cache; kv_bytes_per_element 1 for an FP8 cache
        (`--kv-cache-dtype fp8`), which holds twice the blocks of the model's 2-byte dtype."""
        per_token = self.kv_bytes_per_token // BYTES_PER_PARAM * kv_bytes_per_element
        return int(kv_bytes // (per_token * block_size))

    def hf_config(self) -> dict:
        """A Hugging Face config.json of this shape (bf16; Llama architecture, or OPT for the
        non-gated shapes), enough for dummy weights in pagedserve and in transformers."""
        common = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "torch_dtype": "bfloat16",
                  "num_attention_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                  "max_position_embeddings": self.max_model_len, "bos_token_id": 1, "eos_token_id": 2,
                  "pad_token_id": 0}
        if self.num_experts:
            return common | self._moe_hf_config()
        if not self.gated_mlp:
            return common | {"architectures": ["OPTForCausalLM"], "model_type": "opt",
                             "ffn_dim": self.ffn_size, "word_embed_proj_dim": self.hidden_size,
                             "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True}
        return common | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                         "num_key_value_heads": self.num_kv_heads, "intermediate_size": self.ffn_size,
                         "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                         "tie_word_embeddings": False}

    def _moe_hf_config(self) -> dict:
        moe = {"num_key_value_heads": self.num_kv_heads, "hidden_act": "silu", "tie_word_embeddings": False,
               "num_experts_per_tok": self.num_experts_per_tok, "rope_theta": 1000000.0}
        if self.family == "mixtral":
            return moe | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                          "rms_norm_eps": 1e-5, "num_local_experts": self.num_experts,
                          "intermediate_size": self.ffn_size, "sliding_window": None}
        if self.family == "qwen2_moe":
            return moe | {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                          "rms_norm_eps": 1e-6, "num_experts": self.num_experts, "norm_topk_prob": False,
                          "moe_intermediate_size": self.ffn_size, "intermediate_size": 5632,
                          "shared_expert_intermediate_size": self.shared_expert_ffn_size,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}
        return moe | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "rms_norm_eps": 1e-6, "head_dim": self.head_dim, "num_experts": self.num_experts,
                      "norm_topk_prob": True, "moe_intermediate_size": self.ffn_size,
                      "intermediate_size": 6144, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "use_sliding_window": False}


def moe_and_head_fields(hf: dict) -> dict:
    """ModelSpec fields of a Hugging Face config.json beyond the dense Llama / OPT ones: an explicit
    head_dim, and for Mixtral / Qwen MoE the experts (their width replaces the dense FFN's; Qwen's
    `mlp_only_layers` are counted as sparse)."""
    head_dim = hf.get("head_dim") or 0
    implied = hf["hidden_size"] // hf["num_attention_heads"]
    fields = {"explicit_head_dim": head_dim if head_dim != implied else 0}  # one spec per shape
    model_type = hf.get("model_type")
    if model_type not in MOE_FAMILIES:
        return fields
    fields |= {"family": model_type, "num_experts_per_tok": hf["num_experts_per_tok"]}
    if model_type == "mixtral":
        return fields | {"num_experts": hf["num_local_experts"]}
    num_experts = hf.get("num_experts") or hf["num_local_experts"]
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    ffn_size = hf["moe_intermediate_size"]
    return fields | {"num_experts": num_experts, "ffn_size": ffn_size, "shared_expert_ffn_size": shared}


MODELS: dict[str, ModelSpec] = {
    # max_model_len 2048 is the paper's OPT-13B setting (Llama 2 itself allows 4096).
    "llama2-13b": ModelSpec(40, 5120, 40, 40, 13824, 32000, 2048, gated_mlp=True),
    "opt-13b": ModelSpec(40, 5120, 40, 40, 20480, 50272, 2048, gated_mlp=False),
    "llama3-8b": ModelSpec(32, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True),
    # Llama-3.2-1B's shape (16 layers, head_dim 64), 1.50e9 parameters with its LM head untied (the
    # checkpoint ties it to the embedding: the same bytes read a step): a small model, whose decode
    # steps are short enough for the host's time per step to show.
    "llama3.2-1b": ModelSpec(16, 2048, 32, 8, 8192, 128256, 8192, gated_mlp=True),
    # Llama-3-70B: 70.6e9 parameters, 141 GB in bf16: one H200 (140 GiB) would keep no room for a KV
    # cache, so it is served at tensor-parallel size 2 or more (docs/tensor_parallel.md).
    "llama3-70b": ModelSpec(80, 8192, 64, 8, 28672, 128256, 8192, gated_mlp=True),
    # Mixture of experts. Qwen3-30B-A3B: 30.5e9 parameters (61 GB bf16), 3.3e9 active per token, 128
    # experts of 768, 8 per token. Mixtral-8x7B: 46.7e9 (93 GB), 12.9e9 active, 8 experts, 2 per token.
    "qwen3-30b-a3b": ModelSpec(48, 2048, 32, 4, 768, 151936, 8192, gated_mlp=True, num_experts=128,
                               num_experts_per_tok=8, explicit_head_dim=128, family="qwen3_moe"),
    "mixtral-8x7b": ModelSpec(32, 4096, 32, 8, 14336, 32000, 8192, gated_mlp=True, num_experts=8,
                              num_experts_per_tok=2, family="mixtral"),
}


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    model: ModelSpec
    overhead_s: float = 0.002
    hbm_bytes_per_s: float = 0.8 * A100_HBM_BYTES_PER_S
    flops_per_s: float = 0.6 * A100_BF16_FLOPS_PER_S

    def __post_init__(self) -> None:
        if self.overhead_s < 0 or self.hbm_bytes_per_s <= 0 or self.flops_per_s <= 0:
            raise ValueError(f"bad step-time constants {self}")

    def step_time_s(self, num_tokens: int, kv_context_tokens: int) -> float:
        if num_tokens == 0:
            return 0.0
        model = self.model
        weights_s = model.params_read(num_tokens) * BYTES_PER_PARAM / self.hbm_bytes_per_s
        matmul_s = 2 * model.num_active_params * num_tokens / self.flops_per_s
        kv_s = kv_context_tokens * model.kv_bytes_per_token / self.hbm_bytes_per_s
        return self.overhead_s + max(weights_s, matmul_s) + kv_s
