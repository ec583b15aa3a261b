from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HttpBody(_message.Message):
    __slots__ = ("content_type", "data", "extensions")
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    content_type: str
    data: bytes
    extensions: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, content_type: _Optional[str] = ..., data: _Optional[bytes] = ..., extensions: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class ChatCompletionsRequest(_message.Message):
    __slots__ = ("endpoint", "http_body")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HTTP_BODY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    http_body: HttpBody
    def __init__(self, endpoint: _Optional[str] = ..., http_body: _Optional[_Union[HttpBody, _Mapping]] = ...) -> None: ...

class RawPredictRequest(_message.Message):
    __slots__ = ("endpoint", "http_body")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HTTP_BODY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    http_body: HttpBody
    def __init__(self, endpoint: _Optional[str] = ..., http_body: _Optional[_Union[HttpBody, _Mapping]] = ...) -> None: ...

class StreamRawPredictRequest(_message.Message):
    __slots__ = ("endpoint", "http_body")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HTTP_BODY_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    http_body: HttpBody
    def __init__(self, endpoint: _Optional[str] = ..., http_body: _Optional[_Union[HttpBody, _Mapping]] = ...) -> None: ...
