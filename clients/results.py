"""Typed results of the Generation API, as the client library returns them (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = {0: None, 1: "length", 2: "stop", 3: "abort"}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely alternatives, best first

    def to_json_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """What is new for one output (sample or beam) in one streamed message."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "length" | "stop" | "abort" once the output is finished
    completion_tokens: int = 0
    cumulative_logprob: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """How the server handled the request (on the last message): seconds from its arrival at the
    scheduler, its preemptions, the prompt tokens it found in the prefix cache, and the time to first
    token that the API server taking the call measured from receiving it (0.0: none was sent)."""

    queue_time_s: float
    time_to_first_token_s: float
    e2e_latency_s: float
    num_preemptions: int
    cached_prompt_tokens: int
    api_time_to_first_token_s: float = 0.0

    def to_json_dict(self) -> dict:
        return {"queue_time_s": self.queue_time_s, "time_to_first_token_s": self.time_to_first_token_s,
                "e2e_latency_s": self.e2e_latency_s, "num_preemptions": self.num_preemptions,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "api_time_to_first_token_s": self.api_time_to_first_token_s}


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    request_id: str
    outputs: tuple[OutputDelta, ...]
    prompt_tokens: int
    finished: bool  # the last message of the stream
    metrics: RequestMetrics | None = None  # on the last message


@dataclass(slots=True)
class Output:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0

    def add(self, delta: OutputDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.cumulative_logprob = delta.cumulative_logprob


@dataclass(slots=True)
class GenerationResult:
    request_id: str = ""
    outputs: list[Output] = field(default_factory=list)
    prompt_tokens: int = 0
    metrics: RequestMetrics | None = None  # the server's, once the stream has ended

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    def add(self, delta: GenerationDelta) -> None:
        self.request_id = delta.request_id
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.metrics = delta.metrics or self.metrics
        for out in delta.outputs:
            while len(self.outputs) <= out.index:
                self.outputs.append(Output(index=len(self.outputs)))
            self.outputs[out.index].add(out)

    def to_json_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "outputs": [
                {
                    "index": o.index,
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "finish_reason": o.finish_reason,
                    "cumulative_logprob": o.cumulative_logprob,
                    **({"logprobs": [lp.to_json_dict() for lp in o.logprobs]} if o.logprobs else {}),
                }
                for o in self.outputs
            ],
            **({"metrics": self.metrics.to_json_dict()} if self.metrics is not None else {}),
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_n: int
    max_beam_width: int
    world_size: int
    preemption_mode: str
    enable_prefix_caching: bool
    chat_template: str = ""  # Jinja (empty: none); clients/cli/generate.py --chat renders it
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True, slots=True)
class ServerStats:
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
    num_shared_block_refs: int = 0  # blocks saved by sharing (samples, beams, common prefixes)
    kv_policy: str = ""
