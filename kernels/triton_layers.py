"""Triton kernels for the elementwise steps of a decoder layer, each one launch where the torch
code (kernels/reference.py, same signatures) launches several:

* rms_norm: residual add + RMSNorm + weight, one program per token row (the torch form is ~9
  kernels: add, cast, square, mean, add eps, rsqrt, multiply, cast, weight).
* rotary_embedding: one program per (token, head), query and key in one launch each (~8 kernels
  each in torch: gather cos/sin, cast, repeat, multiply, rotate, multiply, add).
* silu_and_mul: one program per (token, chunk) (2 kernels in torch, and half the traffic).

A decode step is a few hundred small kernels (docs/benchmarks.md, "Step time"); at small batches
their count, not the bytes, sets the step time. Rounding follows the torch code step by step
(float32 arithmetic, rounded to the model dtype where torch rounds); on the H100 the outputs are
within 2 ulps of the reference's in bf16 and fp16 (tests/gpu/test_layer_kernels_gpu.py).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_x, stride_res, stride_y, stride_res_out,
    dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
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
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, y, res_out,
        x.stride(0), res.stride(0), y.stride(0), res_out.stride(0),
        dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return y, res_out


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_x_tok, stride_x_head, stride_out_tok, stride_out_head, stride_cache,
    half,
    HALF_PAD: tl.constexpr,
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
    # out = x * [cos, cos] + [-x2, x1] * [sin, sin], each product and the sum rounded as in torch
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
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
            half, HALF_PAD=triton.next_power_of_2(half), num_warps=1,
        )
    return out


def rotary_embedding(positions, query, key, cos_cache, sin_cache):
    return _rotate(positions, query, cos_cache, sin_cache), _rotate(positions, key, cos_cache, sin_cache)


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
