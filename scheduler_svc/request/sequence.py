"""Sequences and sequence groups: the scheduler's per-request state (no KV memory here).

A `SequenceGroup` is one request. It starts with one sequence (sample_index 0); parallel sampling
(n > 1) and beam search add sequences by forking it. Groups are admitted, preempted, swapped and
resumed as a whole.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.request.beam import BeamState
from scheduler_svc.wire.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token / stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client, or finished by a hook (finish_sequence)


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream. `token_ids` = prompt + output; output positions start at `prompt_len`.

    `num_computed_tokens` counts tokens whose KV is in the cache or is being computed by the step in
    flight (the scheduler advances it when it schedules tokens).

    The `executor_*` fields mirror what the executors hold of this sequence, so a step plan carries
    only diffs. They belong to the plan builder (scheduler_svc/sched/plan_builder.py, which says
    what they mean): nothing else reads or writes them.
    """

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    sample_index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    executor_num_tokens: int = -1
    executor_num_blocks: int = 0
    # Async scheduling: the last `pending` token ids are PENDING_TOKEN, the tokens the steps in flight
    # are sampling (later plans were built before their results), oldest first; `take_sample` puts
    # each real one in its place.
    pending: int = 0
    pending_step: int = -1  # the step whose sample the newest placeholder stands for
    scheduled_step: int = -1  # the last step that computed tokens of it (PlanBuilder.add)
    # After a recompute preemption of several sequences: the group's sequence whose blocks hold this
    # one's first num_computed_tokens (BlockManager.allocate); this one computes nothing until that
    # one's num_computed_tokens has reached its own (SchedulingPass._tokens_to_compute).
    waits_for: Sequence | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def drop_placeholders(self) -> None:
        """Forgets the tokens still being sampled (a sequence that finished or lost its state)."""
        if self.pending:
            del self.token_ids[len(self.token_ids) - self.pending :]
            self.pending = 0

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        self.output_logprobs.append(logprob)

    def take_sample(self, token_id: int, logprob: float) -> None:
        """The token sampled for this sequence: it replaces the oldest pending placeholder, if there is
        one, else it is appended."""
        if self.pending:
            self.token_ids[len(self.token_ids) - self.pending] = token_id
            self.pending -= 1
        else:
            self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        self.output_logprobs.append(logprob)


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its live sequences, sampling parameters, arrival time and timestamps.

    `seqs` holds live (unfinished) sequences; finished ones move to `finished_seqs` so the
    scheduler's per-step work depends on live sequences only. `expected_output_len` is the true
    output length when known (benchmarks set it; the oracle reservation policy reads it), else None.
    """

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    expected_output_len: int | None = None
    arrival_index: int = 0  # tie-break of equal arrival times (set by the scheduler)
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times preempted (swap or recompute): its RequestMetrics
    # Prompt tokens found in the prefix cache at its first admission (None until admitted).
    num_cached_prompt_tokens: int | None = None
    finished_seqs: list[Sequence] = field(default_factory=list)
    # Parallel sampling: True once the n samples exist (forked after the shared prompt prefill).
    samples_forked: bool = False
    beam: BeamState | None = None  # beam search state when sampling_params.beam_width > 1

    @property
    def prompt_len(self) -> int:
        return self.seqs[0].prompt_len if self.seqs else self.finished_seqs[0].prompt_len

    @property
    def is_finished(self) -> bool:
        return not self.seqs

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.seqs:
            seq.status = status
