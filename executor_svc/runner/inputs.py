"""Per-sequence executor state and the step's tensors built from it (`ModelInput`).

Everything per token is built with tensor ops; Python touches each scheduled sequence once (to
slice its new token ids and read its block table). The step's tensors, sampling parameters included,
reach the device in one copy (`pack_to_device`). A step of decodes alone (the common step) takes a
path of its own, `_decode_model_input`: its columns are read from the states by C-level maps, the
ones a sequence keeps between steps from bytes cached per state (the same ModelInput).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields, replace
from itertools import compress, repeat
from operator import add, attrgetter, floordiv, ge, getitem, is_, itemgetter, mod, mul, sub
from typing import Any, NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

import kernels
from executor_svc.layers.attention import AttentionMetadata
from executor_svc.runner.errors import PlanError
from executor_svc.runner.host_to_device import pack_to_device
from executor_svc.runner.sampler import SamplingMetadata
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN


class BlockTableRows:
    """The block tables of one executor's live sequences, one int32 row each in one host tensor
    [rows, width] (zeros past each table's end): a step's padded [B, M] table is one gather of its
    sequences' rows, where padding B per-sequence tensors (pad_sequence) took ~0.3 ms at 256 sequences
    on a CPU core and ~0.7 ms on the H100 machine's host, every step. Rows and width grow by doubling."""

    def __init__(self, rows: int = 64, width: int = 64):
        self._table = torch.zeros(rows, width, dtype=torch.int32)  # [rows, width]
        self._lengths = [0] * rows  # entries written in each row
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_live(self) -> int:
        return len(self._lengths) - len(self._free)

    def acquire(self, block_ids: list[int]) -> int:
        """A free row holding block_ids."""
        if not self._free:
            rows, width = self._table.shape
            self._table = torch.cat([self._table, torch.zeros(rows, width, dtype=torch.int32)])
            self._lengths += [0] * rows
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.write(row, 0, block_ids)
        return row

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Row `row`'s table[start:] = block_ids (a table that gets shorter is zeroed past its end)."""
        end = start + len(block_ids)
        width = self._table.shape[1]
        if end > width:
            while width < end:
                width *= 2
            grown = torch.zeros(self._table.shape[0], width, dtype=torch.int32)
            grown[:, : self._table.shape[1]] = self._table
            self._table = grown
        if block_ids:
            self._table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        if end < self._lengths[row]:
            self._table[row, end : self._lengths[row]] = 0
        self._lengths[row] = end

    def release(self, row: int) -> None:
        self.write(row, 0, [])
        self._free.append(row)

    def gather(self, rows: list[int] | array, width: int) -> torch.Tensor:
        """[len(rows), width] int32: the tables of `rows` (a list, or an array of int64), zero-padded
        to width (a new tensor)."""
        if isinstance(rows, array) and rows:
            index = torch.frombuffer(rows, dtype=torch.int64)
        else:
            index = torch.tensor(rows, dtype=torch.int64)
        gathered = self._table[:, :width].index_select(0, index)
        if width > gathered.shape[1]:  # wider than any table written: zeros
            gathered = torch.nn.functional.pad(gathered, (0, width - gathered.shape[1]))
        return gathered


@dataclass(slots=True)
class SequenceState:
    """What the executor remembers of one sequence between steps.

    Change `block_table` only through `set_blocks`: it keeps the table's tensor form up to date, either
    a row of a `BlockTableRows` (`attach`; the executor's sequences, whose steps gather their rows at
    once) or a tensor of its own, rebuilt only when the table changes (about once per block_size
    tokens), so a step never converts every sequence's whole table from Python. A state attached to
    rows gives its row back with `detach` when the executor forgets it.
    """

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams
    sample_index: int = 0
    prompt_len: int = 0
    _table_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _rows: BlockTableRows | None = field(default=None, repr=False, compare=False)
    _row: int = field(default=-1, repr=False, compare=False)
    # (temperature, top_p) and the integer sampling columns that do not change between steps
    _sampling_row: tuple | None = field(default=None, repr=False, compare=False)

    def attach(self, rows: BlockTableRows) -> None:
        """Keeps the table in a row of `rows` from now on."""
        if self._rows is not None:
            raise ValueError("this sequence's table is in a BlockTableRows already")
        self._row = rows.acquire(self.block_table)
        self._rows = rows

    def detach(self) -> None:
        """Gives the row back (the sequence is forgotten); no-op for a state not attached."""
        if self._rows is not None:
            self._rows.release(self._row)
            self._rows, self._row = None, -1

    def set_blocks(self, start: int, block_ids: list[int]) -> None:
        """block_table[start:] = block_ids."""
        self.block_table[start:] = block_ids
        self._table_tensor = None
        if self._rows is not None:
            self._rows.write(self._row, start, block_ids)

    def block_table_tensor(self) -> torch.Tensor:
        if self._table_tensor is None:
            self._table_tensor = torch.tensor(self.block_table, dtype=torch.int64)  # [num_blocks]
        return self._table_tensor

    def copy(self) -> SequenceState:
        """A copy with its own token ids and table (attached to the same rows, in a row of its own)."""
        child = SequenceState(
            list(self.token_ids),
            self.num_computed_tokens,
            list(self.block_table),
            self.sampling_params,
            self.sample_index,
            self.prompt_len,
            self._table_tensor,  # never written in place: safe to share
        )
        if self._rows is not None:
            child.attach(self._rows)
        return child


class ScheduledSequence(NamedTuple):
    """A sequence of a step: its state and how many of its tokens the step computes (a named tuple:
    a step makes hundreds, each in a fraction of a frozen dataclass's time)."""

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

    `generator` (CPU) draws the seeds of rows whose request has no seed. A step of decodes alone
    (one token each, every sequence sampled) takes `_decode_model_input`: the same tensors.
    """
    decode = _decode_model_input(scheduled, block_size, device, generator)
    if decode is not None:
        return decode
    return _general_model_input(scheduled, block_size, device, generator)


def _general_model_input(
    scheduled: list[ScheduledSequence], block_size: int, device: torch.device, generator: torch.Generator
) -> ModelInput:
    """build_model_input of any step (prompts, chunks, decodes)."""
    # One pass over the sequences: checks, the per-sequence columns, the new tokens, the sampled rows.
    lens: list[int] = []
    begins: list[int] = []
    tokens: list[int] = []
    sampled: list[int] = []
    for i, s in enumerate(scheduled):
        state, n = s.state, s.num_new_tokens
        begin, ids = state.num_computed_tokens, state.token_ids
        end = begin + n
        if n < 1 or end > len(ids) or len(state.block_table) * block_size < end:
            _validate(s, block_size)  # raises, naming what is wrong
        lens.append(n)
        begins.append(begin)
        if n == 1:
            tokens.append(ids[begin])
        else:
            tokens.extend(ids[begin:end])
        if end == len(ids):
            sampled.append(i)
    num_seqs = len(scheduled)
    q_lens = torch.tensor(lens, dtype=torch.int64)  # [B]
    starts = torch.tensor(begins, dtype=torch.int64)  # [B]
    seq_lens = starts + q_lens  # [B]
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)  # [B + 1]
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_tokens = len(tokens)
    input_ids = torch.tensor(tokens, dtype=torch.int64)  # [T]
    if num_tokens == num_seqs:  # all decoding: one token each
        seq_of_token = torch.arange(num_seqs)  # [T]
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [T]
    positions = torch.arange(num_tokens) - query_start_loc[seq_of_token] + starts[seq_of_token]  # [T]

    block_tables = _block_tables(scheduled)  # [B, M] int32
    block_of_token = block_tables[seq_of_token, positions // block_size].long()
    slot_mapping = block_of_token * block_size + positions % block_size

    logits_indices = query_start_loc[torch.tensor(sampled, dtype=torch.int64) + 1] - 1  # [S]
    sampling = _sampling_metadata([scheduled[i].state for i in sampled], generator)
    sampling_tensors = _tensor_fields(sampling)

    host = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slot_mapping,
        "block_tables": block_tables,
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


# A decode step's integer columns reach the device as two matrices: the step's own, [3, B] in
# DECODE_STEP_COLUMNS order, and the ones a sequence keeps from step to step, [7, B] in
# DECODE_STATIC_COLUMNS order (each state's row is cached as bytes, `_sampling_row`).
DECODE_STEP_COLUMNS = ("input_ids", "positions", "slot_mapping")
DECODE_STATIC_COLUMNS = ("top_k", "has_seed", "given_seeds", "num_logprobs", "num_beam_candidates",
                         "sample_index", "prompt_len")


def _decode_model_input(
    scheduled: list[ScheduledSequence], block_size: int, device: torch.device, generator: torch.Generator
) -> ModelInput | None:
    """build_model_input of a step whose every sequence decodes one token and is sampled; None for
    any other step. The general path's Python loop and dozens of small tensor ops cost ~1.8 ms at 256
    sequences on the H100 machine's slow host cores (docs/benchmarks.md Round 11); here the step's
    columns are read from the states by C-level `map`s into one array, the columns that do not change
    between steps are the states' cached byte rows joined at once, the [B, M] block tables are one
    gather, and everything reaches the device in one copy, as row views of those matrices."""
    num_seqs = len(scheduled)
    if not num_seqs or any(map((1).__ne__, map(_NUM_NEW_TOKENS, scheduled))):
        return None
    states = list(map(_STATE, scheduled))
    begins = list(map(_NUM_COMPUTED, states))
    token_ids = list(map(_TOKEN_IDS, states))
    tables = list(map(_BLOCK_TABLE, states))
    if any(map((1).__ne__, map(sub, map(len, token_ids), begins))) or any(
        map(ge, begins, map(mul, map(len, tables), repeat(block_size)))
    ):
        return None  # not the last known token of each (a chunk), or a table too short: the general
        # path (which names the error)
    tokens = list(map(getitem, token_ids, begins))
    blocks = map(getitem, tables, map(floordiv, begins, repeat(block_size)))
    step = array("q", tokens)  # the [3, B] step columns (array + frombuffer: a quarter of
    step.extend(begins)  # torch.tensor's time on lists)
    step.extend(map(add, map(mul, blocks, repeat(block_size)), map(mod, begins, repeat(block_size))))
    rows = list(map(_SAMPLING_ROW, states))  # cached on the states; computed for any new one
    if None in rows:
        rows = list(map(_sampling_row, states))
    columns = torch.frombuffer(step, dtype=torch.int64).view(len(DECODE_STEP_COLUMNS), num_seqs)
    static = torch.frombuffer(_EMPTY.join(map(_INT_BYTES, rows)), dtype=torch.int64).view(num_seqs, -1).t()
    floats = torch.frombuffer(_EMPTY.join(map(_FLOAT_BYTES, rows)), dtype=torch.float32).view(num_seqs, 2).t()
    fresh = torch.randint(0, 2**62, (num_seqs,), generator=generator, dtype=torch.int64)
    positions = columns[1]
    host = {
        "step": columns,
        "static": static,  # [7, B] (a transposed view: the packing copy makes it contiguous)
        "floats": floats,  # [2, B] temperature, top_p
        "output_positions": positions + 1 - static[6],  # [B] tokens generated before this one
        "seeds": torch.where(static[1].bool(), static[2], fresh),  # [B]
        "block_tables": _block_tables_of(states, tables),  # [B, M] int32
        "seq_lens": (positions + 1).to(torch.int32),  # [B]
        "query_start_loc": torch.arange(num_seqs + 1, dtype=torch.int32),  # [B + 1]
    }
    on_device = pack_to_device(host, device)
    cols = dict(zip(DECODE_STEP_COLUMNS, on_device["step"].unbind(0), strict=True))
    cols.update(zip(DECODE_STATIC_COLUMNS, on_device["static"].unbind(0), strict=True))
    query_start_loc = on_device["query_start_loc"]
    attn = AttentionMetadata(
        slot_mapping=cols["slot_mapping"],
        block_tables=on_device["block_tables"],
        seq_lens=on_device["seq_lens"],
        query_start_loc=query_start_loc,
        max_query_len=1,
        max_seq_len=max(begins) + 1,
    )
    max_logprobs = max(map(_NUM_LOGPROBS, rows))
    max_beams = max(map(_NUM_BEAMS, rows))
    on_temperature, on_top_p = on_device["floats"].unbind(0)
    sampling = SamplingMetadata(
        temperature=on_temperature,
        top_p=on_top_p,
        top_k=cols["top_k"],
        seeds=on_device["seeds"],
        has_seed=cols["has_seed"].bool(),
        sample_index=cols["sample_index"],
        output_positions=on_device["output_positions"],
        num_logprobs=cols["num_logprobs"],
        num_beam_candidates=cols["num_beam_candidates"],
        max_num_logprobs=max(0, max_logprobs),
        max_num_beam_candidates=max(0, max_beams),
        all_greedy=not any(map(_RANDOM, rows)),
        any_top_k_top_p=any(map(_TOP_K_TOP_P, rows)),
    )
    seq_ids = tuple(map(_SEQ_ID, scheduled))
    if tokens.count(PENDING_TOKEN) == num_seqs:  # every token planned ahead (async scheduling)
        holes, pending_seq_ids = torch.arange(num_seqs), seq_ids
    else:
        where = list(compress(range(num_seqs), map(PENDING_TOKEN.__eq__, tokens)))
        holes = torch.tensor(where, dtype=torch.int64)
        pending_seq_ids = tuple(map(seq_ids.__getitem__, where))
    return ModelInput(
        input_ids=cols["input_ids"],
        positions=cols["positions"],
        attn=attn,
        logits_indices=query_start_loc[:num_seqs].long(),
        sampling=sampling,
        sampled_seq_ids=seq_ids,
        num_logprobs=tuple(map(_NUM_LOGPROBS, rows)) if max_logprobs > 0 else None,
        num_beam_candidates=tuple(map(_NUM_BEAMS, rows)) if max_beams > 0 else None,
        pending_token_indices=holes,
        pending_seq_ids=pending_seq_ids,
    )


_STATE, _SEQ_ID, _NUM_NEW_TOKENS = attrgetter("state"), attrgetter("seq_id"), attrgetter("num_new_tokens")
_NUM_COMPUTED, _TOKEN_IDS = attrgetter("num_computed_tokens"), attrgetter("token_ids")
_BLOCK_TABLE = attrgetter("block_table")
_TOP_K_TOP_P, _RANDOM, _INT_BYTES, _FLOAT_BYTES = itemgetter(2), itemgetter(3), itemgetter(4), itemgetter(5)
_NUM_LOGPROBS, _NUM_BEAMS = itemgetter(6), itemgetter(7)  # of a _sampling_row
_EMPTY = bytearray()  # its join makes a writable buffer (torch.frombuffer warns about bytes)
_ROWS, _ROW, _SAMPLING_ROW = attrgetter("_rows"), attrgetter("_row"), attrgetter("_sampling_row")


def _block_tables(scheduled: list[ScheduledSequence]) -> torch.Tensor:
    """[B, M] int32, each sequence's table zero-padded to the longest: one gather when the states share
    a BlockTableRows (the executor's), else their tensors padded."""
    states = list(map(_STATE, scheduled))
    return _block_tables_of(states, list(map(_BLOCK_TABLE, states)))


def _block_tables_of(states: list[SequenceState], tables: list[list[int]]) -> torch.Tensor:
    rows = states[0]._rows if states else None
    if rows is not None and all(map(is_, map(_ROWS, states), repeat(rows))):
        return rows.gather(array("q", map(_ROW, states)), max(map(len, tables)))
    return pad_sequence([s.block_table_tensor() for s in states], batch_first=True).to(torch.int32)


def _validate(s: ScheduledSequence, block_size: int) -> None:
    """Raises PlanError where the sequence's tokens or block table cannot hold its new tokens."""
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


def _sampling_row(state: SequenceState) -> tuple:
    """((temperature, top_p), (top_k, has_seed, seed or 0, num_logprobs, num_beam_candidates),
    top_k > 0 or top_p < 1, temperature > 0, the DECODE_STATIC_COLUMNS row as int64 bytes, the
    floats as float32 bytes, num_logprobs, num_beam_candidates): what a state puts in its columns
    that does not change between steps, computed once per state (a state with other parameters is a
    new state; a fork's sample_index is set before its first step)."""
    row = state._sampling_row
    if row is None:
        p = state.sampling_params
        floats = (0.0 if p.use_beam_search else p.temperature, p.top_p)
        ints = (p.top_k, p.seed is not None, p.seed or 0, -1 if p.logprobs is None else p.logprobs,
                p.num_beam_candidates)
        row = state._sampling_row = (
            floats, ints, p.top_k > 0 or p.top_p < 1.0, floats[0] > 0.0,
            array("q", (*ints, state.sample_index, state.prompt_len)).tobytes(),
            array("f", floats).tobytes(), ints[3], ints[4],
        )
    return row


def _sampling_metadata(states: list[SequenceState], generator: torch.Generator) -> SamplingMetadata:
    """The sampling columns from two tensors built at once (floats, integers), as views of them."""
    rows = [_sampling_row(s) for s in states]
    floats = torch.tensor([r[0] for r in rows], dtype=torch.float32).view(-1, 2)  # [S, 2]
    ints = torch.tensor(
        [(*r[1], s.sample_index, len(s.token_ids) - s.prompt_len) for r, s in zip(rows, states, strict=True)],
        dtype=torch.int64,
    ).view(-1, 7)  # [S, 7]
    temperature, top_p = floats.unbind(1)
    top_k, has_seed, given, num_logprobs, num_beams, sample_index, output_positions = ints.unbind(1)
    has_seed = has_seed.bool()
    fresh = torch.randint(0, 2**62, (len(states),), generator=generator, dtype=torch.int64)
    max_logprobs = int(num_logprobs.max()) if rows else -1
    max_beams = int(num_beams.max()) if rows else 0
    return SamplingMetadata(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seeds=torch.where(has_seed, given, fresh),
        has_seed=has_seed,
        sample_index=sample_index,
        output_positions=output_positions,
        num_logprobs=num_logprobs,
        num_beam_candidates=num_beams,
        max_num_logprobs=max(0, max_logprobs),
        max_num_beam_candidates=max(0, max_beams),
        all_greedy=not bool((temperature > 0).any()),
        any_top_k_top_p=any(r[2] for r in rows),
    )


def _tensor_fields(meta: SamplingMetadata) -> dict[str, torch.Tensor]:
    """The tensor fields of `meta` by name (the others are host values: flags and maxima)."""
    values = {f.name: getattr(meta, f.name) for f in fields(meta)}
    return {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
