"""CUDA graphs for every step: one graph per bucket, replayed instead of launching the forward pass
kernel by kernel (a step of an 8B model is ~450 launches: eager, a step took ~40 ms whatever its
size on the H100 machine of docs/benchmarks.md). Two sets, each with its own memory pool:

    DecodeGraphs   decode steps (one token per sequence), bucket b = sequences = tokens; the graph
                   computes the logits [b, V] too, in the model's dtype (as every path gives them
                   to the sampler: ModelRunner.logits)
    MixedGraphs    any other step (prefills, chunks, prefills beside decodes), bucket T = tokens
                   (MIXED_BUCKETS: at most x1.25 apart from 256), S(T) = min(T, max_num_seqs)
                   sequences (a step of T tokens holds at most T); the graph computes the final
                   hidden states [T, D], the logits of the sampled rows are computed eagerly from
                   them (no vocabulary-wide rows for padding; at TP > 1 the logits all-gather runs
                   eagerly)

A step that fits no bucket (more tokens than the largest, more sequences than S(T), a wider block
table) runs eagerly. Every graph of a set reads its inputs from the same static buffers
(`StaticInputs`), sliced to its bucket; a step of R tokens in n sequences is padded to (T, S):

    input_ids, positions, slot_mapping   [T_max]          tokens R..T belong to no sequence:
                                                          id 0, position 0, slot -1 (no KV write)
    block_tables                         [S_max, M_max]   rows n..S stale (never read)
    seq_lens                             [S_max]          sequences n..S: 0, with query length 0:
    query_start_loc                      [S_max + 1]      query_start_loc[n..S] = R
    prefill_tile_starts                  [S_max + 1]      [n..S] = its entry n (empty: no tiles)

The attention kernel's tiles of an empty query exit before reading anything (seq_len included),
so padding reads no K/V; the rows of the orphan tokens R..T are never written by it and hold
garbage (even NaN). That cannot reach a real row: every other op of every family is row-wise
(linear layers, norms, rotary, activations, the TP all-reduce and all-gather); the MoE kernel
(kernels/triton_moe.py) sorts all rows by expert, but its shapes depend only on T and each row's
sums only on that row, so a NaN row only routes itself somewhere (torch.topk returns valid ids).
tests/unit/test_mixed_graphs.py fills the orphan rows with NaN and checks every family's real rows.
The prefill kernel that reads a step's own K/V from the QKV output (paged_attention's fresh_kv) may
read orphan rows there, past the last sequence's end, with weight 0: rotary_and_cache zeroes the K/V
rows of tokens without a slot, so those are finite whatever the orphan rows before them hold.

Each graph is captured with max_seq_len = the model's max length, so the attention's split-K count
(chosen on the host from max_seq_len and the grid, tiles = T // BLOCK_Q + S, fixed per bucket) is
fixed; partitions past a sequence's end exit at once and weigh zero in the reduction. A mixed
bucket passes max_query_len = T (> 1: the varlen kernel). In deterministic mode
(executor_svc/layers/determinism.py) the kernel splits nothing and has one tile shape, and the
batch-invariant GEMMs do not depend on M, so a replayed row has the bits of the same row run
eagerly, in a batch of any size, decode or prefill.

Memory: each set's graphs share one pool, captured largest bucket first, so the smaller ones reuse
its activations; the largest bucket's output is the set's static output, which the smaller ones
copy their result into (one output, not one per bucket). The mixed pool thus keeps about one
forward pass of T_max tokens for the server's life; the memory profile reserves it
(executor_svc/worker/memory_profile.py).

At TP > 1 the tensor-parallel all-reduces (and the decode logits all-gather) are captured inside each
rank's graphs (NCCL supports stream capture): replaying bucket b on every rank replays the same
collectives in the same order, so the ranks stay matched. The warm-up passes before each capture run
the collectives for real, which also creates the NCCL communicator before any capture.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from executor_svc.layers.attention import AttentionMetadata, attends_unwindowed, with_decode_order
from executor_svc.layers.gemm_plan import GemmPlan
from executor_svc.layers.linear import graph_gemms
from executor_svc.runner.inputs import ModelInput
from executor_svc.runner.kv_cache import KVCache

# Row counts where cuBLAS's bf16 GEMMs for llama3-8b's projections ran slower on the H100 than at larger
# ones, so no graph is captured for them and their steps take the next bucket: 448 rows (a decode graph
# of 448 sequences 22.6-22.9 ms against 19.2-19.6 at 480 and 19.8-20.1 at 512, `clients.bench.step`, 300
# positions; mixed-step graphs of 448 tokens 17.9 ms a step against 14.1 at 512 in a 32 req/s sharegpt
# run; gate_up alone 292 us at 448 rows against 206 us as two calls of 256 + 192; docs/benchmarks.md
# rounds 8 and 9).
SLOW_GEMM_ROWS = frozenset({448})
DECODE_BUCKETS = tuple(
    b for b in (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16), *range(288, 513, 32)) if b not in SLOW_GEMM_ROWS
)
# 16, 32, 64, 128, 192, then four a power of two from 256 on (256, 320, 384, [448,] 512, 640, ...): a step
# pads at most 1/5 of its tokens from 256 on (1/3 at 385-448), where a step's projections turn from
# weight-read-bound to FLOP-bound and its time grows with its tokens. Two a power of two (x1.33-1.5)
# padded the 512-token prompt chunks beside decodes of a 32 req/s sharegpt run, its slowest steps, to
# 768 tokens: ITL p99 20.0-20.2 ms, 18.4-18.6 with these (docs/benchmarks.md round 9).
MIXED_BUCKETS = tuple(
    b for b in (16, 32, 64, 128, 192, *(m << k for k in range(6, 19) for m in (4, 5, 6, 7)))
    if b not in SLOW_GEMM_ROWS
)


def check_launch_environment() -> None:
    """The kernels' launch settings from the environment (kernels.check_launch_env: PAGEDSERVE_PDL_OFF,
    PAGEDSERVE_FUSED_ROTARY, PAGEDSERVE_BALANCED_DECODE, PAGEDSERVE_DECODE_ORDER), checked when an
    executor starts rather than when its graphs are first captured (ValueError)."""
    kernels.check_launch_env()


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> tuple[int, ...]:
    """The buckets a server whose steps hold at most `max_batch` sequences (decode) or tokens (mixed)
    can use: those up to the first one that holds max_batch (all of them when none does). Capturing
    more only costs start-up time and graph memory (28 decode buckets up to 512; 4 for 8)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ordered = tuple(sorted(buckets))
    cover = next((b for b in ordered if b >= max_batch), ordered[-1])
    return tuple(b for b in ordered if b <= cover)


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """The inputs every graph of a set reads, sized for its largest bucket (layout and padding: the
    module docstring). Works on any device: the CPU tests run the padded forward pass eagerly."""

    input_ids: torch.Tensor  # [T_max] int64
    positions: torch.Tensor  # [T_max] int64
    slot_mapping: torch.Tensor  # [T_max] int64
    block_tables: torch.Tensor  # [S_max, M_max] int32
    seq_lens: torch.Tensor  # [S_max] int32
    query_start_loc: torch.Tensor  # [S_max + 1] int32
    prefill_tile_starts: torch.Tensor  # [S_max + 1] int32 (kernels.prefill_tile_starts)

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> StaticInputs:
        """All sequences empty, every token an orphan."""
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        return cls(
            input_ids=torch.zeros(max_tokens, **i64),
            positions=torch.zeros(max_tokens, **i64),
            slot_mapping=torch.full((max_tokens,), -1, **i64),
            block_tables=torch.zeros(max_seqs, max_blocks, **i32),
            seq_lens=torch.zeros(max_seqs, **i32),
            query_start_loc=torch.zeros(max_seqs + 1, **i32),
            prefill_tile_starts=torch.zeros(max_seqs + 1, **i32),
        )

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def fits(self, batch: ModelInput, num_tokens: int, num_seqs: int) -> bool:
        """Whether `batch` pads to (num_tokens, num_seqs) within these buffers."""
        attn = batch.attn
        return (
            batch.num_tokens <= num_tokens <= self.max_tokens
            and attn.seq_lens.shape[0] <= num_seqs <= self.max_seqs
            and attn.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def load(self, batch: ModelInput, num_tokens: int, num_seqs: int, prefill: bool = True) -> None:
        """Writes `batch` into the first num_tokens / num_seqs rows, padded (module docstring);
        prefill=False (graphs of decode steps): not the prefill kernel's work list."""
        if not self.fits(batch, num_tokens, num_seqs):
            raise ValueError(
                f"a step of {batch.num_tokens} tokens, {batch.attn.block_tables.shape} block tables does "
                f"not pad to {num_tokens} tokens, {num_seqs} sequences within {self.max_tokens} x "
                f"{tuple(self.block_tables.shape)}"
            )
        attn = batch.attn
        real_tokens = batch.num_tokens
        n, width = attn.block_tables.shape
        self.input_ids[:real_tokens].copy_(batch.input_ids)
        self.input_ids[real_tokens:num_tokens].zero_()
        self.positions[:real_tokens].copy_(batch.positions)
        self.positions[real_tokens:num_tokens].zero_()
        self.slot_mapping[:real_tokens].copy_(attn.slot_mapping)
        self.slot_mapping[real_tokens:num_tokens].fill_(-1)
        self.block_tables[:n, :width].copy_(attn.block_tables)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.seq_lens[n:num_seqs].zero_()
        self.query_start_loc[: n + 1].copy_(attn.query_start_loc)
        self.query_start_loc[n + 1 : num_seqs + 1].fill_(real_tokens)
        if prefill:  # (decode graphs never read the prefill kernel's work list)
            tile_starts = attn.prefill_tile_starts
            if tile_starts is None:  # (a step of decodes alone has none: no prompt tiles)
                tile_starts = kernels.prefill_tile_starts(attn.query_start_loc)
            self.prefill_tile_starts[: n + 1].copy_(tile_starts)
            self.prefill_tile_starts[n + 1 : num_seqs + 1].copy_(tile_starts[n:].expand(num_seqs - n))

    def clear(self) -> None:
        """Every sequence empty, no KV write (the state captures run in)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        self.prefill_tile_starts.zero_()

    def metadata(
        self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            prefill_tile_starts=self.prefill_tile_starts[: num_seqs + 1],
        )


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collected once, then no automatic collection until the block ends.

    torch's `torch.cuda.graph` no longer collects before a capture (only under
    `torch.compiler.config.force_cudagraph_gc`), so an automatic collection can start inside one and run,
    on the capturing thread, the finalizers of objects that died in reference cycles before it: in one
    process that built a worker before (the GPU tests build one a test), that worker's CUDA graphs, events
    and pinned buffers. A CUDA call the capture forbids then invalidates it (H200, 2026-12-03:
    `test_models_gpu[bfloat16-granite]`, the GEMM plan's first timing graph of the test failed with
    cudaErrorStreamCaptureInvalidated; the same test passed on the same code the day before). Nothing is
    lost: what becomes garbage meanwhile is collected after the block."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _BucketGraphs:
    """One CUDA graph per bucket over shared static inputs and one memory pool. Subclasses give a
    bucket's shape (`bucket_shape`) and what its graph makes of the hidden states (`_output`)."""

    def __init__(
        self, model: nn.Module, kv_cache: KVCache, max_model_len: int, buckets: tuple[int, ...],
        max_seqs: int, gemm_plan: GemmPlan | None = None,
    ):
        if not buckets:
            raise ValueError("no bucket to capture")
        self.model = model
        self.unwindowed = attends_unwindowed(model)  # a layer whose decode launch may take the order
        self.gemm_plan = gemm_plan  # None: the fixed rule (executor_svc/layers/gemm_plan.py)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.buckets = tuple(sorted(buckets))
        max_tokens, _, _ = self.bucket_shape(self.buckets[-1])
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.inputs = StaticInputs.allocate(max_tokens, max_seqs, max_blocks, kv_cache.device_cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.output: torch.Tensor | None = None  # the largest bucket's output; bucket b's: its first rows

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        """(num_tokens, num_seqs, max_query_len) of the bucket's padded step."""
        raise NotImplementedError

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, bucket: int) -> torch.Tensor:
        """What the bucket's graph captures, over the static inputs: [num_tokens, ...]."""
        num_tokens, num_seqs, max_query_len = self.bucket_shape(bucket)
        # the decode launches' order is sorted inside the graph, from each replay's lengths
        meta = self.inputs.metadata(num_tokens, num_seqs, max_query_len, self.max_model_len)
        meta = with_decode_order(meta, self.kv_cache.device_cache, self.unwindowed)
        ids, positions = self.inputs.input_ids[:num_tokens], self.inputs.positions[:num_tokens]
        return self._output(self.model(ids, positions, self.kv_cache.device_cache, meta))  # hidden [T, D]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, all sharing one memory pool. The warm-up passes
        write no KV and attend nothing (every sequence empty)."""
        if self.kv_cache.device_cache.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.inputs.clear()
        pool = None
        # each projection its planned GEMM (no host cost in a replay); no finalizer runs inside a capture
        with graph_gemms(self.gemm_plan), no_cyclic_gc():
            self._capture_buckets(pool)
        torch.cuda.synchronize()
        if self.gemm_plan is not None:
            self.gemm_plan.finish()

    def _capture_buckets(self, pool) -> None:
        for bucket in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self.forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(bucket)
                if self.output is None:
                    self.output = out
                else:
                    self.output[: out.shape[0]].copy_(out)
            pool = graph.pool()
            self.graphs[bucket] = graph

    def _replay(self, batch: ModelInput, bucket: int) -> torch.Tensor:
        """The bucket's output for `batch` ([num_tokens, ...], a view of the static output, valid
        until the next replay)."""
        num_tokens, num_seqs, max_query_len = self.bucket_shape(bucket)
        self.inputs.load(batch, num_tokens, num_seqs, prefill=max_query_len > 1)
        self.graphs[bucket].replay()
        return self.output[:num_tokens]


class DecodeGraphs(_BucketGraphs):
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        buckets: tuple[int, ...] = DECODE_BUCKETS,
        gemm_plan: GemmPlan | None = None,
    ):
        super().__init__(model, kv_cache, max_model_len, buckets, max(buckets), gemm_plan)
        # The greedy sampler over each bucket's logits (kernels.greedy_sample), captured after the
        # forward graphs: tokens [max bucket] int64 and their log-probabilities float32 (bucket b: the
        # first b rows), so a plain greedy decode step launches no sampler kernel from Python.
        self.greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy_tokens: torch.Tensor | None = None
        self.greedy_logprobs: torch.Tensor | None = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _capture_buckets(self, pool) -> None:
        super()._capture_buckets(pool)
        assert self.output is not None
        pool = self.graphs[self.buckets[0]].pool()  # the forward graphs' pool, shared
        for bucket in reversed(self.buckets):
            kernels.greedy_sample(self.output[:bucket])  # compile, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                tokens, logprobs = kernels.greedy_sample(self.output[:bucket])
                if self.greedy_tokens is None:
                    self.greedy_tokens, self.greedy_logprobs = tokens.clone(), logprobs.clone()
                else:
                    assert self.greedy_logprobs is not None
                    self.greedy_tokens[:bucket].copy_(tokens)
                    self.greedy_logprobs[:bucket].copy_(logprobs)
            pool = graph.pool()
            self.greedy_graphs[bucket] = graph

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        return bucket, bucket, 1

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        # [b, V] in the model's dtype: a float32 copy inside the graph would write 4 bytes per logit
        # and the greedy sampler read them, every step (0.1 ms of a 2.9 ms step at 256 sequences of
        # a 1B model with a 128k vocabulary, docs/benchmarks.md round 13)
        return self.model.compute_logits(hidden)

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, batch: ModelInput) -> bool:
        num_seqs = batch.attn.seq_lens.shape[0]
        bucket = self.bucket_for(num_seqs)
        return (
            batch.attn.max_query_len == 1
            and batch.num_tokens == num_seqs
            and bucket in self.graphs
            and self.inputs.fits(batch, bucket, bucket)
        )

    def can_run_greedy(self, batch: ModelInput) -> bool:
        """A decode batch that `can_run` and samples every token, in order (a decode step): its
        sampler rows are the graph's first rows."""
        return (self.can_run(batch) and len(batch.sampled_seq_ids) == batch.num_tokens
                and self.bucket_for(batch.num_tokens) in self.greedy_graphs)

    @torch.inference_mode()
    def run_greedy(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [S] int64, log-probabilities [S] float32) of a batch that `can_run_greedy`, as
        `kernels.greedy_sample` of `run`'s logits gives them: views of static outputs, valid until the
        next replay (work queued on the stream before it, the copy to the host and the next step's
        planned-ahead tokens, reads them in time)."""
        bucket = self.bucket_for(batch.num_tokens)
        self._replay(batch, bucket)
        self.greedy_graphs[bucket].replay()
        assert self.greedy_tokens is not None and self.greedy_logprobs is not None
        return self.greedy_tokens[: batch.num_tokens], self.greedy_logprobs[: batch.num_tokens]

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits [S, V] (the model's dtype) of the rows named by `batch.logits_indices` (a decode
        batch that `can_run`). When every token is sampled (a decode step: rows 0..S-1 in order) the
        result is a view of the static output, valid until the next replay (work queued on the stream
        before it, such as the sampler, reads it in time; a caller that keeps it must copy it); else
        a fresh tensor."""
        bucket = self.bucket_for(batch.attn.seq_lens.shape[0])
        out = self._replay(batch, bucket)
        if len(batch.sampled_seq_ids) == batch.num_tokens:  # each token its sequence's last, in order
            return out[: batch.num_tokens]
        return out[batch.logits_indices]


class MixedGraphs(_BucketGraphs):
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        buckets: tuple[int, ...],
        max_num_seqs: int,
        gemm_plan: GemmPlan | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        super().__init__(model, kv_cache, max_model_len, buckets, min(max(buckets), max_num_seqs), gemm_plan)

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        return bucket, min(bucket, self.max_num_seqs), bucket

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # [T, D]

    def bucket_for(self, batch: ModelInput) -> int | None:
        """The bucket `batch` pads to: the smallest that holds its tokens, if it also holds its
        sequences and block tables; None: the step runs eagerly."""
        i = bisect.bisect_left(self.buckets, batch.num_tokens)
        if batch.num_tokens < 1 or i == len(self.buckets):
            return None
        num_tokens, num_seqs, _ = self.bucket_shape(self.buckets[i])
        return self.buckets[i] if self.inputs.fits(batch, num_tokens, num_seqs) else None

    def can_run(self, batch: ModelInput) -> bool:
        return self.bucket_for(batch) in self.graphs

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits [S, V] (the model's dtype) of the rows named by `batch.logits_indices` (a step that
        `can_run`): the graph's hidden states, then the LM head eagerly on those rows."""
        hidden = self._replay(batch, self.bucket_for(batch))  # [T, D]
        return self.model.compute_logits(hidden[batch.logits_indices])
