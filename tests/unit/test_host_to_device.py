"""One packed host-to-device copy per step (executor_svc/runner/host_to_device.py, pack_to_device):
the round trip keeps every tensor's dtype, shape, bits and contiguity (mixed dtypes, bool, 0-size,
odd lengths, a non-contiguous input); each view starts at an ALIGNMENT-aligned byte of one shared
buffer; `build_model_input` gives the ModelInput a plain-Python reference computes for a mixed step,
and moves it with exactly one `.to(device)`.

On the CPU the packing runs the same code as on CUDA, without pinning.
"""

from __future__ import annotations

import pytest
import torch

from executor_svc.runner import host_to_device, inputs
from executor_svc.runner.host_to_device import ALIGNMENT, pack_to_device
from executor_svc.runner.inputs import BlockTableRows, ScheduledSequence, SequenceState, build_model_input
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import PENDING_TOKEN

CPU = torch.device("cpu")
BS = 4


def mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(7, generator=gen)
    floats[1], floats[2], floats[3] = float("nan"), -0.0, float("inf")
    return {
        "ids": torch.randint(-(2**62), 2**62, (3,), generator=gen),  # 24 bytes: next offset pads
        "flags": torch.tensor([True, False, True]),  # 3 bytes
        "table": torch.randint(-(2**31), 2**31, (3, 5), generator=gen, dtype=torch.int32),
        "empty": torch.zeros(0, dtype=torch.int64),
        "floats": floats,
        "empty_rows": torch.zeros(0, 4, dtype=torch.int32),
        "halves": torch.randn(5, generator=gen).to(torch.float16),
        "scalar": torch.tensor(2**40 + 1, dtype=torch.int64),
        "bytes": torch.arange(1, 10, dtype=torch.uint8),
        "transposed": torch.arange(12, dtype=torch.int64).view(3, 4).t(),  # non-contiguous input
        "last_empty": torch.zeros(0, dtype=torch.bool),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as stored bytes (NaN == NaN, -0.0 != 0.0)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_round_trip_keeps_dtype_shape_bits_and_contiguity():
    originals = mixed_tensors()
    expected = {name: t.clone() for name, t in originals.items()}
    packed = pack_to_device(originals, CPU)
    assert list(packed) == list(originals)
    for name, t in packed.items():
        assert t.dtype == expected[name].dtype, name
        assert t.shape == expected[name].shape, name
        assert t.is_contiguous(), name
        assert t.stride() == torch.empty(expected[name].shape).stride(), name
        assert same_bits(t, expected[name]), name
    assert torch.equal(packed["transposed"], torch.arange(12).view(3, 4).t())
    assert packed["table"].stride() == (5, 1)


def test_views_share_one_buffer_at_aligned_disjoint_offsets():
    originals = mixed_tensors()
    packed = pack_to_device(originals, CPU)
    storages = {t.untyped_storage().data_ptr() for t in packed.values()}
    assert len(storages) == 1
    base = storages.pop()
    spans = []
    for name, t in packed.items():
        offset = t.data_ptr() - base
        assert offset % ALIGNMENT == 0, (name, offset)
        spans.append((offset, offset + t.numel() * t.element_size()))
    nonempty = sorted(s for s in spans if s[1] > s[0])
    assert all(end <= start for (_, end), (start, _) in zip(nonempty, nonempty[1:], strict=False))
    # 24 + 3 + 60 + 0 + 28 + 0 + 10 + 8 + 9 + 96 bytes, each rounded up to 16
    assert packed["bytes"].untyped_storage().nbytes() == 32 + 16 + 64 + 0 + 32 + 0 + 16 + 16 + 16 + 96


def test_result_is_a_copy_not_an_alias_of_the_inputs():
    originals = mixed_tensors()
    packed = pack_to_device(originals, CPU)
    originals["ids"].zero_()
    originals["table"].fill_(7)
    assert not torch.equal(packed["ids"], originals["ids"])
    assert not (packed["table"] == 7).all()


def test_all_empty_and_no_tensors():
    empty = {"a": torch.zeros(0, dtype=torch.float32), "b": torch.zeros(0, 3, dtype=torch.bool)}
    packed = pack_to_device(empty, CPU)
    assert packed["a"].shape == (0,) and packed["a"].dtype == torch.float32
    assert packed["b"].shape == (0, 3) and packed["b"].dtype == torch.bool
    assert pack_to_device({}, CPU) == {}


def test_refuses_non_tensors_and_device_tensors():
    with pytest.raises(TypeError, match="ids: expected a tensor, got list"):
        pack_to_device({"ids": [1, 2, 3]}, CPU)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="ids: expected a host tensor, got one on meta"):
        pack_to_device({"ids": torch.empty(3, device="meta")}, CPU)


def count_device_moves(monkeypatch) -> list[tuple]:
    """Every `Tensor.to` call that names a device (dtype-only casts are not moves)."""
    moves: list[tuple] = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args):
            moves.append((tuple(self.shape), self.dtype))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    return moves


def test_pack_moves_with_one_copy(monkeypatch):
    moves = count_device_moves(monkeypatch)
    pack_to_device(mixed_tensors(), CPU)
    assert len(moves) == 1 and moves[0][1] == torch.uint8


# --- build_model_input over a mixed step ------------------------------------------------------------


def mixed_step() -> list[ScheduledSequence]:
    """Two decodes (one with a token planned ahead: PENDING_TOKEN), a prefill chunk that does not
    reach the prompt's end (not sampled), a prompt prefilled to its end after a cached prefix, and a
    beam-search decode: sampled rows mix seeds, top-k, top-p, logprobs and beam candidates."""

    def state(num_tokens, num_computed, table, params, sample_index=0, prompt_len=None):
        tokens = [(7 * i + 3) % 97 + 3 for i in range(num_tokens)]
        return SequenceState(tokens, num_computed, table, params, sample_index, prompt_len or num_tokens)

    a = state(11, 10, [9, 2, 5], SamplingParams(temperature=0.7, top_k=5, seed=1234), 1, 6)
    b = state(6, 5, [4, 11], SamplingParams(temperature=1.2, top_p=0.9, logprobs=3), 0, 3)
    b.token_ids[-1] = PENDING_TOKEN
    c = state(20, 4, [1, 3, 8, 12, 13], SamplingParams(temperature=0.0))
    d = state(9, 4, [9, 6, 7], SamplingParams(temperature=0.0, logprobs=0))
    e = state(8, 7, [10, 14], SamplingParams(beam_width=2), 2, 5)
    return [
        ScheduledSequence(10, a, 1),
        ScheduledSequence(11, b, 1),
        ScheduledSequence(12, c, 8),
        ScheduledSequence(13, d, 5),
        ScheduledSequence(14, e, 1),
    ]


def reference(scheduled: list[ScheduledSequence], generator_seed: int) -> dict:
    """The step's columns from Python lists, one sequence and one token at a time."""
    input_ids, positions, slot_mapping, seq_lens, query_start_loc = [], [], [], [], [0]
    width = max(len(s.state.block_table) for s in scheduled)
    block_tables = [s.state.block_table + [0] * (width - len(s.state.block_table)) for s in scheduled]
    logits_indices, sampled = [], []
    for s in scheduled:
        st = s.state
        for pos in range(st.num_computed_tokens, st.num_computed_tokens + s.num_new_tokens):
            input_ids.append(st.token_ids[pos])
            positions.append(pos)
            slot_mapping.append(st.block_table[pos // BS] * BS + pos % BS)
        seq_lens.append(st.num_computed_tokens + s.num_new_tokens)
        query_start_loc.append(len(input_ids))
        if seq_lens[-1] == len(st.token_ids):
            logits_indices.append(len(input_ids) - 1)
            sampled.append(s)
    fresh = torch.randint(
        0, 2**62, (len(sampled),), generator=torch.Generator().manual_seed(generator_seed), dtype=torch.int64
    ).tolist()
    params = [s.state.sampling_params for s in sampled]
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    return {
        "input_ids": torch.tensor(input_ids, dtype=i64),
        "positions": torch.tensor(positions, dtype=i64),
        "slot_mapping": torch.tensor(slot_mapping, dtype=i64),
        "block_tables": torch.tensor(block_tables, dtype=i32),
        "seq_lens": torch.tensor(seq_lens, dtype=i32),
        "query_start_loc": torch.tensor(query_start_loc, dtype=i32),
        "logits_indices": torch.tensor(logits_indices, dtype=i64),
        "sampled_seq_ids": tuple(s.seq_id for s in sampled),
        "temperature": torch.tensor([0.0 if p.use_beam_search else p.temperature for p in params], dtype=f32),
        "top_p": torch.tensor([p.top_p for p in params], dtype=f32),
        "top_k": torch.tensor([p.top_k for p in params], dtype=i64),
        "seeds": torch.tensor(
            [p.seed if p.seed is not None else f for p, f in zip(params, fresh, strict=True)], dtype=i64
        ),
        "has_seed": torch.tensor([p.seed is not None for p in params], dtype=torch.bool),
        "sample_index": torch.tensor([s.state.sample_index for s in sampled], dtype=i64),
        "output_positions": torch.tensor(
            [len(s.state.token_ids) - s.state.prompt_len for s in sampled], dtype=i64
        ),
        "num_logprobs": torch.tensor([-1 if p.logprobs is None else p.logprobs for p in params], dtype=i64),
        "num_beam_candidates": torch.tensor([p.num_beam_candidates for p in params], dtype=i64),
    }


def test_build_model_input_matches_the_reference_for_a_mixed_step():
    scheduled = mixed_step()
    batch = build_model_input(scheduled, BS, CPU, torch.Generator().manual_seed(42))
    want = reference(scheduled, 42)
    got = {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "slot_mapping": batch.attn.slot_mapping,
        "block_tables": batch.attn.block_tables,
        "seq_lens": batch.attn.seq_lens,
        "query_start_loc": batch.attn.query_start_loc,
        "logits_indices": batch.logits_indices,
        **{name: getattr(batch.sampling, name) for name in want if hasattr(batch.sampling, name)},
    }
    assert set(got) == set(want) - {"sampled_seq_ids"}
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype, name
        assert tensor.shape == want[name].shape, name
        assert tensor.is_contiguous(), name
        assert same_bits(tensor, want[name]), (name, tensor, want[name])
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1  # views of one buffer
    assert batch.attn.block_tables.stride() == (5, 1)
    assert batch.sampled_seq_ids == want["sampled_seq_ids"] == (10, 11, 13, 14)
    assert (batch.attn.max_query_len, batch.attn.max_seq_len) == (8, 12)
    s = batch.sampling
    assert (s.max_num_logprobs, s.max_num_beam_candidates) == (3, 4)
    assert (s.all_greedy, s.any_top_k_top_p) == (False, True)
    assert batch.num_logprobs == (-1, 3, 0, -1)
    assert batch.num_beam_candidates == (0, 0, 0, 4)
    assert batch.pending_token_indices.tolist() == [1] and batch.pending_seq_ids == (11,)
    assert batch.input_ids[1] == PENDING_TOKEN


def test_block_table_rows_keep_each_table_zero_padded():
    """acquire / write (longer, shorter, past the width: it doubles) / release / gather against the
    tables padded by hand; more rows than the start (they double) and a freed row reused clean."""
    rows = BlockTableRows(rows=2, width=4)
    tables = {rows.acquire(t): t for t in ([5, 6, 7], [], [1, 2, 3, 4])}
    assert rows.num_live == 3

    def check():
        order = sorted(tables)
        width = max(len(t) for t in tables.values())
        want = [tables[r] + [0] * (width - len(tables[r])) for r in order]
        got = rows.gather(order, width)
        assert got.dtype == torch.int32 and got.tolist() == want
        assert rows.gather(order, width + 2).tolist() == [w + [0, 0] for w in want]  # zeros past every end

    check()
    first = next(iter(tables))
    rows.write(first, 1, [9])  # table[1:] = [9]: shorter, its old tail zeroed
    tables[first] = [5, 9]
    check()
    rows.write(first, 2, list(range(10, 17)))  # 9 entries: past the width of 4, which doubles to 16
    tables[first] = [5, 9, *range(10, 17)]
    check()
    rows.release(first)
    del tables[first]
    assert rows.num_live == 2
    again = rows.acquire([8])
    assert again == first  # the freed row, zeroed
    tables[again] = [8]
    check()
    assert rows.gather([again], 40).tolist() == [[8] + [0] * 39]  # wider than the rows: zeros


def test_attached_states_build_the_same_step():
    """The executor's states keep their tables in one BlockTableRows (PlanApplier): the step's tensors
    equal the reference's, also after a table changed, a copy took a row of its own and rows were
    given back and taken again."""
    rows = BlockTableRows(rows=1, width=2)
    scheduled = mixed_step()
    others = [SequenceState([1] * 40, 0, list(range(30, 33)), SamplingParams()) for _ in range(3)]
    for other in others:
        other.attach(rows)
    for s in scheduled:
        s.state.attach(rows)
    others[1].detach()  # a freed row between the step's rows
    scheduled[0].state.set_blocks(1, [2, 15])  # a table that grows: [9, 2, 15]
    scheduled[2].state.set_blocks(4, [13])  # a table rewritten in place
    copy = scheduled[4].state.copy()
    assert copy._rows is rows and copy._row != scheduled[4].state._row
    scheduled[4].state.detach()
    scheduled[4] = ScheduledSequence(14, copy, 1)
    batch = build_model_input(scheduled, BS, CPU, torch.Generator().manual_seed(42))
    want = reference(scheduled, 42)
    assert same_bits(batch.attn.block_tables, want["block_tables"])
    assert same_bits(batch.attn.slot_mapping, want["slot_mapping"])
    assert same_bits(batch.sampling.seeds, want["seeds"])
    with pytest.raises(ValueError, match="already"):
        copy.attach(rows)


def test_build_model_input_with_no_sampled_row():
    c = SequenceState(list(range(3, 23)), 0, [1, 3, 8, 12, 13], SamplingParams(temperature=0.0), 0, 20)
    batch = build_model_input([ScheduledSequence(0, c, 6)], BS, CPU, torch.Generator().manual_seed(0))
    assert batch.input_ids.tolist() == list(range(3, 9))
    assert batch.attn.slot_mapping.tolist() == [4, 5, 6, 7, 12, 13]
    assert batch.logits_indices.shape == (0,) and batch.logits_indices.dtype == torch.int64
    assert batch.sampling.seeds.shape == (0,) and batch.sampling.has_seed.dtype == torch.bool
    assert batch.sampled_seq_ids == () and batch.num_logprobs is None


def test_build_model_input_moves_the_step_with_one_copy(monkeypatch):
    packs = []
    original = host_to_device.pack_to_device

    def spy(tensors, device):
        packs.append(sorted(tensors))
        return original(tensors, device)

    monkeypatch.setattr(inputs, "pack_to_device", spy)
    moves = count_device_moves(monkeypatch)
    build_model_input(mixed_step(), BS, CPU, torch.Generator().manual_seed(0))
    assert len(moves) == 1
    # the step's 7 columns, the prefill kernel's work list (a step with prompts), the sampler's 9
    assert len(packs) == 1 and len(packs[0]) == 7 + 1 + 9 and "prefill_tile_starts" in packs[0]


# --- the decode fast path (_decode_model_input) -----------------------------------------------------


def decode_step(rows: BlockTableRows | None = None) -> list[ScheduledSequence]:
    """Five decodes of one token each, every one sampled: seeds, top-k, top-p, logprobs, a beam, two
    tokens planned ahead (PENDING_TOKEN), tables of different widths, positions on and off a block's
    first slot."""

    def state(num_tokens, table, params, sample_index=0, prompt_len=3):
        tokens = [(5 * i + 7) % 89 + 3 for i in range(num_tokens)]
        s = SequenceState(tokens, num_tokens - 1, table, params, sample_index, prompt_len)
        if rows is not None:
            s.attach(rows)
        return s

    a = state(11, [9, 2, 5], SamplingParams(temperature=0.7, top_k=5, seed=1234), 1, 6)
    b = state(5, [4, 11], SamplingParams(temperature=1.2, top_p=0.9, logprobs=3))  # position 4: slot 0
    b.token_ids[-1] = PENDING_TOKEN
    c = state(17, [1, 3, 8, 12, 13], SamplingParams(temperature=0.0))
    d = state(9, [9, 6, 7], SamplingParams(temperature=0.0, logprobs=0))
    d.token_ids[-1] = PENDING_TOKEN
    e = state(8, [10, 14], SamplingParams(beam_width=2), 2, 5)
    return [ScheduledSequence(20 + i, s, 1) for i, s in enumerate((a, b, c, d, e))]


def _model_input_fields(batch) -> dict:
    """Every field of a ModelInput, its attention and sampling metadata, by name."""
    out = {}
    for name in ("input_ids", "positions", "logits_indices", "sampled_seq_ids", "pending_token_indices",
                 "pending_seq_ids", "num_logprobs", "num_beam_candidates"):
        out[name] = getattr(batch, name)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "max_query_len",
                 "max_seq_len", "prefill_tile_starts"):
        out[f"attn.{name}"] = getattr(batch.attn, name)
    for name in batch.sampling.__dataclass_fields__:
        out[f"sampling.{name}"] = getattr(batch.sampling, name)
    return out


@pytest.mark.parametrize("attached,all_pending", [(False, False), (True, False), (True, True)])
def test_the_decode_path_builds_what_the_general_path_builds(attached, all_pending, monkeypatch):
    rows = BlockTableRows(rows=2, width=2) if attached else None
    scheduled = decode_step(rows)
    if all_pending:  # every token planned ahead (async scheduling): the path's shortcut
        for s in scheduled:
            s.state.token_ids[-1] = PENDING_TOKEN
    general = inputs._general_model_input(scheduled, BS, CPU, torch.Generator().manual_seed(42))
    moves = count_device_moves(monkeypatch)
    fast = inputs._decode_model_input(scheduled, BS, CPU, torch.Generator().manual_seed(42))
    assert fast is not None and len(moves) == 1  # one copy to the device
    want, got = _model_input_fields(general), _model_input_fields(fast)
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            assert got[name].is_contiguous() and same_bits(got[name], value), (name, got[name], value)
        else:
            assert got[name] == value, name
    reference_columns = reference(scheduled, 42)
    assert same_bits(fast.attn.slot_mapping, reference_columns["slot_mapping"])
    assert fast.pending_seq_ids == ((20, 21, 22, 23, 24) if all_pending else (21, 23))
    assert fast.num_logprobs == (-1, 3, -1, 0, -1)
    assert fast.sampling.max_num_beam_candidates == 4 and not fast.sampling.all_greedy


def test_build_model_input_takes_the_decode_path_only_for_decode_steps(monkeypatch):
    calls = []
    original = inputs._general_model_input
    monkeypatch.setattr(inputs, "_general_model_input", lambda *a: calls.append(1) or original(*a))
    gen = torch.Generator().manual_seed(0)
    build_model_input(decode_step(), BS, CPU, gen)
    assert calls == []
    build_model_input(mixed_step(), BS, CPU, gen)  # prompts and a chunk: the general path
    assert calls == [1]
    chunk = decode_step()
    chunk[2].state.num_computed_tokens -= 1  # one token of two still to compute: not the last token
    build_model_input(chunk, BS, CPU, gen)
    assert calls == [1, 1]
    short = decode_step()
    short[0].state.block_table[:] = [9]  # a table too short for the position: the general path says so
    with pytest.raises(Exception, match="block table of 1 blocks cannot hold"):
        build_model_input(short, BS, CPU, gen)
