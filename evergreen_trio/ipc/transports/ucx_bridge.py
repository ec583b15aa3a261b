"""The UCX <-> Trio bridge: the only module that touches ``ucxx``.

One UCX worker per connection, in blocking progress mode, driven by one Trio task:
it progresses the worker, wakes every waiter through a ``trio.lowlevel.ParkingLot``,
arms the worker and sleeps in ``trio.lowlevel.wait_readable`` on the worker's epoll
file descriptor. A task that posts a request kicks the progress task (cancelling its
sleep) so the request is progressed at once. No asyncio, no busy loop, no thread.

Receives are probe-then-receive-with-handle: nothing is posted before the message is
there, so a cancelled receive never leaves a posted request behind. Every send keeps
its buffer referenced until its request completes (UCX does not), and teardown cancels
and reaps whatever is still in flight.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

UCX_ENVIRONMENT = {
    # UCX logs (its warnings included) to stdout by default, where `ipc serve` prints its URI.
    "UCX_LOG_FILE": "stderr",
    # ucxx sets this on import, after loading libucs, which reads it when loaded: UCX then warns
    # that it is unused and the value has no effect. Set first, UCX reads ucxx's value.
    "UCX_MEMTYPE_CACHE": "n",
    # Endpoints run in peer-failure mode (a dead peer is an error, not an abort). UCX then
    # only picks CMA (single-copy rendezvous: the receiver reads the sender's memory with
    # process_vm_readv) when CMA advertises memory invalidation; without it bodies fall
    # back to tcp. CMA needs no registration, so there is nothing to invalidate.
    "UCX_CMA_MEMORY_INVALIDATE": "y",
}
"""Set (unless already set) before ``ucxx`` is first imported: libucs reads them when it loads."""

if "ucxx" in sys.modules:
    log.warning("ucxx was imported before %s: UCX ignores %s", __name__, ", ".join(UCX_ENVIRONMENT))
for _name, _value in UCX_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)

from evergreen_trio._extras import require_extra

require_extra("ucx", __name__)

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import trio
from ucxx._lib import libucxx as ucx
from ucxx._lib.arr import Array

from evergreen_trio.ipc._nursery import open_quiet_nursery
from evergreen_trio.ipc.errors import ConnectionLostError, TransportError

DEFAULT_TLS = "tcp,self,cma"
"""Transports used when ``UCX_TLS`` is unset: what works on a CPU-only host."""
CUDA_TLS = "cuda_copy,cuda_ipc"
"""Added to the default where an NVIDIA driver is present, for device (GPU) bodies.
Not everywhere: UCX logs a warning for each named transport it lacks."""
FULL_MASK = 0xFFFF_FFFF_FFFF_FFFF
_REAP_ROUNDS = 1000
"""Worker progress rounds spent, at most, finishing a request without waiting (teardown, a peer gone)."""

Endpoint: TypeAlias = Any
ProbeResult: TypeAlias = Any
Context: TypeAlias = Any
Listener: TypeAlias = Any


@functools.cache
def create_context() -> Context:
    """The process's UCX context (tag matching, wakeup); ``UCX_TLS`` picks transports.

    Unset, it is :data:`DEFAULT_TLS`, plus :data:`CUDA_TLS` on a host with a GPU.

    Creating a context costs tens of milliseconds, so it is shared; workers are not.
    """
    default = f"{DEFAULT_TLS},{CUDA_TLS}" if os.path.exists("/dev/nvidiactl") else DEFAULT_TLS
    tls = os.environ.get("UCX_TLS", default)
    try:
        return ucx.UCXContext(config_dict={"TLS": tls}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
    except ucx.UCXError as exc:
        raise TransportError(f"UCX: could not create a context with TLS={tls}: {exc}") from None


def worker_address(address: bytes) -> Any:
    return ucx.UCXAddress.create_from_buffer(address)


class Request:
    """A posted UCX request and the buffer it must keep alive; also a body completion."""

    __slots__ = ("bridge", "buffer", "request")

    def __init__(self, bridge: WorkerBridge, request: Any, buffer: object) -> None:
        self.bridge = bridge
        self.request = request
        self.buffer = buffer

    @property
    def done(self) -> bool:
        return bool(self.request.completed)

    async def wait(self) -> None:
        await self.bridge.wait(self)


class WorkerBridge:
    """One worker, its progress task, its in-flight requests and its endpoints."""

    def __init__(self, context: Context) -> None:
        self.worker = ucx.UCXWorker(context)
        self.worker.init_blocking_progress_mode()
        self._fd = self.worker.epoll_file_descriptor
        self._lot = trio.lowlevel.ParkingLot()
        self._kicked = False
        self._sleep: trio.CancelScope | None = None
        self._inflight: set[Request] = set()
        self._abandoned: list[Request] = []
        self._endpoints: list[Endpoint] = []
        self.failure: str | None = None
        self.wakeups = 0

    @property
    def inflight(self) -> int:
        """Requests posted and not yet completed (0 after teardown)."""
        return len(self._inflight)

    def address(self) -> bytes:
        return bytes(self.worker.address.tobytes())

    def kick(self) -> None:
        """Make the progress task progress now (called after posting a request)."""
        self._kicked = True
        if self._sleep is not None:
            self._sleep.cancel()

    async def progress_forever(self) -> None:
        while True:
            self._kicked = False
            self.worker.progress()
            self._lot.unpark_all()
            await trio.lowlevel.cancel_shielded_checkpoint()
            if self._kicked or not self.worker.arm():
                continue
            with trio.CancelScope() as sleep:
                self._sleep = sleep
                await trio.lowlevel.wait_readable(self._fd)
            self._sleep = None
            self.wakeups += 1

    async def _park(self) -> None:
        if self.failure is not None:
            raise ConnectionLostError(f"UCX peer went away: {self.failure}")
        await self._lot.park()

    def watch(self, endpoint: Endpoint, on_close: Callable[[], None] | None = None) -> Endpoint:
        """Track an endpoint; its failure fails every waiter (or calls ``on_close``)."""
        self._endpoints.append(endpoint)
        endpoint.set_close_callback(self._closed, (endpoint, on_close))
        return endpoint

    def _closed(self, endpoint: Endpoint, on_close: Callable[[], None] | None) -> None:
        if on_close is not None:
            on_close()
            return
        if self.failure is None:
            self.failure = f"endpoint {endpoint.handle:#x} closed or failed"
            log.info("ucx.endpoint_closed handle=%#x", endpoint.handle)
        self._lot.unpark_all()

    def forget(self, endpoint: Endpoint) -> None:
        if endpoint in self._endpoints:
            self._endpoints.remove(endpoint)

    def send(self, endpoint: Endpoint, tag: int, payload: object) -> Request:
        """Post a tagged send; the returned request holds ``payload`` until it completes."""
        if self.failure is not None:
            raise ConnectionLostError(f"UCX peer went away: {self.failure}")
        try:
            request = Request(self, endpoint.tag_send(Array(payload), ucx.UCXXTag(tag)), payload)
        except ucx.UCXError as exc:
            raise ConnectionLostError(f"UCX send of tag {tag:#x} failed: {exc}") from None
        self._inflight.add(request)
        self.kick()
        return request

    async def wait(self, request: Request, peer_left: Callable[[], bool] | None = None) -> None:
        """Wait for a request; raise ConnectionLostError if it failed.

        ``peer_left`` says the peer has gone gracefully (its BYE arrived): a graceful close is no
        endpoint error, and a sender-driven rendezvous (tcp, CUDA staging) never completes once the
        sender's worker stops; so the worker is progressed a bounded number of rounds, and a request
        still pending is a ConnectionLostError.
        """
        self.kick()
        while not request.request.completed:
            if peer_left is not None and peer_left() and not self._settle(request):
                raise ConnectionLostError("UCX peer left with a message it announced still unsent")
            await self._park()
        self._inflight.discard(request)
        try:
            request.request.check_error()
        except ucx.UCXError as exc:
            raise ConnectionLostError(f"UCX request failed: {exc}") from None

    def _settle(self, request: Request) -> bool:
        """Progress the worker (bounded, without blocking) until ``request`` completes; whether it did."""
        for _ in range(_REAP_ROUNDS):
            if request.done:
                return True
            self.worker.progress()
        return request.done

    def try_probe(self, tag: int = 0, mask: int = 0) -> ProbeResult | None:
        """Take a message matching (tag, mask) off the queue if one has arrived."""
        result = self.worker.tag_probe(ucx.UCXXTag(tag), ucx.UCXXTagMask(mask), remove=True)
        return result if result.matched else None

    async def probe(self, tag: int = 0, mask: int = 0) -> ProbeResult:
        """Wait until a message matching (tag, mask) has arrived and take it off the queue."""
        while (result := self.try_probe(tag, mask)) is None:
            await self._park()
        return result

    def post_receive(self, probe: ProbeResult, target: object) -> Request:
        """Start receiving a probed message into ``target`` (a writable buffer of ``probe.length`` bytes)."""
        request = Request(self, self.worker.tag_recv_with_handle(Array(target), probe), target)
        self._inflight.add(request)
        self.kick()
        return request

    async def receive(self, probe: ProbeResult, target: object) -> None:
        """Receive a probed message into ``target`` and wait for it."""
        await self.wait(self.post_receive(probe, target))

    def shutdown(self) -> None:
        """Cancel in-flight requests, let sends flush, close endpoints, reap (bounded, synchronous).

        Cancelling reaches only receives still waiting for a message: a receive posted on a probed
        message, and a send its peer no longer takes, end only when their endpoint closes. Endpoints
        are in peer-failure mode, so ``close`` is UCX's forced close: it fails what is still pending
        on them and drops what is not yet sent, so sends (a BYE) get their rounds of progress first.
        A receive on a probed message whose sender-driven rendezvous stopped ends only with the worker:
        it is kept (with its buffer, which UCX may still write) as long as the worker.
        """
        self._reap()
        if self._inflight:
            self.worker.cancel_inflight_requests(0, 1)
            self._reap()
        for endpoint in self._endpoints:
            endpoint.remove_close_callback()
            if endpoint.alive:
                endpoint.close()
        self._endpoints.clear()
        # A peer that already left (shared memory cannot tell) never answers a close either.
        self._reap()
        if self._inflight:
            log.warning("ucx.unreaped_requests count=%d (released with the worker)", len(self._inflight))
            self._abandoned.extend(self._inflight)
            self._inflight.clear()

    def _reap(self) -> None:
        """Progress the worker (bounded) until it is idle with nothing in flight."""
        for _ in range(_REAP_ROUNDS):
            self._inflight = {r for r in self._inflight if not r.request.completed}
            if not self.worker.progress_once() and not self._inflight:
                break


_OPEN: set[WorkerBridge] = set()


def open_bridges() -> list[WorkerBridge]:
    """Bridges currently open in this process (for leak checks)."""
    return list(_OPEN)


@asynccontextmanager
async def open_bridge(context: Context) -> AsyncIterator[WorkerBridge]:
    """A worker with its progress task running for the duration of the block."""
    bridge = WorkerBridge(context)
    _OPEN.add(bridge)
    # Shielded: a block cancelled from outside still says BYE (a shielded, bounded send) and that
    # send, or one queued behind a rendezvous, needs the worker progressed until the block ends.
    progress = trio.CancelScope(shield=True)

    async def progress_until_closed() -> None:
        with progress:
            await bridge.progress_forever()

    try:
        async with open_quiet_nursery() as nursery:
            nursery.start_soon(progress_until_closed)
            try:
                yield bridge
            finally:
                progress.cancel()
    finally:
        bridge.shutdown()
        _OPEN.discard(bridge)


def create_listener(bridge: WorkerBridge, port: int, on_connect: Callable[[int], None]) -> Listener:
    """A listener on ``bridge``'s worker; ``on_connect`` gets each connection request."""
    try:
        return ucx.UCXListener.create(bridge.worker, port, on_connect)
    except ucx.UCXError as exc:
        raise TransportError(f"UCX: could not listen on port {port}: {exc}") from None


def connect(bridge: WorkerBridge, host: str, port: int) -> Endpoint:
    try:
        return bridge.watch(bridge.worker.create_endpoint_from_hostname(host, port, True))
    except ucx.UCXError as exc:
        raise TransportError(f"UCX: could not connect to {host}:{port}: {exc}") from None


def connect_address(bridge: WorkerBridge, address: bytes) -> Endpoint:
    try:
        return bridge.watch(bridge.worker.create_endpoint_from_worker_address(worker_address(address), True))
    except ucx.UCXError as exc:
        raise TransportError(f"UCX: could not connect to a worker address: {exc}") from None


def accept(listener: Listener, conn_request: int) -> Endpoint:
    return listener.create_endpoint_from_conn_request(conn_request, True)
