"""gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``) served on the server wire.

Answers come from protobuf's default descriptor pool, where the generated modules register their
files (importing ``evergreen_service_pb2`` here puts the Evergreen service there), as grpclib's
``ServerReflection`` answers: one response per request, ``error_response`` NOT_FOUND for a name
the pool lacks. A lookup is a hash of the name, and an error echoes only a short sanitized
prefix of it, so a hostile name costs its length once. ``grpcurl list`` and ``describe`` work.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache, partial
from types import ModuleType
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.message import Message
from grpclib.const import Status
from grpclib.reflection.v1 import reflection_pb2 as v1
from grpclib.reflection.v1alpha import reflection_pb2 as v1alpha

from evergreen_trio._grpc.server_wire import SyncBidiMethod, _sanitize
from evergreen_trio._proto.evergreen.v2 import evergreen_service_pb2

SERVICE_FILE = evergreen_service_pb2.DESCRIPTOR.name
"""The .proto file that declares ``evergreen.v2.EvergreenService``, as reflection names it."""

REFLECTION_SERVICES = {
    "grpc.reflection.v1.ServerReflection": v1,
    "grpc.reflection.v1alpha.ServerReflection": v1alpha,
}
"""The reflection services served, by name, with their message modules."""

_POOL = descriptor_pool.Default()


@lru_cache(maxsize=256)  # the pool's files: one serialization each, whatever the number of asks
def _serialized(file: FileDescriptor) -> bytes:
    proto = FileDescriptorProto()
    file.CopyToProto(proto)
    return proto.SerializeToString()


def _file_containing(symbol: str) -> FileDescriptor:
    """The file declaring ``symbol``; a method too (grpcurl asks for one), which the pool's
    own lookup does not find. KeyError when there is none."""
    try:
        return _POOL.FindFileContainingSymbol(symbol)
    except KeyError:
        name, _, method = symbol.rpartition(".")
        service = _POOL.FindServiceByName(name)
        if method not in service.methods_by_name:
            raise
        return service.file


class _Answers:
    """One reflection version's answers (``pb2``, its message module)."""

    def __init__(self, pb2: ModuleType, services: Sequence[str]) -> None:
        self._pb2 = pb2
        self._listed = pb2.ServerReflectionResponse(list_services_response=pb2.ListServiceResponse(
            service=[pb2.ServiceResponse(name=name) for name in services]))
        self._invalid = pb2.ServerReflectionResponse(error_response=pb2.ErrorResponse(
            error_code=Status.INVALID_ARGUMENT.value, error_message="invalid argument"))

    def __call__(self, request: Any) -> Message:
        pb2, kind = self._pb2, request.WhichOneof("message_request")
        response: Message
        try:
            if kind == "file_by_filename":
                response = self._file(_POOL.FindFileByName(request.file_by_filename))
            elif kind == "file_containing_symbol":
                response = self._file(_file_containing(request.file_containing_symbol))
            elif kind == "file_containing_extension":
                asked = request.file_containing_extension
                extension = _POOL.FindExtensionByNumber(_POOL.FindMessageTypeByName(asked.containing_type),
                                                        asked.extension_number)
                response = self._file(_POOL.FindFileContainingSymbol(extension.full_name))
            elif kind == "all_extension_numbers_of_type":
                message = _POOL.FindMessageTypeByName(request.all_extension_numbers_of_type)
                response = pb2.ServerReflectionResponse(all_extension_numbers_response=pb2.ExtensionNumberResponse(
                    base_type_name=message.full_name,
                    extension_number=[extension.number for extension in _POOL.FindAllExtensions(message)]))
            else:
                response = self._listed if kind == "list_services" else self._invalid
        except KeyError:
            name = getattr(request, kind)
            if kind == "file_containing_extension":
                name = f"{name.containing_type} {name.extension_number}"
            response = pb2.ServerReflectionResponse(error_response=pb2.ErrorResponse(
                error_code=Status.NOT_FOUND.value, error_message=f"{kind} {_sanitize(name.encode())} not found"))
        return response

    def _file(self, file: FileDescriptor) -> Message:
        response: Message = self._pb2.ServerReflectionResponse(
            file_descriptor_response=self._pb2.FileDescriptorResponse(file_descriptor_proto=[_serialized(file)]))
        return response


class _Reflection:
    """One ServerReflectionInfo stream: a response per request, until the client ends it."""

    __slots__ = ("_answer", "finished")

    def __init__(self, answer: _Answers) -> None:
        self._answer = answer
        self.finished = False

    def on_message(self, request: Any) -> Sequence[Message]:
        return (self._answer(request),)

    def on_end(self) -> Sequence[Message]:
        self.finished = True
        return ()


def reflection_methods(services: Sequence[str]) -> list[SyncBidiMethod[Any, Message]]:
    """``ServerReflectionInfo`` of v1 and v1alpha, for the server wire: they list ``services`` and
    the reflection services, and serve the files of protobuf's default pool."""
    listed = list(dict.fromkeys([*services, *REFLECTION_SERVICES]))
    return [SyncBidiMethod(f"/{name}/ServerReflectionInfo", pb2.ServerReflectionRequest,
                           partial(_Reflection, _Answers(pb2, listed)))
            for name, pb2 in REFLECTION_SERVICES.items()]

