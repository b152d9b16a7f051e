"""The one-pass greedy sampler (kernels/triton_sampling.py) compiled on the GPU, against torch at
llama3's vocabulary (128,256) from 1 to 330 rows, float32 and bf16 logits, with planted ties; a row's
bits in batches of any size (deterministic mode's promise); and a decode graph's logits view feeding
the sampler across the next replay. Timing: docs/benchmarks.md, Round 8.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 128_256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 330])
def test_greedy_sample_matches_torch(rows, dtype):
    from kernels import triton_sampling

    gen = torch.Generator("cuda").manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 5).to(dtype)
    for row in range(0, rows, 3):  # ties: the first index wins, here across chunks
        logits[row, 17 + row] = logits[row, VOCAB - 5 - row] = 40.0
    tokens, logprobs = triton_sampling.greedy_sample(logits)
    ref_tokens = logits.float().argmax(dim=-1)
    ref_logprobs = logits.float().log_softmax(dim=-1).gather(1, ref_tokens[:, None]).squeeze(1)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_batch():
    from kernels import triton_sampling

    logits = torch.randn(256, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(9)) * 5
    tokens, logprobs = triton_sampling.greedy_sample(logits)
    for rows in (1, 5, 100):
        t, lp = triton_sampling.greedy_sample(logits[:rows].clone())
        assert torch.equal(t, tokens[:rows]) and torch.equal(lp, logprobs[:rows])


def test_sampler_reads_a_graph_view_before_the_next_replay_overwrites_it():
    """The sampler's kernels are queued before the next replay, so the view they read still holds
    this step's logits: sample twice on one stream with a replay-like overwrite in between."""
    from executor_svc.runner.sampler import SamplingMetadata, sample

    static = torch.randn(64, VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    view = static[:40]
    expected = view.argmax(dim=-1)
    rows = 40
    zeros_i = torch.zeros(rows, dtype=torch.int64, device="cuda")
    meta = SamplingMetadata(
        temperature=torch.zeros(rows, device="cuda"), top_p=torch.ones(rows, device="cuda"), top_k=zeros_i,
        seeds=zeros_i, has_seed=torch.zeros(rows, dtype=torch.bool, device="cuda"), sample_index=zeros_i,
        output_positions=zeros_i, num_logprobs=zeros_i - 1, num_beam_candidates=zeros_i,
        all_greedy=True, any_top_k_top_p=False,
    )
    out = sample(view, meta)
    static.fill_(0.0)  # the next replay writes the static output after the sampler's kernels
    static[:, 5] = 1.0
    torch.cuda.synchronize()
    assert torch.equal(out.token_ids, expected)
    assert sample(view, meta).token_ids.eq(5).all()
