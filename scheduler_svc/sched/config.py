"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.wire.options import option
from scheduler_svc.wire.step_plan import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Sizes and policies of one scheduler.

    preemption_mode: "recompute" frees a preempted group's blocks and requeues it; a group with
    several live sequences (n samples, beams) is swapped instead when the CPU pool can take it,
    since recomputing would lose their sharing. "swap" moves groups to the CPU pool, falling back
    to recompute when swap space is full.
    """

    block_size: int = 16
    num_gpu_blocks: int = 1024
    num_cpu_blocks: int = 0
    max_num_batched_tokens: int = option(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                         "most tokens computed in one step (prompt chunks + decodes)")
    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "most sequences in one step's batch")
    max_prefill_tokens_while_decoding: int = option(
        512, "most prompt tokens in a step that also decodes, unless a backlog lifts it (0: only "
        "--max-num-batched-tokens bounds them): a long prompt joins the running streams in chunks of this "
        "size, so no step stalls them for long, while a queue of prompts still drains at full pace (each "
        "such step may take 1/4 of the waiting requests' tokens); needs chunked prefill. On an H100 the "
        "ITL p99 at 32-48 req/s fell from 25-41 to 21-26 ms, offline unchanged (docs/benchmarks.md, Round 7)")
    max_model_len: int = 2048
    preemption_mode: str = option("recompute", "a preempted request's KV cache is recomputed later, or "
                                  "swapped to the CPU pool", choices=PREEMPTION_MODES, flag="preemption")
    enable_prefix_caching: bool = option(True, "automatic prefix caching (blocks of a shared prompt prefix "
                                         "are computed once)", flag="prefix-caching")
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence (Llama 3 has several)
    watermark_blocks: int = 0  # free blocks admission keeps in reserve (fewer preemptions)
    plans_ahead: int = option(
        1, "with async scheduling, plans built ahead of the results of the steps in flight (1 to 3): "
        "with 2 or 3 the scheduler and the executors each work on a different step, which keeps a "
        "small model's GPU busy when one step's host work (result, plan, launch) outlasts its GPU "
        "time; a sequence that stops may compute up to that many tokens for nothing", choices=(1, 2, 3))

    def __post_init__(self) -> None:
        positive = ("block_size", "num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.num_cpu_blocks <= self.num_gpu_blocks:
            raise ValueError(
                f"num_cpu_blocks must be in [0, num_gpu_blocks={self.num_gpu_blocks}], "
                f"got {self.num_cpu_blocks}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ValueError("preemption_mode 'swap' needs num_cpu_blocks > 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len}): a long prompt could never run"
            )
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 0 (0: no cap), "
                             f"got {self.max_prefill_tokens_while_decoding}")
        if not 0 <= self.watermark_blocks < self.num_gpu_blocks:
            raise ValueError(f"watermark_blocks must be in [0, num_gpu_blocks), got {self.watermark_blocks}")
        if self.plans_ahead not in (1, 2, 3):
            raise ValueError(f"plans_ahead must be 1, 2 or 3, got {self.plans_ahead}")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be >= 0, got {self.eos_token_ids}")
