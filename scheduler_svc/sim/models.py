"""Model shapes and the step-time model of the simulator (no GPU; docs/simulator.md).

Step time on an A100-40GB-like GPU, a roofline with a fixed overhead:

    t_step = OVERHEAD_S
           + max(weight_bytes / HBM_BYTES_PER_S,                      # decode: read every weight once
                 2 * num_params * num_tokens / FLOPS_PER_S)            # prefill: matmul-bound
           + kv_context_tokens * kv_bytes_per_token / HBM_BYTES_PER_S  # attention reads the KV cache

`num_tokens` counts the tokens computed in the step, `kv_context_tokens` the context length (cached
+ new tokens) of every scheduled sequence. The rates are A100 peaks (1.555 TB/s HBM2, 312 TFLOP/s
bf16) times typical achieved fractions (80 % and 60 %); attention FLOPs, sampling and swap/copy
traffic are left out. The constants are a modelling choice, not a measurement: throughput and
latency figures of the simulator compare policies with each other, they do not predict a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

A100_HBM_BYTES_PER_S = 1.555e12
A100_BF16_FLOPS_PER_S = 312e12
BYTES_PER_PARAM = 2  # bf16 / fp16 weights and KV


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

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_kv_heads, self.ffn_size, self.max_model_len) < 1:
            raise ValueError(f"bad model shape {self}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads do not divide evenly in {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x 2 bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BYTES_PER_PARAM

    @property
    def num_params(self) -> int:
        h, kv_dim = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv_dim  # q, o, k, v projections
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_size
        return self.num_layers * (attention + mlp) + 2 * self.vocab_size * h  # + embedding, lm head

    def num_gpu_blocks(self, kv_bytes: float, block_size: int) -> int:
        return int(kv_bytes // (self.kv_bytes_per_token * block_size))

    def hf_config(self) -> dict:
        """A Hugging Face config.json of this shape (bf16; Llama architecture, or OPT for the
        non-gated shapes), enough for dummy weights in pagedserve and in transformers."""
        common = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "torch_dtype": "bfloat16",
                  "num_attention_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                  "max_position_embeddings": self.max_model_len, "bos_token_id": 1, "eos_token_id": 2,
                  "pad_token_id": 0}
        if not self.gated_mlp:
            return common | {"architectures": ["OPTForCausalLM"], "model_type": "opt",
                             "ffn_dim": self.ffn_size, "word_embed_proj_dim": self.hidden_size,
                             "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True}
        return common | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                         "num_key_value_heads": self.num_kv_heads, "intermediate_size": self.ffn_size,
                         "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                         "tie_word_embeddings": False}


MODELS: dict[str, ModelSpec] = {
    # max_model_len 2048 is the paper's OPT-13B setting (Llama 2 itself allows 4096).
    "llama2-13b": ModelSpec(40, 5120, 40, 40, 13824, 32000, 2048, gated_mlp=True),
    "opt-13b": ModelSpec(40, 5120, 40, 40, 20480, 50272, 2048, gated_mlp=False),
    "llama3-8b": ModelSpec(32, 4096, 32, 8, 14336, 128256, 8192, gated_mlp=True),
    # Llama-3-70B: 70.6e9 parameters, 141 GB in bf16: one H200 (140 GiB) would keep no room for a KV
    # cache, so it is served at tensor-parallel size 2 or more (docs/tensor_parallel.md).
    "llama3-70b": ModelSpec(80, 8192, 64, 8, 28672, 128256, 8192, gated_mlp=True),
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
        weights_s = model.num_params * BYTES_PER_PARAM / self.hbm_bytes_per_s
        matmul_s = 2 * model.num_params * num_tokens / self.flops_per_s
        kv_s = kv_context_tokens * model.kv_bytes_per_token / self.hbm_bytes_per_s
        return self.overhead_s + max(weights_s, matmul_s) + kv_s
