"""A CPU stand-in for the executor that applies StepPlans exactly as step_plan.py specifies and
checks them: its per-sequence state must equal the scheduler's after every plan, and every KV slot
a sequence attends to must hold that sequence's token at that position (simulated KV content:
a running hash of the prefix), so a wrong share, a missed copy-on-write or a bad swap is caught."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scheduler_svc.scheduler import Scheduler
from scheduler_svc.step_plan import SampledToken, StepPlan, StepResult


@dataclass
class _State:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    params: object
    sample_index: int
    prompt_len: int
    prefix_keys: list[int] = field(default_factory=list)

    def key(self, pos: int) -> int:
        while len(self.prefix_keys) <= pos:
            p = len(self.prefix_keys)
            prev = self.prefix_keys[-1] if self.prefix_keys else 17
            self.prefix_keys.append(hash((prev, self.token_ids[p])))
        return self.prefix_keys[pos]


class FakeExecutor:
    def __init__(self, sched: Scheduler, vocab_size: int = 40, seed: int = 0, eos_prob: float = 0.0):
        self.sched = sched
        self.block_size = sched.config.block_size
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.eos_prob = eos_prob
        self.states: dict[int, _State] = {}
        self.gpu: dict[int, dict[int, int]] = {}
        self.cpu: dict[int, dict[int, int]] = {}
        self.step_id = 0
        self.token_counts: list[int] = []  # tokens computed per step

    def _token(self) -> int:
        eos = self.sched.config.eos_token_id
        if eos is not None and self.rng.random() < self.eos_prob:
            return eos
        return self.rng.randrange(3, self.vocab_size)

    def step(self, plan: StepPlan) -> StepResult:
        assert plan.step_id == self.step_id + 1, "plans must follow one another"
        self.step_id = plan.step_id
        for seq_id in plan.finished_seq_ids:
            del self.states[seq_id]
        for child, parent in plan.forks:
            assert child not in self.states
            src = self.states[parent]
            self.states[child] = _State(
                list(src.token_ids),
                list(src.block_table),
                src.num_computed_tokens,
                src.params,
                src.sample_index,
                src.prompt_len,
            )
        for src, dst in plan.swap_out:
            self.cpu[dst] = dict(self.gpu.get(src, {}))
        for src, dst in plan.swap_in:
            self.gpu[dst] = dict(self.cpu.get(src, {}))
        for src, dst in plan.copies:
            self.gpu[dst] = dict(self.gpu.get(src, {}))
        scheduled = []
        for new in plan.new_seqs:
            assert new.seq_id not in self.states, f"seq {new.seq_id} sent as new twice"
            state = _State(
                list(new.token_ids),
                list(new.block_table),
                new.num_computed_tokens,
                new.sampling_params,
                new.sample_index,
                new.prompt_len,
            )
            self.states[new.seq_id] = state
            scheduled.append((new.seq_id, state, new.num_new_tokens))
        for cont in plan.cont_seqs:
            state = self.states[cont.seq_id]
            state.token_ids.extend(cont.new_token_ids)
            assert cont.block_table_start <= len(state.block_table)
            state.block_table[cont.block_table_start :] = cont.block_ids
            scheduled.append((cont.seq_id, state, cont.num_new_tokens))
        assert len({s[0] for s in scheduled}) == len(scheduled), "a sequence scheduled twice"
        result = StepResult(plan.step_id)
        bs = self.block_size
        self.token_counts.append(sum(n for _, _, n in scheduled))
        for seq_id, state, num_new in scheduled:
            entry = self.sched._seqs.get(seq_id)  # None: aborted after the plan was made
            if entry is not None:
                seq = entry[0]
                assert state.token_ids == seq.token_ids, f"seq {seq_id}: executor tokens differ"
                assert state.block_table == self.sched.kv.block_table(seq), f"seq {seq_id}: tables differ"
            assert num_new > 0
            end = state.num_computed_tokens + num_new
            assert end <= len(state.token_ids)
            for p in range(state.num_computed_tokens, end):  # reshape_and_cache
                self.gpu.setdefault(state.block_table[p // bs], {})[p % bs] = state.key(p)
            for p in range(end):  # attention reads the whole context
                held = self.gpu.get(state.block_table[p // bs], {}).get(p % bs)
                assert held == state.key(p), f"seq {seq_id}: wrong KV at position {p}"
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                result.samples.append(self._sample(seq_id, state))
        return result

    def _sample(self, seq_id: int, state: _State) -> SampledToken:
        params = state.params
        if params.use_beam_search:
            tokens = self.rng.sample(range(3, self.vocab_size), params.num_beam_candidates)
            eos = self.sched.config.eos_token_id
            if eos is not None and self.rng.random() < self.eos_prob:
                tokens[self.rng.randrange(len(tokens))] = eos
            logprobs = sorted((-self.rng.random() * 4 for _ in tokens), reverse=True)
            candidates = list(zip(tokens, logprobs, strict=True))
            return SampledToken(seq_id, tokens[0], logprobs[0], beam_candidates=candidates)
        return SampledToken(seq_id, self._token(), -self.rng.random())

    def run_until_done(self, max_steps: int = 2000, check=None) -> list:
        outputs = []
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            plan = self.sched.schedule()
            outputs += self.sched.process_result(self.step(plan))
            if check:
                check()
        else:
            raise AssertionError("requests did not finish")
        self.sched.process_result(self.step(self.sched.schedule()))  # delivers the last finished ids
        return outputs


def test_fake_executor_rejects_a_wrong_block_table():
    from scheduler_svc.sampling_params import SamplingParams
    from scheduler_svc.scheduler import SchedulerConfig

    sched = Scheduler(SchedulerConfig(block_size=2, num_gpu_blocks=8, max_model_len=32))
    sched.add_request(sched.new_group("a", [1, 2, 3], SamplingParams(max_tokens=2), 0.0))
    ex = FakeExecutor(sched)
    plan = sched.schedule()
    plan.new_seqs[0].block_table[0] = 7
    try:
        ex.step(plan)
    except AssertionError as e:
        assert "tables differ" in str(e)
    else:
        raise AssertionError("a corrupted plan was accepted")
