"""The step worker of one executor rank, the facade its gRPC servicer calls
(executor_svc/worker/protocol.py: StepWorker, ReportsMemory). It holds the model and the KV cache;
plan application (executor_svc/worker/plan_apply.py) holds the per-sequence state and runs the
steps, in the order documented in scheduler_svc/wire/step_plan.py.

Lifecycle: `Worker(...)` loads the model and measures how many KV blocks fit
(executor_svc/worker/memory_profile.py): the capacity, which `describe()` reports whatever size the
cache has now; `init_cache(num_gpu_blocks, num_cpu_blocks)` (optional) allocates the caches with
the counts the scheduler settled on (any up to the capacity), otherwise they are allocated on first
use with the counts that fit; `execute(plan)` runs a step (or `launch`,
then `finish`); `reset()` drops all sequence state.

Errors: StepOrderError (a plan that does not follow the last step), PlanError (a plan inconsistent
with the state: unknown sequence or fork parent, block table too short, block id out of range);
after either, the scheduler resets the worker. Finished ids the worker does not hold are ignored.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from executor_svc.layers import determinism
from executor_svc.models.config import DTYPES, ModelConfig
from executor_svc.models.loader import load_model
from executor_svc.runner.cuda_graphs import MIXED_BUCKETS, buckets_up_to
from executor_svc.runner.errors import PlanError, StepOrderError
from executor_svc.runner.inputs import SequenceState
from executor_svc.runner.kv_cache import GIB, KVCache, bytes_per_block, kv_cache_dtype
from executor_svc.runner.kv_calibration import MAX_CALIBRATION_TOKENS, calibrate_kv_scales, measure_kv_amax
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.config import WorkerConfig
from executor_svc.worker.launched_step import LaunchedStep
from executor_svc.worker.memory_profile import (
    blocks_that_fit,
    check_cache_fits,
    memory_usage,
    profile_gpu_blocks,
)
from executor_svc.worker.plan_apply import PlanApplier
from executor_svc.worker.protocol import MemoryUsage
from executor_svc.worker.step_trace import open_step_trace
from scheduler_svc.wire.step_plan import StepPlan, StepResult
from scheduler_svc.wire.worker_description import WorkerDescription

__all__ = ["PlanError", "StepOrderError", "Worker", "WorkerConfig"]

_log = logging.getLogger(__name__)


def _on_device(method):
    """Makes the rank's GPU the calling thread's current device first. The gRPC servicer calls the
    worker from a thread pool, and the current CUDA device is per thread (0 in a new one): Triton
    launches on the current device, so rank 1's kernels would get rank 0's context ("Pointer
    argument cannot be accessed from Triton") without this."""

    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)
        return method(self, *args, **kwargs)

    return on_device


def _num_graphs(graphs) -> int:
    return len(graphs.graphs) if graphs is not None else 0


class Worker:
    launches_ahead = True  # launch() queues the step's device work and returns before it is done

    def __init__(self, config: WorkerConfig | str, **overrides):
        if not isinstance(config, WorkerConfig):
            config = WorkerConfig(model_dir=str(config), **overrides)
        elif overrides:
            config = replace(config, **overrides)
        if config.world_size > 1 and not torch.distributed.is_initialized():
            raise ValueError("world_size > 1 needs torch.distributed initialized before the Worker is built")
        self.config = config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # the thread's current one, named
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.dtype = _resolve_dtype(config.dtype, self.model_config, self.device)
        determinism.set_deterministic(config.deterministic)  # before the layers are built: they read it
        self.model = load_model(
            config.model_dir,
            self.model_config,
            self.dtype,
            self.device,
            config.load_format,
            config.rank,
            config.world_size,
            config.seed,
        )
        self.num_kv_heads_per_rank = max(1, self.model_config.num_kv_heads // config.world_size)
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_bytes = bytes_per_block(
            self.model_config.num_layers,
            self.cache_config.block_size,
            self.num_kv_heads_per_rank,
            self.model_config.head_dim,
            self.kv_cache_dtype,
        )
        # Steps replay CUDA graphs on the GPU unless config.enforce_eager: decode steps, and the others
        # (prefills, mixed) unless config.eager_mixed_steps; the memory profile reserves the mixed
        # graphs' pool. At TP > 1 each rank's graphs hold its NCCL collectives: every rank captures
        # the same buckets in the same order (the warm-up passes run real collectives, matched across
        # ranks) and replays the same bucket for a step, since the choice depends only on the plan,
        # which every rank gets.
        self.use_cuda_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.use_mixed_graphs = self.use_cuda_graphs and not config.eager_mixed_steps
        # What fits (profiled once) is the ceiling of every init_cache, kept apart from the size the
        # cache has now: a small InitCache never lowers what a later one may ask for.
        self.capacity_gpu_blocks, self.capacity_cpu_blocks = blocks_that_fit(
            self.cache_config, self.device, self.block_bytes, self._profile_gpu_blocks
        )
        self.num_gpu_blocks, self.num_cpu_blocks = self.capacity_gpu_blocks, self.capacity_cpu_blocks
        # (k_scale, v_scale) per attention layer: an FP8 cache's, set before any cache or graph exists
        self.kv_scales = self._calibrate_kv_scales() if config.kv_cache_dtype == "fp8" else []
        self.runner: ModelRunner | None = None
        self._plan = PlanApplier(
            self.device,
            self.cache_config.block_size,
            config.seed,
            self._ensure_cache,
            open_step_trace(config.step_trace_path, config.rank),
        )

    # ---- lifecycle -------------------------------------------------------------------------------

    def describe(self) -> WorkerDescription:
        mc = self.model_config
        return WorkerDescription(
            model_name=self.config.model_dir.rstrip("/").rsplit("/", 1)[-1],
            family=mc.family,
            rank=self.config.rank,
            world_size=self.config.world_size,
            vocab_size=mc.vocab_size,
            max_model_len=mc.max_model_len,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=self.cache_config.block_size,
            num_gpu_blocks=self.capacity_gpu_blocks,
            num_cpu_blocks=self.capacity_cpu_blocks,
            eos_token_ids=mc.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            bos_token_id=mc.bos_token_id,
            hidden_size=mc.hidden_size,
        )

    @_on_device
    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the caches (dropping any sequence state); at most the blocks that fit (the
        profiled capacity, whatever size an earlier call chose)."""
        if not 1 <= num_gpu_blocks <= self.capacity_gpu_blocks or not 0 <= num_cpu_blocks <= max(
            self.capacity_cpu_blocks, 0
        ):
            raise ValueError(
                f"init_cache({num_gpu_blocks}, {num_cpu_blocks}): at most "
                f"({self.capacity_gpu_blocks}, {self.capacity_cpu_blocks}) blocks fit"
            )
        self.reset()
        if self.runner is not None and (num_gpu_blocks, num_cpu_blocks) == (
            self.num_gpu_blocks,
            self.num_cpu_blocks,
        ):
            pass  # recovery asks for the sizes it has: keep the caches (their contents are never reused)
        else:
            self._free_cache()
            self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
            check_cache_fits(self.device, self.block_bytes, num_gpu_blocks)
            self._ensure_cache()
        if self.config.world_size > 1:
            # Every rank of the set must be there: after a rank died, the survivors fail here (and
            # exit, see executor_svc/server/main.py) instead of waiting for a step that never comes.
            torch.distributed.barrier()

    @_on_device
    def reset(self) -> None:
        """Drops every sequence's state and the step count; the next plan may carry any step_id."""
        self._plan.reset()

    @property
    def seqs(self) -> dict[int, SequenceState]:
        """seq_id -> the state this rank holds for it."""
        return self._plan.seqs

    @property
    def last_step_id(self) -> int | None:
        return self._plan.last_step_id

    @property
    def kv_cache(self) -> KVCache:
        return self._ensure_cache().kv_cache

    @_on_device
    def memory_usage(self) -> MemoryUsage:
        return memory_usage(
            self.device, self.block_bytes, self.num_gpu_blocks, self.num_cpu_blocks, self.runner is not None
        )

    # ---- one step (executor_svc/worker/plan_apply.py) --------------------------------------------

    @_on_device
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step to the end (`launch`, then `finish`)."""
        return self._plan.finish(self._plan.launch(plan))

    @_on_device
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Applies the plan and queues the step's GPU work (block operations, forward pass, sampling,
        copy of the samples to the host) without waiting for it, so the host can go on to the next
        plan while the GPU runs this one. Steps are finished in the order they were launched."""
        return self._plan.launch(plan)

    @_on_device
    def wait(self, step: LaunchedStep) -> None:
        """Blocks until the GPU is done with `step` (not with steps launched after it)."""
        self._plan.wait(step)

    @_on_device
    def finish(self, step: LaunchedStep) -> StepResult:
        """The step's samples, once the GPU is done with it; also fills in the tokens that later
        steps took from it on the device."""
        return self._plan.finish(step)

    # ---- memory ----------------------------------------------------------------------------------

    def _free_cache(self) -> None:
        """Drops the caches before new ones are made: the two never live at once, even when an earlier
        step's objects still hold the old runner somewhere (they lose its tensors, not the memory)."""
        if self.runner is None:
            return
        self.runner.kv_cache.release()
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _ensure_cache(self) -> ModelRunner:
        if self.runner is None:
            mc, cc = self.model_config, self.cache_config
            cache = KVCache(
                mc.num_layers,
                self.num_kv_heads_per_rank,
                mc.head_dim,
                cc.block_size,
                self.num_gpu_blocks,
                self.num_cpu_blocks,
                self.kv_cache_dtype,
                self.device,
            )
            self.runner = ModelRunner(self.model, cache)
            if self.use_cuda_graphs:
                begin = time.perf_counter()
                self.runner.capture_decode_graphs(mc.max_model_len, cc.max_num_seqs)
                _log.info("rank %d: %d decode-step CUDA graphs captured in %.1f s", self.config.rank,
                          _num_graphs(self.runner.decode_graphs), time.perf_counter() - begin)
            if self.use_mixed_graphs:
                torch.cuda.empty_cache()  # what the device holds before, less free cached blocks
                reserved_before = torch.cuda.memory_reserved(self.device)
                begin = time.perf_counter()
                self.runner.capture_mixed_graphs(mc.max_model_len, cc.max_num_batched_tokens, cc.max_num_seqs)
                torch.cuda.empty_cache()  # the warm-up passes' blocks: the graphs' pool stays
                _log.info(
                    "rank %d: %d mixed-step CUDA graphs (steps of up to %d tokens) captured in %.1f s hold "
                    "%.3f GiB (the memory profile's reserve for them is logged above)", self.config.rank,
                    _num_graphs(self.runner.mixed_graphs), cc.max_num_batched_tokens,
                    time.perf_counter() - begin,
                    (torch.cuda.memory_reserved(self.device) - reserved_before) / GIB,
                )
            if self.device.type == "cuda":
                begin = time.perf_counter()
                self.runner.warm_eager(cc.max_num_seqs)
                _log.info("rank %d: the LM head and the sampler warmed at every step size in %.1f s",
                          self.config.rank, time.perf_counter() - begin)
        return self.runner

    def _profile_gpu_blocks(self) -> int:
        mc, cc = self.model_config, self.cache_config
        graph_tokens = 0  # the largest mixed-step graph, whose pool the profile reserves
        if self.use_mixed_graphs:
            graph_tokens = buckets_up_to(cc.max_num_batched_tokens, MIXED_BUCKETS)[-1]
        return profile_gpu_blocks(
            self.model,
            cc,
            mc.num_layers,
            self.num_kv_heads_per_rank,
            mc.head_dim,
            self.kv_cache_dtype,
            self.device,
            self.block_bytes,
            graph_tokens=graph_tokens,
            graph_max_seq_len=mc.max_model_len,
        )

    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Measures each layer's K and V amax over a few random prompts and sets the FP8 cache's
        scales from them (executor_svc/runner/kv_calibration.py)."""
        mc, cc = self.model_config, self.cache_config
        kv_amax = measure_kv_amax(
            self.model,
            mc.num_layers,
            self.num_kv_heads_per_rank,
            mc.head_dim,
            cc.block_size,
            self.dtype,
            self.device,
            mc.vocab_size,
            min(MAX_CALIBRATION_TOKENS, cc.max_num_batched_tokens, mc.max_model_len * 4),
            mc.bos_token_id,
        )
        scales = calibrate_kv_scales(self.model, kv_amax)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the calibration's cache and activations
        k_scales, v_scales = [k for k, _ in scales], [v for _, v in scales]
        _log.info(
            "rank %d: FP8 KV cache (e4m3), %d layers, k_scale %g..%g, v_scale %g..%g (K amax up to %.3g, "
            "V amax up to %.3g)", self.config.rank, len(scales), min(k_scales), max(k_scales),
            min(v_scales), max(v_scales), max(k for k, _ in kv_amax), max(v for _, v in kv_amax),
        )
        return scales


def _resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    saved = DTYPES.get(config.torch_dtype, torch.float32)
    return torch.bfloat16 if saved == torch.float32 and device.type == "cuda" else saved
