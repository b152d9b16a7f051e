"""Property-based test: random allocate / compute / append / fork / free / swap on the real
BlockManager, with a simulated KV cache that checks every computed slot holds the right token."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.kv.kv_manager import AllocStatus
from scheduler_svc.request.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.wire.sampling_params import SamplingParams

PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7] * 8]


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_gpu_blocks=st.integers(4, 24))
    def setup(self, block_size, num_gpu_blocks):
        self.bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks=num_gpu_blocks)
        self.groups: list[SequenceGroup] = []
        self.gpu_kv: dict[int, dict[int, tuple]] = {}  # block -> offset -> content key
        self.cpu_kv: dict[int, dict[int, tuple]] = {}
        self.next_id = 0

    def _running(self):
        return [g for g in self.groups if g.seqs[0].status is SequenceStatus.RUNNING]

    def _write(self, seq, start, end):
        bs, table = self.bm.block_size, self.bm.block_table(seq)
        for p in range(start, end):
            self.gpu_kv.setdefault(table[p // bs], {})[p % bs] = tuple(seq.token_ids[: p + 1])

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(10, 12), max_size=6))
    def add(self, prefix, suffix):
        self.next_id += 1
        tokens = prefix + suffix
        seq = Sequence(self.next_id, tokens, len(tokens))
        group = SequenceGroup(str(self.next_id), [seq], SamplingParams(), 0.0)
        if self.bm.can_allocate(group) is not AllocStatus.OK:
            return
        self.bm.allocate(group)
        assert seq.num_computed_tokens < seq.num_tokens
        group.set_status(SequenceStatus.RUNNING)
        self.groups.append(group)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def step(self, data):
        group = data.draw(st.sampled_from(self._running()))
        todo = {s.seq_id: (s.num_uncomputed_tokens or 1) for s in group.seqs}
        if not self.bm.can_append_slots(group, todo):
            return
        for seq in group.seqs:
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(data.draw(st.integers(10, 12)), -0.5)
            start = seq.num_computed_tokens
            for src, dst in self.bm.append_slots(seq, todo[seq.seq_id]):
                self.gpu_kv[dst] = dict(self.gpu_kv.get(src, {}))
            self._write(seq, start, start + todo[seq.seq_id])
            seq.num_computed_tokens += todo[seq.seq_id]
            self.bm.mark_computed(seq)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data):
        group = data.draw(st.sampled_from(self._running()))
        parent = data.draw(st.sampled_from(group.seqs))
        self.next_id += 1
        child = Sequence(self.next_id, list(parent.token_ids), parent.prompt_len, len(group.seqs))
        child.num_computed_tokens, child.status = parent.num_computed_tokens, parent.status
        self.bm.fork(parent, child)
        group.seqs.append(child)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free_seq(self, data):
        group = data.draw(st.sampled_from(self.groups))
        seq = group.seqs.pop(data.draw(st.integers(0, len(group.seqs) - 1)))
        self.bm.free(seq)
        if not group.seqs:
            self.groups.remove(group)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self._running()))
        if not self.bm.can_swap_out(group):
            return
        for gpu, cpu in self.bm.swap_out(group):
            self.cpu_kv[cpu] = dict(self.gpu_kv.get(gpu, {}))
        group.set_status(SequenceStatus.SWAPPED)

    @precondition(lambda self: any(g.seqs[0].status is SequenceStatus.SWAPPED for g in self.groups))
    @rule(data=st.data())
    def swap_in(self, data):
        swapped = [g for g in self.groups if g.seqs[0].status is SequenceStatus.SWAPPED]
        group = data.draw(st.sampled_from(swapped))
        if not self.bm.can_swap_in(group):
            return
        for cpu, gpu in self.bm.swap_in(group):
            self.gpu_kv[gpu] = dict(self.cpu_kv.get(cpu, {}))
        group.set_status(SequenceStatus.RUNNING)

    @invariant()
    def integrity(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_integrity()
        bs = self.bm.block_size
        for group in self._running():
            for seq in group.seqs:
                table = self.bm.block_table(seq)
                assert len(table) * bs >= seq.num_tokens
                for p in range(seq.num_computed_tokens):
                    held = self.gpu_kv.get(table[p // bs], {}).get(p % bs)
                    assert held == tuple(seq.token_ids[: p + 1]), f"seq {seq.seq_id} pos {p}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for group in self.groups:
            for seq in group.seqs:
                self.bm.free(seq)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert self.bm.cpu.num_free_blocks == self.bm.cpu.num_blocks
        assert self.bm.num_filled_slots == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
