"""The step worker of one executor rank: holds the model, the KV cache and per-sequence state, and
carries out step plans (order documented in scheduler_svc/wire/step_plan.py).

Lifecycle: `Worker(...)` loads the model and measures how many KV blocks fit; `describe()` reports
it; `init_cache(num_gpu_blocks, num_cpu_blocks)` (optional) allocates the caches with the counts the
scheduler settled on, otherwise they are allocated on first use with the counts that fit;
`execute(plan)` runs a step; `reset()` drops all sequence state.

Errors: StepOrderError (a plan that does not follow the last step), PlanError (a plan inconsistent
with the state: unknown sequence or fork parent, block table too short, block id out of range);
after either, the scheduler resets the worker. Finished ids the worker does not hold are ignored.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from executor_svc.models.config import DTYPES, ModelConfig
from executor_svc.models.loader import load_model
from executor_svc.runner.errors import PlanError, StepOrderError
from executor_svc.runner.host_to_device import to_device
from executor_svc.runner.inputs import ScheduledSequence, SequenceState, build_model_input
from executor_svc.runner.kv_cache import GIB, KVCache, blocks_from_profile, bytes_per_block
from executor_svc.runner.model_runner import ModelRunner
from executor_svc.worker.config import WorkerConfig, WorkerDescription
from executor_svc.worker.launched_step import LaunchedStep, copy_to_host, to_samples
from scheduler_svc.wire.step_plan import PENDING_TOKEN, StepPlan, StepResult

__all__ = ["PlanError", "StepOrderError", "Worker", "WorkerConfig", "WorkerDescription"]


class Worker:
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
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.dtype = _resolve_dtype(config.dtype, self.model_config, self.device)
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
        self.block_bytes = bytes_per_block(
            self.model_config.num_layers,
            self.cache_config.block_size,
            self.num_kv_heads_per_rank,
            self.model_config.head_dim,
            self.dtype,
        )
        self.num_gpu_blocks, self.num_cpu_blocks = self._blocks_that_fit()
        self.runner: ModelRunner | None = None
        self.generator = torch.Generator().manual_seed(config.seed)
        self.seqs: dict[int, SequenceState] = {}
        self.last_step_id: int | None = None
        self._last_launched: LaunchedStep | None = None
        self._last_end_event = None
        # Decode steps replay CUDA graphs on one GPU unless PAGEDSERVE_ENFORCE_EAGER=1.
        eager = os.environ.get("PAGEDSERVE_ENFORCE_EAGER") == "1"
        self.use_cuda_graphs = self.device.type == "cuda" and config.world_size == 1 and not eager
        # PAGEDSERVE_STEP_TRACE=FILE: one line per step, "step_id t_start t_launch t_end num_seqs
        # num_tokens gpu_gap_ms gpu_busy_ms" (time.perf_counter seconds; t_launch: the forward pass is
        # launched; t_end: the host saw the GPU done; on CUDA, from events on the stream: the time from
        # the previous step's end to this step's forward pass (the GPU idles but for this step's
        # block operations and input copies), and the forward pass + sampling; -1 elsewhere), read by
        # `pagedserve bench` for the GPU idle time between steps.
        # Rank 0 alone writes it (the ranks of a tensor-parallel set step together).
        trace_path = os.environ.get("PAGEDSERVE_STEP_TRACE") if config.rank == 0 else None
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None  # noqa: SIM115

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
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            eos_token_ids=mc.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            bos_token_id=mc.bos_token_id,
            hidden_size=mc.hidden_size,
            model_config=mc,
        )

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the caches (dropping any sequence state); at most the blocks that fit."""
        if not 1 <= num_gpu_blocks <= self.num_gpu_blocks or num_cpu_blocks > max(self.num_cpu_blocks, 0):
            raise ValueError(
                f"init_cache({num_gpu_blocks}, {num_cpu_blocks}): at most "
                f"({self.num_gpu_blocks}, {self.num_cpu_blocks}) blocks fit"
            )
        self.reset()
        self.runner = None
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self._ensure_cache()
        if self.config.world_size > 1:
            # Every rank of the set must be there: after a rank died, the survivors fail here (and
            # exit, see executor_svc/server/main.py) instead of waiting for a step that never comes.
            torch.distributed.barrier()

    def reset(self) -> None:
        """Drops every sequence's state and the step count; the next plan may carry any step_id."""
        self.seqs.clear()
        self.last_step_id = None
        self._last_launched = None
        self._last_end_event = None

    @property
    def kv_cache(self) -> KVCache:
        return self._ensure_cache().kv_cache

    # ---- one step --------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step to the end (`launch`, then `finish`)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Applies the plan and queues the step's GPU work (block operations, forward pass, sampling,
        copy of the samples to the host) without waiting for it, so the host can go on to the next
        plan while the GPU runs this one. Steps are finished in the order they were launched."""
        if self.last_step_id is not None and plan.step_id != self.last_step_id + 1:
            raise StepOrderError(
                f"step {plan.step_id} does not follow step {self.last_step_id}; expected "
                f"{self.last_step_id + 1} (reset the executor to start over)"
            )
        step = LaunchedStep(plan.step_id, time.perf_counter())
        runner = self._ensure_cache()
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        self._apply_forks(plan.forks)
        runner.kv_cache.swap_out(plan.swap_out)
        runner.kv_cache.swap_in(plan.swap_in)
        runner.kv_cache.copy(plan.copies)
        scheduled = self._apply_sequences(plan)
        batch = None
        if scheduled:
            batch = build_model_input(scheduled, self.cache_config.block_size, self.device, self.generator)
            if batch.pending_seq_ids:
                self._fill_pending_tokens(batch, step.step_id)
        # The start event goes on the stream just before the forward pass: the GPU is idle from the
        # previous step's end to it unless this step was queued while that one ran.
        start_event = self._record_event() if self._trace is not None else None  # timing: trace only
        step.launch = time.perf_counter()
        if batch is not None:
            output = runner.execute(batch)
            for s in scheduled:
                s.state.num_computed_tokens += s.num_new_tokens
            if output is not None:
                step.rows = {seq_id: row for row, seq_id in enumerate(batch.sampled_seq_ids)}
                step.token_ids = output.token_ids
                step.host = copy_to_host(batch, output)
        step.num_seqs, step.num_tokens = len(scheduled), sum(s.num_new_tokens for s in scheduled)
        step.events = (start_event, self._record_event())
        self.last_step_id = plan.step_id
        self._last_launched = step
        return step

    def wait(self, step: LaunchedStep) -> None:
        """Blocks until the GPU is done with `step` (not with steps launched after it)."""
        if step.events is not None and step.events[1] is not None:
            step.events[1].synchronize()

    def finish(self, step: LaunchedStep) -> StepResult:
        """The step's samples, once the GPU is done with it; also fills in the tokens that later
        steps took from it on the device."""
        self.wait(step)
        end = time.perf_counter()
        samples = to_samples(*step.host) if step.host is not None else []
        step.sampled_token_ids = [s.token_id for s in samples]
        for state, index, row in step.pending_fixes:
            state.token_ids[index] = step.sampled_token_ids[row]
        step.pending_fixes.clear()
        if self._trace is not None:
            gap_ms = busy_ms = -1.0
            if step.events is not None and step.events[0] is not None:
                busy_ms = step.events[0].elapsed_time(step.events[1])
                if self._last_end_event is not None:
                    gap_ms = self._last_end_event.elapsed_time(step.events[0])
                self._last_end_event = step.events[1]
            times = f"{step.start:.6f} {step.launch:.6f} {end:.6f}"
            self._trace.write(
                f"{step.step_id} {times} {step.num_seqs} {step.num_tokens} {gap_ms:.4f} {busy_ms:.4f}\n"
            )
        return StepResult(step.step_id, samples, end - step.start)

    def _fill_pending_tokens(self, batch, step_id: int) -> None:
        """PENDING_TOKEN in the batch = the token the previous step sampled for that sequence: copied
        into input_ids on the device (the previous step may still be running), and into the
        sequence's token ids as soon as it is known on the host."""
        prev = self._last_launched
        if prev is None or prev.step_id != step_id - 1:
            raise PlanError(f"step {step_id} takes tokens from a previous step this executor did not run")
        rows = []
        for seq_id in batch.pending_seq_ids:
            row = prev.rows.get(seq_id)
            if row is None:
                raise PlanError(f"sequence {seq_id}: pending token, step {prev.step_id} sampled none for it")
            rows.append(row)
        source = torch.tensor(rows, dtype=torch.int64)
        batch.input_ids[to_device(batch.pending_token_indices, self.device)] = prev.token_ids[
            to_device(source, self.device)
        ]
        for seq_id, row in zip(batch.pending_seq_ids, rows, strict=True):
            state = self.seqs[seq_id]
            index = len(state.token_ids) - 1
            if state.token_ids[index] != PENDING_TOKEN:
                raise PlanError(f"sequence {seq_id}: a pending token that is not its last")
            if prev.sampled_token_ids is not None:  # the previous step is finished already
                state.token_ids[index] = prev.sampled_token_ids[row]
            else:
                prev.pending_fixes.append((state, index, row))

    def _record_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=self._trace is not None)
        event.record()
        return event

    def _apply_forks(self, forks: list[tuple[int, int]]) -> None:
        """child := copy of parent. Forks carry no sample index, so the k-th child forked from a parent
        in one plan gets the parent's sample_index + k: the numbering the scheduler gives the n samples
        of a request (it forks samples 1..n-1 from sample 0 in one plan), so a seeded request draws the
        same streams here as when its sequences come back as NewSequences with their own index. Beam
        candidates ignore the index (they are not random)."""
        forks_per_parent: dict[int, int] = {}
        for child_id, parent_id in forks:
            if child_id in self.seqs:
                raise PlanError(f"fork child {child_id} already exists")
            parent = self._state(parent_id, "fork parent")
            forks_per_parent[parent_id] = forks_per_parent.get(parent_id, 0) + 1
            child = parent.copy()
            child.sample_index = parent.sample_index + forks_per_parent[parent_id]
            self.seqs[child_id] = child

    def _apply_sequences(self, plan: StepPlan) -> list[ScheduledSequence]:
        scheduled = []
        for new in plan.new_seqs:
            state = SequenceState(
                list(new.token_ids),
                new.num_computed_tokens,
                list(new.block_table),
                new.sampling_params,
                new.sample_index,
                new.prompt_len,
            )
            self.seqs[new.seq_id] = state
            scheduled.append(ScheduledSequence(new.seq_id, state, new.num_new_tokens))
        for cont in plan.cont_seqs:
            state = self._state(cont.seq_id, "continuing sequence")
            state.token_ids.extend(cont.new_token_ids)
            if cont.block_table_start > len(state.block_table):
                raise PlanError(
                    f"sequence {cont.seq_id}: block_table_start {cont.block_table_start} past its "
                    f"{len(state.block_table)} blocks"
                )
            if cont.block_ids:  # no block ids: the table is unchanged (whatever block_table_start says)
                state.set_blocks(cont.block_table_start, cont.block_ids)
            scheduled.append(ScheduledSequence(cont.seq_id, state, cont.num_new_tokens))
        seqs = self.seqs
        for seq_id, token_id in zip(plan.decode_seq_ids, plan.decode_token_ids, strict=True):
            state = seqs.get(seq_id)
            if state is None:
                raise PlanError(f"decoding sequence {seq_id} is unknown to this executor")
            state.token_ids.append(token_id)
            scheduled.append(ScheduledSequence(seq_id, state, 1))
        return scheduled

    def _state(self, seq_id: int, what: str) -> SequenceState:
        state = self.seqs.get(seq_id)
        if state is None:
            raise PlanError(f"{what} {seq_id} is unknown to this executor")
        return state

    # ---- memory ----------------------------------------------------------------------------------

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
                self.dtype,
                self.device,
            )
            self.runner = ModelRunner(self.model, cache)
            if self.use_cuda_graphs:
                self.runner.capture_decode_graphs(mc.max_model_len)
        return self.runner

    def _blocks_that_fit(self) -> tuple[int, int]:
        cc = self.cache_config
        num_gpu = cc.num_gpu_blocks
        if num_gpu is None and self.device.type == "cuda":
            num_gpu = self._profile_gpu_blocks()
        elif num_gpu is None:
            num_gpu = int(cc.cpu_kv_gib * GIB) // self.block_bytes
        num_cpu = cc.num_cpu_blocks
        if num_cpu is None:
            num_cpu = int(cc.swap_space_gib * GIB) // self.block_bytes
        if num_gpu < 1:
            raise MemoryError("no KV cache block fits in the memory budget")
        return num_gpu, min(num_cpu, num_gpu)

    def _profile_gpu_blocks(self) -> int:
        mc, cc = self.model_config, self.cache_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        probe = KVCache(
            mc.num_layers,
            self.num_kv_heads_per_rank,
            mc.head_dim,
            cc.block_size,
            1,
            0,
            self.dtype,
            self.device,
        )
        ModelRunner(self.model, probe).profile_run(cc.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        del probe
        torch.cuda.empty_cache()
        return blocks_from_profile(
            total, cc.gpu_memory_utilization, peak + max(0, non_torch), self.block_bytes
        )


def _resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    saved = DTYPES.get(config.torch_dtype, torch.float32)
    return torch.bfloat16 if saved == torch.float32 and device.type == "cuda" else saved
