"""A model-free executor for the simulator: it applies StepPlans exactly as step_plan.py specifies
(per-sequence state, forks, block tables) and answers with fake samples.

Tokens are uniform in [MIN_TOKEN_ID, vocab_size) with random log-probabilities, so a request that
ignores EOS runs to max_tokens; beam search gets 2k distinct candidates with random log-probabilities,
best first. With `verify_kv=True` it also keeps a simulated KV cache (every slot holds a key of the
prefix that wrote it) and asserts that every position a sequence attends to holds that sequence's
key — a wrong share, a missed copy or a bad swap fails loudly. That check costs O(context) per
sequence per step, so it is for tests, not for 1000-request runs. Tests subclass it and override
`check_scheduled` to compare its state with the scheduler's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scheduler_svc.sim.workloads import MIN_TOKEN_ID
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN, SampledToken, StepPlan, StepResult


@dataclass(slots=True)
class _SeqState:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    params: SamplingParams
    prefix_keys: list[int] = field(default_factory=list)  # verify_kv only
    last_sampled: int | None = None  # the token sampled in this sequence's last step
    last_sampled_step: int = -1  # that step's id

    def resolve(self, token_id: int, step_id: int) -> int:
        """PENDING_TOKEN stands for the token this sequence sampled in the step just before `step_id`
        (async scheduling), as a real executor takes it; any other step's is an error, as there."""
        if token_id != PENDING_TOKEN:
            return token_id
        if self.last_sampled is None or self.last_sampled_step != step_id - 1:
            raise ValueError(f"a pending token in step {step_id}, but the sequence sampled nothing in the "
                             "step before")
        return self.last_sampled

    def key(self, position: int) -> int:
        keys = self.prefix_keys
        while len(keys) <= position:
            keys.append(hash((keys[-1] if keys else 0, self.token_ids[len(keys)])))
        return keys[position]


@dataclass(slots=True)
class StepWork:
    """What one step computed, for the step-time model."""

    num_tokens: int = 0
    num_seqs: int = 0
    kv_context_tokens: int = 0  # sum over scheduled sequences of their context after the step


class SimExecutor:
    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        seed: int = 0,
        verify_kv: bool = False,
        min_token_id: int = MIN_TOKEN_ID,
        eos_token_id: int | None = None,
        eos_prob: float = 0.0,
    ):
        """Sampled tokens are uniform in [min_token_id, vocab_size), or `eos_token_id` with
        probability `eos_prob` (also planted among beam candidates)."""
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.rng = random.Random(f"{seed}/sim-executor")
        self.verify_kv = verify_kv
        self.min_token_id = min_token_id
        self.eos_token_id = eos_token_id
        self.eos_prob = eos_prob
        self.states: dict[int, _SeqState] = {}
        self._gpu: dict[int, dict[int, int]] = {}  # block -> offset -> key (verify_kv only)
        self._cpu: dict[int, dict[int, int]] = {}
        self.step_id = 0

    def step(self, plan: StepPlan) -> tuple[StepResult, StepWork]:
        if plan.step_id != self.step_id + 1:
            raise ValueError(f"plan {plan.step_id} does not follow step {self.step_id}")
        self.step_id = plan.step_id
        states = self.states
        for seq_id in plan.finished_seq_ids:
            del states[seq_id]
        for child_id, parent_id in plan.forks:
            if child_id in states:
                raise ValueError(f"fork child {child_id} already exists")
            src = states[parent_id]
            states[child_id] = _SeqState(
                list(src.token_ids),
                list(src.block_table),
                src.num_computed_tokens,
                src.params,
                list(src.prefix_keys),
            )
        if self.verify_kv:
            for src_block, dst_block in plan.swap_out:
                self._cpu[dst_block] = dict(self._gpu.get(src_block, {}))
            for src_block, dst_block in plan.swap_in:
                self._gpu[dst_block] = dict(self._cpu.get(src_block, {}))
            for src_block, dst_block in plan.copies:
                self._gpu[dst_block] = dict(self._gpu.get(src_block, {}))
        scheduled: list[tuple[int, _SeqState, int]] = []
        for new in plan.new_seqs:
            if new.seq_id in states:
                raise ValueError(f"seq {new.seq_id} sent as new while the executor holds it")
            if PENDING_TOKEN in new.token_ids:
                raise ValueError(f"seq {new.seq_id}: a new sequence with a pending token")
            state = _SeqState(
                list(new.token_ids), list(new.block_table), new.num_computed_tokens, new.sampling_params
            )
            states[new.seq_id] = state
            scheduled.append((new.seq_id, state, new.num_new_tokens))
        for cont in plan.cont_seqs:
            state = states[cont.seq_id]
            if PENDING_TOKEN in cont.new_token_ids[:-1]:
                raise ValueError(f"seq {cont.seq_id}: a pending token that is not its last")
            state.token_ids.extend(state.resolve(t, plan.step_id) for t in cont.new_token_ids)
            if cont.block_table_start > len(state.block_table):
                raise ValueError(f"seq {cont.seq_id}: block_table_start past the end of its table")
            state.block_table[cont.block_table_start :] = cont.block_ids
            scheduled.append((cont.seq_id, state, cont.num_new_tokens))
        for seq_id, token_id in zip(plan.decode_seq_ids, plan.decode_token_ids, strict=True):
            state = states[seq_id]
            state.token_ids.append(state.resolve(token_id, plan.step_id))
            scheduled.append((seq_id, state, 1))
        if len({seq_id for seq_id, _, _ in scheduled}) != len(scheduled):
            raise ValueError("a sequence is scheduled twice in one plan")
        result = StepResult(plan.step_id)
        work = StepWork(num_seqs=len(scheduled))
        for seq_id, state, num_new_tokens in scheduled:
            self.check_scheduled(seq_id, state)
            end = state.num_computed_tokens + num_new_tokens
            if not (num_new_tokens > 0 and end <= len(state.token_ids)):
                raise ValueError(f"seq {seq_id}: bad token count {num_new_tokens}")
            if len(state.block_table) * self.block_size < end:
                raise ValueError(f"seq {seq_id}: block table too short for {end} tokens")
            if self.verify_kv:
                self._write_and_check(seq_id, state, end)
            state.num_computed_tokens = end
            work.num_tokens += num_new_tokens
            work.kv_context_tokens += end
            if end == len(state.token_ids):
                sample = self._sample(seq_id, state.params)
                state.last_sampled, state.last_sampled_step = sample.token_id, plan.step_id
                result.samples.append(sample)
        return result, work

    def check_scheduled(self, seq_id: int, state: _SeqState) -> None:
        """Called for each scheduled sequence after the plan's updates, before its forward pass."""

    def _write_and_check(self, seq_id: int, state: _SeqState, end: int) -> None:
        bs, table, gpu = self.block_size, state.block_table, self._gpu
        for pos in range(state.num_computed_tokens, end):  # reshape_and_cache
            gpu.setdefault(table[pos // bs], {})[pos % bs] = state.key(pos)
        for pos in range(end):  # attention reads the whole context
            if gpu.get(table[pos // bs], {}).get(pos % bs) != state.key(pos):
                raise AssertionError(f"seq {seq_id}: wrong KV at position {pos}")

    def _token(self) -> int:
        rng = self.rng
        if self.eos_token_id is not None and rng.random() < self.eos_prob:
            return self.eos_token_id
        return self.min_token_id + int(rng.random() * (self.vocab_size - self.min_token_id))

    def _sample(self, seq_id: int, params: SamplingParams) -> SampledToken:
        rng = self.rng
        if params.use_beam_search:
            tokens = rng.sample(range(self.min_token_id, self.vocab_size), params.num_beam_candidates)
            if self.eos_token_id is not None and rng.random() < self.eos_prob:
                tokens[rng.randrange(len(tokens))] = self.eos_token_id
            logprobs = sorted((-4.0 * rng.random() for _ in tokens), reverse=True)
            return SampledToken(
                seq_id, tokens[0], logprobs[0], beam_candidates=list(zip(tokens, logprobs, strict=True))
            )
        return SampledToken(seq_id, self._token(), -rng.random())
