"""Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral (incl. its sliding window), TinyLlama.

Parameter names follow the HF checkpoint except the fused `qkv_proj` and `gate_up_proj`
(`STACKED_PARAMS` tells the loader where q/k/v and gate/up go). Qwen2 and Qwen3 reuse these
blocks (Qwen3 with its own attention class).
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.layers.attention import AttentionMetadata, PagedAttention
from executor_svc.layers.linear import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from executor_svc.layers.mlp import GatedMLP
from executor_svc.layers.norm import RMSNorm
from executor_svc.layers.rotary import RotaryEmbedding
from executor_svc.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, config.qkv_bias, tp_rank, tp_size
        )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            d,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d, config.hidden_size, config.o_bias, tp_rank, tp_size
        )
        self.rotary_emb = RotaryEmbedding(d, config.max_model_len, config.rope)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5, config.sliding_window)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Qwen3 overrides

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        q, k = self.normalize_qk(q, k)
        # rotary inside attention: one kernel rotates q and k and writes K and V into the cache
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rotary=self.rotary_emb, positions=positions))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.self_attn = attention_cls(config, tp_rank, tp_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        """x: the previous layer's output (the embeddings for layer 0, residual None); returns this
        layer's output and the residual stream before it (each norm adds the two in its launch)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer  # Granite overrides

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, tp_rank, tp_size, attention_cls) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids, positions, kv_cache, meta):
        x = self.embed_tokens(input_ids)  # [T, D]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, kv_cache[i], meta)
        return self.norm.add_and_norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # (our fused name, HF name, shard id)
    STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    attention_cls = LlamaAttention
    model_cls = LlamaModel  # Granite overrides

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, tp_rank, tp_size, self.attention_cls)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, 2, num_blocks, block_size, KV, D] -> hidden [T, D]."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # [S, V]
