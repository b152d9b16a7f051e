"""Every check of one request against this server's limits, in one place.

The engine calls the `RequestValidator` once per request, before the scheduler sees it; a failed
check raises `InvalidRequestError` naming the field (INVALID_ARGUMENT at the gRPC edge) and nothing
else changes. Two phases, because a text prompt is tokenized in between:

    check_fields(id, stop, stop_token_ids, num_prompt_ids)   the sizes a client controls:
                          request_id length, stop strings' count and length, stop token ids' count,
                          a token-id prompt's length against max_model_len and the KV cache (before
                          anything is converted, stored or tokenized)
    check_prompt(prompt)  the prompt is not empty; a text prompt is not longer than the model could
                          ever hold (max_model_len * max_prompt_chars_per_token characters: checked
                          before tokenizing); its token ids lie in the vocabulary
    check(group)          the server's limits on n and beam width; stop token ids in the vocabulary;
                          prompt and prompt + max_tokens against the KV cache's size; then
    check_schedulable     what the scheduler relies on: prompt + max_tokens within max_model_len,
                          n / beam width within max_num_seqs, room under the KV policy

The values a `SamplingParams` can judge alone (temperature range, ...) it checks on construction.
The scheduler trusts what passed here (it only asserts its invariants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.kv.kv_manager import AllocStatus, KVCacheManager
from scheduler_svc.request.sequence import SequenceGroup
from scheduler_svc.sched.config import SchedulerConfig
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.limits import MAX_PROMPT_CHARS_PER_TOKEN

MAX_N = 16
MAX_BEAM_WIDTH = 16
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Stop token ids a request may give: a few end-of-turn ids is the use; without a cap a client sent 7
# million (13 MiB over HTTP), accepted, and every stream of the server stalled ~1 s while they were read
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask of this server: set by its configuration (ServeOptions), not by
    the client; clients read them from GetModelInfo."""

    max_n: int = MAX_N  # parallel samples per request
    max_beam_width: int = MAX_BEAM_WIDTH
    max_request_id_chars: int = MAX_REQUEST_ID_CHARS
    max_stop_strings: int = MAX_STOP_STRINGS  # per request
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS  # per stop string
    max_prompt_chars_per_token: int = MAX_PROMPT_CHARS_PER_TOKEN
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS  # per request

    def __post_init__(self) -> None:
        for name in ("max_n", "max_beam_width", "max_request_id_chars", "max_stop_strings",
                     "max_stop_string_chars", "max_prompt_chars_per_token", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class RequestValidator:
    """Checks requests against the server's limits (`limits`), the model's vocabulary, and the
    scheduler's configuration and KV manager (max model length, max_num_seqs, cache capacity)."""

    def __init__(self, limits: RequestLimits, vocab_size: int, config: SchedulerConfig, kv: KVCacheManager):
        self.limits = limits
        self.vocab_size = vocab_size
        self.config = config
        self.kv = kv
        self._cache = f"the KV cache ({config.num_gpu_blocks} blocks of {config.block_size} tokens)"

    def check_fields(self, request_id: str, stop: Sequence[str], stop_token_ids: Sequence[int] = (),
                     num_prompt_ids: int = 0) -> None:
        """The sizes of what the client sent, before the engine stores or tokenizes anything (the
        servicer also calls it before converting the request: `stop` and `stop_token_ids` may then be
        the protobuf lists, whose lengths cost nothing to read, while converting 20,000 strings costs
        18 ms; `num_prompt_ids`: the length of a prompt of token ids, checked before its ids are
        converted and checked one by one: 15 million took the engine's loop 2.5 s)."""
        limits = self.limits
        self._check_num_prompt_ids(num_prompt_ids)
        if len(stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequestError(
                "stop_token_ids", f"{len(stop_token_ids)} token ids; at most {limits.max_stop_token_ids}"
            )
        if len(request_id) > limits.max_request_id_chars:
            raise InvalidRequestError(
                "request_id", f"{len(request_id)} characters; at most {limits.max_request_id_chars}"
            )
        if len(stop) > limits.max_stop_strings:
            raise InvalidRequestError("stop", f"{len(stop)} stop strings; at most {limits.max_stop_strings}")
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidRequestError(
                "stop", f"a stop string of {longest} characters; at most {limits.max_stop_string_chars}"
            )

    def check_prompt(self, prompt: str | list[int]) -> None:
        """The prompt as the client sent it: text, or token ids."""
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if isinstance(prompt, str):
            max_chars = self.config.max_model_len * self.limits.max_prompt_chars_per_token
            if len(prompt) > max_chars:
                raise InvalidRequestError(
                    "prompt.text",
                    f"{len(prompt)} characters can never fit max_model_len {self.config.max_model_len} "
                    f"(at most {max_chars} characters)",
                )
            return
        self._check_num_prompt_ids(len(prompt))
        vocab = self.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt.token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )

    def check(self, group: SequenceGroup) -> None:
        """A new one-sequence group (scheduler.new_group) with its tokenized prompt."""
        params, limits, config = group.sampling_params, self.limits, self.config
        if params.n > limits.max_n:
            raise InvalidRequestError("n", f"must be in [1, {limits.max_n}], got {params.n}")
        if params.beam_width > limits.max_beam_width:
            raise InvalidRequestError(
                "beam_width", f"must be in [1, {limits.max_beam_width}], got {params.beam_width}"
            )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {self.vocab_size})")
        prompt_len = group.prompt_len
        if self._num_blocks(prompt_len) > config.num_gpu_blocks:
            raise InvalidRequestError("prompt", f"{prompt_len} tokens can never fit in {self._cache}")
        total_len = prompt_len + params.max_tokens
        if total_len <= config.max_model_len and self._num_blocks(total_len) > config.num_gpu_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                f"can never fit in {self._cache}",
            )
        self.check_schedulable(group)
        # Every sequence of the group at its longest: the prompt's full blocks are shared, each sequence
        # holds the rest of its own (its copy of the prompt's last, partial block included). A group
        # alone in the cache that outgrows it is dropped mid-stream (scheduling_pass, OUTGREW_KV_CACHE),
        # so one that would is refused here, up front, as one sequence that would is above.
        width = max(params.n, params.beam_width)
        shared = prompt_len // config.block_size
        need = shared + width * (self._num_blocks(total_len) - shared)
        if width > 1 and need > config.num_gpu_blocks:
            raise InvalidRequestError(
                "n" if params.n > 1 else "beam_width",
                f"{width} sequences of prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
                f"need {need} blocks at their longest and can never fit in {self._cache}",
            )

    def check_schedulable(self, group: SequenceGroup) -> None:
        """What the scheduler needs of every group it is given (`check` includes it): the model's
        length, max_num_seqs, and room in an empty cache under the KV policy. Tests and simulations
        that drive a Scheduler without the engine call this alone (their requests may outgrow the
        cache on purpose)."""
        params, config = group.sampling_params, self.config
        prompt_len = group.prompt_len
        if prompt_len + params.max_tokens > config.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {config.max_model_len}",
            )
        width = max(params.n, params.beam_width)
        if width > config.max_num_seqs:
            name = "n" if params.n > 1 else "beam_width"
            raise InvalidRequestError(name, f"{width} exceeds max_num_seqs {config.max_num_seqs}")
        if self.kv.can_allocate(group) is AllocStatus.NEVER:  # the policy's own reservation
            raise InvalidRequestError("prompt", f"{prompt_len} tokens can never fit in {self._cache}")

    def _check_num_prompt_ids(self, num_ids: int) -> None:
        """A prompt of more tokens than the model's length or the whole KV cache can never be served."""
        config = self.config
        most = min(config.max_model_len, config.num_gpu_blocks * config.block_size)
        if num_ids > most:
            raise InvalidRequestError(
                "prompt.token_ids",
                f"{num_ids} tokens can never fit (max_model_len {config.max_model_len}, {self._cache})",
            )

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)
