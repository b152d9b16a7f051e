"""Plan application: the per-sequence state of one rank and the steps that change it.

`launch(plan)` checks the step order, drops finished sequences, applies forks, carries out the
block operations (swap-out, swap-in, copies), updates or creates each scheduled sequence's state,
builds the batch and queues the forward pass and sampling without waiting for them; `finish(step)`
collects the samples once the device is done. Order and errors: scheduler_svc/wire/step_plan.py,
executor_svc/worker/protocol.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, sub

import torch

from executor_svc.runner.errors import PlanError, StepOrderError
from executor_svc.runner.host_to_device import to_device
from executor_svc.runner.inputs import BlockTableRows, ScheduledSequence, SequenceState, build_model_input
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.launched_step import LaunchedStep, copy_to_host, to_samples
from executor_svc.worker.step_trace import StepTrace
from scheduler_svc.wire.step_plan import PENDING_TOKEN, StepPlan, StepResult

_TOKEN_IDS = attrgetter("token_ids")


class PlanApplier:
    """`ensure_runner()` gives the model runner (allocating the caches on first use)."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        seed: int,
        ensure_runner: Callable[[], ModelRunner],
        trace: StepTrace | None = None,
    ):
        self.device = device
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.seqs: dict[int, SequenceState] = {}
        self.block_rows = BlockTableRows()  # every state of self.seqs keeps its table in a row of it
        self.last_step_id: int | None = None
        self._ensure_runner = ensure_runner
        self._trace = trace
        self._last_launched: LaunchedStep | None = None

    def reset(self) -> None:
        self.seqs.clear()
        self.block_rows = BlockTableRows()
        self.last_step_id = None
        self._last_launched = None
        if self._trace is not None:
            self._trace.reset()

    def launch(self, plan: StepPlan) -> LaunchedStep:
        if self.last_step_id is not None and plan.step_id != self.last_step_id + 1:
            raise StepOrderError(
                f"step {plan.step_id} does not follow step {self.last_step_id}; expected "
                f"{self.last_step_id + 1} (reset the executor to start over)"
            )
        step = LaunchedStep(plan.step_id, time.perf_counter(), start_cpu=time.thread_time())
        runner = self._ensure_runner()
        for seq_id in plan.finished_seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                state.detach()
        self._apply_forks(plan.forks)
        runner.kv_cache.swap_out(plan.swap_out)
        runner.kv_cache.swap_in(plan.swap_in)
        runner.kv_cache.copy(plan.copies)
        scheduled = self._apply_sequences(plan)
        batch = None
        if scheduled:
            batch = build_model_input(scheduled, self.block_size, self.device, self.generator)
            if batch.pending_seq_ids:
                self._fill_pending_tokens(batch, step.step_id)
        # The start event goes on the stream just before the forward pass: the GPU is idle from the
        # previous step's end to it unless this step was queued while that one ran.
        start_event = self._record_event() if self._trace is not None else None  # timing: trace only
        step.launch = time.perf_counter()
        step.prepare_cpu_s = time.thread_time() - step.start_cpu
        if self._trace is not None:  # the trace's context fields; no per-step walk otherwise
            contexts = [s.state.num_computed_tokens + s.num_new_tokens for s in scheduled]
            step.context_tokens = sum(contexts)
            step.longest_context = max(contexts, default=0)
        if batch is not None:
            output = runner.execute(batch)
            for s in scheduled:
                s.state.num_computed_tokens += s.num_new_tokens
            if output is not None:
                step.rows = dict(zip(batch.sampled_seq_ids, range(len(batch.sampled_seq_ids)), strict=True))
                step.token_ids = output.token_ids
                step.host = copy_to_host(batch, output)
        step.num_seqs, step.num_tokens = len(scheduled), batch.num_tokens if batch is not None else 0
        step.events = (start_event, self._record_event())
        self.last_step_id = plan.step_id
        self._last_launched = step
        return step

    def wait(self, step: LaunchedStep) -> None:
        if step.events is not None and step.events[1] is not None:
            step.events[1].synchronize()

    def finish(self, step: LaunchedStep) -> StepResult:
        self.wait(step)
        end = time.perf_counter()
        samples, step.sampled_token_ids = to_samples(*step.host) if step.host is not None else ([], [])
        if step.pending_fixes is not None:  # each token list's index <- this step's row's token
            tokens, indices, rows = step.pending_fixes
            deque(map(list.__setitem__, tokens, indices, map(step.sampled_token_ids.__getitem__, rows)),
                  maxlen=0)
            step.pending_fixes = None
        if self._trace is not None:
            self._trace.write(step, end)
        return StepResult(step.step_id, samples, end - step.start)

    def _fill_pending_tokens(self, batch, step_id: int) -> None:
        """PENDING_TOKEN in the batch = the token the previous step sampled for that sequence: copied
        into input_ids on the device (the previous step may still be running), and into the
        sequence's token ids as soon as it is known on the host."""
        prev = self._last_launched
        if prev is None or prev.step_id != step_id - 1:
            raise PlanError(f"step {step_id} takes tokens from a previous step this executor did not run")
        seq_ids = batch.pending_seq_ids
        try:  # (C-level maps: no Python frame per pending token)
            rows = list(map(prev.rows.__getitem__, seq_ids))
        except KeyError as err:
            raise PlanError(
                f"sequence {err.args[0]}: pending token, step {prev.step_id} sampled none for it"
            ) from None
        assert prev.token_ids is not None  # it sampled rows
        holes = batch.pending_token_indices  # [P] ascending
        assert holes is not None
        num_pending = len(rows)
        if rows == list(range(num_pending)) and int(holes[-1]) == num_pending - 1:
            # the step's first P tokens are the previous step's first P samples, in order (a decode
            # batch that kept its sequences and their order): one copy, no index upload
            batch.input_ids[:num_pending].copy_(prev.token_ids[:num_pending])
        else:
            where = to_device(torch.stack((holes, torch.tensor(rows, dtype=torch.int64))), self.device)
            batch.input_ids[where[0]] = prev.token_ids[where[1]]  # [P] <- [P]: [2, P] (holes, rows)
        tokens = list(map(_TOKEN_IDS, map(self.seqs.__getitem__, seq_ids)))
        indices = list(map(sub, map(len, tokens), repeat(1)))
        if any(map(PENDING_TOKEN.__ne__, map(list.__getitem__, tokens, indices))):
            last = next(i for i, t in enumerate(tokens) if t[-1] != PENDING_TOKEN)
            raise PlanError(f"sequence {seq_ids[last]}: a pending token that is not its last")
        if prev.sampled_token_ids is not None:  # the previous step is finished already
            deque(map(list.__setitem__, tokens, indices, map(prev.sampled_token_ids.__getitem__, rows)),
                  maxlen=0)
        else:  # (a step is the previous one of exactly one launch: nothing to merge with)
            prev.pending_fixes = (tokens, indices, rows)

    def _record_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=self._trace is not None)
        event.record()
        return event

    def _apply_forks(self, forks: list[tuple[int, int]]) -> None:
        """child := copy of parent. Forks carry no sample index, so the k-th child forked from a parent
        in one plan gets the parent's sample_index + k: the numbering the scheduler gives the n samples
        of a request (it forks samples 1..n-1 from sample 0 in one plan), so a seeded request draws the
        same streams here as when its sequences come back as NewSequences with their own index. Beam
        candidates ignore the index (they are not random)."""
        forks_per_parent: dict[int, int] = {}
        for child_id, parent_id in forks:
            if child_id in self.seqs:
                raise PlanError(f"fork child {child_id} already exists")
            parent = self._state(parent_id, "fork parent")
            forks_per_parent[parent_id] = forks_per_parent.get(parent_id, 0) + 1
            child = parent.copy()
            child.sample_index = parent.sample_index + forks_per_parent[parent_id]
            self.seqs[child_id] = child

    def _apply_sequences(self, plan: StepPlan) -> list[ScheduledSequence]:
        scheduled = []
        for new in plan.new_seqs:
            state = SequenceState(
                list(new.token_ids),
                new.num_computed_tokens,
                list(new.block_table),
                new.sampling_params,
                new.sample_index,
                new.prompt_len,
            )
            state.attach(self.block_rows)
            old = self.seqs.get(new.seq_id)
            if old is not None:  # a sequence sent again (recomputed) replaces its old state
                old.detach()
            self.seqs[new.seq_id] = state
            scheduled.append(ScheduledSequence(new.seq_id, state, new.num_new_tokens))
        for cont in plan.cont_seqs:
            state = self._state(cont.seq_id, "continuing sequence")
            state.token_ids.extend(cont.new_token_ids)
            if cont.block_table_start > len(state.block_table):
                raise PlanError(
                    f"sequence {cont.seq_id}: block_table_start {cont.block_table_start} past its "
                    f"{len(state.block_table)} blocks"
                )
            if cont.block_ids:  # no block ids: the table is unchanged (whatever block_table_start says)
                state.set_blocks(cont.block_table_start, cont.block_ids)
            scheduled.append(ScheduledSequence(cont.seq_id, state, cont.num_new_tokens))
        seq_ids, token_ids = plan.decode_seq_ids, plan.decode_token_ids
        if len(seq_ids) != len(token_ids):
            raise PlanError(f"{len(seq_ids)} decoding sequences but {len(token_ids)} decode tokens")
        try:  # (C-level maps: no Python frame per decoding sequence)
            decoding = list(map(self.seqs.__getitem__, seq_ids))
        except KeyError as err:
            raise PlanError(f"decoding sequence {err.args[0]} is unknown to this executor") from None
        deque(map(list.append, map(_TOKEN_IDS, decoding), token_ids), maxlen=0)
        scheduled.extend(map(ScheduledSequence, seq_ids, decoding, repeat(1)))
        return scheduled

    def _state(self, seq_id: int, what: str) -> SequenceState:
        state = self.seqs.get(seq_id)
        if state is None:
            raise PlanError(f"{what} {seq_id} is unknown to this executor")
        return state
