"""Paged attention over one layer's view of the KV cache, through `kernels`.

The metadata describes one forward pass (flat tokens of several sequences, no padding):

    query tokens  |--seq 0 (q_len 3)--|-seq 1 (1)-|----seq 2 (4)----|
    query_start_loc  0                 3           4                  8
    seq_lens[i]   = tokens of context of seq i INCLUDING this step's (their K/V are written first)
    slot_mapping  = block_tables[i][pos // block_size] * block_size + pos % block_size per token

An FP8 KV cache holds K / k_scale and V / v_scale: each layer's scales, 1.0 until the worker
calibrates them (executor_svc/runner/kv_calibration.py), before the cache is made and decode graphs
are captured (a graph keeps the scales it was captured with).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from executor_svc.layers import determinism

if TYPE_CHECKING:
    from executor_svc.layers.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    # kernels.prefill_tile_starts(query_start_loc) [B + 1] int32, built on the host with the rest (the
    # Hopper prefill kernel's work list); None: the kernel computes it on the device
    prefill_tile_starts: torch.Tensor | None = None
    # kernels.decode_order(seq_lens) [B] int32, on the device (with_decode_order): the order in which a
    # decode launch takes the sequences, longest context first; None: their own order
    decode_order: torch.Tensor | None = None


def with_decode_order(meta: AttentionMetadata, kv_cache: torch.Tensor, unwindowed: bool) -> AttentionMetadata:
    """meta with its decode_order, sorted on the device (one sort a forward pass, inside a CUDA graph
    when captured in one), where the step's decode launches over kv_cache ([L, 2, N, bs, KV, D], a
    rank's) take it (kernels.needs_decode_order); else meta. `unwindowed`: the model has a layer
    without a sliding window (`attends_unwindowed`); a windowed launch takes no order, so a model whose
    layers are all windowed never sorts."""
    lens, plain = meta.seq_lens, kv_cache.element_size() > 1 and unwindowed
    if meta.decode_order is not None or not kernels.needs_decode_order(
            len(lens), kv_cache.shape[-2], lens.device, plain_cache=plain):
        return meta
    return replace(meta, decode_order=kernels.decode_order(lens))


def attends_unwindowed(model: nn.Module) -> bool:
    """Whether any PagedAttention layer of `model` attends without a sliding window (Gemma's global
    layers, every layer of most families), the only launches that take a decode_order."""
    return any(isinstance(m, PagedAttention) and m.sliding_window <= 0 for m in model.modules())


class PagedAttention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0,
        logit_softcap: float = 0.0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # > 0: keys this many positions back or more are masked
        self.logit_softcap = logit_softcap  # > 0: scores softcap * tanh(score / softcap) (Gemma 2)
        self.k_scale = 1.0  # an FP8 cache holds K / k_scale and V / v_scale; 1.0 for any other cache
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KV, D], kv_cache: [2, num_blocks, block_size, KV, D] -> [T, H * D].

        With `rotary` (and positions [T]) q and k come unrotated (views of the QKV projection are
        fine): one kernel rotates both and writes the rotated K and V into the cache
        (kernels.rotary_and_cache, the same bits as rotary then reshape_and_cache), and in a decode
        step the attention launch does that itself (kernels.rotary_cache_attention, the same bits
        again). Without it q and k are used as they are (OPT). The rotated K exists only in the cache."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        fresh_kv = None
        if rotary is not None and meta.max_query_len == 1:
            if positions is None:
                raise ValueError("rotary attention needs the tokens' positions")
            # a decode step: on CUDA one launch rotates q and k, writes K and V and attends
            out = kernels.rotary_cache_attention(
                positions, q, k, v, key_cache, value_cache, meta.slot_mapping, rotary.cos_cache,
                rotary.sin_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 1,
                meta.max_seq_len, self.scale, self.sliding_window, self.logit_softcap,
                deterministic=determinism.deterministic(), k_scale=self.k_scale, v_scale=self.v_scale,
                decode_order=meta.decode_order,
            )  # [T, H, D]
            return out.reshape(out.shape[0], self.num_heads * self.head_dim)
        if rotary is None:
            kernels.reshape_and_cache(
                k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale
            )
        else:
            if positions is None:
                raise ValueError("rotary attention needs the tokens' positions")
            # a step with prompts: the rotated keys also go back into k (and padding tokens' K/V rows
            # are zeroed), so the prefill kernel can read the step's own K/V from q/k/v's buffer
            prefill = meta.max_query_len > 1
            q = kernels.rotary_and_cache(
                positions, q, k, v, key_cache, value_cache, meta.slot_mapping,
                rotary.cos_cache, rotary.sin_cache, self.k_scale, self.v_scale, rotate_key_in_place=prefill,
            )  # [T, H, D]
            fresh_kv = (k, v) if prefill else None
        out = kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            self.scale,
            self.sliding_window,
            self.logit_softcap,
            deterministic=determinism.deterministic(),
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            fresh_kv=fresh_kv,
            prefill_tile_starts=meta.prefill_tile_starts,
            decode_order=meta.decode_order,
        )  # [T, H, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
