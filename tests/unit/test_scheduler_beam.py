"""Beam search: block-level forks and frees, and the selection compared with transformers'
`generate(num_beams=k, do_sample=False)` on a tiny random model (logprobs computed in the test)."""

import pytest

from scheduler_svc.request.beam import BeamState
from scheduler_svc.request.sequence import Sequence
from scheduler_svc.sched.beam_search import select_beams
from scheduler_svc.sched.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import SampledToken, StepResult


def _beam_result(plan, candidates_by_seq):
    samples = [
        SampledToken(sid, cands[0][0], cands[0][1], beam_candidates=cands)
        for sid, cands in candidates_by_seq.items()
    ]
    return StepResult(plan.step_id, samples)


def test_beam_search_forks_chosen_parents_and_frees_dropped_beams():
    sched = Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=16, max_model_len=64, eos_token_ids=(2,)))
    group = sched.new_group("b", [5, 6, 7], SamplingParams(beam_width=2, max_tokens=4), 0.0)
    sched.add_request(group)
    s0 = group.seqs[0]
    plan = sched.schedule()
    assert plan.new_seqs[0].sampling_params.num_beam_candidates == 4
    cands = [(10, -0.1), (11, -0.2), (12, -1.0), (13, -2.0)]
    assert sched.process_result(_beam_result(plan, {s0.seq_id: cands})) == []
    s1 = group.seqs[1]
    assert [s.output_token_ids for s in group.seqs] == [[10], [11]]
    plan = sched.schedule()
    assert plan.forks == [(s1.seq_id, s0.seq_id)]
    assert plan.copies == [(0, 1)]  # both write position 3 into the shared block 0
    assert [(c.seq_id, c.new_token_ids, c.block_table_start, c.block_ids) for c in plan.cont_seqs] == [
        (s0.seq_id, [10], 0, [1]),
    ]
    assert (plan.decode_seq_ids, plan.decode_token_ids) == ([s1.seq_id], [11])  # the fork's table is right
    # Both survivors extend s0 (cum -0.2 and -0.3); s1 (cum -3.2 at best) is dropped.
    result = _beam_result(
        plan,
        {
            s0.seq_id: [(20, -0.1), (21, -0.2), (22, -3.0), (23, -4.0)],
            s1.seq_id: [(30, -3.0), (31, -3.1), (32, -3.2), (33, -3.3)],
        },
    )
    assert sched.process_result(result) == []
    s2 = group.seqs[1]
    assert [s.seq_id for s in group.seqs] == [s0.seq_id, s2.seq_id]
    assert [s.output_token_ids for s in group.seqs] == [[10, 20], [10, 21]]
    assert sched.kv.block_table(s0) == sched.kv.block_table(s2) == [1]
    assert sched.kv.gpu.blocks[0].ref_cnt == 0 and sched.kv.gpu.blocks[1].ref_cnt == 2
    plan = sched.schedule()
    assert plan.finished_seq_ids == [s1.seq_id] and plan.forks == [(s2.seq_id, s0.seq_id)]
    # s0+EOS ranks first and is finished; the others continue.
    result = _beam_result(
        plan,
        {
            s0.seq_id: [(2, -0.05), (40, -0.5), (41, -0.6), (42, -0.7)],
            s2.seq_id: [(50, -0.01), (2, -0.3), (51, -2.0), (52, -3.0)],
        },
    )
    sched.process_result(result)
    assert [h.output_token_ids for h in group.beam.finished] == [[10, 20, 2]]
    assert group.beam.finished[0].score == pytest.approx(-0.25 / 3)
    assert [s.output_token_ids for s in group.seqs] == [[10, 21, 50], [10, 20, 40]]
    plan = sched.schedule()
    last = {s.seq_id: [(60 + i, -1.0 - i) for i in range(4)] for s in group.seqs}
    (out,) = sched.process_result(_beam_result(plan, last))  # max_tokens: every candidate ends
    assert out.finished and not sched.has_unfinished()
    assert [h.output_token_ids for h in out.beams] == [[10, 20, 2], [10, 21, 50, 60]]
    assert out.samples[0].token_ids == [10, 20, 2]
    assert sched.kv.num_free_blocks == 16
    sched.kv.check_integrity()


def test_beam_search_stops_early_when_no_live_beam_can_beat_the_finished_ones():
    state = BeamState(beam_width=1, length_penalty=1.0)
    seq = Sequence(1, [1, 2], 2)
    state.pending[1] = [(2, -0.1), (7, -0.2)]  # EOS is the best candidate
    assert select_beams(state, [seq], frozenset({2}), max_tokens=10) == []
    assert state.done and state.finished[0].output_token_ids == [2]


@pytest.mark.parametrize(
    "beam_width,length_penalty,seed",
    [(2, 1.0, 0), (3, 1.0, 1), (4, 0.5, 2), (3, 2.0, 3), (2, 0.0, 4), (5, 1.0, 5), (3, -1.0, 6), (2, 1.0, 7)],
)
def test_best_beam_matches_transformers_generate(beam_width, length_penalty, seed):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a shared CPU
    try:
        _compare_with_transformers(torch, transformers, beam_width, length_penalty, seed)
    finally:
        torch.set_num_threads(threads)


def _compare_with_transformers(torch, transformers, beam_width, length_penalty, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = [1, 5 + seed, 9, 17, 30]
    max_new = 10
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    eos = int(greedy[0, len(prompt) + 2])  # a token the model likes: beams do end on it
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]),
            num_beams=beam_width,
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=0,
            length_penalty=length_penalty,
        )
    hf_output = hf[0, len(prompt) :].tolist()

    config = SchedulerConfig(block_size=4, num_gpu_blocks=64, max_model_len=64, eos_token_ids=(eos,))
    sched = Scheduler(config)
    params = SamplingParams(beam_width=beam_width, max_tokens=max_new, length_penalty=length_penalty)
    sched.add_request(sched.new_group("r", prompt, params, 0.0))
    outputs = []
    while sched.has_unfinished():
        plan = sched.schedule()
        seqs = [sched._seqs[seq_id][0] for seq_id in plan.scheduled_seq_ids]
        samples = []
        if seqs:  # live beams have equal lengths: one batched forward
            with torch.no_grad():
                logits = model(torch.tensor([s.token_ids for s in seqs])).logits[:, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * beam_width)
            for seq, ids, lps in zip(seqs, top.indices.tolist(), top.values.tolist(), strict=True):
                cands = list(zip(ids, lps, strict=True))
                samples.append(SampledToken(seq.seq_id, ids[0], lps[0], beam_candidates=cands))
        outputs += sched.process_result(StepResult(plan.step_id, samples))
        sched.kv.check_integrity()
    (out,) = outputs
    assert out.beams[0].output_token_ids == hf_output
    assert sched.kv.num_free_blocks == 64
