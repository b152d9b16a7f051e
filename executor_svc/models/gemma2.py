"""Gemma 2 family: GeGLU feed-forward, Gemma's (1 + w) RMSNorm before and after both the attention and
the feed-forward, embeddings scaled by sqrt(hidden_size), attention scaled by
query_pre_attn_scalar ** -0.5 and soft-capped, sliding-window and global layers alternating (the
paged attention kernel masks by each layer's window), final logits soft-capped. Gemma 3 (text)
reuses these blocks with its q / k norms and the local layers' own rope (gemma3.py)."""

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
from executor_svc.layers.mlp import GeluTanhGatedMLP
from executor_svc.layers.norm import GemmaRMSNorm
from executor_svc.layers.rotary import RotaryEmbedding
from executor_svc.models.config import GemmaConfig, ModelConfig, RopeConfig


class Gemma2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp_rank: int, tp_size: int):
        super().__init__()
        gemma = _gemma(config)
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, config.qkv_bias, tp_rank, tp_size
        )
        self.num_heads, self.num_kv_heads, self.head_dim = (
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * d, config.hidden_size, config.o_bias, tp_rank, tp_size
        )
        window = gemma.layer_windows[layer_index]
        self.rotary_emb = RotaryEmbedding(d, config.max_model_len, self.rope_of(config, window > 0))
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, d, gemma.query_pre_attn_scalar**-0.5,
            window if window < config.max_model_len else 0, gemma.attn_logit_softcap,
        )

    def rope_of(self, config: ModelConfig, is_sliding: bool) -> RopeConfig:
        return config.rope  # Gemma 3 overrides: its sliding layers have their own

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Gemma 3 overrides

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


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, tp_rank: int, tp_size: int,
        attention_cls: type[Gemma2Attention],
    ):
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        self.self_attn = attention_cls(config, layer_index, tp_rank, tp_size)
        self.mlp = GeluTanhGatedMLP(d, config.intermediate_size, config.mlp_bias, tp_rank, tp_size)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, positions, x, kv_cache, meta):
        """x: [T, D] the residual stream -> the stream after this layer."""
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, attention_cls: type[Gemma2Attention]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, tp_rank, tp_size, attention_cls) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, input_ids, positions, kv_cache, meta):
        x = self.embed_tokens(input_ids)  # [T, D]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as HF does
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, kv_cache[i], meta)
        return self.norm(x)


class Gemma2ForCausalLM(nn.Module):
    # (our fused name, HF name, shard id)
    STACKED_PARAMS = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    attention_cls = Gemma2Attention

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.final_logit_softcap = _gemma(config).final_logit_softcap
        self.model = Gemma2Model(config, tp_rank, tp_size, self.attention_cls)
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
        logits = self.lm_head.compute_logits(hidden)  # [S, V]
        cap = self.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits


def _gemma(config: ModelConfig) -> GemmaConfig:
    if config.gemma is None:
        raise ValueError(f"family {config.family!r}: a Gemma model needs its Gemma config")
    return config.gemma
