"""Granite family (IBM Granite 3.x dense): Llama with four multipliers: embeddings times
embedding_multiplier, attention scaled by attention_multiplier (not head_dim ** -0.5), each
attention and feed-forward output times residual_multiplier before it joins the residual stream,
and logits divided by logits_scaling."""

from __future__ import annotations

import torch

from executor_svc.models.config import GraniteConfig, ModelConfig
from executor_svc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def _granite(config: ModelConfig) -> GraniteConfig:
    if config.granite is None:
        raise ValueError("a Granite model needs its multipliers (ModelConfig.granite)")
    return config.granite


class GraniteAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__(config, tp_rank, tp_size)
        self.attn.scale = _granite(config).attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[LlamaAttention]):
        super().__init__(config, tp_rank, tp_size, attention_cls)
        self.residual_multiplier = _granite(config).residual_multiplier

    def forward(self, positions, x, residual, kv_cache, meta):
        """As Llama's, each block's output scaled before the next norm adds it to the residual."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta) * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[LlamaAttention]):
        super().__init__(config, tp_rank, tp_size, attention_cls)
        self.embedding_multiplier = _granite(config).embedding_multiplier

    def forward(self, input_ids, positions, kv_cache, meta):
        x = self.embed_tokens(input_ids) * self.embedding_multiplier  # [T, D]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, kv_cache[i], meta)
        return self.norm.add_and_norm(x, residual)[0]


class GraniteForCausalLM(LlamaForCausalLM):
    attention_cls = GraniteAttention
    model_cls = GraniteModel

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(config, tp_rank, tp_size)
        self.logits_scaling = _granite(config).logits_scaling

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.logits_scaling  # [S, V]
