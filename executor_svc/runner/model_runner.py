"""Runs one step's `ModelInput` through the model and the sampler."""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.layers.attention import AttentionMetadata, attends_unwindowed, with_decode_order
from executor_svc.layers.gemm_plan import GemmPlan
from executor_svc.layers.linear import projection_weights
from executor_svc.runner.cuda_graphs import MIXED_BUCKETS, DecodeGraphs, MixedGraphs, buckets_up_to
from executor_svc.runner.inputs import ModelInput
from executor_svc.runner.kv_cache import KVCache
from executor_svc.runner.sampler import SamplerOutput, SamplingMetadata, greedy_output, plain_greedy, sample
from scheduler_svc.wire.sampling_params import MAX_LOGPROBS


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: KVCache):
        self.model = model
        self.unwindowed = attends_unwindowed(model)  # a layer whose decode launch may take the order
        self.kv_cache = kv_cache
        self.decode_graphs: DecodeGraphs | None = None
        # A plain greedy decode step samples inside its decode graph (`execute`); False: every step
        # goes through compute_logits (float32) and sample (for callers that look at the logits).
        self.graph_sampling = True
        self.mixed_graphs: MixedGraphs | None = None
        self._gemm_plan: GemmPlan | None | bool = False  # False: not read from the environment yet

    def gemm_plan(self) -> GemmPlan | None:
        """The graphs' GEMM plan (PAGEDSERVE_GEMM_PLAN, read once; None: the fixed rule), over the
        model's projection weights; the decode and the mixed graphs share it."""
        if self._gemm_plan is False:
            plan = GemmPlan.from_env(self.kv_cache.device_cache.device)
            if plan is not None:
                plan.register(projection_weights(self.model))
            self._gemm_plan = plan
        return self._gemm_plan

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        """From now on decode batches of up to max_num_seqs sequences (at most DECODE_BUCKETS[-1])
        replay CUDA graphs; only the buckets those batches can use are captured."""
        graphs = DecodeGraphs(self.model, self.kv_cache, max_model_len, buckets_up_to(max_num_seqs),
                              self.gemm_plan())
        graphs.capture()
        self.decode_graphs = graphs

    def capture_mixed_graphs(
        self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        """From now on the other steps of up to max_num_batched_tokens tokens (prefills, chunks, mixed)
        replay CUDA graphs too, one per MIXED_BUCKETS size up to the first that holds
        max_num_batched_tokens (the largest is what the memory profile reserves)."""
        buckets = buckets_up_to(max_num_batched_tokens, MIXED_BUCKETS)
        graphs = MixedGraphs(self.model, self.kv_cache, max_model_len, buckets, max_num_seqs,
                             self.gemm_plan())
        graphs.capture()
        self.mixed_graphs = graphs

    @torch.inference_mode()
    def logits(self, batch: ModelInput) -> torch.Tensor:
        """Runs the forward pass (writing this step's K/V) and returns the logits [S, V] of the rows
        named by `logits_indices`, in the model's dtype (S may be 0: a step of prefill chunks only). A
        step replays a captured CUDA graph when one fits it: a decode graph, else a mixed-step graph;
        else eager. A decode graph's logits may be a view of its static output, valid until the next
        replay: copy them to keep them (`DecodeGraphs.run`). Every path gives the sampler logits of
        one dtype, so `kernels.greedy_sample` (whose sums' order follows the dtype it reads) gives
        a row the same bits whichever path computed it."""
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        if self.mixed_graphs is not None and self.mixed_graphs.can_run(batch):
            return self.mixed_graphs.run(batch)
        cache = self.kv_cache.device_cache  # [L, 2, N, bs, KV, D]
        meta = with_decode_order(batch.attn, cache, self.unwindowed)
        hidden = self.model(batch.input_ids, batch.positions, cache, meta)  # [T, D]
        return self.model.compute_logits(hidden[batch.logits_indices])

    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """`logits` as float32 (for callers that look at the logits; a fresh tensor unless the model
        computes in float32)."""
        return self.logits(batch).float()

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> SamplerOutput | None:
        """Forward pass and sampling; None when no row is sampled. A decode step whose rows are all
        plain greedy replays its bucket's greedy-sampler graph after the forward graph
        (`DecodeGraphs.run_greedy`): the same kernels as `sample`, none launched from Python."""
        graphs = self.decode_graphs
        if (graphs is not None and self.graph_sampling and plain_greedy(batch.sampling)
                and graphs.can_run_greedy(batch)):
            return greedy_output(*graphs.run_greedy(batch))
        logits = self.logits(batch) if self.graph_sampling else self.compute_logits(batch)
        return sample(logits, batch.sampling) if logits.shape[0] else None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int) -> None:
        """The largest step, for the memory profile: `profile_forward`, then the sampler over one row
        per prefill (a step samples at most one row per sequence, and each sampled sequence computes
        a token) at its costliest (`worst_case_sampling`)."""
        device = self.kv_cache.device_cache.device
        hidden, last_rows = self.profile_forward(num_tokens, max_num_seqs)
        logits = self.model.compute_logits(hidden[last_rows])  # the model's dtype, as `logits` gives
        del hidden
        logits.normal_()  # [B, V] spread out like real logits (the zero prompts' rows are all equal)
        sample(logits, worst_case_sampling(last_rows.shape[0], logits.shape[-1], max_num_seqs, device))

    @torch.inference_mode()
    def warm_eager(self, max_num_seqs: int) -> None:
        """Runs, once, what a step with prompts runs eagerly after its graph, at every size it can
        have: the LM head over 1..max_num_seqs rows and the sampler at sizes up to max_num_seqs
        (every path of `sample`). Each new row count used to cost the launching thread ~3-4 ms the
        first time (cuBLAS's choice of kernel for the shape, and loading that kernel: CUDA loads
        modules lazily), in the middle of a launch, while every stream waited (docs/benchmarks.md
        round 13: ~0.1 s of a 4 s 1B run's launches); here the server pays it before serving. The
        largest sampler pass also leaves the caching allocator blocks that every later step's
        logits and sampler temporaries fit in; the memory profile reserved that peak (`profile_run`).
        Every tensor-parallel rank makes the same calls (the LM head all-gathers)."""
        device = self.kv_cache.device_cache.device
        config = self.model.config
        dtype = next(self.model.parameters()).dtype  # the hidden states' and the logits' (`logits`)
        hidden = torch.randn(max_num_seqs, config.hidden_size, dtype=dtype, device=device)  # [B, D]
        rows = torch.arange(max_num_seqs, device=device)
        for num_rows in range(1, max_num_seqs + 1):
            self.model.compute_logits(hidden[rows[:num_rows]])  # [S, V], as MixedGraphs.run
        for num_rows in sorted({*(1 << k for k in range(max_num_seqs.bit_length())), max_num_seqs}):
            logits = torch.randn(num_rows, config.vocab_size, dtype=dtype, device=device)  # [S, V]
            sample(logits, worst_case_sampling(num_rows, config.vocab_size, max_num_seqs, device))
        del logits, hidden
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def profile_forward(
        self, num_tokens: int, max_num_seqs: int, max_seq_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward pass over `num_tokens` tokens split into up to `max_num_seqs` prefills (the
        sequences of a mixed-step graph of num_tokens), writing no KV (all slots -1), reading only
        block 0. max_seq_len: the attention's bound, which sets its split-K count (default: the
        longest prefill, as an eager step; a graph passes the model's maximum). Returns the hidden
        states [T, D] and the row of each prefill's last token [B]."""
        device = self.kv_cache.device_cache.device
        num_seqs = max(1, min(max_num_seqs, num_tokens))
        q_lens = torch.full((num_seqs,), num_tokens // num_seqs, dtype=torch.int32)  # [B]
        q_lens[: num_tokens % num_seqs] += 1
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)  # [B + 1]
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        max_len = int(q_lens.max())
        block_size = self.kv_cache.block_size
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(num_seqs, -(-max_len // block_size), dtype=torch.int32, device=device),
            seq_lens=q_lens.to(device),
            query_start_loc=query_start_loc.to(device),
            max_query_len=max_len,
            max_seq_len=max(max_len, max_seq_len or 0),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)  # [T]
        positions = torch.arange(num_tokens, dtype=torch.int32) - query_start_loc[:-1].repeat_interleave(
            q_lens
        )
        hidden = self.model(
            input_ids, positions.to(device=device, dtype=torch.int64), self.kv_cache.device_cache, meta
        )  # [T, D]
        return hidden, query_start_loc[1:].to(device, torch.int64) - 1


def worst_case_sampling(
    num_rows: int, vocab_size: int, max_num_seqs: int, device: torch.device
) -> SamplingMetadata:
    """Sampling parameters taking every path of `sample` at once, with its largest outputs: random
    sampling (temperature > 0) through the top-k / top-p sort, seeded, the most logprobs a request may
    ask for, and the most beam candidates a step may ask for (2 per beam; a beam is at most
    max_num_seqs wide, the scheduler's validation)."""
    num_logprobs = min(MAX_LOGPROBS, vocab_size)
    num_beam_candidates = min(2 * max_num_seqs, vocab_size)

    def full(value, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((num_rows,), value, dtype=dtype, device=device)  # [S]

    return SamplingMetadata(
        temperature=full(0.8, torch.float32),
        top_p=full(0.95, torch.float32),
        top_k=full(max(1, vocab_size // 2), torch.int64),
        seeds=torch.arange(num_rows, dtype=torch.int64, device=device),
        has_seed=full(True, torch.bool),
        sample_index=torch.zeros(num_rows, dtype=torch.int64, device=device),
        output_positions=torch.zeros(num_rows, dtype=torch.int64, device=device),
        num_logprobs=full(num_logprobs, torch.int64),
        num_beam_candidates=full(num_beam_candidates, torch.int64),
        max_num_logprobs=num_logprobs,
        max_num_beam_candidates=num_beam_candidates,
        all_greedy=False,
        any_top_k_top_p=True,
    )
