"""Random paged-attention inputs for the kernel tests and benchmarks (never zeros, scattered blocks)."""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.max_query_len, self.max_seq_len, self.scale,
        )


def scattered_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> torch.Tensor:
    """[num_seqs, max_blocks + 1] int32: distinct shuffled block ids per sequence; the unused tail of
    each row holds other random (valid) ids, so a kernel that reads past a sequence's blocks gets
    wrong numbers rather than a crash."""
    needed = torch.tensor([-(-n // block_size) for n in seq_lens])  # [num_seqs]
    assert int(needed.sum()) <= num_blocks, "not enough blocks for the sequences"
    width = int(needed.max()) + 1
    ids = torch.randperm(num_blocks, generator=generator)[: int(needed.sum())]  # [total_blocks]
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=generator)
    column = torch.arange(width)[None, :]  # [1, width]
    used = column < needed[:, None]  # [num_seqs, width]
    table[used] = ids
    return table.to(torch.int32)


def make_paged_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
    spare_blocks: int = 3,
) -> PagedCase:
    assert all(0 < q <= n for q, n in zip(query_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare_blocks
    tables = scattered_block_tables(seq_lens, block_size, num_blocks, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    key_cache = torch.randn(cache_shape, generator=device_gen, device=device, dtype=torch.float32).to(dtype)
    value_cache = torch.randn(cache_shape, generator=device_gen, device=device, dtype=torch.float32).to(dtype)
    query = torch.randn(
        (sum(query_lens), num_heads, head_dim), generator=device_gen, device=device, dtype=torch.float32
    ).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    as_i32 = dict(dtype=torch.int32, device=device)
    return PagedCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, **as_i32),
        query_start_loc=torch.tensor(starts, **as_i32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=1.0 / math.sqrt(head_dim),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm())


def random_block_pairs(
    gen: torch.Generator, num_src_blocks: int, num_dst_blocks: int, num_pairs: int, disjoint: bool
) -> torch.Tensor:
    """[num_pairs, 2] int64 (src, dst) with distinct dsts; `disjoint`: within one cache, no dst is
    also a src (so the result does not depend on the order the pairs are copied in)."""
    if disjoint:
        ids = torch.randperm(num_src_blocks, generator=gen)
        return torch.stack([ids[:num_pairs], ids[num_pairs : 2 * num_pairs]], dim=1)
    src = torch.randint(0, num_src_blocks, (num_pairs,), generator=gen)
    return torch.stack([src, torch.randperm(num_dst_blocks, generator=gen)[:num_pairs]], dim=1)


def fresh_qkv(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's q, k, v as a model's attention layer has them (paged_attention's fresh_kv): strided
    views of one [T, (H + 2 KV) * D] QKV buffer, q the case's query, k and v what the cache holds at
    each query token's position."""
    num_tokens, num_heads, head_dim = case.query.shape
    block_size, num_kv_heads = case.key_cache.shape[1], case.key_cache.shape[2]
    device = case.query.device
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.empty(num_tokens, width, dtype=case.query.dtype, device=device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    q.copy_(case.query)
    starts = case.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]  # [B]
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=device), query_lens)  # [T]
    pos = case.seq_lens.long()[seq] - query_lens[seq] + torch.arange(num_tokens, device=device) - starts[seq]
    block = case.block_tables.long()[seq, pos // block_size]
    k.copy_(case.key_cache[block, pos % block_size])
    v.copy_(case.value_cache[block, pos % block_size])
    return q, k, v
