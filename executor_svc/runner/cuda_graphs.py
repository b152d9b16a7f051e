"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed instead of launching the
forward pass kernel by kernel (a decode step of an 8B model is ~450 launches; on a slow host CPU the
launches alone take milliseconds). Prefill and mixed steps stay eager.

Every captured graph reads its inputs from the same static buffers, sliced to its bucket `b`:

    input_ids, positions, slot_mapping   [B_max]          rows n..b of a batch of n are padding:
    block_tables                         [B_max, M_max]   slot -1 (no KV write), seq_len 1
    seq_lens                             [B_max]          (reads one position of a stale block)
    query_start_loc                      [B_max + 1]      arange: one query token per sequence

The attention metadata is captured with max_seq_len = the model's max length, so the decode kernel's
split-K count (chosen on the host from max_seq_len and the grid) is fixed per bucket; partitions past
a sequence's end exit at once and weigh zero in the reduction. In deterministic mode
(executor_svc/layers/determinism.py) the kernel splits nothing and runs its prefill tile whatever
max_query_len says, so a replayed decode row has the bits of the same row run eagerly, in a batch of
any size, or in a prefill. The logits of the padded batch
`[b, V]` float32 come out of a static buffer too; the sampler runs eagerly on the real rows.

At TP > 1 the tensor-parallel all-reduces and the logits all-gather are captured inside each rank's
graphs (NCCL supports stream capture): replaying bucket b on every rank replays the same collectives
in the same order, so the ranks stay matched. The warm-up passes before each capture run the
collectives for real, which also creates the NCCL communicator before any capture.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from executor_svc.layers.attention import AttentionMetadata
from executor_svc.runner.inputs import ModelInput
from executor_svc.runner.kv_cache import KVCache

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16), *range(288, 513, 32))


def buckets_up_to(max_batch: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> tuple[int, ...]:
    """The buckets a server whose steps hold at most `max_batch` sequences can use: those up to the
    first one that holds max_batch (all of them when none does). Capturing more only costs start-up
    time and graph memory (40 buckets up to 512 by default; 4 for max_num_seqs = 8)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ordered = tuple(sorted(buckets))
    cover = next((b for b in ordered if b >= max_batch), ordered[-1])
    return tuple(b for b in ordered if b <= cover)


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_cache: KVCache,
        max_model_len: int,
        buckets: tuple[int, ...] = DECODE_BUCKETS,
    ):
        device = kv_cache.device_cache.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.buckets = tuple(sorted(buckets))
        max_batch = self.buckets[-1]
        max_blocks = -(-max_model_len // kv_cache.block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)  # [B]
        self.positions = torch.zeros(max_batch, **i64)  # [B]
        self.slot_mapping = torch.full((max_batch,), -1, **i64)  # [B]
        self.block_tables = torch.zeros(max_batch, max_blocks, **i32)  # [B, M]
        self.seq_lens = torch.ones(max_batch, **i32)  # [B]
        self.query_start_loc = torch.arange(max_batch + 1, **i32)  # [B + 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [b, V] float32

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:b], self.positions[:b], self.kv_cache.device_cache, self._metadata(b)
        )  # [b, D]
        return self.model.compute_logits(hidden).float()  # [b, V]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, all sharing one memory pool. The warm-up passes
        write no KV (every slot is -1 while capturing)."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        pool = None
        for b in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def bucket_for(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, batch: ModelInput) -> bool:
        num_seqs = batch.attn.seq_lens.shape[0]
        return (
            batch.attn.max_query_len == 1
            and batch.num_tokens == num_seqs
            and self.bucket_for(num_seqs) in self.graphs
            and batch.attn.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits [S, V] float32 of the rows named by `batch.logits_indices` (a decode batch that
        `can_run`). The result is a fresh tensor: the static output is overwritten by the next replay."""
        attn = batch.attn
        n, width = attn.block_tables.shape
        b = self.bucket_for(n)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, :width].copy_(attn.block_tables)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][batch.logits_indices]
