"""Mixtral: the Llama architecture with a sparse mixture-of-experts feed-forward in every layer
(softmax router, top-k renormalized). Also the MoE decoder stack the Qwen MoE families reuse.

Checkpoint names: Mixtral's `block_sparse_moe` is our `mlp` (`CHECKPOINT_RENAMES`); each expert's
`experts.N.w1/w3/w2` goes into the stacked `experts.w13_weight` / `experts.w2_weight` (`EXPERT_PARAMS`:
HF projection -> (our parameter, part); the loader passes `(N, part)` as the shard id).
"""

from __future__ import annotations

from torch import nn

from executor_svc.layers.linear import ParallelLMHead, VocabParallelEmbedding
from executor_svc.layers.mlp import GatedMLP
from executor_svc.layers.moe import SparseMoeBlock
from executor_svc.layers.norm import RMSNorm
from executor_svc.models.config import ModelConfig
from executor_svc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose `mlp` is a SparseMoeBlock, or dense on the config's dense layers."""

    def __init__(
        self, config: ModelConfig, layer_index: int, tp_rank: int, tp_size: int,
        attention_cls: type[LlamaAttention],
    ):
        nn.Module.__init__(self)
        assert config.moe is not None
        self.self_attn = attention_cls(config, tp_rank, tp_size)
        if config.moe.is_sparse(layer_index):
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, tp_rank, tp_size)  # type: ignore[assignment]
        else:
            dense = config.hidden_size, config.intermediate_size, config.mlp_bias
            self.mlp = GatedMLP(*dense, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)


class MoeModel(LlamaModel):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[LlamaAttention]):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(config, i, tp_rank, tp_size, attention_cls) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama causal LM over a MoeModel; subclasses name their attention and checkpoint names."""

    EXPERT_PARAMS: dict[str, tuple[str, str]] = {}
    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        nn.Module.__init__(self)
        if config.moe is None:
            raise ValueError(f"a {type(self).__name__} config must describe its experts")
        self.config = config
        self.model = MoeModel(config, tp_rank, tp_size, self.attention_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class MixtralForCausalLM(MoeForCausalLM):
    EXPERT_PARAMS = {"w1": ("w13_weight", "gate"), "w3": ("w13_weight", "up"), "w2": ("w2_weight", "down")}
    CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."),)
