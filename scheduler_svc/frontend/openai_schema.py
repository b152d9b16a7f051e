"""The OpenAI HTTP API's request and response bodies (pydantic models), as the `openai` SDK sends and
parses them: /v1/completions, /v1/chat/completions, /v1/models. Extensions beside OpenAI's fields,
as vLLM names them: `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, and on chat
`add_generation_prompt`. Fields OpenAI defines that pagedserve cannot honour (echo, suffix,
penalties, logit_bias, tools, ...) are refused with a 400 naming them unless left at their neutral
value; fields nobody defines are ignored, as OpenAI's own server does with unknown fields.

Bodies are typed strictly, as OpenAI's schema types them: a string, a boolean or 5.0 where an integer
goes is a 400 naming the field, not coerced ("max_tokens": "5" and "stream": 1 were accepted, and a
prompt [1, "2"] became token ids [1, 2]); an integer where a float goes is fine (JSON has one number).
Every number is bounded here so that nothing out of a 64-bit range reaches protobuf; the server's own
limits (n, max_tokens against the model, logprobs) are checked where every request is checked
(scheduler_svc/sched/validation.py), and reach the client as the same 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

INT64_MAX = 2**63 - 1
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]


def _prompt_kind(value: Any) -> str | None:
    """Which of Prompt's forms a body's prompt is, from its first item (a list of token ids with a
    text in it is a list of token ids whose item is wrong, not a list of texts)."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    if not value or isinstance(value[0], str):
        return "list[str]"  # (an empty list is refused by CompletionRequest, naming prompt)
    return "list[list[int]]" if isinstance(value[0], list) else "list[int]"


# A prompt: text, a list of texts, token ids, or a list of token-id lists (one completion each). The
# form is picked by the first item, not by trying each: pydantic's smart union took 0.69 s for a prompt
# of 700,000 ids, this 0.11 s (the 2-core dev machine, busy), the front-end's event loop held all along;
# and the errors name the form the client meant.
Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[TokenId], Tag("list[int]")] | Annotated[list[list[TokenId]], Tag("list[list[int]]")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type", custom_error_message=(
        "Input should be a text, a list of texts, a list of token ids or a list of token-id lists")),
]
MAX_PROMPTS = 64  # prompts in one /v1/completions request


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields completions and chat share."""

    model: str
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None  # extension
    n: Annotated[int, Field(ge=1, le=2**31 - 1)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension: each choice's token ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name}: not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream = true")
        return self


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (leave it unset or equal to n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: empty")
        if len(self.prompts()) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per completion asked for: a text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True  # extension
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools: not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: not supported")
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs = true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses (the non-streamed bodies; streamed chunks are the same fields, built as dicts) ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (RequestMetrics)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
