"""Per-layer scales of an FP8 KV cache, measured once at startup.

e4m3 (float8_e4m3fn) keeps 3 mantissa bits for normal values in [2^-6, 448] (a relative rounding
error of at most 2^-4), subnormals in steps of 2^-9 below, and nothing beyond 448 (a cast gives
NaN; the kernels clamp first). A cache written with scale s holds x / s, which moves that window to
[2^-6 s, 448 s]: the relative precision is the same for every s; s only decides what clamps and
what falls into the subnormals.

The worker runs one prefill forward pass over a few random prompts (BOS first, where the model has
one) with a small cache in the model's dtype, records each attention layer's largest |K| and |V|,
and sets

    scale = 2^ceil(log2(amax * HEADROOM / 448)),   HEADROOM = 2

so the calibration's largest value lands in (448 / 4, 448 / 2]: real prompts may go 2-4x beyond what
the random ones showed before anything clamps. A power of two keeps x / s and the dequantization
exact (only the e4m3 rounding changes a value) and is the same for every amax of a binade (a
slightly different calibration gives the same scale).

Why calibrate rather than use 1.0 (vLLM's choice when the checkpoint has no scales): at scale 1.0
every |value| under 2^-6 = 0.0156 is a subnormal with an absolute step of 2^-9, and V activations
of real models often sit around 0.01-0.1 in some layers (those of randomly initialised test models
lower still), where 1.0 loses most of their digits; K and V of normal models never come near 448,
so the headroom above costs nothing. It costs one forward pass at startup.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor_svc.layers.attention import AttentionMetadata, PagedAttention
from kernels.reference import FP8_E4M3_MAX

HEADROOM = 2.0
CALIBRATION_SEED = 0
MAX_CALIBRATION_TOKENS = 1024


def fp8_scale(amax: float, headroom: float = HEADROOM) -> float:
    """The power of two at or above amax * headroom / 448; 1.0 for an amax of 0 (or not finite)."""
    if not (math.isfinite(amax) and amax > 0.0):
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * headroom / FP8_E4M3_MAX))


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


@torch.inference_mode()
def measure_kv_amax(
    model: nn.Module,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    vocab_size: int,
    num_tokens: int,
    bos_token_id: int | None = None,
    num_prompts: int = 4,
) -> list[tuple[float, float]]:
    """Each attention layer's (max |K|, max |V|), in `attention_layers` order, over one prefill of
    `num_prompts` random prompts of num_tokens // num_prompts tokens (a cache of the model's dtype;
    every rank of a tensor-parallel set runs it, with the same prompts, and measures its own heads)."""
    num_prompts = max(1, min(num_prompts, num_tokens))
    prompt_len = max(1, num_tokens // num_prompts)
    blocks_per_prompt = -(-prompt_len // block_size)
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen)  # [B, L]
    if bos_token_id is not None:
        input_ids[:, 0] = bos_token_id
    positions = torch.arange(prompt_len).repeat(num_prompts)  # [B * L]
    first_slot = torch.arange(num_prompts).repeat_interleave(prompt_len) * blocks_per_prompt * block_size
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=(first_slot + positions).to(device),  # [B * L] int64
        block_tables=torch.arange(num_prompts * blocks_per_prompt, **i32).view(num_prompts, -1),
        seq_lens=torch.full((num_prompts,), prompt_len, **i32),
        query_start_loc=torch.arange(0, (num_prompts + 1) * prompt_len, prompt_len, **i32),
        max_query_len=prompt_len,
        max_seq_len=prompt_len,
    )
    cache_shape = (num_layers, 2, num_prompts * blocks_per_prompt, block_size, num_kv_heads, head_dim)
    kv_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    layers = attention_layers(model)
    amax = torch.zeros(len(layers), 2, dtype=torch.float32, device=device)  # [layers, K / V]

    def recorder(index: int):
        def record(_module, args, _output) -> None:
            # after the layer ran: its cache (args[3], zeros where nothing was written) holds the K
            # and V it wrote, K rotated (for a rotary model the rotated K exists nowhere else)
            layer_cache = args[3]  # [2, blocks, block_size, KV, D]
            amax[index] = torch.maximum(amax[index], layer_cache.flatten(1).abs().amax(dim=1).float())

        return record

    hooks = [layer.register_forward_hook(recorder(i)) for i, layer in enumerate(layers)]
    try:
        model(input_ids.flatten().to(device), positions.to(device), kv_cache, meta)
    finally:
        for hook in hooks:
            hook.remove()
    return [(k, v) for k, v in amax.tolist()]


def calibrate_kv_scales(model: nn.Module, kv_amax: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sets each attention layer's (k_scale, v_scale) from its measured amax; returns them."""
    layers = attention_layers(model)
    if len(kv_amax) != len(layers):
        raise ValueError(f"{len(kv_amax)} measurements for {len(layers)} attention layers")
    for layer, (k_amax, v_amax) in zip(layers, kv_amax, strict=True):
        layer.k_scale, layer.v_scale = fp8_scale(k_amax), fp8_scale(v_amax)
    return [(layer.k_scale, layer.v_scale) for layer in layers]
