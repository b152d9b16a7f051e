"""The step plan (scheduler → every executor rank) and the step result (rank 0 → scheduler).

Plain data. The gRPC edge converts these to and from protobuf; the executor keeps per-sequence
state (token ids, block table, number of computed tokens) so a plan carries only diffs and its size
does not grow with context length.

Order in which an executor applies a plan:

    1. `finished_seq_ids`: drop those sequences' state (finished, aborted, or preempted by recompute;
       a recomputed sequence comes back later as a `NewSequence`).
    2. `forks`: child state := a copy of the parent's state (token ids, block table, computed count).
    3. block operations: `swap_out` (GPU→CPU), then `swap_in` (CPU→GPU), then `copies` (GPU→GPU,
       copy-on-write), each a list of (src_block, dst_block).
    4. `new_seqs`, `cont_seqs` and the decode columns: update state, then run the model over
       exactly `num_new_tokens` tokens per scheduled sequence, starting at its
       `num_computed_tokens` (one token for each sequence of the decode columns).
    5. sample one token for every scheduled sequence whose computed tokens reach the end of its
       known token ids (its prefill is complete or it is decoding).

A sequence scheduled in a step appears in exactly one of `new_seqs` / `cont_seqs` /
`decode_seq_ids`. The decode columns carry the common case without an object per sequence: a
continuing sequence that appended exactly one token since the executor last saw it (the one sampled
in its previous step), computes exactly that token, and keeps its block table unchanged. Every
other continuing sequence (a new block, copy-on-write, swap-in, a prefill chunk) is a
`ContinuingSequence`.

Async scheduling: the scheduler may build plan i+1 before the result of step i is back (so the
executor can prepare it while the GPU runs step i). The token a sequence samples in step i is then
unknown when plan i+1 is built; the plan carries `PENDING_TOKEN` (-1) in its place (in
`decode_token_ids`, or as the last of a `ContinuingSequence`'s `new_token_ids`), meaning "the token
this executor sampled for this sequence in the step just before this one". The executor fills it
in on the device and in its own copy of the token ids. A sequence not
scheduled in a step (e.g. swapped out) keeps its executor state untouched. A group is swapped in only
in a step that schedules it; its sequences then come as `ContinuingSequence`s with
`block_table_start=0` and their whole new GPU block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.wire.sampling_params import SamplingParams

# A token id not known yet when the plan was built: the one the executor sampled for the sequence in
# the previous step (async scheduling, see above).
PENDING_TOKEN = -1

# The default size limits of one step: a plan computes at most this many tokens, over at most this
# many sequences. The scheduler keeps its plans within them (SchedulerConfig) and an executor's
# memory profile sizes its activations and its sampler for them (CacheConfig); `serve` passes the
# same values to both.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(slots=True)
class NewSequence:
    """A sequence the executor has no state for (first step, or resumed after recompute)."""

    seq_id: int
    token_ids: list[int]  # every token known so far: prompt (+ earlier outputs when recomputed)
    num_computed_tokens: int  # tokens whose KV is already cached (prefix-cache hits)
    num_new_tokens: int  # tokens to compute this step, from num_computed_tokens on
    block_table: list[int]
    sampling_params: SamplingParams
    # Index of this sequence within its request (0..n-1); with `seed`, it picks the random stream
    # so the n samples of a seeded request differ from one another but are each reproducible.
    sample_index: int = 0
    prompt_len: int = 0  # number of prompt tokens in token_ids (output positions start here)


@dataclass(slots=True)
class ContinuingSequence:
    """A sequence the executor already holds; only what changed since its last step."""

    seq_id: int
    num_new_tokens: int
    # Tokens appended since the executor last saw this sequence (normally the one token sampled
    # in the previous step; for beam search the token the scheduler chose). Empty while a long
    # prompt is still being prefilled in chunks.
    new_token_ids: list[int] = field(default_factory=list)
    # block_table[block_table_start:] = block_ids (appends, and copy-on-write replacing the last block).
    block_table_start: int = 0
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    cont_seqs: list[ContinuingSequence] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)  # (child_seq_id, parent_seq_id)
    finished_seq_ids: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src_gpu_block, dst_gpu_block)
    # Decoding sequences, column by column: decode_seq_ids[i] appends decode_token_ids[i] and
    # computes it (one token, block table unchanged).
    decode_seq_ids: list[int] = field(default_factory=list)
    decode_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_new_tokens for s in self.new_seqs) + sum(s.num_new_tokens for s in self.cont_seqs)
                + len(self.decode_seq_ids))

    @property
    def num_scheduled_seqs(self) -> int:
        return len(self.new_seqs) + len(self.cont_seqs) + len(self.decode_seq_ids)

    @property
    def scheduled_seq_ids(self) -> list[int]:
        """Every scheduled sequence: new, continuing, decode columns (in that order)."""
        return [s.seq_id for s in self.new_seqs] + [s.seq_id for s in self.cont_seqs] + self.decode_seq_ids

    @property
    def is_empty(self) -> bool:
        return not (
            self.new_seqs
            or self.cont_seqs
            or self.decode_seq_ids
            or self.forks
            or self.finished_seq_ids
            or self.swap_out
            or self.swap_in
            or self.copies
        )


@dataclass(slots=True)
class SampledToken:
    """One sampled token of one sequence."""

    seq_id: int
    token_id: int
    logprob: float  # log-probability of token_id under the (temperature-scaled) distribution
    # Most likely alternatives, best first, when the request asked for logprobs.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # Beam search: the 2k best (token_id, logprob) continuations of this sequence, best first.
    beam_candidates: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    samples: list[SampledToken] = field(default_factory=list)
    execute_time_s: float = 0.0  # the executor's time for the step (block ops + forward + sample)
