"""What the engine's callers see besides the engine itself: the served model's limits, its
statistics, and the protocols of its tokenizer and executors. No protobuf here. (Its errors are the
API's, scheduler_svc/wire/errors.py; requests are checked by scheduler_svc/sched/validation.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.engine.detokenizer import Decoder
from scheduler_svc.wire.chat_template import ChatTemplate
from scheduler_svc.wire.step_plan import StepPlan, StepResult


class Tokenizer(Decoder, Protocol):
    def encode(self, text: str): ...


class Executors(Protocol):
    """The executor ranks as the engine drives them (scheduler_svc.engine.executor_client.ExecutorPool)."""

    last_plan_bytes: int  # size of the last plan sent, serialized (a metric)

    async def step(self, plan: StepPlan) -> StepResult:
        """Run one plan on every rank; raises when a rank fails or misses the step deadline."""
        ...

    async def recover(self) -> None:
        """Re-initialize every rank (cache and state) after a failure; raises while one is down."""
        ...

    async def close(self) -> None:
        """Close the connections to the ranks (the engine is done with them)."""
        ...


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The served model and its KV cache, as the executors describe them once the cache is sized."""

    model_name: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...] = ()
    world_size: int = 1
    default_sampling: tuple[tuple[str, float], ...] = ()  # generation_config.json's, for unset fields
    chat_template: ChatTemplate = ChatTemplate()  # reported to clients (GetModelInfo), never rendered here


@dataclass(frozen=True, slots=True)
class RecoveryOptions:
    """Executor failure handling: requests wait up to `recovery_timeout_s` after a failure for
    the ranks to come back (then end with UNAVAILABLE); the ranks are probed every `probe_interval_s`."""

    recovery_timeout_s: float = 120.0
    probe_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.recovery_timeout_s < 0 or self.probe_interval_s <= 0:
            raise ValueError("recovery_timeout_s must be >= 0 and probe_interval_s > 0")


@dataclass(slots=True)
class EngineStats:
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_steps: int
    num_preemptions: int
    num_running_seqs: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_shared_block_refs: int = 0  # blocks saved by sharing (kv_manager.num_shared_block_refs)
    kv_policy: str = "paged"


class ExecutorError(RuntimeError):
    """An executor rank failed a call; `code` is the gRPC status code name."""

    def __init__(self, target: str, code: str, details: str):
        super().__init__(f"executor {target}: {code}: {details}")
        self.target = target
        self.code = code
