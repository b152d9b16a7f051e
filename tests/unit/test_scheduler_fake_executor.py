"""The simulator's model-free executor (scheduler_svc/sim/executor.py), set up for scheduler tests:
it applies StepPlans exactly as step_plan.py specifies, keeps simulated KV content (every slot holds a
running hash of the prefix that wrote it) and checks that every position a sequence attends to holds
its own key, and here also that its per-sequence state equals the scheduler's after every plan — so a
wrong share, a missed copy-on-write or a bad swap is caught."""

from __future__ import annotations

from collections import deque

from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sim.executor import SimExecutor
from scheduler_svc.wire.step_plan import PENDING_TOKEN, StepPlan, StepResult


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
            if seq.pending:  # planned ahead: the executor knows the token the scheduler does not yet
                assert seq.token_ids[-1] == PENDING_TOKEN and state.token_ids[-1] == state.last_sampled
                assert state.token_ids[:-1] == seq.token_ids[:-1], f"seq {seq_id}: executor tokens differ"
            else:
                assert state.token_ids == seq.token_ids, f"seq {seq_id}: executor tokens differ"
            assert state.block_table == self.sched.kv.block_table(seq), f"seq {seq_id}: tables differ"

    def step_ahead(self, in_flight: deque, ahead: bool) -> None:
        """Runs a new plan when none is in flight, and one more ahead when `ahead` and allowed."""
        if not in_flight:
            in_flight.append(self.step(self.sched.schedule()))
        if ahead and self.sched.can_schedule_ahead():
            in_flight.append(self.step(self.sched.schedule()))

    def step(self, plan: StepPlan) -> StepResult:
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


def test_fake_executor_rejects_a_wrong_block_table():
    from scheduler_svc.sched.scheduler import SchedulerConfig
    from scheduler_svc.wire.sampling_params import SamplingParams

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
