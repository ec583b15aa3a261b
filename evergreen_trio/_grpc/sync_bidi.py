"""Bidirectional gRPC methods served by plain synchronous per-stream logic.

The picker's ext_proc stream needs no Trio task per message: each message is a synchronous
call made on grpclib's side of the bridge, so a request costs no Trio/asyncio crossing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import Message
from grpclib.const import Cardinality, Handler
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from evergreen_trio._grpc.bridge import RpcAbort

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
ReqIn = TypeVar("ReqIn", bound=Message, contravariant=True)
RepOut = TypeVar("RepOut", bound=Message, covariant=True)


class StreamProcessor(Protocol[ReqIn, RepOut]):
    """Per-stream synchronous logic of a bidirectional method: messages in, replies out."""

    def on_message(self, message: ReqIn) -> Iterable[RepOut]: ...

    def on_end(self) -> Iterable[RepOut]: ...


@dataclass(frozen=True)
class SyncBidiMethod(Generic[Req, Rep]):
    """A bidirectional-streaming method served by a plain synchronous :class:`StreamProcessor`."""

    path: str
    request_type: type[Req]
    reply_type: type[Rep]
    new_processor: Callable[[], StreamProcessor[Req, Rep]]


class _SyncBidiService:
    def __init__(self, methods: Sequence[SyncBidiMethod[Any, Any]]) -> None:
        self._methods = methods

    def __mapping__(self) -> dict[str, Handler]:
        return {
            m.path: Handler(_sync_bidi_handler(m), Cardinality.STREAM_STREAM, m.request_type, m.reply_type)
            for m in self._methods
        }


def _sync_bidi_handler(method: SyncBidiMethod[Any, Any]) -> Callable[[Stream[Any, Any]], Any]:
    async def handle(stream: Stream[Any, Any]) -> None:
        processor = method.new_processor()
        try:
            async for message in stream:
                for reply in processor.on_message(message):
                    await stream.send_message(reply)
            for reply in processor.on_end():
                await stream.send_message(reply)
        except RpcAbort as abort:
            raise GRPCError(abort.status, abort.message) from None

    return handle


def sync_bidi_service(*methods: SyncBidiMethod[Any, Any]) -> Any:
    """A grpclib servable whose per-message work is a synchronous call on the asyncio side."""
    return _SyncBidiService(methods)
