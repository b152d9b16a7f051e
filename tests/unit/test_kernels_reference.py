"""The plain-torch references (the CPU path of kernels/) against independent formulations."""

import math

import pytest
import torch

import kernels
from kernels import reference


@pytest.fixture
def gen(request):
    seed = torch.seed() % 2**31
    print(f"{request.node.name}: seed {seed}")
    return torch.Generator().manual_seed(seed)


def _scattered_block_tables(gen, seq_lens, block_size, num_blocks):
    """[num_seqs, max_blocks] int32 of distinct shuffled block ids, padded with -1."""
    needed = [-(-n // block_size) for n in seq_lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(needed)]
    table = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = ids[start : start + n].to(torch.int32)
        start += n
    return table


def test_reshape_and_cache_writes_slots_and_skips_negative(gen):
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    key_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key = torch.randn(5, kvh, d, generator=gen)  # [T, kvh, d]
    value = torch.randn(5, kvh, d, generator=gen)
    slots = torch.tensor([3, 17, -1, 8, 23])
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(key_cache[s // block_size, s % block_size], key[t])
        assert torch.equal(value_cache[s // block_size, s % block_size], value[t])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(key_cache.flatten(0, 1)[~written], before_k.flatten(0, 1)[~written])
    assert torch.equal(value_cache.flatten(0, 1)[~written], before_v.flatten(0, 1)[~written])


@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_matches_sdpa_per_sequence(gen, group):
    block_size, kvh, d, num_blocks = 4, 2, 16, 40
    seq_lens = [9, 1, 8, 13]
    q_lens = [9, 1, 1, 5]  # a full prefill, two decodes, a chunk after a cached prefix
    heads = kvh * group
    key_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen, dtype=torch.float64)
    value_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen, dtype=torch.float64)
    tables = _scattered_block_tables(gen, seq_lens, block_size, num_blocks)
    query = torch.randn(sum(q_lens), heads, d, generator=gen, dtype=torch.float64)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    out = kernels.paged_attention(
        query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl,
        max(q_lens), max(seq_lens), scale,
    )
    for i, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        blocks = tables[i].tolist()
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        k = key_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [n, heads, d]
        v = value_cache.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]  # [q, n]
        want = torch.nn.functional.scaled_dot_product_attention(
            query[qsl[i] : qsl[i + 1]].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], want, rtol=1e-10, atol=1e-10)


def test_copy_blocks_copies_every_layer_k_and_v(gen):
    kv = torch.randn(3, 2, 8, 4, 2, 8, generator=gen)  # [L, 2, blocks, bs, kvh, d]
    before = kv.clone()
    mapping = torch.tensor([[1, 5], [1, 6], [7, 0]])
    kernels.copy_blocks(kv, mapping)
    want = before.clone()
    want[:, :, [5, 6, 0]] = before[:, :, [1, 1, 7]]
    assert torch.equal(kv, want)


def test_swap_blocks_between_two_caches(gen):
    src = torch.randn(2, 2, 6, 4, 2, 8, generator=gen)
    dst = torch.randn(2, 2, 3, 4, 2, 8, generator=gen)
    before = dst.clone()
    mapping = torch.tensor([[4, 0], [1, 2]])
    reference.swap_blocks(src, dst, mapping)
    assert torch.equal(dst[:, :, 0], src[:, :, 4])
    assert torch.equal(dst[:, :, 2], src[:, :, 1])
    assert torch.equal(dst[:, :, 1], before[:, :, 1])
