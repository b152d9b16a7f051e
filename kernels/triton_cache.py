"""Triton kernels that move KV-cache data: reshape_and_cache, copy_blocks, swap_blocks.

Signatures as in kernels/reference.py (docs/interfaces.md).

* reshape_and_cache: one program per (token, group of KV heads) copies that token's K and V rows
  into its slot; K and V in the same launch; slots < 0 are skipped. Into an FP8 (e4m3) cache it
  writes value * float32(1 / scale), clamped to +-448, rounded to nearest even (the reference's
  numbers: the float32 product is exact-rounded on both, and so is the cast).
* copy_blocks and swap_blocks share one block-copy kernel. In the layout
  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] one (layer, K-or-V, block) is a
  contiguous run of block_size * num_kv_heads * head_dim elements, so a program copies one chunk of
  one such run: grid = (pairs, layers * 2, chunks), every pair of a step in one launch.
* swap_blocks runs that kernel across devices: the CPU cache is pinned, and pinned memory is mapped
  into the GPU's address space (unified addressing), so the GPU reads (swap in) or writes (swap
  out) the host blocks in place over PCIe. No staging buffer, no per-block cudaMemcpyAsync, one
  launch. A pageable (unpinned) CPU cache falls back to the torch reference (gather, copy, scatter).
  Block moves copy bytes: an FP8 cache goes through the kernel viewed as uint8.
"""

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.reference import FP8_E4M3_MAX, check_scales, is_fp8

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def as_cached(x, inv_scale, cache_dtype: tl.constexpr, FP8: tl.constexpr):
    """x as the cache stores it: a cast, or into an FP8 (e4m3) cache x * float32(1 / scale) clamped to
    +-448 first (e4m3 has no infinity), then the cast. Every kernel that writes the cache uses it."""
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    return x.to(cache_dtype)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_slot, stride_c_head,  # key and value caches share strides
    num_kv_heads, head_dim, k_inv_scale, v_inv_scale,
    HEADS: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    dims = tl.arange(0, D_PAD)  # [D_PAD]
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    tok = token.to(tl.int64)
    k = tl.load(key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    cache_dtype = key_cache_ptr.dtype.element_ty
    dst = slot * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(key_cache_ptr + dst, as_cached(k, k_inv_scale, cache_dtype, FP8), mask=mask)
    tl.store(value_cache_ptr + dst, as_cached(v, v_inv_scale, cache_dtype, FP8), mask=mask)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    check_scales(key_cache.dtype, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape == value_cache.shape
    d_pad = triton.next_power_of_2(head_dim)
    heads = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, 1.0 / k_scale, 1.0 / v_scale,
        HEADS=heads, D_PAD=d_pad, FP8=is_fp8(key_cache.dtype), num_warps=4,
    )


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, mapping_ptr,
    src_layer_stride, dst_layer_stride,  # elements between (layer, K/V) planes of each cache
    block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 = K, 1 = V)
    src_block = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offs < block_numel
    data = tl.load(src_ptr + plane * src_layer_stride + src_block * block_numel + offs, mask=mask)
    tl.store(dst_ptr + plane * dst_layer_stride + dst_block * block_numel + offs, data, mask=mask)


def _launch_block_copy(src_cache, dst_cache, block_mapping, chunk=8192) -> None:
    """Copy every (src, dst) block pair of every (layer, K/V) plane, in one launch."""
    num_layers, two, _, *block_shape = src_cache.shape
    assert src_cache.is_contiguous() and dst_cache.is_contiguous()
    assert dst_cache.shape[:2] == (num_layers, two) and list(dst_cache.shape[3:]) == block_shape
    assert src_cache.dtype == dst_cache.dtype
    if is_fp8(src_cache.dtype):
        src_cache, dst_cache = src_cache.view(torch.uint8), dst_cache.view(torch.uint8)
    block_numel = src_cache[0, 0, 0].numel()
    chunk = min(chunk, triton.next_power_of_2(block_numel))
    grid = (block_mapping.shape[0], num_layers * two, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_cache, dst_cache, block_mapping,
        src_cache.stride(1), dst_cache.stride(1), block_numel,
        CHUNK=chunk, num_warps=4,
    )


def _mapping_on(block_mapping: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[num_pairs, 2] int64, contiguous, on device (copied without blocking the host)."""
    return block_mapping.to(dtype=torch.int64).contiguous().to(device, non_blocking=True)


def copy_blocks(kv_cache, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    _launch_block_copy(kv_cache, kv_cache, _mapping_on(block_mapping, kv_cache.device))


def _gpu_side(src_cache: torch.Tensor, dst_cache: torch.Tensor) -> torch.device:
    return src_cache.device if src_cache.device.type != "cpu" else dst_cache.device


def _cpu_side_is_pinned(src_cache: torch.Tensor, dst_cache: torch.Tensor) -> bool:
    return all(c.is_pinned() for c in (src_cache, dst_cache) if c.device.type == "cpu")


def swap_blocks(src_cache, dst_cache, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    gpu = _gpu_side(src_cache, dst_cache)
    if gpu.type == "cuda" and not _cpu_side_is_pinned(src_cache, dst_cache):
        return reference.swap_blocks(src_cache, dst_cache, block_mapping)
    _launch_block_copy(src_cache, dst_cache, _mapping_on(block_mapping, gpu))
