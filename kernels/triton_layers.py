"""Triton kernels for the elementwise steps of a decoder layer, each one launch where the torch
code (kernels/reference.py, same signatures) launches several:

* rms_norm: residual add + RMSNorm + weight, one program per token row (the torch form is ~9
  kernels: add, cast, square, mean, add eps, rsqrt, multiply, cast, weight).
* rotary_embedding: one program per (token, head), query and key in one launch each (~8 kernels
  each in torch: gather cos/sin, cast, repeat, multiply, rotate, multiply, add).
* rotary_and_cache: the model's path: rotary of query and key and the K/V cache write
  (triton_cache.reshape_and_cache) in one launch per layer, reading q, k, v from the QKV
  projection's output; the same bits as rotary_embedding then reshape_and_cache (`_rotated_halves` is
  the one rotary arithmetic of both kernels; the cache write, FP8 included, is reshape_and_cache's).
* silu_and_mul: one program per (token, chunk) (2 kernels in torch, and half the traffic).

A decode step is a few hundred small kernels (docs/benchmarks.md, "Step time"); at small batches
their count, not the bytes, sets the step time. Rounding follows the torch code step by step
(float32 arithmetic, rounded to the model dtype where torch rounds); on the H100 the outputs are
within 2 ulps of the reference's in bf16 and fp16 (tests/gpu/test_layer_kernels_gpu.py), and the
rotary's are torch's bit for bit (its products and sums go through libdevice's round-to-nearest
operations when compiled, which the compiler may not fuse into FMAs or narrow to bf16:
tests/gpu/test_rotary_and_cache_gpu.py).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl, pdl_launch
from kernels.reference import check_scales, is_fp8
from kernels.triton_cache import as_cached


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_res, stride_y, stride_res_out,
    dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # kernels.pdl
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / dim
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, weight, eps, residual=None):
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype
    num_tokens, dim = x.shape
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if num_tokens == 0:
        return y, res_out
    block = triton.next_power_of_2(dim)
    res = residual if residual is not None else x
    on = pdl(x.device, "rms_norm")
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, y, res_out,
        x.stride(0), res.stride(0), y.stride(0), res_out.stride(0),
        dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        PDL=on, **pdl_launch(on),
    )
    return y, res_out


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    """a * b in float32; RN: libdevice's round-to-nearest product, which the compiler may not fuse with
    an add into an FMA (compiled for sm_90, the plain product below became bf16 FMAs: one rounding
    where the rotary rounds twice). The interpreter has no libdevice, and numpy rounds as written.
    Compiled, it flushes float32 subnormal results to zero (`mul.rn.ftz`), which torch does not:
    products below 1.2e-38 in magnitude would differ, none at a rotary's magnitudes."""
    if RN:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _add(a, b, RN: tl.constexpr):
    """a + b in float32; RN: not narrowed to a bf16 add (one rounding where torch rounds twice)."""
    if RN:
        return libdevice.add_rn(a, b)
    return a + b


@triton.jit
def rotated(x, x_turned, cos, sin, dtype: tl.constexpr, RN: tl.constexpr):
    """x * cos + x_turned * sin in dtype, each product and the sum rounded to dtype as torch rounds
    them (float32, then dtype): the one rotary arithmetic of every kernel that rotates (both rotary
    kernels here, and the decode attention launch that rotates its own query and key:
    kernels/triton_attention.py). x, x_turned ([-x2, x1] for x = [x1, x2], the halves of a head) in
    float32, cos and sin in float32 already rounded to dtype; RN (compiled kernels) keeps the
    compiler to that rounding (`_mul`, `_add`)."""
    a = _mul(x, cos, RN).to(dtype).to(tl.float32)
    b = _mul(x_turned, sin, RN).to(dtype).to(tl.float32)
    return _add(a, b, RN).to(dtype)


@triton.jit
def _rotated_halves(x1, x2, cos, sin, dtype: tl.constexpr, RN: tl.constexpr):
    """(x1, x2) the halves of a head in float32 -> the halves of the rotated head in dtype (`rotated`)."""
    return rotated(x1, -x2, cos, sin, dtype, RN), rotated(x2, x1, cos, sin, dtype, RN)


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_x_tok, stride_x_head, stride_out_tok, stride_out_head, stride_cache,
    half,
    HALF_PAD: tl.constexpr, RN: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    mask = offs < half
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_cache + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cache + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    base = x_ptr + token * stride_x_tok + head * stride_x_head
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotated_halves(x1, x2, cos, sin, dtype, RN)
    out = out_ptr + token * stride_out_tok + head * stride_out_head
    tl.store(out + offs, out1, mask=mask)
    tl.store(out + half + offs, out2, mask=mask)


def _rotate(positions, x, cos_cache, sin_cache):
    assert x.stride(-1) == 1 and cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens, num_heads)](
            x, out, positions, cos_cache, sin_cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_cache.stride(0),
            half, HALF_PAD=triton.next_power_of_2(half), RN=x.is_cuda, num_warps=1,
        )
    return out


def rotary_embedding(positions, query, key, cos_cache, sin_cache):
    return _rotate(positions, query, cos_cache, sin_cache), _rotate(positions, key, cos_cache, sin_cache)


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_out_tok, stride_out_head,
    stride_c_slot, stride_c_head,  # key and value caches share strides
    stride_cos,
    num_heads, num_kv_heads, num_q_blocks, half, k_inv_scale, v_inv_scale,
    HEADS: tl.constexpr, HALF_PAD: tl.constexpr, FP8: tl.constexpr, KEY_IN_PLACE: tl.constexpr,
    RN: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # kernels.pdl
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    in_half = offs < half
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty  # query, key and value share it
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=in_half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=in_half, other=0.0).to(dtype).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]  # [1, HALF_PAD]
    if block < num_q_blocks:
        heads = block * HEADS + tl.arange(0, HEADS)  # [HEADS]
        mask = (heads[:, None] < num_heads) & in_half[None, :]  # [HEADS, HALF_PAD]
        src = q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + offs[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        out1, out2 = _rotated_halves(x1, x2, cos, sin, dtype, RN)
        dst = q_out_ptr + token * stride_out_tok + heads[:, None] * stride_out_head + offs[None, :]
        tl.store(dst, out1, mask=mask)
        tl.store(dst + half, out2, mask=mask)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = (block - num_q_blocks) * HEADS + tl.arange(0, HEADS)  # [HEADS]
            mask = (heads[:, None] < num_kv_heads) & in_half[None, :]  # [HEADS, HALF_PAD]
            src = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + offs[None, :]
            x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
            k1, k2 = _rotated_halves(x1, x2, cos, sin, dtype, RN)
            if KEY_IN_PLACE:  # each program reads its keys before writing them back
                tl.store(src, k1, mask=mask)
                tl.store(src + half, k2, mask=mask)
            src = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + offs[None, :]
            v1 = tl.load(src, mask=mask)
            v2 = tl.load(src + half, mask=mask)
            cache_dtype = key_cache_ptr.dtype.element_ty
            dst = slot * stride_c_slot + heads[:, None] * stride_c_head + offs[None, :]
            tl.store(key_cache_ptr + dst, as_cached(k1, k_inv_scale, cache_dtype, FP8), mask=mask)
            tl.store(key_cache_ptr + dst + half, as_cached(k2, k_inv_scale, cache_dtype, FP8), mask=mask)
            tl.store(value_cache_ptr + dst, as_cached(v1, v_inv_scale, cache_dtype, FP8), mask=mask)
            tl.store(value_cache_ptr + dst + half, as_cached(v2, v_inv_scale, cache_dtype, FP8), mask=mask)
        elif KEY_IN_PLACE:  # a padding token: zero K and V rows (a fresh-K/V tile may read them, weight 0)
            heads = (block - num_q_blocks) * HEADS + tl.arange(0, HEADS)
            mask = (heads[:, None] < num_kv_heads) & in_half[None, :]
            zero = tl.zeros([HEADS, HALF_PAD], dtype=dtype)
            k_row = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + offs[None, :]
            tl.store(k_row, zero, mask=mask)
            tl.store(k_row + half, zero, mask=mask)
            v_row = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + offs[None, :]
            tl.store(v_row, zero, mask=mask)
            tl.store(v_row + half, zero, mask=mask)


def rotary_and_cache(
    positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
    k_scale=1.0, v_scale=1.0, rotate_key_in_place=False,
):
    """rotary_embedding + reshape_and_cache in one launch; returns the rotated query [T, H, D].
    rotate_key_in_place: the rotated keys also overwrite `key` (tokens with a slot), and the key and
    value rows of tokens without one (a CUDA graph's padding) are zeroed, for a prefill launch that
    reads the step's K/V from there (paged_attention's fresh_kv: finite rows past a sequence).

    grid = (T, cdiv(H, HEADS) + cdiv(KV, HEADS)). Program (t, b) for b < cdiv(H, HEADS) rotates
    query heads [b * HEADS, (b + 1) * HEADS) of token t into the new query tensor; a program past
    those takes the same-sized group of KV heads: it rotates their keys and writes them and their
    values into the cache at slot_mapping[t], or does nothing for a slot < 0 (the rotated key goes
    nowhere else). Each program handles [HEADS, head_dim / 2] tiles of the two halves (HEADS: about
    512 elements a tile, at most the head count); elementwise, so the tile shapes change no bits.
    """
    check_scales(key_cache.dtype, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, value.shape)
    assert key_cache.shape == value_cache.shape and tuple(key_cache.shape[2:]) == (num_kv_heads, head_dim)
    assert query.dtype == key.dtype == value.dtype and head_dim % 2 == 0
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    query_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return query_out
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    heads = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(1, 512 // half_pad))
    num_q_blocks = triton.cdiv(num_heads, heads)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, heads))
    on = pdl(query.device, "rotary_cache")
    _rotary_and_cache_kernel[grid](
        query, key, value, query_out, key_cache, value_cache, positions, slot_mapping, cos_cache, sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        query_out.stride(0), query_out.stride(1),
        key_cache.stride(1), key_cache.stride(2),
        cos_cache.stride(0),
        num_heads, num_kv_heads, num_q_blocks, half, 1.0 / k_scale, 1.0 / v_scale,
        HEADS=heads, HALF_PAD=half_pad, FP8=is_fp8(key_cache.dtype), KEY_IN_PLACE=rotate_key_in_place,
        RN=query.is_cuda, PDL=on,
        num_warps=2, **pdl_launch(on),
    )
    return query_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs, (act * up).to(dtype), mask=mask)


def silu_and_mul(x):
    assert x.stride(-1) == 1
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
        )
    return out
