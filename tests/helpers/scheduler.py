"""Scheduler test tools: `make` / `add` / `answer` drive a Scheduler by hand, and `FakeExecutor`, the
simulator's model-free executor (scheduler_svc/sim/executor.py) set up for scheduler tests: it
applies StepPlans exactly as step_plan.py specifies, keeps simulated KV content (every slot holds a
running hash of the prefix that wrote it) and checks that every position a sequence attends to holds
its own key, and here also that its per-sequence state equals the scheduler's after every plan — so a
wrong share, a missed copy-on-write or a bad swap is caught."""

from __future__ import annotations

from collections import deque

from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sim.executor import SimExecutor
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN, SampledToken, StepPlan, StepResult


def make(**cfg) -> Scheduler:
    """A Scheduler of SchedulerConfig(**cfg) (max_model_len 64 unless given) on a clock stopped at 0."""
    cfg.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**cfg), clock=lambda: 0.0)


def add(sched, rid, prompt, arrival=0.0, **params):
    """Adds request `rid` arriving at `arrival` with SamplingParams(**params); returns its SequenceGroup."""
    group = sched.new_group(rid, list(prompt), SamplingParams(**params), arrival)
    sched.add_request(group)
    return group


def answer(sched, plan, tokens):
    """A StepResult giving tokens[seq_id] to each sequence in `tokens`."""
    samples = [SampledToken(sid, tok, -0.5) for sid, tok in tokens.items()]
    return sched.process_result(StepResult(plan.step_id, samples))


class FakeExecutor(SimExecutor):
    def __init__(self, sched: Scheduler, vocab_size: int = 40, seed: int = 0, eos_prob: float = 0.0):
        super().__init__(
            vocab_size,
            sched.config.block_size,
            seed=seed,
            verify_kv=True,
            min_token_id=3,
            eos_token_id=next(iter(sched.config.eos_token_ids), None),
            eos_prob=eos_prob,
        )
        self.sched = sched
        self.token_counts: list[int] = []  # tokens computed per step

    def check_scheduled(self, seq_id, state) -> None:
        entry = self.sched._seqs.get(seq_id)  # None: aborted after the plan was made
        if entry is not None:
            seq = entry[0]
            if seq.pending:  # planned ahead: the executor knows tokens the scheduler does not yet
                k = seq.pending
                assert seq.token_ids[-k:] == [PENDING_TOKEN] * k and state.token_ids[-1] == state.last_sampled
                assert len(state.token_ids) == len(seq.token_ids), f"seq {seq_id}: executor tokens differ"
                assert state.token_ids[:-k] == seq.token_ids[:-k], f"seq {seq_id}: executor tokens differ"
            else:
                assert state.token_ids == seq.token_ids, f"seq {seq_id}: executor tokens differ"
            assert state.block_table == self.sched.kv.block_table(seq), f"seq {seq_id}: tables differ"

    def step_ahead(self, in_flight: deque, ahead: bool) -> None:
        """Runs a new plan when none is in flight, and more ahead (config.plans_ahead) when `ahead` and
        allowed."""
        if not in_flight:
            in_flight.append(self.step(self.sched.schedule()))
        while ahead and self.sched.can_schedule_ahead():
            in_flight.append(self.step(self.sched.schedule()))

    def step(self, plan: StepPlan) -> StepResult:  # type: ignore[override]  # the result only
        result, work = super().step(plan)
        self.token_counts.append(work.num_tokens)
        return result

    def run_until_done(self, max_steps: int = 2000, check=None, ahead: bool = False) -> list:
        """Steps until every request finished. `ahead`: async scheduling, the next plan is built
        (and run here) before the previous result is processed whenever the scheduler allows it."""
        outputs = []
        in_flight: deque[StepResult] = deque()
        for _ in range(max_steps):
            if not self.sched.has_unfinished() and not in_flight:
                break
            self.step_ahead(in_flight, ahead)
            outputs += self.sched.process_result(in_flight.popleft())
            if check:
                check()
        else:
            raise AssertionError("requests did not finish")
        self.sched.process_result(self.step(self.sched.schedule()))  # delivers the last finished ids
        return outputs
