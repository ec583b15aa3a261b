"""Bidirectional gRPC methods served by plain synchronous per-stream logic.

The picker's ext_proc stream needs no Trio task per message: each message is a synchronous
call made on grpclib's side of the bridge, so a request costs no Trio/asyncio crossing.

The replies to one message go out in one socket write (initial headers, every reply and, once
the processor is finished, the OK trailers): on loopback each write wakes the peer, and a write
costs more than a small reply's encoding, so one write instead of four is most of a request's
cost saved.
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
_OK_TRAILERS = [("grpc-status", "0")]


class StreamProcessor(Protocol[ReqIn, RepOut]):
    """Per-stream synchronous logic of a bidirectional method: messages in, replies out.

    Once ``finished`` is true after a message, its replies are sent with the OK trailers and
    the RPC ends there: nothing more is read and ``on_end`` is not called.
    """

    @property
    def finished(self) -> bool: ...

    def on_message(self, message: ReqIn) -> Sequence[RepOut]: ...

    def on_end(self) -> Sequence[RepOut]: ...


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


def _frame(reply: Message) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    data = reply.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


async def _send(stream: Stream[Any, Any], replies: Iterable[Message], *, end: bool) -> None:
    """Send ``replies`` (and the OK trailers if ``end``) on ``stream``, in one write when possible.

    Frames are queued on the h2 connection and written once. A batch larger than the flow-control
    window, or a connection whose transport asked for a pause, takes grpclib's own path
    (chunked, waiting for window updates and writability).
    """
    h2_stream = stream._stream
    h2 = h2_stream._h2_connection
    frames = [_frame(reply) for reply in replies]
    if h2_stream.id not in h2.streams:
        return  # Envoy reset the stream: nobody left to answer
    connection = h2_stream.connection
    size = sum(len(f) for f in frames)
    if not connection.write_ready.is_set() or size > h2.local_flow_control_window(h2_stream.id):
        for frame in frames:
            if not stream._send_initial_metadata_done:
                await stream.send_initial_metadata()
            await h2_stream.send_data(frame)
        if end:
            await stream.send_trailing_metadata()
        return
    stream_id = h2_stream.id
    if frames and not stream._send_initial_metadata_done:
        h2.send_headers(stream_id, [(":status", "200"), ("content-type", stream._content_type)])
        stream._send_initial_metadata_done = True
    max_frame = h2.max_outbound_frame_size
    for frame in frames:
        for offset in range(0, len(frame), max_frame):
            h2.send_data(stream_id, frame[offset : offset + max_frame])
    if end:
        trailers = _OK_TRAILERS if stream._send_initial_metadata_done else [
            (":status", "200"), ("content-type", stream._content_type), *_OK_TRAILERS]
        h2.send_headers(stream_id, trailers, end_stream=True)
        stream._send_initial_metadata_done = stream._send_trailing_metadata_done = True
    h2_stream._transport.write(h2.data_to_send())


def _sync_bidi_handler(method: SyncBidiMethod[Any, Any]) -> Callable[[Stream[Any, Any]], Any]:
    async def handle(stream: Stream[Any, Any]) -> None:
        processor = method.new_processor()
        try:
            async for message in stream:
                replies = processor.on_message(message)
                if processor.finished:
                    await _send(stream, replies, end=True)
                    return
                if replies:
                    await _send(stream, replies, end=False)
            await _send(stream, processor.on_end(), end=True)
        except RpcAbort as abort:
            raise GRPCError(abort.status, abort.message) from None

    return handle


def sync_bidi_service(*methods: SyncBidiMethod[Any, Any]) -> Any:
    """A grpclib servable whose per-message work is a synchronous call on the asyncio side."""
    return _SyncBidiService(methods)
