from protos.pagedserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerResponse(_message.Message):
    __slots__ = ("tokenizer_json_zlib",)
    TOKENIZER_JSON_ZLIB_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json_zlib: bytes
    def __init__(self, tokenizer_json_zlib: _Optional[bytes] = ...) -> None: ...

class OpenStream(_message.Message):
    __slots__ = ("stream_id", "request", "client", "api", "make_text")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    MAKE_TEXT_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request: _generation_pb2.GenerateRequest
    client: str
    api: str
    make_text: bool
    def __init__(self, stream_id: _Optional[int] = ..., request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., client: _Optional[str] = ..., api: _Optional[str] = ..., make_text: _Optional[bool] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenStream
    cancel: int
    def __init__(self, open: _Optional[_Union[OpenStream, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("stream_id", "response", "end", "code", "message", "text_by_frontend", "prompt_tail_ids", "accepted")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_BY_FRONTEND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: _generation_pb2.GenerateResponse
    end: bool
    code: int
    message: str
    text_by_frontend: bool
    prompt_tail_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted: bool
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[_generation_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., text_by_frontend: _Optional[bool] = ..., prompt_tail_ids: _Optional[_Iterable[int]] = ..., accepted: _Optional[bool] = ...) -> None: ...

class TokenColumns(_message.Message):
    __slots__ = ("stream_ids", "token_ids", "logprobs", "finish_reasons", "finished", "finished_metrics")
    STREAM_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_METRICS_FIELD_NUMBER: _ClassVar[int]
    stream_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reasons: _containers.RepeatedScalarFieldContainer[int]
    finished: _containers.RepeatedScalarFieldContainer[bool]
    finished_metrics: _containers.RepeatedCompositeFieldContainer[_generation_pb2.RequestMetrics]
    def __init__(self, stream_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reasons: _Optional[_Iterable[int]] = ..., finished: _Optional[_Iterable[bool]] = ..., finished_metrics: _Optional[_Iterable[_Union[_generation_pb2.RequestMetrics, _Mapping]]] = ...) -> None: ...

class StreamBatch(_message.Message):
    __slots__ = ("events", "tokens")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    tokens: TokenColumns
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ..., tokens: _Optional[_Union[TokenColumns, _Mapping]] = ...) -> None: ...
