"""Transport-independent Trio runtime: serve one connection, fetch one stream.

The server answers ``want_data`` by sending the metadata stream and the body stream
from two concurrent tasks (bodies may overtake metadata; the client reassembles), and
keeps at most ``max_unacked_bodies`` bodies unacknowledged per stream. The client
drives the sans-IO :class:`Reassembler` and pyarrow's reader.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import random
from collections.abc import Sequence
from typing import Generic, TypeVar

import pyarrow as pa
import trio

from evergreen_trio.ipc.arrow import BatchDecoder, OutgoingMessage
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import (
    ConnectionLostError,
    FramingError,
    IpcError,
    LimitExceededError,
    UnknownTicketError,
)
from evergreen_trio.ipc.flatbuf import MessageKind
from evergreen_trio.ipc.framing import (
    UINT32_MAX,
    BodyIn,
    decode_free_data,
    encode_end_of_stream,
    encode_free_data,
    encode_metadata,
    encode_refusal,
)
from evergreen_trio.ipc.reassembly import ReadyMessage, Reassembler
from evergreen_trio.ipc.transports.base import (
    BodyResolver,
    BodySender,
    ClientChannel,
    Completion,
    HostBodies,
    Lookup,
    MetadataIn,
    Role,
    ServeOptions,
    ServerChannel,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_METADATA_BATCH = 256
"""Metadata messages handed to the transport at once (it coalesces them into few sends)."""


class _Pacer:
    """Keeps the metadata and body senders of one stream within ``ahead`` messages of each other.

    A client buffers at most ``max_pending_messages`` messages waiting for their other
    half, so neither stream may run further ahead of the other than half of that.
    """

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.metadata = 0
        self.bodies = 0
        self._moved = trio.Event()

    def blocks_metadata(self, end: int) -> bool:
        return end - self.bodies > self.ahead

    def blocks_body(self, index: int) -> bool:
        return index + 1 - self.metadata > self.ahead

    async def moved(self) -> None:
        await self._moved.wait()

    def advance(self, *, metadata: int | None = None, bodies: int | None = None) -> None:
        if metadata is not None:
            self.metadata = metadata
        if bodies is not None:
            self.bodies = bodies
        self._moved.set()
        self._moved = trio.Event()


async def _send_metadata(channel: ServerChannel, messages: Sequence[OutgoingMessage], pacer: _Pacer | None) -> None:
    count = len(messages)
    batch = min(_METADATA_BATCH, pacer.ahead) if pacer is not None else _METADATA_BATCH
    for start in range(0, count + 1, batch):
        end = min(start + batch, count + 1)
        while pacer is not None and pacer.blocks_metadata(min(end, count)):
            await pacer.moved()
        frames = [encode_metadata(i & UINT32_MAX, messages[i].flatbuffer) for i in range(start, min(end, count))]
        if end > count:
            frames.append(encode_end_of_stream(count & UINT32_MAX))
        await channel.send_metadata(frames)
        if pacer is not None:
            pacer.advance(metadata=end)


async def _send_bodies(
    channel: ServerChannel,
    messages: Sequence[OutgoingMessage],
    bodies: BodySender,
    limits: IpcLimits,
    pacer: _Pacer | None,
) -> None:
    window: collections.deque[Completion] = collections.deque()
    unannounced: collections.deque[int] = collections.deque()

    def announced(upto: int) -> None:
        # The metadata sender paces itself on bodies the client can see, not queued ones.
        while len(unannounced) > bodies.queued:
            unannounced.popleft()
        if pacer is not None:
            pacer.advance(bodies=unannounced[0] if unannounced else upto)

    bodies.prepare(messages, limits.max_unacked_bodies)
    for i, message in enumerate(messages):
        if not message.header.has_body:
            continue
        if pacer is not None and pacer.blocks_body(i):
            await bodies.flush(channel)
            announced(i)
            while pacer.blocks_body(i):
                await pacer.moved()
        if len(window) >= limits.max_unacked_bodies:
            oldest = window.popleft()
            if not oldest.done:
                await bodies.flush(channel)
                announced(i)
            await _acknowledged(oldest, limits.idle_timeout_s)
        window.append(await bodies.post(channel, i & UINT32_MAX, message))
        unannounced.append(i)
        announced(i + 1)
    await bodies.flush(channel)
    announced(len(messages))
    while window:
        await _acknowledged(window.popleft(), limits.idle_timeout_s)


async def _acknowledged(completion: Completion, seconds: float) -> None:
    """Wait for the client to take (or free) a body; a client that does not for ``seconds`` is dropped."""
    with trio.move_on_after(seconds):
        await completion.wait()
        return
    raise ConnectionLostError(f"client took or freed no body for {seconds:g} s (idle_timeout_s)")


async def _send_stream(
    channel: ServerChannel, messages: Sequence[OutgoingMessage], bodies: BodySender, options: ServeOptions
) -> None:
    # Serving one stream of the two, this process cannot pace them against each other.
    pacer = _Pacer(max(1, options.limits.max_pending_messages // 2)) if options.role is Role.BOTH else None
    async with trio.open_nursery() as nursery:
        if options.role is not Role.DATA:
            nursery.start_soon(_send_metadata, channel, messages, pacer)
        if options.role is not Role.METADATA:
            nursery.start_soon(_send_bodies, channel, messages, bodies, options.limits, pacer)
    log.debug("ipc.stream_sent messages=%d role=%s", len(messages), options.role.value)


async def serve_connection(
    channel: ServerChannel, lookup: Lookup, bodies: BodySender, options: ServeOptions, peer: str
) -> None:
    """Serve requests on one connection until the client leaves or a deadline passes; never raises IpcError.

    The first request must arrive within ``first_request_timeout_s`` (plus up to 10%); later, with no stream
    running, the next one within ``idle_timeout_s``. More than ``max_streams_per_connection``
    streams running at once close the connection.
    """
    limits = options.limits
    running = 0
    # Waiting for a request has a deadline only while no stream runs; it moves as streams end. Up
    # to 10% extra on the first, so that a flood of connections does not expire in one burst.
    first_s = limits.first_request_timeout_s * (1 + random.random() / 10)
    idle = trio.CancelScope(deadline=trio.current_time() + first_s)
    why = f"first request in {limits.first_request_timeout_s:g} s"

    async def stream(messages: Sequence[OutgoingMessage]) -> None:
        nonlocal running
        try:
            await _send_stream(channel, messages, bodies, options)
        finally:
            running -= 1
            if not running:
                idle.deadline = trio.current_time() + limits.idle_timeout_s

    try:
        async with trio.open_nursery() as nursery:
            with idle:
                while True:
                    tag, payload = await channel.receive_request()
                    why = f"request and no stream running for {limits.idle_timeout_s:g} s"
                    if tag == options.want_data:
                        if running >= limits.max_streams_per_connection:
                            raise LimitExceededError(
                                f"want_data: expected at most {limits.max_streams_per_connection} streams running "
                                "on one connection (max_streams_per_connection), got one more"
                            )
                        if len(payload) > limits.max_ticket_bytes:
                            raise LimitExceededError(
                                f"want_data: expected a ticket <= {limits.max_ticket_bytes} bytes, got {len(payload)}"
                            )
                        try:
                            messages = lookup(payload)
                        except UnknownTicketError as exc:
                            await channel.send_metadata([encode_refusal(str(exc))])  # the client says why
                            raise
                        log.info("ipc.want_data peer=%s ticket_bytes=%d messages=%d", peer, len(payload),
                                 len(messages))
                        running += 1
                        idle.deadline = math.inf
                        nursery.start_soon(stream, messages)
                    elif tag == options.free_data:
                        bodies.on_free(decode_free_data(payload, limits))
                    else:
                        raise FramingError(
                            f"request tag: expected want_data {options.want_data} or free_data "
                            f"{options.free_data}, got {tag}"
                        )
                    if not running:
                        idle.deadline = trio.current_time() + limits.idle_timeout_s
            log.info("ipc.connection_timeout peer=%s reason=no %s", peer, why)
            nursery.cancel_scope.cancel()
    except* ConnectionLostError:
        log.info("ipc.client_gone peer=%s", peer)
    except* IpcError as group:
        log.warning("ipc.connection_error peer=%s error=%s", peer, group.exceptions[0])
    finally:
        bodies.release_all()


class MergedChannel:
    """A :class:`ClientChannel` over a metadata server and a data server (two processes).

    One pump task per connection hands each message on through an unbuffered Trio
    channel, so neither side reads ahead of the consumer; an error on either side is
    handed on too and raised by :meth:`receive`. Requests (``free_data``) go to the data
    server, which holds the bodies.
    """

    def __init__(self, metadata: ClientChannel, data: ClientChannel) -> None:
        self._metadata = metadata
        self._data = data
        self._send, self._receive = trio.open_memory_channel[MetadataIn | BodyIn | IpcError](0)

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._pump, self._metadata, "metadata")
        nursery.start_soon(self._pump, self._data, "data")

    async def _pump(self, channel: ClientChannel, side: str) -> None:
        try:
            while True:
                await self._send.send(await channel.receive())
        except ConnectionLostError as exc:
            await self._send.send(ConnectionLostError(f"{side} server: {exc}"))
        except IpcError as exc:
            await self._send.send(exc)

    async def send_request(self, tag: int, payload: bytes) -> None:
        await self._data.send_request(tag, payload)

    async def receive(self) -> MetadataIn | BodyIn:
        item = await self._receive.receive()
        if isinstance(item, IpcError):
            raise item
        return item

    def ready(self) -> bool:
        return self._receive.statistics().tasks_waiting_send > 0


class MessagePump(Generic[T]):
    """The client side of one stream: reassembles messages and turns each into items of ``T``.

    Subclasses say what a complete message becomes (``_deliver``); the pump owns the
    receive loop, ordering, the end of the stream and ``free_data``.
    """

    def __init__(
        self,
        channel: ClientChannel,
        *,
        free_data: int | None,
        bodies: BodyResolver | None = None,
        limits: IpcLimits = DEFAULT_LIMITS,
    ) -> None:
        self._channel = channel
        self._free_data = free_data
        self._bodies: BodyResolver = bodies if bodies is not None else HostBodies()
        self._limits = limits
        self._reassembler = Reassembler(limits)
        self._decoder = BatchDecoder(limits)
        self._items: collections.deque[T] = collections.deque()
        self._done = False

    @property
    def schema(self) -> pa.Schema | None:
        return self._decoder.schema

    @property
    def finished(self) -> bool:
        """Whether every message of the stream has arrived (its connection can carry another)."""
        return self._done

    async def wait_schema(self) -> None:
        """Receive until the schema (the stream's first message) is decoded or the stream has ended."""
        while self._decoder.schema is None and not self._done and not self._items:
            await self._step()

    def __aiter__(self) -> MessagePump[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            if self._items:
                return self._items.popleft()
            if self._done:
                # Everything arrived; a server already gone has freed its memory itself.
                with contextlib.suppress(ConnectionLostError):
                    await self.flush_frees()
                raise StopAsyncIteration
            await self._step()

    def _deliver(self, ready: ReadyMessage) -> None:
        """Turn one complete message (in sequence order) into items, appended to ``_items``."""
        raise NotImplementedError

    async def _step(self) -> None:
        for ready in self._reassembler.pop_ready():
            self._deliver(ready)
        if self._reassembler.finished:
            self._done = True
            return
        if self._items:
            return
        try:
            if not self._channel.ready():
                # About to wait for the server: return what was released first, so a
                # server waiting for space is never waiting on us (and frees coalesce).
                await self.flush_frees()
            incoming = await self._channel.receive()
        except ConnectionLostError as exc:
            raise ConnectionLostError(
                f"server went away mid-stream after {self._reassembler.delivered} messages "
                f"(missing {self._reassembler.missing()[:8]}): {exc}"
            ) from None
        if isinstance(incoming, MetadataIn):
            self._reassembler.on_metadata(incoming.data)
        else:
            self._reassembler.on_body(incoming)

    async def flush_frees(self) -> None:
        """Send one coalesced free_data message for every released shared-memory body."""
        if self._free_data is None:
            return
        offsets = self._bodies.take_freed()
        for start in range(0, len(offsets), self._limits.max_free_data_offsets):
            chunk = offsets[start : start + self._limits.max_free_data_offsets]
            await self._channel.send_request(self._free_data, encode_free_data(chunk))


class IpcStream(MessagePump[pa.RecordBatch]):
    """An async iterator of ``pyarrow.RecordBatch`` built by pyarrow's reader on host bodies.

    Batches over shared memory are built on the mapped segment; their memory goes back
    to the server (``free_data``) once pyarrow releases them. Pass ``copy=True`` to
    hold many batches at once (the server keeps at most ``max_unacked_bodies`` of them
    alive per stream and waits for the rest). ``bodies`` is the connection's one resolve
    step (its transport picks it: host buffers as they are by default, or shared memory).
    """

    def __init__(
        self,
        channel: ClientChannel,
        *,
        free_data: int | None,
        bodies: BodyResolver | None = None,
        limits: IpcLimits = DEFAULT_LIMITS,
        copy: bool = False,
    ) -> None:
        super().__init__(channel, free_data=free_data, bodies=bodies, limits=limits)
        self._copy = copy

    async def read_all(self) -> pa.Table:
        """Every remaining batch as one table (shared-memory bodies are copied out)."""
        self._copy = True
        batches = [batch async for batch in self]
        if self._decoder.schema is None:
            raise IpcError("stream: expected a schema, got none")
        return pa.Table.from_batches(batches, schema=self._decoder.schema)

    def _deliver(self, ready: ReadyMessage) -> None:
        batch = self._decoder.feed(ready.flatbuffer, ready.header, self._resolve(ready))
        if batch is not None:
            self._items.append(batch)

    def _resolve(self, ready: ReadyMessage) -> pa.Buffer | None:
        if ready.body is None:
            return None
        # pyarrow's reader keeps dictionaries for the whole stream: copy them out so
        # their shared memory goes back at once instead of pinning the window.
        copy = self._copy or ready.header.kind is MessageKind.DICTIONARY_BATCH
        return self._bodies.resolve(ready.body, ready.header, copy=copy)
