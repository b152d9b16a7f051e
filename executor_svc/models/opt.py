"""OPT family (the vLLM paper's model): learned positions (offset 2), LayerNorm, ReLU MLP, biases
everywhere, MHA; `do_layer_norm_before=False` (OPT-350m) puts the norms after the residual adds and
`word_embed_proj_dim != hidden_size` adds project_in / project_out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.attention import AttentionMetadata, PagedAttention
from executor_svc.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from executor_svc.layers.mlp import ReluMLP
from executor_svc.layers.norm import LayerNorm
from executor_svc.models.config import ModelConfig

POSITION_OFFSET = 2  # OPT's position table has two extra leading rows


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_heads, True, tp_rank, tp_size
        )
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, d
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, True, tp_rank, tp_size)
        self.attn = PagedAttention(self.num_heads, self.num_heads, d, d**-0.5)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        shape = (-1, self.num_heads, self.head_dim)  # [T, H, D]
        return self.out_proj(self.attn(q.view(shape), k.view(shape), v.view(shape), kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        affine = config.layer_norm_elementwise_affine
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, tp_rank, tp_size)
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, config.norm_eps, affine)
        self.mlp = ReluMLP(config.hidden_size, config.intermediate_size, tp_rank, tp_size)
        self.final_layer_norm = LayerNorm(config.hidden_size, config.norm_eps, affine)

    def forward(self, x, kv_cache, meta):
        pre = self.do_layer_norm_before
        x = x + self.self_attn(self.self_attn_layer_norm(x) if pre else x, kv_cache, meta)
        if not pre:
            x = self.self_attn_layer_norm(x)
        x = x + self.mlp(self.final_layer_norm(x) if pre else x)
        return x if pre else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        embed_dim = config.word_embed_proj_dim or config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp_rank, tp_size)
        # [P + 2, D], replicated on every rank
        self.embed_positions = nn.Embedding(config.max_model_len + POSITION_OFFSET, config.hidden_size)
        self.embed_positions.weight.requires_grad_(False)
        self.project_in = self.project_out = None
        if embed_dim != config.hidden_size:
            self.project_in = ColumnParallelLinear(embed_dim, config.hidden_size, False)
            self.project_out = ColumnParallelLinear(config.hidden_size, embed_dim, False)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_layers)
        )
        self.final_layer_norm = None
        if config.do_layer_norm_before:
            self.final_layer_norm = LayerNorm(
                config.hidden_size, config.norm_eps, config.layer_norm_elementwise_affine
            )

    def forward(self, input_ids, positions, kv_cache, meta):
        x = self.embed_tokens(input_ids)  # [T, E]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, D]
        x = x + F.embedding(positions + POSITION_OFFSET, self.embed_positions.weight)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache[i], meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [T, E]
        return x


class OPTModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int):
        super().__init__()
        self.decoder = OPTDecoder(config, tp_rank, tp_size)


class OPTForCausalLM(nn.Module):
    STACKED_PARAMS = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".mlp.fc1.", ".fc1.", None),
        (".mlp.fc2.", ".fc2.", None),
    )

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.model = OPTModel(config, tp_rank, tp_size)
        embed_dim = config.word_embed_proj_dim or config.hidden_size
        self.lm_head = ParallelLMHead(config.vocab_size, embed_dim, tp_rank, tp_size)
        if config.tie_word_embeddings:  # OPT's default; an untied checkpoint holds lm_head.weight
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, 2, num_blocks, block_size, H, D] -> hidden [T, E]."""
        return self.model.decoder(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # [S, V]
