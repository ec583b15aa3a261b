"""UCX transport: per-connection workers, tagged metadata, tagged bodies.

Connection set-up (our own, before the protocol starts): the client connects to the
listener's ``host:port`` and sends its worker address under :data:`HELLO_TAG`; the
server creates a fresh worker for that client, connects to the client's worker and
answers with its own address under :data:`ADDRESS_TAG`; the client connects to that
worker. From then on each side has one worker per connection, so tag matching only
ever sees that connection's messages.

The metadata stream travels as tagged messages under :data:`METADATA_TAG` (bits 32-55
set, so it can never match a body tag); bodies use the protocol's body tags.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import trio

from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError, FramingError, LimitExceededError, TransportError
from evergreen_trio.ipc.framing import (
    ADDRESS_TAG,
    BYE_TAG,
    HELLO_TAG,
    METADATA_PREFIX,
    METADATA_TAG,
    RESERVED_MASK,
    BodyIn,
    BodyTag,
    BodyType,
    classify_body,
)
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.transports.base import (
    Completion,
    Connection,
    ConnectionHandler,
    HostBodies,
    MetadataIn,
    RawBodies,
    ServeOptions,
)
from evergreen_trio.ipc.transports.ucx_bridge import (
    FULL_MASK,
    Endpoint,
    ProbeResult,
    Request,
    WorkerBridge,
    accept,
    connect,
    connect_address,
    create_context,
    create_listener,
    open_bridge,
)
from evergreen_trio.ipc.uri import IpcUri

log = logging.getLogger(__name__)

MAX_ADDRESS_BYTES = 1 << 16
RECEIVE_DEPTH = 4
"""Bodies a client receives at once (each in its own pooled buffer)."""
BYE_TIMEOUT_S = 1.0


async def _say_bye(bridge: WorkerBridge, endpoint: Endpoint) -> None:
    """Tell the peer we are closing; best effort, bounded, even while being cancelled."""
    with trio.move_on_after(BYE_TIMEOUT_S, shield=True), contextlib.suppress(ConnectionLostError):
        await bridge.send(endpoint, BYE_TAG, b"\0").wait()


async def _receive_small(bridge: WorkerBridge, tag: int, mask: int, limit: int, what: str) -> tuple[int, bytes]:
    probe = await bridge.probe(tag, mask)
    data = bytearray(probe.length)
    await bridge.receive(probe, data)
    if probe.length > limit:
        raise LimitExceededError(f"{what}: expected <= {limit} bytes, got {probe.length}")
    return int(probe.sender_tag.value), bytes(data)


class UcxServerChannel:
    """:class:`ServerChannel` on a per-connection worker."""

    def __init__(self, bridge: WorkerBridge, endpoint: Endpoint, limits: IpcLimits) -> None:
        self.bridge = bridge
        self.endpoint = endpoint
        self._max_request = max(limits.max_ticket_bytes, 8 * limits.max_free_data_offsets)

    async def receive_request(self) -> tuple[int, bytes]:
        tag, payload = await _receive_small(self.bridge, 0, 0, self._max_request, "request")
        if tag == BYE_TAG:
            raise ConnectionLostError("client closed the connection")
        return tag, payload

    async def send_metadata(self, frames: Sequence[bytes]) -> None:
        await self.send_descriptors([(METADATA_TAG, frame) for frame in frames])

    async def post_body(self, tag: int, body: object) -> Completion:
        return self.bridge.send(self.endpoint, tag, body)

    async def send_descriptors(self, descriptors: Sequence[tuple[int, bytes]]) -> None:
        # Tagged sends on one endpoint match in order: post them all, then wait.
        requests = [self.bridge.send(self.endpoint, tag, payload) for tag, payload in descriptors]
        for request in requests:
            await request.wait()


class _Posted:
    """A message taken off UCX's queue whose receive is posted; ``body`` and ``body_tag`` for bodies."""

    __slots__ = ("body", "body_tag", "nbytes", "request", "tag")

    def __init__(
        self, tag: int, nbytes: int, request: Request, body: object | None = None, body_tag: BodyTag | None = None
    ) -> None:
        self.tag = tag
        self.nbytes = nbytes
        self.request = request
        self.body = body
        self.body_tag = body_tag


class UcxClientChannel:
    """:class:`ClientChannel`: probe, then receive metadata or bodies into pooled buffers.

    Bodies use the rendezvous protocol, which moves data only once the receive is
    posted; so every message already announced is probed and posted at once (at most
    :data:`RECEIVE_DEPTH` bodies), and the transfer of the next bodies overlaps the
    Python work on the current one. Each posted receive has its message already there
    (probe with removal first), so none is ever left waiting for a message. With
    ``device``, raw bodies land in the buffers it allocates (GPU memory) instead.
    """

    def __init__(
        self,
        bridge: WorkerBridge,
        endpoint: Endpoint,
        limits: IpcLimits,
        pool: BufferPool,
        device: Callable[[int], object] | None = None,
    ) -> None:
        self.bridge = bridge
        self.endpoint = endpoint
        self.limits = limits
        self.pool = pool
        self.device = device
        self._posted: collections.deque[_Posted] = collections.deque()
        self._bodies_posted = 0
        self._bye = False

    async def send_request(self, tag: int, payload: bytes) -> None:
        await self.bridge.send(self.endpoint, tag, payload).wait()

    async def receive(self) -> MetadataIn | BodyIn:
        if not self._posted:
            self._post(await self._next_probe())
        while self._bodies_posted < RECEIVE_DEPTH and (probe := self.bridge.try_probe(0, 0)) is not None:
            self._post(probe)
        posted = self._posted.popleft()
        await self.bridge.wait(posted.request, self._server_left)
        if posted.body_tag is not None:
            self._bodies_posted -= 1
            return BodyIn(posted.body_tag, posted.body, posted.nbytes)
        data = bytes(memoryview(posted.request.buffer))  # type: ignore[arg-type]
        if posted.tag == METADATA_TAG:
            return MetadataIn(data)
        if posted.tag == BYE_TAG:
            raise ConnectionLostError("server closed the connection")
        raise FramingError(f"tag {posted.tag:#018x}: expected metadata or a body tag (bits 32-55 zero)")

    def ready(self) -> bool:
        return bool(self._posted)

    async def _next_probe(self) -> ProbeResult:
        if self._bye:
            # The BYE was taken off the queue while waiting; what the server sent before it is queued.
            probe = self.bridge.try_probe(0, 0)
            if probe is None:
                raise ConnectionLostError("server closed the connection")
            return probe
        return await self.bridge.probe(0, 0)

    def _server_left(self) -> bool:
        """Whether the server's BYE has arrived (probed already, or waiting in UCX's queue)."""
        if not self._bye and (probe := self.bridge.try_probe(BYE_TAG, FULL_MASK)) is not None:
            self.bridge.post_receive(probe, bytearray(probe.length))  # drained; reaped at teardown
            self._bye = True
        self._bye = self._bye or any(posted.tag == BYE_TAG for posted in self._posted)
        return self._bye

    def _post(self, probe: ProbeResult) -> None:
        """Post the receive of one probed message (limits checked on its announced length)."""
        tag, nbytes = int(probe.sender_tag.value), int(probe.length)
        if tag == METADATA_TAG or tag & RESERVED_MASK:
            # Take the message off the wire before judging it: nothing stays queued.
            if nbytes > self.limits.max_metadata_bytes + METADATA_PREFIX:
                raise LimitExceededError(f"metadata: expected <= {self.limits.max_metadata_bytes} bytes, got {nbytes}")
            self._posted.append(_Posted(tag, nbytes, self.bridge.post_receive(probe, bytearray(nbytes))))
            return
        body_tag = classify_body(tag, nbytes, self.limits, BodyType.RAW)
        if self.device is not None and nbytes:
            body = self.device(nbytes)
            self._posted.append(_Posted(tag, nbytes, self.bridge.post_receive(probe, body), body, body_tag))
        else:
            buffer, view = self.pool.acquire(nbytes)
            self._posted.append(_Posted(tag, nbytes, self.bridge.post_receive(probe, view), buffer, body_tag))
        self._bodies_posted += 1


async def _serve_one(
    context: object, client_address: bytes, handler: ConnectionHandler, options: ServeOptions, peer: str
) -> None:
    async with open_bridge(context) as bridge:
        try:
            endpoint = connect_address(bridge, client_address)
            await bridge.send(endpoint, ADDRESS_TAG, bridge.address()).wait()
        except TransportError as exc:
            log.info("ucx.handshake_failed peer=%s error=%s", peer, exc)
            return
        try:
            await handler(UcxServerChannel(bridge, endpoint, options.limits), RawBodies(), peer)
        finally:
            await _say_bye(bridge, endpoint)


class UcxTransport:
    """``ucx://host:port``: a listener for the handshake, then one worker per connection."""

    async def serve(
        self,
        uri: IpcUri,
        handler: ConnectionHandler,
        options: ServeOptions,
        task_status: trio.TaskStatus[IpcUri],
    ) -> None:
        """Listen on ``uri.port``; hand every client its own worker."""
        context = create_context()
        async with open_bridge(context) as listen_bridge:
            bootstrap: list[Endpoint] = []

            def on_connect(conn_request: int) -> None:
                endpoint = accept(listener, conn_request)
                bootstrap.append(endpoint)
                listen_bridge.watch(endpoint, on_close=lambda: _drop(endpoint))

            def _drop(endpoint: Endpoint) -> None:
                if endpoint in bootstrap:
                    bootstrap.remove(endpoint)
                listen_bridge.forget(endpoint)

            listener = create_listener(listen_bridge, uri.port, on_connect)
            task_status.started(IpcUri("ucx", options.want_data, host=uri.host, port=int(listener.port)))
            async with trio.open_nursery() as nursery:
                count = 0
                while True:
                    _, address = await _receive_small(listen_bridge, HELLO_TAG, FULL_MASK, MAX_ADDRESS_BYTES, "hello")
                    count += 1
                    nursery.start_soon(_serve_one, context, address, handler, options, f"ucx#{count}")

    @asynccontextmanager
    async def connect(
        self, uri: IpcUri, ticket: bytes | None, limits: IpcLimits, pool: BufferPool
    ) -> AsyncIterator[Connection]:
        async with connect_ucx(uri, limits, pool) as channel:
            if ticket is not None:
                await channel.send_request(uri.want_data, ticket)
            yield Connection(channel, HostBodies())


@asynccontextmanager
async def connect_ucx(
    uri: IpcUri, limits: IpcLimits, pool: BufferPool, device: Callable[[int], object] | None = None
) -> AsyncIterator[UcxClientChannel]:
    """Run the handshake and yield a channel to the server's per-connection worker."""
    context = create_context()
    async with open_bridge(context) as bridge:
        with trio.move_on_after(limits.connect_timeout_s) as timeout:
            hello = connect(bridge, uri.host, uri.port)
            await bridge.send(hello, HELLO_TAG, bridge.address()).wait()
            _, server_address = await _receive_small(bridge, ADDRESS_TAG, FULL_MASK, MAX_ADDRESS_BYTES, "address")
            endpoint = connect_address(bridge, server_address)
        if timeout.cancelled_caught:
            raise TransportError(f"UCX connect {uri.host}:{uri.port}: no answer within {limits.connect_timeout_s}s")
        try:
            yield UcxClientChannel(bridge, endpoint, limits, pool, device)
        finally:
            await _say_bye(bridge, endpoint)
