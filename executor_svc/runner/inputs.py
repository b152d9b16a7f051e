"""Per-sequence executor state and the step's tensors built from it (`ModelInput`).

Everything per token is built with tensor ops; Python touches each scheduled sequence once (to
slice its new token ids and read its block table). The step's tensors, sampling parameters included,
reach the device in one copy (`pack_to_device`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

import kernels
from executor_svc.layers.attention import AttentionMetadata
from executor_svc.runner.errors import PlanError
from executor_svc.runner.host_to_device import pack_to_device
from executor_svc.runner.sampler import SamplingMetadata
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN


@dataclass(slots=True)
class SequenceState:
    """What the executor remembers of one sequence between steps.

    Change `block_table` only through `set_blocks`: it keeps a tensor copy of the table, rebuilt only
    when the table changes (about once per block_size tokens), so a step never converts every
    sequence's whole table from Python.
    """

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams
    sample_index: int = 0
    prompt_len: int = 0
    _table_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def set_blocks(self, start: int, block_ids: list[int]) -> None:
        """block_table[start:] = block_ids."""
        self.block_table[start:] = block_ids
        self._table_tensor = None

    def block_table_tensor(self) -> torch.Tensor:
        if self._table_tensor is None:
            self._table_tensor = torch.tensor(self.block_table, dtype=torch.int64)  # [num_blocks]
        return self._table_tensor

    def copy(self) -> SequenceState:
        return SequenceState(
            list(self.token_ids),
            self.num_computed_tokens,
            list(self.block_table),
            self.sampling_params,
            self.sample_index,
            self.prompt_len,
            self._table_tensor,  # never written in place: safe to share
        )


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    seq_id: int
    state: SequenceState
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata  # slot_mapping, block_tables, seq_lens, query_start_loc, max_query/seq_len
    logits_indices: torch.Tensor  # [S] int64 rows of the hidden states to sample
    sampling: SamplingMetadata  # per sampled row
    sampled_seq_ids: tuple[int, ...]  # [S] the sequence of each sampled row
    # Async scheduling: positions in input_ids (host tensor [P]) holding PENDING_TOKEN, the token the
    # previous step sampled for the sequence named in pending_seq_ids; the worker fills them in.
    pending_token_indices: torch.Tensor | None = None
    pending_seq_ids: tuple[int, ...] = ()
    # Host copies of sampling.num_logprobs / num_beam_candidates, when any row asks for them.
    num_logprobs: tuple[int, ...] | None = None
    num_beam_candidates: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_model_input(
    scheduled: list[ScheduledSequence], block_size: int, device: torch.device, generator: torch.Generator
) -> ModelInput:
    """Tensors for one forward pass over `num_new_tokens` tokens of each sequence from its
    `num_computed_tokens` on; a row is sampled for each sequence that reaches the end of its tokens.

    `generator` (CPU) draws the seeds of rows whose request has no seed.
    """
    for s in scheduled:
        _validate(s, block_size)
    num_seqs = len(scheduled)
    q_lens = torch.tensor([s.num_new_tokens for s in scheduled], dtype=torch.int64)  # [B]
    starts = torch.tensor([s.state.num_computed_tokens for s in scheduled], dtype=torch.int64)  # [B]
    seq_lens = starts + q_lens  # [B]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)  # [B + 1]
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    input_ids = torch.tensor(
        list(
            itertools.chain.from_iterable(
                s.state.token_ids[
                    s.state.num_computed_tokens : s.state.num_computed_tokens + s.num_new_tokens
                ]
                for s in scheduled
            )
        ),
        dtype=torch.int64,
    )  # [T]
    if num_tokens == num_seqs:  # all decoding: one token each
        seq_of_token = torch.arange(num_seqs)  # [T]
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [T]
    positions = torch.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]  # [T]

    block_tables = pad_sequence([s.state.block_table_tensor() for s in scheduled], batch_first=True)  # [B, M]
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    sampled = [
        i
        for i, s in enumerate(scheduled)
        if s.state.num_computed_tokens + s.num_new_tokens == len(s.state.token_ids)
    ]
    logits_indices = query_start_loc[torch.tensor(sampled, dtype=torch.int64) + 1] - 1  # [S]
    sampling = _sampling_metadata([scheduled[i].state for i in sampled], generator)
    sampling_tensors = _tensor_fields(sampling)

    host = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "block_tables": block_tables.to(torch.int32),
        "seq_lens": seq_lens.to(torch.int32),
        "query_start_loc": query_start_loc.to(torch.int32),
        "logits_indices": logits_indices,
        **{f"sampling.{name}": value for name, value in sampling_tensors.items()},
    }
    if num_tokens != num_seqs:  # the prefill kernel's work list (a decode step has no prompt tiles)
        host["prefill_tile_starts"] = kernels.prefill_tile_starts(query_start_loc)
    on_device = pack_to_device(host, device)
    attn = AttentionMetadata(
        slot_mapping=on_device["slot_mapping"],
        block_tables=on_device["block_tables"],
        seq_lens=on_device["seq_lens"],
        query_start_loc=on_device["query_start_loc"],
        max_query_len=int(q_lens.max()) if num_seqs else 0,
        max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        prefill_tile_starts=on_device.get("prefill_tile_starts"),
    )
    sampling_on_device: dict[str, Any] = {name: on_device[f"sampling.{name}"] for name in sampling_tensors}
    holes = (input_ids == PENDING_TOKEN).nonzero().flatten()  # [P] tokens planned ahead (async)
    return ModelInput(
        input_ids=on_device["input_ids"],
        positions=on_device["positions"],
        attn=attn,
        logits_indices=on_device["logits_indices"],
        sampling=replace(sampling, **sampling_on_device),
        sampled_seq_ids=tuple(scheduled[i].seq_id for i in sampled),
        num_logprobs=tuple(sampling.num_logprobs.tolist()) if sampling.max_num_logprobs else None,
        num_beam_candidates=(
            tuple(sampling.num_beam_candidates.tolist()) if sampling.max_num_beam_candidates else None
        ),
        pending_token_indices=holes,
        pending_seq_ids=tuple(scheduled[i].seq_id for i in seq_of_token[holes].tolist()),
    )


def _validate(s: ScheduledSequence, block_size: int) -> None:
    state = s.state
    end = state.num_computed_tokens + s.num_new_tokens
    if s.num_new_tokens < 1 or end > len(state.token_ids):
        raise PlanError(
            f"sequence {s.seq_id}: {s.num_new_tokens} new tokens from {state.num_computed_tokens} "
            f"but only {len(state.token_ids)} token ids are known"
        )
    if len(state.block_table) * block_size < end:
        raise PlanError(
            f"sequence {s.seq_id}: block table of {len(state.block_table)} blocks cannot hold {end} tokens"
        )


def _sampling_metadata(states: list[SequenceState], generator: torch.Generator) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    beam = [p.use_beam_search for p in params]
    temperature = torch.tensor(
        [0.0 if b else p.temperature for p, b in zip(params, beam, strict=True)], dtype=torch.float32
    )
    has_seed = torch.tensor([p.seed is not None for p in params], dtype=torch.bool)
    fresh = torch.randint(0, 2**62, (len(params),), generator=generator, dtype=torch.int64)
    given = torch.tensor([p.seed or 0 for p in params], dtype=torch.int64)
    num_logprobs = torch.tensor([-1 if p.logprobs is None else p.logprobs for p in params], dtype=torch.int64)
    num_beams = torch.tensor([p.num_beam_candidates for p in params], dtype=torch.int64)
    return SamplingMetadata(
        temperature=temperature,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        seeds=torch.where(has_seed, given, fresh),
        has_seed=has_seed,
        sample_index=torch.tensor([s.sample_index for s in states], dtype=torch.int64),
        output_positions=torch.tensor([len(s.token_ids) - s.prompt_len for s in states], dtype=torch.int64),
        num_logprobs=num_logprobs,
        num_beam_candidates=num_beams,
        max_num_logprobs=max([0, *num_logprobs.tolist()]),
        max_num_beam_candidates=max([0, *num_beams.tolist()]),
        all_greedy=not bool((temperature > 0).any()),
        any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
    )


def _tensor_fields(meta: SamplingMetadata) -> dict[str, torch.Tensor]:
    """The tensor fields of `meta` by name (the others are host values: flags and maxima)."""
    values = {f.name: getattr(meta, f.name) for f in fields(meta)}
    return {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
