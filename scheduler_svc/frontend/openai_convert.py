"""OpenAI request bodies → the GenerateRequests the gRPC API sends (one path into the engine), and
GenerateResponses → OpenAI choices, chunks, logprobs and usage. Protobuf here and in the servers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.frontend.chat import ModelText
from scheduler_svc.frontend.openai_schema import ChatCompletionRequest, CompletionRequest, _Sampling
from scheduler_svc.wire.errors import InvalidRequestError
from scheduler_svc.wire.limits import MAX_PROMPT_CHARS_PER_TOKEN

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_UNSPECIFIED: None,
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


def sampling_pb(
    body: _Sampling, max_tokens: int | None, logprobs: int | None
) -> generation_pb2.SamplingParameters:
    """Unset fields stay unset: the server's defaults (the model's generation_config) apply."""
    msg = generation_pb2.SamplingParameters(n=body.n, ignore_eos=body.ignore_eos, top_k=body.top_k or 0)
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    if body.temperature is not None:
        msg.temperature = body.temperature
    if body.top_p is not None:
        msg.top_p = body.top_p
    if body.stop is not None:
        msg.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        msg.stop_token_ids.extend(body.stop_token_ids)
    if body.seed is not None:
        msg.seed = body.seed
    if logprobs is not None:
        msg.logprobs = logprobs
    return msg


def completion_requests(body: CompletionRequest) -> list[generation_pb2.GenerateRequest]:
    sampling = sampling_pb(body, body.max_tokens, body.logprobs)
    requests = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            requests.append(generation_pb2.GenerateRequest(text=prompt, sampling=sampling))
        else:
            requests.append(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling))
    return requests


def chat_request(
    body: ChatCompletionRequest, text: ModelText, max_context_tokens: int
) -> generation_pb2.GenerateRequest:
    """The chat rendered and tokenized here (the caller runs it off the event loop); without a token
    limit the answer may fill the context (`max_context_tokens`: the model's length, capped by the KV
    cache). Messages of more characters than that many tokens could ever hold are refused before
    rendering, as a text prompt is (a 15 MiB message took 24 s to render and tokenize), and so is a
    chat that renders to no room for an answer, naming `messages` (not the max_tokens it did not send)."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    max_chars = max_context_tokens * MAX_PROMPT_CHARS_PER_TOKEN
    num_chars = sum(len(m["content"]) for m in messages)
    if num_chars > max_chars:
        raise InvalidRequestError(
            "messages", f"{num_chars} characters can never fit the model's {max_context_tokens} tokens "
                        f"(at most {max_chars} characters)")
    ids = text.render_chat(messages, body.add_generation_prompt)
    max_tokens = body.output_limit()
    if max_tokens is None:
        if len(ids) >= max_context_tokens:
            raise InvalidRequestError(
                "messages", f"the chat renders to {len(ids)} tokens, leaving no room for an answer in "
                            f"the model's {max_context_tokens}")
        max_tokens = max_context_tokens - len(ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling_pb(body, max_tokens, logprobs)
    )


@dataclass(slots=True)
class Choice:
    """One output (sample) of one prompt, as it accumulates."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # chat entries, or completion rows
    finish_reason: str | None = None
    completion_tokens: int = 0
    text_offset: int = 0


def _tops(lp: generation_pb2.Logprobs) -> list[list[tuple[int, float]]]:
    tops, start = [], 0
    for count in lp.num_top:
        tops.append(list(zip(lp.top_token_ids[start : start + count], lp.top_logprobs[start : start + count],
                             strict=True)))
        start += count
    return tops


def chat_logprobs(out: generation_pb2.OutputDelta, text: ModelText) -> list[dict[str, Any]]:
    """OpenAI chat logprobs entries of one delta's tokens."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": text.token_label(token_id), "logprob": logprob,
                "bytes": list(text.token_bytes(token_id))}

    tops = _tops(out.logprobs)
    return [
        {**entry(token_id, lp),
         "top_logprobs": [entry(t, tlp) for t, tlp in tops[i]] if i < len(tops) else []}
        for i, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs.token_logprobs, strict=False))
    ]


def completion_logprobs(out: generation_pb2.OutputDelta, text: ModelText, choice: Choice) -> dict[str, Any]:
    """OpenAI completions logprobs (parallel lists) of one delta's tokens; advances the text offset."""
    offsets = []
    for token_id in out.token_ids:  # (in the characters of the text, as the tokens decode)
        offsets.append(choice.text_offset)
        choice.text_offset += len(text.token_text(token_id))
    tops = _tops(out.logprobs)
    return {
        "tokens": [text.token_label(t) for t in out.token_ids],
        "token_logprobs": list(out.logprobs.token_logprobs),
        "top_logprobs": [{text.token_label(t): lp for t, lp in top} for top in tops],
        "text_offset": offsets,
    }


def merge_completion_logprobs(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    return {key: [item for row in rows for item in row[key]] for key in rows[0]}
