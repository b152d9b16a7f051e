from protos.pagedserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenStream(_message.Message):
    __slots__ = ("stream_id", "request", "client", "api")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request: _generation_pb2.GenerateRequest
    client: str
    api: str
    def __init__(self, stream_id: _Optional[int] = ..., request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., client: _Optional[str] = ..., api: _Optional[str] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: OpenStream
    cancel: int
    def __init__(self, open: _Optional[_Union[OpenStream, _Mapping]] = ..., cancel: _Optional[int] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("stream_id", "response", "end", "code", "message")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: _generation_pb2.GenerateResponse
    end: bool
    code: int
    message: str
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[_generation_pb2.GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StreamBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ...) -> None: ...
