"""The front-end's side of the token lane (scheduler_svc/server/frontend_link.py): the text and the
counts of the streams whose outputs the scheduler sends as bare tokens.

The scheduler's tokenizer comes over the link once (`FrontendLink.Tokenizer`), so both processes
decode with the same one. A stream is announced by an event with `text_by_frontend` (its request id,
prompt length and the prompt's last tokens); each of its rows then becomes the StreamEvent the
scheduler would have sent for it, made by the same code (OutputText over an
IncrementalDetokenizer, started from the same prompt tokens): the text, completion_tokens,
cumulative_logprob (float32 logprobs summed in double, as the engine does) and the finish reason.
What the client receives does not depend on which process made the text (tests/service/test_frontend.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from tokenizers import Tokenizer

from protos.pagedserve.v1 import frontend_pb2, generation_pb2
from scheduler_svc.engine.detokenizer import Decoder, IncrementalDetokenizer, OutputText, TokenIdsOnly

FINISH_REASON_UNSPECIFIED = generation_pb2.FINISH_REASON_UNSPECIFIED
FLUSHED_REASONS = (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)


class _LaneStream:
    __slots__ = ("text", "request_id", "prompt_tokens", "num_tokens", "cumulative_logprob")

    def __init__(self, text: OutputText, request_id: str, prompt_tokens: int):
        self.text = text
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.num_tokens = 0
        self.cumulative_logprob = 0.0


class TokenLane:
    """The lane streams of one link (stream id -> its text state)."""

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._streams: dict[int, _LaneStream] = {}

    @classmethod
    def from_reply(cls, reply: frontend_pb2.TokenizerResponse) -> TokenLane:
        """The lane of the scheduler's tokenizer (none: every text is empty, as the scheduler's)."""
        if not reply.tokenizer_json_zlib:
            return cls(TokenIdsOnly())
        return cls(Tokenizer.from_str(zlib.decompress(reply.tokenizer_json_zlib).decode()))

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def announce(self, event: frontend_pb2.StreamEvent) -> None:
        """A stream whose text is made here from now on (its announcing event is not for the client)."""
        detokenizer = IncrementalDetokenizer(self._tokenizer, list(event.prompt_tail_ids))
        self._streams[event.stream_id] = _LaneStream(
            OutputText(detokenizer), event.response.request_id, event.response.prompt_tokens
        )

    def forget(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    def complete(self, event: frontend_pb2.StreamEvent) -> None:
        """Another event of a lane stream (an abort, an error, a delta with no token): its outputs get
        this stream's text and counts; the stream is forgotten at its end."""
        stream = self._streams.get(event.stream_id)
        if stream is None:
            return
        if event.HasField("response"):
            if not event.response.request_id:
                event.response.request_id = stream.request_id
            for out in event.response.outputs:  # (no flush for an abort: the engine's abort_delta has none)
                self._fill(stream, out, list(out.token_ids), (), out.finish_reason,
                           flush=out.finish_reason in FLUSHED_REASONS)
        if event.end:
            del self._streams[event.stream_id]

    def rows(self, columns: frontend_pb2.TokenColumns) -> Iterator[tuple[int, frontend_pb2.StreamEvent]]:
        """The StreamEvent of each row, in order (a row of a stream not announced here is skipped)."""
        streams = self._streams
        metrics = iter(columns.finished_metrics)  # one per finished row, in order
        for stream_id, token_id, logprob, reason, finished in zip(
            columns.stream_ids, columns.token_ids, columns.logprobs, columns.finish_reasons, columns.finished,
            strict=True,
        ):
            stream = streams.get(stream_id)
            ended_metrics = next(metrics, None) if finished else None
            if stream is None:
                continue
            event = frontend_pb2.StreamEvent(stream_id=stream_id, end=finished)
            response = event.response
            response.request_id = stream.request_id
            response.prompt_tokens = stream.prompt_tokens
            response.finished = finished
            self._fill(stream, response.outputs.add(), [token_id], (logprob,), reason,
                       flush=reason != FINISH_REASON_UNSPECIFIED)
            if finished:
                if ended_metrics is not None:
                    response.metrics.CopyFrom(ended_metrics)
                del streams[stream_id]
            yield stream_id, event

    @staticmethod
    def _fill(stream: _LaneStream, out: generation_pb2.OutputDelta, token_ids: list[int],
              logprobs: tuple[float, ...], reason: generation_pb2.FinishReason, flush: bool) -> None:
        """`out` as the engine's RequestState.sample_output + output_delta_to_pb make it (index 0);
        `flush`: the output ends here, its held-back text goes out."""
        stream.num_tokens += len(token_ids)
        stream.cumulative_logprob += sum(logprobs)
        text = stream.text.append(token_ids).text if token_ids else ""
        if flush:
            text += stream.text.finish()
        if token_ids and not out.token_ids:
            out.token_ids.extend(token_ids)
        out.text = text
        out.finish_reason = reason
        out.completion_tokens = stream.num_tokens
        out.cumulative_logprob = stream.cumulative_logprob
