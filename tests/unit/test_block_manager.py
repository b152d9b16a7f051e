"""BlockManager: exact block ids for prefix hits, collisions, copy-on-write, forks, swap, NEVER."""

import pytest

import scheduler_svc.kv.prefix_cache as prefix_cache
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_manager import AllocStatus
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.wire.sampling_params import SamplingParams

_next_id = [0]


def make_group(token_ids, arrival=0.0, **params) -> SequenceGroup:
    _next_id[0] += 1
    seq = Sequence(_next_id[0], list(token_ids), len(token_ids))
    return SequenceGroup(f"r{_next_id[0]}", [seq], SamplingParams(**params), arrival)


def admit(bm: BlockManager, token_ids) -> Sequence:
    group = make_group(token_ids)
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.check_integrity()
    return seq


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    bm.check_integrity()


def test_prefix_hits_share_full_computed_blocks_and_leave_one_token_to_compute():
    bm = BlockManager(block_size=4, num_gpu_blocks=8)
    a = admit(bm, range(10))
    assert bm.block_table(a) == [0, 1, 2] and a.num_computed_tokens == 0
    b = admit(bm, range(10))  # nothing is computed yet: no hit
    assert bm.block_table(b) == [3, 4, 5] and b.num_computed_tokens == 0
    compute_all(bm, a)
    assert sorted(bm.gpu.cached.values(), key=lambda x: x.block_id) == [bm.gpu.blocks[0], bm.gpu.blocks[1]]
    c = admit(bm, [*range(8), 99])
    assert bm.block_table(c) == [0, 1, 6] and c.num_computed_tokens == 8
    assert bm.gpu.blocks[0].ref_cnt == 2 and bm.num_shared_block_refs == 2
    d = admit(bm, range(8))  # 8 tokens = 2 full blocks, but the last token must be computed
    assert bm.block_table(d) == [0, 7] and d.num_computed_tokens == 4
    assert bm.num_prefix_query_tokens == 10 + 10 + 9 + 8
    assert bm.num_prefix_hit_tokens == 8 + 4
    for seq in (a, b, c, d):
        bm.free(seq)
        bm.check_integrity()
    assert bm.num_free_blocks == 8 and bm.num_filled_slots == 0


def test_free_keeps_full_blocks_findable_until_evicted_in_lru_order():
    bm = BlockManager(block_size=2, num_gpu_blocks=4)
    a = admit(bm, [1, 2, 3, 4, 5])  # blocks 0, 1 full; 2 partial
    compute_all(bm, a)
    bm.free(a)
    # partial block 2 (no hash) goes to the head; then the tail block of the prefix before its head
    assert bm.gpu.free_block_ids() == [2, 3, 1, 0]
    assert bm.num_cached_free_blocks == 2
    b = admit(bm, [1, 2, 3, 4, 9])
    assert bm.block_table(b) == [0, 1, 2] and b.num_computed_tokens == 4
    bm.free(b)
    c = admit(bm, [7, 7, 7, 7, 7, 7, 7])  # needs 4 blocks: evicts both cached ones, block 1 first
    assert bm.block_table(c) == [2, 3, 1, 0]
    assert bm.gpu.cached == {} and bm.num_cached_free_blocks == 0
    bm.check_integrity()


def test_hash_collision_never_shares_wrong_tokens(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent_hash, token_ids: 42)
    bm = BlockManager(block_size=2, num_gpu_blocks=8)
    a = admit(bm, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert list(bm.gpu.cached) == [42] and bm.gpu.cached[42].block_id == 0
    b = admit(bm, [9, 9, 3, 4, 5])  # same hash for block 0, other tokens: no hit
    assert b.num_computed_tokens == 0 and bm.block_table(b) == [3, 4, 5]
    c = admit(bm, [1, 2, 7, 7, 5])  # block 0 hits; block 1 collides on hash, tokens differ
    assert c.num_computed_tokens == 2 and bm.block_table(c)[0] == 0
    bm.check_integrity()


def test_a_collided_parent_does_not_let_a_child_block_hit(monkeypatch):
    # hash ignores the parent and only sums the tokens: [1, 2] and [2, 1] collide, and block
    # [5, 5] hashes the same after either parent. The parent serial must stop the second hit.
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent_hash, token_ids: sum(token_ids))
    bm = BlockManager(block_size=2, num_gpu_blocks=8)
    a = admit(bm, [1, 2, 5, 5, 0])
    compute_all(bm, a)
    bm.free(a)
    bm.gpu.uncache(bm.gpu.blocks[0])  # evict the [1, 2] block only
    b = admit(bm, [2, 1, 8])
    compute_all(bm, b)  # publishes [2, 1] under the hash [1, 2] had
    c = admit(bm, [2, 1, 5, 5, 0])
    assert c.num_computed_tokens == 2  # [2, 1] hits; [5, 5] was computed after [1, 2]: no hit
    assert bm.block_table(c)[1] != 1
    bm.check_integrity()


def test_copy_on_write_of_a_shared_partial_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=6)
    parent = admit(bm, range(6))
    compute_all(bm, parent)
    child = Sequence(100, list(parent.token_ids), 6, sample_index=1, num_computed_tokens=6)
    bm.fork(parent, child)
    assert bm.block_table(child) == [0, 1] and bm.gpu.blocks[1].ref_cnt == 2
    bm.check_integrity()
    for seq, token in ((child, 50), (parent, 60)):
        seq.append_token(token, 0.0)
    assert bm.append_slots(child, 1) == [(1, 2)]
    assert bm.block_table(child) == [0, 2] and bm.block_table(parent) == [0, 1]
    assert bm.append_slots(parent, 1) == []  # block 1 is now the parent's alone
    bm.check_integrity()
    assert bm.num_filled_slots == 4 + 3 + 3  # block 0 shared counts once
    assert bm.num_allocated_slots == 3 * 4


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(block_size=4, num_gpu_blocks=6)
    parent = admit(bm, range(8))
    compute_all(bm, parent)
    child = Sequence(101, list(parent.token_ids), 8, num_computed_tokens=8)
    bm.fork(parent, child)
    child.append_token(1, 0.0)
    group = SequenceGroup("g", [parent, child], SamplingParams(), 0.0)
    assert bm.can_append_slots(group, {child.seq_id: 1})
    assert bm.append_slots(child, 1) == []
    assert bm.block_table(child) == [0, 1, 2]
    bm.check_integrity()


def test_n4_forks_share_every_prompt_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=10)
    seq0 = admit(bm, range(11))
    compute_all(bm, seq0)
    children = [Sequence(200 + i, list(seq0.token_ids), 11, sample_index=i) for i in (1, 2, 3)]
    for child in children:
        bm.fork(seq0, child)
    assert all(bm.block_table(c) == [0, 1, 2] for c in children)
    assert [bm.gpu.blocks[i].ref_cnt for i in range(3)] == [4, 4, 4]
    assert bm.num_shared_block_refs == 9 and bm.num_used_blocks == 3
    bm.check_integrity()


def test_swap_round_trip_maps_each_shared_block_once():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=4)
    filler = admit(bm, [5, 5, 5])  # blocks 0, 1
    a = admit(bm, [1, 2, 3])  # blocks 2, 3
    compute_all(bm, a)
    child = Sequence(300, list(a.token_ids), 3, num_computed_tokens=3)
    bm.fork(a, child)
    child.append_token(4, 0.0)
    assert bm.append_slots(child, 1) == [(3, 4)]
    group = SequenceGroup("g", [a, child], SamplingParams(), 0.0)
    assert bm.can_swap_out(group)
    assert bm.swap_out(group) == [(2, 0), (3, 1), (4, 2)]
    assert bm.block_table(a) == [0, 1] and bm.block_table(child) == [0, 2]
    assert bm.cpu.blocks[0].ref_cnt == 2 and bm.num_used_blocks == 2
    bm.check_integrity()
    bm.free(filler)  # GPU free queue is now [4, 3, 2 (cached), ...]
    assert bm.can_swap_in(group)
    pairs = bm.swap_in(group)
    assert [cpu for cpu, _ in pairs] == [0, 1, 2]
    gpu_ids = [gpu for _, gpu in pairs]
    assert bm.block_table(a) == gpu_ids[:2] and bm.block_table(child) == [gpu_ids[0], gpu_ids[2]]
    assert bm.cpu.num_free_blocks == 4
    bm.check_integrity()
    bm.free(a)
    bm.free(child)
    assert bm.num_free_blocks == 8 and bm.cpu.num_free_blocks == 4
    bm.check_integrity()


def test_swap_out_refused_when_cpu_space_is_short():
    bm = BlockManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=1)
    seq = admit(bm, [1, 2, 3])
    group = SequenceGroup("g", [seq], SamplingParams(), 0.0)
    assert not bm.can_swap_out(group)


def test_a_prompt_larger_than_the_cache_is_never_allocatable():
    bm = BlockManager(block_size=4, num_gpu_blocks=3)
    assert bm.can_allocate(make_group(range(13))) is AllocStatus.NEVER
    assert bm.can_allocate(make_group(range(12))) is AllocStatus.OK
    admit(bm, range(5))
    assert bm.can_allocate(make_group(range(12))) is AllocStatus.LATER


def test_integrity_check_catches_a_table_refcount_mismatch():
    bm = BlockManager(block_size=4, num_gpu_blocks=3)
    seq = admit(bm, range(5))
    bm.block_table(seq).append(2)  # a reference the pool never counted
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_samples_recomputed_together_count_their_shared_prefix_blocks_once():
    """A group whose n samples wait again (recompute after a preemption) with the same cached prompt
    blocks: can_allocate counts those blocks once, as allocate shares them (counting them per
    sample said LATER, which with nothing else in the cache dropped a request that fits)."""
    bm = BlockManager(block_size=4, num_gpu_blocks=8, enable_prefix_caching=True)
    first = admit(bm, range(9))
    compute_all(bm, first)  # blocks 0 and 1 full and cached
    bm.free(first)
    assert bm.num_free_blocks == 8
    seqs = [Sequence(100 + i, [*range(8), 50 + i, 60 + i, 70 + i], 8) for i in range(3)]
    group = SequenceGroup("samples", seqs, SamplingParams(n=3), 0.0)
    # 3 blocks each = 9 > 8 free; sharing the two cached blocks: 2 + 3 x 1 = 5
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert [bm.block_table(s) for s in seqs] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert bm.num_free_blocks == 3 and all(s.num_computed_tokens == 8 for s in seqs)
    bm.check_integrity()
    crowded = SequenceGroup("more", [Sequence(200 + i, [*range(8), 90 + i, 91, 92, 93, 94], 8)
                                     for i in range(2)], SamplingParams(n=2), 0.0)
    assert bm.can_allocate(crowded) is AllocStatus.LATER  # 2 blocks of its own each: 4 > 3 free


def test_a_samples_new_block_never_evicts_a_cached_block_a_later_sample_hits():
    """allocate takes every sample's prefix hits before any new block: the first sample's new blocks
    come from the free queue's head, which here holds cached blocks the other two samples hit (and
    can_allocate counted once for both); taking those would have left the group two blocks short
    of what can_allocate promised (found by the property test: the pool ran out)."""
    bm = BlockManager(block_size=2, num_gpu_blocks=8, enable_prefix_caching=True)
    a = admit(bm, range(1, 10))  # blocks 0..3 full ([1, 2] .. [7, 8]), 4 partial
    d = admit(bm, range(50, 56))  # blocks 5..7, full
    compute_all(bm, a)
    compute_all(bm, d)
    bm.free(a)
    bm.free(d)  # free queue: 4 (uncached), then cached 3, 2, 1, 0, 7, 6, 5
    seqs = [Sequence(300, [1, 2, 3, 4, 90, 91, 92, 93], 8),  # hits 0, 1; two new blocks
            Sequence(301, [*range(1, 9), 95], 9),  # hits 0..3; one new block
            Sequence(302, [*range(1, 9), 96], 9)]
    group = SequenceGroup("samples", seqs, SamplingParams(n=3), 0.0)
    assert bm.can_allocate(group) is AllocStatus.OK  # 4 shared + 2 + 1 + 1 = 8 free
    bm.allocate(group)
    assert [bm.block_table(s) for s in seqs] == [[0, 1, 4, 7], [0, 1, 2, 3, 6], [0, 1, 2, 3, 5]]
    assert [s.num_computed_tokens for s in seqs] == [4, 8, 8] and bm.num_free_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("num_free", [5, 4])
def test_samples_recomputed_without_cached_blocks_share_the_first_ones_prompt_blocks(num_free):
    """A recomputed group of n samples whose prompt blocks were evicted (here: no prefix caching):
    the samples after the first share its blocks of their common full blocks, as the fork had shared
    them, and start computing past them once it has (waits_for); the first one writes into those
    shared blocks without a copy. Counted per sample, 3 x 3 blocks would not fit in 8."""
    bm = BlockManager(block_size=4, num_gpu_blocks=8, enable_prefix_caching=False)
    for _ in range(8 - num_free):
        admit(bm, range(3))
    seqs = [Sequence(400 + i, [*range(8), 50 + i, 60 + i, 70 + i], 8) for i in range(3)]
    group = SequenceGroup("samples", seqs, SamplingParams(n=3), 0.0)
    if num_free == 4:  # 3 + 1 + 1 blocks
        assert bm.can_allocate(group) is AllocStatus.LATER
        return
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    bm.check_integrity()
    lead, *rest = seqs
    assert [bm.block_table(s) for s in seqs] == [[3, 4, 5], [3, 4, 6], [3, 4, 7]]
    assert [s.num_computed_tokens for s in seqs] == [0, 8, 8] and bm.num_free_blocks == 0
    assert lead.waits_for is None and all(s.waits_for is lead for s in rest)
    assert bm.can_append_slots(group, {lead.seq_id: 11}) and bm.append_slots(lead, 11) == []
    assert bm.block_table(lead) == [3, 4, 5] and bm.gpu.blocks[3].ref_cnt == 3
    for seq in rest:
        assert bm.append_slots(seq, 3) == []
    assert bm.num_filled_slots == 3 * 3 + 8 + 3 * 3  # the 3 one-block sequences, the shared, the own
    for seq in seqs:
        bm.free(seq)
        bm.check_integrity()
    assert bm.num_free_blocks == num_free


def test_recomputed_samples_share_the_leaders_blocks_only_where_their_tokens_are_the_same():
    """Per block and per sample: a sample that diverges from the first inside the prompt's second
    block shares one block; a block that is full for the first but holds the other's last token is
    not shared (a sequence keeps >= 1 token to compute)."""
    bm = BlockManager(block_size=2, num_gpu_blocks=16, enable_prefix_caching=False)
    seqs = [Sequence(500, [1, 2, 3, 4, 5, 6], 4), Sequence(501, [1, 2, 3, 9, 5, 6], 4),
            Sequence(502, [1, 2, 3, 4, 5], 4)]
    group = SequenceGroup("g", seqs, SamplingParams(n=3), 0.0)
    assert bm.can_allocate(group) is AllocStatus.OK
    bm.allocate(group)
    assert [bm.block_table(s) for s in seqs] == [[0, 1, 2], [0, 3, 4], [0, 1, 5]]
    assert [s.num_computed_tokens for s in seqs] == [0, 2, 4]
    assert bm.num_free_blocks == 10
    bm.check_integrity()
