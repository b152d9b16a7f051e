"""Plain-torch references of every kernel, with the signatures of docs/interfaces.md.

They run on any device and are the CPU path of the dispatcher. Attention accumulates in float32
(float64 for float64 inputs), so it is exact up to rounding. One Python iteration per sequence,
never per token.

KV cache layout (one layer)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

An FP8 cache (torch.float8_e4m3fn) holds K / k_scale and V / v_scale: reshape_and_cache multiplies
by the float32 reciprocal of the scale, clamps to +-448 (e4m3 has no infinity; beyond 448 a cast
gives NaN) and rounds to nearest even; paged_attention reads the e4m3 values in the compute dtype
and folds k_scale into the softmax scale and v_scale into the output. Any other cache holds the
values as they are, and takes only scales of 1.0.
"""

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> None:
    """Only an FP8 cache is scaled; any other takes scales of 1.0. Scales are positive and finite."""
    if not is_fp8(cache_dtype):
        if (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError(f"a {cache_dtype} KV cache is not scaled: k_scale and v_scale must be 1.0")
    elif not (0.0 < k_scale < float("inf") and 0.0 < v_scale < float("inf")):
        raise ValueError(f"KV scales must be positive and finite, got k {k_scale}, v {v_scale}")


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it: a cast, or for an FP8 cache x * float32(1 / scale) clamped to
    +-448 and rounded to nearest even (the Triton kernel computes the same float32 product)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    inv_scale = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def _as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor viewed as uint8: caches are indexed as bytes (not every device and torch
    version indexes float8), and block moves copy bytes."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its slot of the paged cache; tokens with slot < 0 are skipped. An
    FP8 cache gets K / k_scale and V / v_scale (quantize_to_cache)."""
    check_scales(key_cache.dtype, k_scale, v_scale)
    valid = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[valid].to(torch.long)  # [num_valid]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        _as_bytes(cache)[blocks, offsets] = _as_bytes(quantize_to_cache(x[valid], cache.dtype, scale))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K (or V), contiguous: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].to(device=cache.device, dtype=torch.long)
    return _as_bytes(cache)[blocks].flatten(0, 1)[:seq_len].view(cache.dtype)


def attend_one_sequence(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA attention of the last q_len positions of a context over all of it; with a
    sliding_window > 0, a position sees only the last sliding_window positions (itself included);
    with a logit_softcap > 0, scores become softcap * tanh(score / softcap) (Gemma 2).

    Computes in float32, or float64 for float64 inputs.
    """
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.to(acc).view(q_len, num_kv_heads, group, head_dim)  # [q, kvh, g, d]
    k, v = key.to(acc), value.to(acc)  # [t, kvh, d]
    scores = torch.einsum("qhgd,thd->hgqt", q, k) * scale  # [kvh, g, q, t]
    if logit_softcap > 0:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q]
    k_pos = torch.arange(seq_len, device=query.device)  # [t]
    hidden = k_pos[None, :] > q_pos[:, None]  # [q, t]
    if sliding_window > 0:
        hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqt,thd->qhgd", probs, v)  # [q, kvh, g, d]
    return out.reshape(q_len, num_heads, head_dim)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,  # > 0: keys older than this many positions are masked
    logit_softcap: float = 0.0,  # > 0: scores capped by softcap * tanh(score / softcap)
    k_scale: float = 1.0,  # an FP8 cache holds K / k_scale and V / v_scale
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Varlen causal paged attention; see docs/interfaces.md. Returns [num_tokens, num_heads, head_dim]."""
    del max_query_len, max_seq_len  # only the kernels need the bounds
    check_scales(key_cache.dtype, k_scale, v_scale)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[i], starts[i + 1]
        if end == begin:
            continue
        key = gather_context(key_cache, block_tables[i], seq_len)
        value = gather_context(value_cache, block_tables[i], seq_len)
        attended = attend_one_sequence(
            query[begin:end], key, value, scale * k_scale, sliding_window, logit_softcap
        )
        out[begin:end] = (attended * v_scale).to(out.dtype)
    return out


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy block src to block dst in every layer, K and V (copy-on-write)."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.long)
    kv_bytes = _as_bytes(kv_cache)
    kv_bytes[:, :, mapping[:, 1]] = kv_bytes[:, :, mapping[:, 0]]


def swap_blocks(
    src_cache: torch.Tensor,  # [num_layers, 2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_layers, 2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src block, dst block)
) -> None:
    """Copy blocks between two whole caches, possibly on different devices (swap out / in)."""
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].to(device=src_cache.device, dtype=torch.long)
    dst_ids = block_mapping[:, 1].to(device=dst_cache.device, dtype=torch.long)
    _as_bytes(dst_cache)[:, :, dst_ids] = _as_bytes(src_cache)[:, :, src_ids].to(dst_cache.device)


# ---- layer ops (the model's elementwise steps; fused kernels in kernels/triton_layers.py) ----------


def rms_norm(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x + residual` (of `x` without a residual) as Hugging Face computes it (float32
    statistics, cast back, then the weight in the model's dtype), and the residual stream for the
    next layer: `x + residual` (or `x`)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KV, D]
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,  # [P, D / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX ("rotate half") rotary embedding of query and key, in their dtype as HF does."""
    cos = cos_cache[positions].to(query.dtype).repeat(1, 2).unsqueeze(1)  # [T, 1, D]
    sin = sin_cache[positions].to(query.dtype).repeat(1, 2).unsqueeze(1)  # [T, 1, D]
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_and_cache(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KV, D]
    value: torch.Tensor,  # [T, KV, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,  # [P, D / 2] float32
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rotate_key_in_place: bool = False,
) -> torch.Tensor:
    """rotary_embedding, then reshape_and_cache of the rotated key and the value; returns the rotated
    query [T, H, D]. The rotated key goes to the cache, and with rotate_key_in_place also over `key`
    (the tokens with a slot >= 0), the key and value rows of the others (padding) zeroed."""
    query_out, key_out = rotary_embedding(positions, query, key, cos_cache, sin_cache)
    reshape_and_cache(key_out, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if rotate_key_in_place:
        cached = slot_mapping >= 0
        key[cached] = key_out[cached]
        key[~cached] = 0
        value[~cached] = 0
    return query_out


def rotary_cache_attention(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D], unrotated
    key: torch.Tensor,  # [T, KV, D], unrotated
    value: torch.Tensor,  # [T, KV, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
    cos_cache: torch.Tensor,  # [P, D / 2] float32
    sin_cache: torch.Tensor,  # [P, D / 2] float32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """rotary_and_cache, then paged_attention over the rotated query -> [T, H, D]."""
    query = rotary_and_cache(
        positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
        k_scale, v_scale,
    )
    return paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
        scale, sliding_window, logit_softcap, k_scale, v_scale,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def moe_routing(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by the softmax of its router logits (float32), as Hugging Face
    routes: the weights renormalized to sum 1 over the top k (Mixtral, Qwen `norm_topk_prob`) or not.
    Returns (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    deterministic: bool = False,
) -> torch.Tensor:
    """Mixture-of-experts feed-forward: sum over each token's top_k experts e of
    weight_e * w2[e] @ (silu(gate_e) * up_e), [gate_e | up_e] = w13[e] @ x. Computes in float32
    (float64 for float64 inputs), one Python iteration per expert, never per token; the experts'
    contributions are added in expert order. deterministic: the expert matmuls row by row
    (`batch_invariant_matmul`), so a token's output does not depend on which other tokens chose
    its experts (a BLAS GEMM blocks by the number of rows). -> [T, H]"""
    weights, ids = moe_routing(router_logits, top_k, renormalize)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    x = hidden.to(acc)
    out = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)  # [T, H]

    def matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant_matmul(rows, weight) if deterministic else rows @ weight.t()

    for expert in range(w13.shape[0]):
        token_index, slot = torch.where(ids == expert)  # [n], [n]
        if token_index.numel() == 0:
            continue
        gate_up = matmul(x[token_index], w13[expert].to(acc))  # [n, 2 I]
        y = matmul(silu_and_mul(gate_up), w2[expert].to(acc))  # [n, H]
        out.index_add_(0, token_index, y * weights[token_index, slot, None].to(acc))
    return out.to(hidden.dtype)


# ---- deterministic mode: the CPU forms of kernels/triton_batch_invariant.py ---------------------------


def batch_invariant_matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """x @ weight.T + bias -> [M, N] in x's dtype, in float32 (float64 for float64 inputs), each row
    by its own matrix-vector product of the same shape on a fresh copy of the row (a BLAS GEMM picks
    its kernel and blocking by M, and a vectorized dot may peel by the row's alignment), so a row's
    result never depends on the other rows. One Python iteration per row: the CPU path of
    deterministic mode, for tests and tiny models, not for speed."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc)  # [N, K]
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=acc, device=x.device)  # [M, N]
    for i in range(x.shape[0]):
        out[i] = torch.mv(w, x[i].to(acc).clone())
    if bias is not None:
        out += bias.to(acc)
    return out.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of [..., D] as Hugging Face computes it: the weight is an offset from 1,
    applied in float32 before the one cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of [..., D] over D (OPT)."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, V] -> (the first argmax of each row [S] int64, its log-softmax [S] float32): what the
    sampler's general path gives a greedy row (executor_svc/runner/sampler.py)."""
    x = logits.float()
    tokens = x.argmax(dim=-1)
    return tokens, x.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
