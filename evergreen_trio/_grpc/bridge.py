"""The session server's grpclib <-> Trio bridge: the only module of the package that touches asyncio.

(The client side of sessions runs on Trio alone: ``client.py`` over the sans-IO ``client_wire.py``.)
grpclib runs on a trio-asyncio loop. Crossing between Trio and asyncio once per message
costs about 50 us, so nothing here crosses per message: each gRPC stream gets two
long-lived asyncio pumps (reader and writer) that exchange messages with Trio tasks
through a :class:`Handoff`, a same-thread queue whose put and get are plain calls that
wait only for backpressure. Both sides run on the Trio thread, so waking the other side
is a plain ``Event.set`` / ``Future.set_result``.

Rules kept here: no single ``recv_message`` is ever cancelled (that corrupted framing in
a test; a stream that must stop is reset, which ends the pending read with an error);
shutdown steps are shielded; a final status always reaches the peer.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from contextvars import Context
from functools import partial
from typing import Any, Generic, TypeVar

import grpclib.server
import grpclib.utils
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio
import trio_asyncio
from google.protobuf.message import DecodeError, Message
from grpclib.config import Configuration
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.service import Health
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.server import Stream
from h2.errors import ErrorCodes
from sniffio import thread_local as sniffio_library
from trio_asyncio._base import TrioAsyncioExit
from trio_asyncio._handles import AsyncHandle

from evergreen_trio._grpc import streams
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.limits import (
    HEALTH_WATCH_SECONDS,
    MAX_HEALTH_WATCHES,
    OUT_OF_RESOURCES_ERRNOS,
    FrameScanner,
    ResetBudget,
    TransportLimits,
)
from evergreen_trio._grpc.streams import FinalStatus, HandoffClosedError

# On CPython 3.12+ ``asyncio.current_task`` is C code that knows nothing of trio-asyncio's loop;
# trio-asyncio replaces ``asyncio.current_task`` with a version that does, but grpclib took its own
# reference at import time, and if grpclib was imported first that is the original: every grpclib
# call then fails with "no running event loop". Point grpclib at the patched function.
grpclib.utils._current_task = asyncio.current_task

log = logging.getLogger(__name__)

T = TypeVar("T")
Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
ReqIn = TypeVar("ReqIn", bound=Message, contravariant=True)
RepOut = TypeVar("RepOut", bound=Message, covariant=True)


CLOSE_TIMEOUT_SECONDS = 5.0
"""How long a stopping server waits for grpclib to release its connections."""

FEED_BYTES = 8 * 1024
"""The session server hands h2 at most this much input at a time (see ``_GuardedProtocol``)."""

BACKLOG_BYTES = 64 * 1024
"""Input of one connection read and waiting for its turn, past which the session server stops reading it."""

LINGER_BYTES = 4 * 1024 * 1024
"""Unread input dropped before the socket of a connection told to go away closes (see
``_GuardedProtocol._drop_unread``)."""

STREAMS_PER_TURN = 1
"""The session server opens at most this many streams of one connection per turn of its loop (see
``_GuardedProtocol._take_turn``)."""

TURNS_PER_PASS = 8
"""Connections whose waiting input gets a turn (``STREAMS_PER_TURN`` new streams each) per pass through
the session server's queue of ready asyncio callbacks (see ``_GuardedServer.wait_turn``)."""

ACCEPTS_PER_PASS = 8
"""The session server accepts at most this many connections each time its listening socket is ready
(once per Trio scheduling pass; see :func:`_accept_connections`)."""


class Handoff(streams.Handoff[T]):
    """:class:`streams.Handoff` with an asyncio side: ``aio_put``/``aio_get_batch`` for grpclib's pumps.

    Both sides run on the Trio thread, so waking the other side is a plain ``Event.set`` /
    ``Future.set_result``.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._aio_wakeup: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        super()._wake()
        if self._aio_wakeup is not None:
            if not self._aio_wakeup.done():
                self._aio_wakeup.set_result(None)
            self._aio_wakeup = None

    async def _aio_wait(self) -> None:
        if self._aio_wakeup is None:
            self._aio_wakeup = asyncio.get_running_loop().create_future()
        await self._aio_wakeup

    async def aio_put(self, item: T) -> None:
        """asyncio side: queue ``item``, waiting while the queue is full."""
        while self._full():
            await self._aio_wait()
        self.push(item)

    async def aio_get_batch(self, limit: int = 1 << 30) -> list[T]:
        """asyncio side: wait for items, return up to ``limit``; ``[]`` once closed and drained."""
        while self._empty():
            await self._aio_wait()
        return self._take(limit)


class MessageStream(streams.MessageStream[T]):
    """:class:`streams.MessageStream` whose queues have an asyncio side (see :class:`Handoff`)."""

    handoff = Handoff
    inbound: Handoff[Message]
    outbound: Handoff[T]


# ---------------------------------------------------------------------------------------------
# Serving


class _CancelledTimerPurge:
    """Drops cancelled timers from a trio-asyncio loop's heap once they are half of it.

    trio-asyncio keeps a cancelled timer until it is due, and grpclib starts one per request that
    carries a deadline (grpcio clients send one with every call): at 400 sessions/s with 30 s
    deadlines that is 12,000 dead timers, a few MiB. asyncio's own loop purges them the same way.
    """

    MIN_PURGE = 256

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._cancelled = 0

    def __call__(self, handle: asyncio.TimerHandle) -> None:
        self._cancelled += 1
        timers: list[asyncio.TimerHandle] = self._loop._timers
        if self._cancelled > self.MIN_PURGE and 2 * self._cancelled > len(timers):
            timers[:] = [timer for timer in timers if not timer.cancelled()]
            heapq.heapify(timers)
            self._cancelled = 0


READY_BATCH = 64
"""At most this many ready asyncio callbacks run in one Trio scheduling pass (see :func:`_loop_step`)."""


def _no_op() -> None:
    pass


def _call_soon(loop: Any, callback: Callable[..., object], *args: Any, context: Context | None = None) -> Any:
    """trio-asyncio's ``call_soon`` less its ``_check_callback``: asyncio checks the callback only in
    debug mode, and the check (``inspect.iscoroutinefunction``) cost more than queueing it. Every
    future's wakeup comes through here."""
    return loop._queue_handle(asyncio.Handle(callback, args, loop, context=context))


def _call_later(loop: Any, delay: float, callback: Callable[..., object], *args: Any,
                context: Context | None = None) -> asyncio.TimerHandle:
    """trio-asyncio's ``call_later`` less its ``_check_callback`` (see :func:`_call_soon`): grpclib and
    the session server start two or three timers per connection."""
    handle = asyncio.TimerHandle(loop.time() + delay, callback, args, loop, context=context)
    loop._queue_handle(handle)
    return handle


def _stop_loop() -> None:
    raise TrioAsyncioExit("stopping trio-asyncio loop")


class _ReadyQueue:
    """trio-asyncio's queue of ready callbacks (its Trio memory channel, ``_q_send``/``_q_recv``), as a
    deque that the loop task waits on and that an I/O task drains itself (see :func:`_io_task`).

    With the channel, a callback queued while the loop task waited went straight to that task: each
    message read from a socket then cost a scheduling pass and a step of the loop task before the
    stream's asyncio task saw it.
    """

    def __init__(self) -> None:
        self.items: deque[asyncio.Handle] = deque()
        self.held = False  # an I/O task runs a callback and drains what it queues: no need to wake the loop
        self._waiter: trio.lowlevel.Task | None = None

    def send_nowait(self, handle: asyncio.Handle) -> None:
        """Queue ``handle`` (trio-asyncio's ``_queue_handle``, ``call_soon_threadsafe``, signals)."""
        self.items.append(handle)
        if not self.held:
            self.wake()

    def wake(self) -> None:
        if self._waiter is not None:
            task, self._waiter = self._waiter, None
            trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until :meth:`wake` (or the caller's cancel scope)."""
        self._waiter = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


def _run_queued(loop: Any, queue: _ReadyQueue, limit: int, now: float = -math.inf) -> bool:
    """Run the loop's timers due at ``now``, then up to ``limit`` queued callbacks (a queued timer goes
    to the heap); False at one that only the loop task may run (a Trio function's handle, or the
    loop's stop), left first in the queue."""
    items, timers = queue.items, loop._timers
    previous, sniffio_library.name = sniffio_library.name, "asyncio"
    try:
        while timers and timers[0].when() <= now:
            handle = heapq.heappop(timers)
            if not handle._cancelled:
                handle._run()
        for _ in range(limit):
            if not items:
                return True
            handle = items.popleft()
            if isinstance(handle, asyncio.TimerHandle):
                heapq.heappush(timers, handle)
                queue.wake()  # a loop task waiting for a later timer must wait less
            elif isinstance(handle, AsyncHandle):
                items.appendleft(handle)
                return False
            elif not handle._cancelled:
                try:
                    handle._run()
                except TrioAsyncioExit:  # the loop's stop: the loop task must raise it
                    items.appendleft(asyncio.Handle(_stop_loop, (), loop))
                    return False
        return True
    finally:
        sniffio_library.name = previous


async def _loop_step(loop: Any, no_wait: bool = False) -> None:
    """trio-asyncio's loop step on a :class:`_ReadyQueue`: wait for a callback or the next timer, then run
    the due timers and up to ``READY_BATCH`` queued callbacks (trio-asyncio ran one per scheduling pass;
    asyncio's own loop runs every ready callback per iteration). With ``no_wait`` (the loop's final
    drain), one callback, or ``trio.WouldBlock``."""
    queue: _ReadyQueue = loop._q_recv
    timers: list[asyncio.TimerHandle] = loop._timers
    if no_wait:
        if not queue.items:
            raise trio.WouldBlock
        done = _run_queued(loop, queue, 1)
    else:
        # One reading of the clock for both: with two, a timer falling due between them made the wait
        # negative, and the ValueError ended the loop (a server that then ignored SIGTERM, issue 22).
        now = loop.time()
        if queue.items or (timers and timers[0].when() <= now):
            await trio.lowlevel.checkpoint()  # a busy loop still lets other tasks run once per pass
        else:
            with trio.move_on_after(timers[0].when() - now if timers else math.inf):
                await queue.wait()
        done = _run_queued(loop, queue, READY_BATCH, loop.time())
    if done:
        return
    handle = queue.items.popleft()
    if isinstance(handle, AsyncHandle):  # a Trio function called from asyncio, started as trio-asyncio does
        handle._context.run(loop._nursery.start_soon, handle._run, name=handle._callback)
        await handle._started.wait()
    else:
        handle._run()  # the loop's stop: TrioAsyncioExit ends trio-asyncio's main loop


async def _io_task(loop: Any, fd: int, handle: Any, wait_ready: Callable[[int], Any]) -> None:
    """trio-asyncio's task for one reader or writer: it runs the callback when ``fd`` is ready, then,
    if nothing else was queued before it, runs what that queued (a stream's task woken by the data
    just read) itself.

    trio-asyncio instead waited, after every callback, until the loop task had run all the callbacks
    queued so far: per message read, a scheduling pass, a step of the loop task and one of this task.
    Callbacks queued before this one's are left to the loop task (``READY_BATCH`` a pass), in order:
    each ready socket's task draining ``READY_BATCH`` of them made one pass's work grow with the
    sockets ready (50 flooding connections: 3,200 callbacks, 100-130 ms, in one pass).
    """
    queue: _ReadyQueue = loop._q_recv
    with handle._scope:
        try:
            while not handle._cancelled:
                try:
                    await wait_ready(fd)
                except OSError:
                    if handle._cancelled:  # closed after the handle was cancelled, in one step
                        break
                    raise
                if handle._cancelled:
                    break
                backlog = bool(queue.items)  # the loop task's to run, in order, behind the others
                queue.held = True
                try:
                    handle._run()
                    if not backlog:
                        _run_queued(loop, queue, READY_BATCH)
                finally:
                    queue.held = False
                    if queue.items:
                        queue.wake()
        except Exception as exc:
            handle._raise(exc)


@asynccontextmanager
async def _open_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:
    async with trio_asyncio.open_loop() as loop:
        loop._timer_handle_cancelled = _CancelledTimerPurge(loop)
        # Read by the running loop at each step, by _queue_handle and by _add_io_handler (set on the
        # instance: trio-asyncio's own methods stay as they are for any other loop).
        queue, channel = _ReadyQueue(), loop._q_send
        while True:  # what was queued before the swap
            try:
                queue.items.append(loop._q_recv.receive_nowait())
            except trio.WouldBlock:
                break
        loop._q_send = loop._q_recv = queue
        loop._main_loop_one = partial(_loop_step, loop)
        loop._io_task = partial(_io_task, loop)
        loop.call_soon = partial(_call_soon, loop)
        loop.call_later = partial(_call_later, loop)
        channel.send_nowait(asyncio.Handle(_no_op, (), loop))  # wakes the step waiting on the channel
        yield loop


def _bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio disables Nagle only on sockets that say so, and accepted
    # sockets inherit it (with Nagle on, each ext_proc exchange stalled about 40 ms on a delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        # Several worker processes accept on one port; the kernel spreads connections among them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class _GuardedH2Connection(h2.connection.H2Connection):
    """h2's connection, leaving the stream cap to :class:`_GuardedProtocol`.

    h2 enforces SETTINGS_MAX_CONCURRENT_STREAMS as a connection error (TooManyStreamsError, and
    grpclib then dropped the connection with every session on it) where RFC 9113 section 5.1.2
    allows refusing the one stream; and it counts open streams by walking all of them for every
    HEADERS frame, quadratic in a burst (4,000 HEADERS in one write cost 1.3 s of CPU). Here h2
    sees no open stream, and the protocol prunes closed ones once per read.
    """

    @property
    def open_inbound_streams(self) -> int:
        return 0

    def prune(self) -> None:
        """Forget closed streams (h2 does it while counting open ones)."""
        h2.connection.H2Connection.open_inbound_streams.fget(self)  # type: ignore[attr-defined]


def _h2(connection: Connection) -> _GuardedH2Connection:
    h2_conn = connection._connection
    assert isinstance(h2_conn, _GuardedH2Connection)
    return h2_conn


class _GuardedProtocol(H2Protocol):
    """grpclib's HTTP/2 protocol with the session server's transport limits.

    Per connection: streams past ``max_streams_per_connection`` are refused with
    RST_STREAM(REFUSED_STREAM) before any handler task starts; a stream the peer opens and resets
    within one read starts nothing; too many premature resets get GOAWAY(ENHANCE_YOUR_CALM); a
    protocol error gets h2's GOAWAY on the wire (grpclib closed without sending it); a connection
    that is slow with its preface, or idle with no stream, is closed.
    """

    def __init__(
        self, handler: _Handler, config: Configuration, h2_config: Any, limits: TransportLimits, server: _GuardedServer
    ) -> None:
        super().__init__(handler, config, h2_config)
        self.limits = limits
        self.server = server
        self._counted = False  # holds one of the server's max_connections
        self.budget = ResetBudget(limits)
        self._settled = False  # the peer's SETTINGS arrived (its preface is complete)
        self._last_frame = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._frames = FrameScanner()
        self._input = b""  # read and not yet fed to h2 (from offset ``_fed``)
        self._fed = 0
        self.waiting = False  # input waits for a turn (see _GuardedServer.wait_turn)
        self._transport: Any = None  # an asyncio transport, once connected

    def connection_made(self, transport: Any) -> None:
        # grpclib's connection_made, with local settings that advertise the stream cap, all in one
        # SETTINGS frame (grpclib sent the stream window in a second one: a second ACK from every
        # peer to process, 1,000 of them at once when 1,000 connections answer together).
        self._transport = transport
        h2_conn = _GuardedH2Connection(config=self.h2_config)
        h2_conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_streams_per_connection,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: h2_conn.DEFAULT_MAX_HEADER_LIST_SIZE,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size,
            },
        )
        h2_conn.initiate_connection()
        initial = h2_conn.inbound_flow_control_window  # the connection's: SETTINGS do not change it
        if self.config.http2_connection_window_size != initial:
            h2_conn.increment_flow_control_window(self.config.http2_connection_window_size - initial)
        self.connection = Connection(h2_conn, transport, config=self.config)
        self.connection.guard = self  # type: ignore[attr-defined]  # how a stream's handler finds its connection
        self.processor = EventsProcessor(self.handler, self.connection)
        if self.server.open_connections >= self.limits.max_connections:
            self._refuse(h2_conn, transport)
            return
        self.server.connection_admitted()
        self._counted = True
        self.connection.flush()
        self.connection.initialize()
        self._schedule(self.limits.handshake_timeout)

    def _refuse(self, h2_conn: h2.connection.H2Connection, transport: Any) -> None:
        """Past ``max_connections``: our SETTINGS and GOAWAY(ENHANCE_YOUR_CALM, last stream 0), then close
        (the client knows nothing was processed and backs off before it retries)."""
        self.server.connection_refused(self.limits.max_connections)
        why = f"over the limit of {self.limits.max_connections} connections"
        h2_conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, last_stream_id=0, additional_data=why.encode())
        transport.write(h2_conn.data_to_send())
        transport.close()

    def data_received(self, data: bytes) -> None:
        self._last_frame = time.monotonic()
        self._input = self._input[self._fed :] + data if self._fed < len(self._input) else data
        self._fed = 0
        if not self.waiting:
            self._take_turn()
        elif len(self._input) > BACKLOG_BYTES:  # the input waits for its turn; so does the peer
            self._transport.pause_reading()

    def _take_turn(self) -> None:
        """Feed the input read so far in slices (so that a read full of frames, up to 256 KiB, is
        cut short as soon as the connection is told to calm down, and no slice costs much CPU),
        stopping before the stream past ``STREAMS_PER_TURN``: the rest is fed in a later turn,
        behind the work those streams queued on the loop and other connections' turns, with
        reading paused while more than ``BACKLOG_BYTES`` wait (read, so that a GOAWAY sent
        meanwhile is not lost to the reset a close with unread input sends). A read of 100
        HEADERS from each of 50 connections queued the work of 5,000 sessions ahead of every
        other client's next step (seconds of stall)."""
        self.waiting = False
        opened = 0
        while self._fed < len(self._input) and not self.connection.is_closing():
            window = memoryview(self._input)[self._fed : self._fed + FEED_BYTES]
            size, headers = self._frames.cut(window, STREAMS_PER_TURN - opened)
            window.release()
            if size == 0:  # the next frame may open one stream too many for this turn
                if len(self._input) - self._fed > BACKLOG_BYTES:
                    self._transport.pause_reading()
                self.waiting = True
                self.server.wait_turn(self)
                return
            opened += headers
            self._fed += size
            if not self._feed(self._input[self._fed - size : self._fed]):
                break
        if self._fed >= len(self._input):
            self._input, self._fed = b"", 0
            if not self.connection.is_closing():
                self._transport.resume_reading()

    def _feed(self, data: bytes) -> bool:
        """Process one slice of input; False once the connection is closed."""
        try:
            events = self.connection.feed(data)
        except h2.exceptions.ProtocolError as error:
            hint = " (a TLS client on a plaintext port?)" if not self._settled and data[:2] == b"\x16\x03" else ""
            log.info("grpc.protocol_error peer=%s error=%s%s", self._peer(), error, hint)
            self.connection.flush()  # h2 queued a GOAWAY naming the error: send it before closing
            self.processor.close("Protocol error")
            return False
        self.connection.flush()
        _h2(self.connection).prune()
        reset_now = {e.stream_id for e in events if isinstance(e, h2.events.StreamReset) and e.remote_reset}
        for event in events:
            if isinstance(event, h2.events.RequestReceived) and not self._admit(event.stream_id, reset_now):
                if self.budget.exceeded is not None:
                    break  # the GOAWAY below: the rest of this slice is not worth processing
                continue
            if isinstance(event, h2.events.StreamReset) and event.remote_reset:
                stream = self.processor.streams.get(event.stream_id)
                if stream is not None and stream.created is not None:
                    self.budget.reset(time.monotonic() - stream.created)
            elif isinstance(event, h2.events.RemoteSettingsChanged) and not self._settled:
                self._settled = True
                self._idle_timer()
            self.processor.process(event)
        if self.connection.is_closing():  # the peer's GOAWAY closed it while processing
            return False
        if self.budget.exceeded is not None:
            self._go_away(ErrorCodes.ENHANCE_YOUR_CALM, self.budget.exceeded)
            return False
        self.connection.flush()
        return True

    def _admit(self, stream_id: int, reset_now: set[int]) -> bool:
        """Whether a new stream gets a handler; a refused stream is reset unless the peer did."""
        self.budget.opened()
        if stream_id in reset_now:
            self.budget.reset(0.0)  # opened and reset in one read: nothing to start
            return False
        if len(self.processor.streams) < self.limits.max_streams_per_connection:
            return True
        self.budget.refused()
        h2_conn = self.connection._connection
        with suppress(h2.exceptions.StreamClosedError, KeyError):
            h2_conn.reset_stream(stream_id, error_code=ErrorCodes.REFUSED_STREAM)
        return False

    def not_admitted(self) -> None:
        """A stream of this connection was refused by the admission check (bad credentials): such
        refusals count with the stream-cap ones, and past the budget the connection gets GOAWAY."""
        self.budget.refused()
        why = self.budget.exceeded
        if why is not None and not self.connection.is_closing():
            self._go_away(ErrorCodes.ENHANCE_YOUR_CALM, why)

    def _schedule(self, delay: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if delay is None else asyncio.get_running_loop().call_later(delay, self._check_idle)

    def _idle_timer(self) -> None:
        """The preface is complete: the idle deadline applies. The handshake's timer stays when it is
        due first (``_check_idle`` then moves it on): a timer fewer to start per connection."""
        idle = self.limits.idle_timeout
        if idle is None or self._timer is None or self._timer.when() > asyncio.get_running_loop().time() + idle:
            self._schedule(idle)

    def _go_away(self, code: ErrorCodes, why: str) -> None:
        level = logging.INFO if code is ErrorCodes.NO_ERROR else logging.WARNING
        log.log(level, "grpc.goaway peer=%s code=%s reason=%s", self._peer(), code.name, why)
        h2_conn = self.connection._connection
        with suppress(h2.exceptions.ProtocolError):
            h2_conn.close_connection(error_code=code, last_stream_id=h2_conn.highest_inbound_stream_id)
        self.connection.flush()
        self._drop_unread()
        self.processor.close(why)

    def _drop_unread(self) -> None:
        """Read and drop what the peer already sent, up to ``LINGER_BYTES``: closing a socket with
        unread input (reading was paused, or the kernel holds more) sends a reset, and the reset
        can destroy the GOAWAY before the peer reads it."""
        sock = self._transport.get_extra_info("socket")
        if sock is None:
            return
        left = LINGER_BYTES
        with suppress(OSError):  # BlockingIOError: nothing more is waiting
            while left > 0 and (chunk := os.read(sock.fileno(), min(left, 256 * 1024))):
                left -= len(chunk)

    def _check_idle(self) -> None:
        self._timer = None
        if self.connection.is_closing():
            return
        if not self._settled:
            log.info("grpc.handshake_timeout peer=%s", self._peer())
            self.processor.close("no HTTP/2 preface in time")
            return
        idle = self.limits.idle_timeout
        if idle is None:
            return
        quiet = time.monotonic() - self._last_frame
        if not self.processor.streams and quiet >= idle:
            self._go_away(ErrorCodes.NO_ERROR, f"no stream for {idle:g} s")
            return
        self._schedule(max(idle - quiet if not self.processor.streams else idle, 0.01))

    def _peer(self) -> str:
        return str(self.connection.get_peer().addr()) if not self.connection.is_closing() else "?"

    def connection_lost(self, exc: BaseException | None) -> None:
        self._schedule(None)
        self.waiting = False
        self._input, self._fed = b"", 0
        if self._counted:
            self._counted = False
            self.server.connection_closed()
        super().connection_lost(exc)
        assert isinstance(self.handler, _Handler)
        self.server.handler_closed(self.handler)


class _Handler(grpclib.server.Handler):
    """grpclib's per-connection handler, releasing every stream.

    grpclib releases a stream in its request task's ``finally``; a task cancelled before its first
    step (the peer reset the stream at once) never runs it, and the stream, with its buffers, stayed
    in the connection's table until the connection closed: rapid reset grew memory without bound.
    """

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                release_stream()

        super().accept(stream, headers, release_once)
        self._tasks[stream].add_done_callback(lambda _task: release_once())


class BoundedHealth(Health):
    """grpclib's Health, whose Watch streams (each held open by the client, nowhere else counted)
    are capped at ``max_watches`` and end after ``watch_seconds``."""

    def __init__(self, checks: Any, *, max_watches: int = MAX_HEALTH_WATCHES,
                 watch_seconds: float = HEALTH_WATCH_SECONDS) -> None:
        super().__init__(checks)
        self.max_watches = max_watches
        self.watch_seconds = watch_seconds
        self.watches = 0

    async def Watch(self, stream: Stream[Any, Any]) -> None:
        """grpclib's Watch, refused past the cap and ended after ``watch_seconds``."""
        if self.watches >= self.max_watches:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"{self.max_watches} health watches open, the limit")
        self.watches += 1
        # A task and asyncio.wait, not wait_for: wait_for finds its task through asyncio's own
        # current_task, which knows nothing of trio-asyncio's loop on CPython 3.12+.
        watch = asyncio.ensure_future(super().Watch(stream))
        try:
            await asyncio.wait({watch}, timeout=self.watch_seconds)
            if watch.done():
                watch.result()  # its error, if any, ends the stream as grpclib would
        finally:
            self.watches -= 1
            if not watch.done():
                # The stream ends right after: its pending read may be cancelled.
                watch.cancel()
                await asyncio.wait({watch})


class _GuardedServer(grpclib.server.Server):
    """grpclib's server with :class:`_GuardedProtocol` connections."""

    def __init__(self, handlers: Sequence[Any], limits: TransportLimits) -> None:
        config = Configuration(
            _keepalive_time=limits.keepalive_time,
            _keepalive_timeout=limits.keepalive_timeout,
        )
        super().__init__(list(handlers), config=config)
        self._limits = limits
        self.open_connections = 0
        self._refused = 0  # in the current burst: one warning per burst
        self._waiting: deque[_GuardedProtocol] = deque()  # connections whose input waits for a turn
        self._granting = False  # a _grant is queued
        self._closed_handlers: set[grpclib.server.Handler] = set()  # see __gc_collect__

    def connection_admitted(self) -> None:
        self.open_connections += 1
        if self._refused:
            log.info("grpc.accepting_again refused=%d", self._refused)
            self._refused = 0

    def connection_refused(self, cap: int) -> None:
        if not self._refused:
            log.warning("grpc.connection_refused open=%d cap=%d: refusing new connections", self.open_connections, cap)
        self._refused += 1

    def connection_closed(self) -> None:
        self.open_connections -= 1

    def wait_turn(self, protocol: _GuardedProtocol) -> None:
        """Queue ``protocol`` for a turn of its waiting input. Turns are granted ``TURNS_PER_PASS`` at a
        time, once per pass through the loop's ready callbacks, whatever the number of connections
        waiting: with a turn per connection per pass, 50 flooding connections opened 50 streams
        (about 20 ms of work) ahead of each step of every other session."""
        self._waiting.append(protocol)
        self._grant_soon()

    def _grant_soon(self) -> None:
        if not self._granting:
            self._granting = True
            asyncio.get_running_loop().call_soon(self._grant)

    def _grant(self) -> None:
        self._granting = False
        granted = 0
        while self._waiting and granted < TURNS_PER_PASS:
            protocol = self._waiting.popleft()
            if protocol.waiting:  # not closed meanwhile
                granted += 1
                protocol._take_turn()  # which may queue it again, at the back
        if self._waiting:
            self._grant_soon()

    # grpclib drops the handlers of closed connections (and with them each connection's h2 state,
    # about 100 bytes per stream it served) every tenth new connection, by walking all of them: a
    # server that clients keep reconnecting to then held up to ten dead connections, and collecting
    # at every connection made opening 1,000 connections quadratic. Every new connection here
    # collects, walking only the connections closed since (see ``connection_lost``).
    __gc_interval__ = 1

    def handler_closed(self, handler: grpclib.server.Handler) -> None:
        """The connection of ``handler`` closed: drop it at the next collection once its tasks are done."""
        self._closed_handlers.add(handler)

    def __gc_collect__(self) -> None:
        done = {handler for handler in self._closed_handlers if handler.check_closed()}
        self._closed_handlers -= done
        self._handlers -= done

    def _protocol_factory(self) -> H2Protocol:
        self.__gc_step__()
        handler = _Handler(self._mapping, self._codec, self._status_details_codec, self.__dispatch__)
        self._handlers.add(handler)
        return _GuardedProtocol(handler, self._config, self._h2_config, self._limits, self)


async def serve_grpclib(
    servables: Sequence[Any],
    host: str,
    port: int,
    *,
    limits: TransportLimits | None = None,
    tls: ssl.SSLContext | None = None,
    reuse_port: bool = False,
    before_close: Callable[[], Any] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve grpclib ``servables`` on ``host:port`` until cancelled; ``started`` gets the bound port.

    ``limits`` bound each connection (see :class:`TransportLimits`); ``tls`` serves TLS (its
    handshake must end within ``limits.handshake_timeout``). On cancellation, ``before_close`` (a
    Trio async function) runs first, shielded, so open streams can end with a status of their own
    before grpclib cancels what is left. Raises ``OSError`` when the address cannot be bound.
    """
    limits = limits or TransportLimits()
    sock = _bind(host, port, reuse_port=reuse_port)
    bound_port: int = sock.getsockname()[1]
    async with _open_loop():
        server = _GuardedServer(servables, limits)
        await trio_asyncio.aio_as_trio(_start)(server, sock, tls, limits.handshake_timeout)
        log.info("grpc.listening host=%s port=%d tls=%s", host, bound_port, tls is not None)
        try:
            task_status.started(bound_port)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                if before_close is not None:
                    await before_close()
                server.close()
                # grpclib waits for connections the peer keeps open; a stopping server does not.
                with trio.move_on_after(CLOSE_TIMEOUT_SECONDS):
                    await trio_asyncio.aio_as_trio(server.wait_closed)()
                log.info("grpc.closed port=%d", bound_port)


async def _start(server: _GuardedServer, sock: socket.socket, tls: ssl.SSLContext | None, handshake: float) -> None:
    """grpclib's ``Server.start``, TLS (if any) through :class:`_TlsGate`, accepting by :func:`_accept_connections`."""
    loop = asyncio.get_running_loop()
    loop._accept_connection = partial(_accept_connections, loop)  # type: ignore[attr-defined]
    factory: Callable[[], asyncio.BaseProtocol] = server._protocol_factory
    if tls is not None:
        factory = partial(_TlsGate, server._protocol_factory, tls, handshake)
    server._server = await loop.create_server(factory, sock=sock, backlog=LISTEN_BACKLOG)
    server._server_closed_fut = loop.create_future()


def _accept_connections(loop: Any, protocol_factory: Callable[[], asyncio.Protocol], sock: socket.socket,
                        sslcontext: None, server: asyncio.AbstractServer, backlog: int, *timeouts: float) -> None:
    """asyncio's ``_accept_connection`` (run when the listening socket is ready), accepting at most
    ``ACCEPTS_PER_PASS`` connections and setting each up at once (transport, then ``connection_made`` and its
    reader as this I/O task's follow-ups), where asyncio accepted up to 100 and started a task for each.

    Those 100 tasks queued about 500 callbacks (task steps, transport setup, a future each) ahead of
    every other connection's next step, ``READY_BATCH`` a pass: while 1,100 connections were opened
    one after another, each step of a legitimate session waited behind several such passes (probe
    stalls of 200-1,400 ms). What is not accepted now waits in the kernel's queue for the next pass.
    """
    for _ in range(ACCEPTS_PER_PASS):
        try:
            conn, addr = sock.accept()
            conn.setblocking(False)
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as error:
            if error.errno not in OUT_OF_RESOURCES_ERRNOS:
                raise
            # Out of descriptors or memory: as asyncio does, stop accepting for a while (the kernel
            # keeps reporting the listening socket ready, and every pass would fail again).
            log.warning("grpc.accept_failed error=%s: not accepting for %g s", error, ACCEPT_RETRY_SECONDS)
            loop._remove_reader(sock.fileno())
            loop.call_later(ACCEPT_RETRY_SECONDS, loop._start_serving, protocol_factory, sock, sslcontext, server,
                            backlog, *timeouts)
            return
        try:
            loop._make_socket_transport(conn, protocol_factory(), extra={"peername": addr}, server=server)
        except Exception as error:  # the protocol's setup failed: this connection only
            log.error("grpc.accept_failed peer=%s error=%r", _address(addr), error)
            conn.close()


LISTEN_BACKLOG = 128
"""Connections the kernel completes and holds for the session server to accept (``listen``; asyncio set
100). Under a flood of connections the server accepts ``ACCEPTS_PER_PASS`` a pass and the rest wait
here, in order: a client connecting meanwhile waits behind them (1,024 held up to 400 of a 1,100-connection
flood, 140-280 ms of wait). Past it the kernel drops a handshake and the client retries a second later,
which also slows the flood down."""

ACCEPT_RETRY_SECONDS = 1.0
"""How long the session server stops accepting after ``accept`` ran out of descriptors (asyncio's delay)."""


class _TlsGate(asyncio.Protocol):
    """Serves TLS on one accepted connection: a handshake (with a deadline; grpclib leaves asyncio's
    60 s) by ``loop.start_tls``, then grpclib's protocol on the TLS transport.

    asyncio's own TLS server drops a failed handshake without a word; here it is one log line naming
    the peer and why (most often a plaintext client, or a client that does not trust our certificate).
    The gate is the TLS transport's protocol until grpclib's takes over, keeping what arrives in between
    (a client's first HTTP/2 bytes can come with its last handshake message).
    """

    def __init__(self, make_protocol: Callable[[], H2Protocol], tls: ssl.SSLContext, handshake: float) -> None:
        self._make_protocol = make_protocol
        self._tls = tls
        self._handshake = handshake
        self._task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the first bytes are the handshake's: start_tls reads them
        self._task = asyncio.ensure_future(self._upgrade(transport))
        self._task.add_done_callback(_log_task_error)

    def data_received(self, data: bytes) -> None:
        self._early.append(data)

    def eof_received(self) -> bool | None:
        self._closed = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        peer = _address(transport.get_extra_info("peername"))
        try:
            secure = await asyncio.get_running_loop().start_tls(
                transport, self, self._tls, server_side=True, ssl_handshake_timeout=self._handshake
            )
        except (OSError, TimeoutError) as error:  # ssl.SSLError is an OSError
            hint = " (a plaintext client?)" if getattr(error, "reason", None) in _NOT_TLS else ""
            log.info("grpc.tls_handshake_failed peer=%s error=%s%s", peer, str(error) or type(error).__name__, hint)
            transport.close()
            return
        if secure is None or self._closed:  # the peer went away during the handshake
            transport.close()
            return
        protocol = self._make_protocol()
        secure.set_protocol(protocol)
        protocol.connection_made(secure)
        for data in self._early:
            protocol.data_received(data)
        self._early.clear()


_NOT_TLS = frozenset({"HTTP_REQUEST", "WRONG_VERSION_NUMBER", "UNSUPPORTED_PROTOCOL", "RECORD_LAYER_FAILURE",
                      "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG"})


# ---------------------------------------------------------------------------------------------
# Message streams handed to Trio


async def _recv_message(h2_stream: Any, message_type: type[Message], limit: int) -> Message | None:
    """grpclib's ``recv_message``, refusing a message on its 5-byte prefix when it claims more than
    ``limit`` bytes (grpclib reads a whole message into memory first, whatever it claims).

    Raises :class:`RpcAbortError`: RESOURCE_EXHAUSTED (too large), UNIMPLEMENTED (compressed),
    INVALID_ARGUMENT (not a ``message_type``, or the stream ended inside a message).
    """
    try:
        prefix = await h2_stream.recv_data(5)
        if not prefix:
            return None
        length = int.from_bytes(prefix[1:5], "big")
        if prefix[0]:
            raise RpcAbortError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        if length > limit:
            raise RpcAbortError(Status.RESOURCE_EXHAUSTED, f"a message of {length} bytes, over the {limit}-byte limit")
        body = await h2_stream.recv_data(length)
    except AssertionError:  # grpclib's Buffer, when the stream ends inside a message
        raise RpcAbortError(Status.INVALID_ARGUMENT, "the stream ended inside a message") from None
    try:
        return message_type.FromString(body)
    except DecodeError as error:
        raise RpcAbortError(Status.INVALID_ARGUMENT, f"not a {message_type.__name__}: {error}") from None


async def _pump_in(stream: Any, session: MessageStream[Any], message_type: type[Message], limit: int) -> None:
    """Server side: read every message into ``inbound``; never cancelled, it ends when the stream does."""
    inbound = session.inbound
    try:
        while (message := await _recv_message(stream._stream, message_type, limit)) is not None:
            session.received += 1
            session.last_activity = trio.current_time()
            await inbound.aio_put(message)
        inbound.close()
    except RpcAbortError as abort:
        inbound.close(abort)
    except (StreamTerminatedError, ConnectionError) as exc:
        inbound.close(RpcAbortError(Status.UNAVAILABLE, f"stream terminated: {exc}"))
    except HandoffClosedError:
        pass


async def _pump_out(stream: Any, session: MessageStream[Any]) -> None:
    """Send packed batches of ``session.outbound`` until the Trio side finishes the stream."""
    while True:
        batch = await session.outbound.aio_get_batch()
        if not batch:
            return
        session.last_activity = trio.current_time()
        for message in session.pack(batch):
            await stream.send_message(message)


class SessionAcceptor(Generic[Req, T]):
    """Serves one bidirectional method by handing each new stream to a Trio acceptor task.

    ``admit`` (if given) is called with each new stream (its peer and metadata set) before it is
    counted or anything starts for it; raising :class:`RpcAbortError` refuses it at once with that
    status, and the refusal counts against its connection's budget (GOAWAY ENHANCE_YOUR_CALM past
    it). Past ``limits.max_streams`` open streams, or ``limits.max_streams_per_peer`` from one
    remote address, a new one is answered RESOURCE_EXHAUSTED at once (and ``on_limit("max_sessions")``
    or ``on_limit("max_sessions_per_peer")`` is called, for metrics); inbound messages over
    ``limits.max_message_bytes`` end their stream with RESOURCE_EXHAUSTED.
    """

    def __init__(
        self,
        path: str,
        request_type: type[Req],
        reply_type: type[Message],
        pack: Callable[[list[T]], Iterable[Message]],
        *,
        limits: TransportLimits | None = None,
        backlog: int = 1024,
        on_limit: Callable[[str], object] | None = None,
        admit: Callable[[MessageStream[T]], object] | None = None,
    ) -> None:
        self.path = path
        self.request_type = request_type
        self.reply_type = reply_type
        self.limits = limits or TransportLimits()
        self._pack = pack
        self._on_limit = on_limit
        self._admit = admit
        self.accepted: Handoff[MessageStream[T]] = Handoff(backlog)
        self.open_streams = 0
        self._per_peer: dict[str, int] = {}
        self._saturated = False

    def __mapping__(self) -> dict[str, Handler]:
        handler = Handler(self._handle, Cardinality.STREAM_STREAM, self.request_type, self.reply_type)
        return {self.path: handler}

    def _refuse_past_cap(self, stream: Stream[Any, Any], host: str) -> None:
        cap = self.limits.max_streams
        if self.open_streams < cap:
            self._saturated = False
            share = self.limits.max_streams_per_peer
            if self._per_peer.get(host, 0) < share:
                return
            if self._on_limit is not None:
                self._on_limit("max_sessions_per_peer")
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"{host} has {share} sessions open, its share of the server")
        if not self._saturated:  # once per episode: a flood must not flood the log too
            self._saturated = True
            log.warning("grpc.session_cap_reached open=%d peer=%s", self.open_streams, stream.peer.addr())
        if self._on_limit is not None:
            self._on_limit("max_sessions")
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"the server has {cap} sessions open, its limit")

    async def _handle(self, stream: Stream[Any, Any]) -> None:
        addr = stream.peer.addr() if stream.peer else None
        session: MessageStream[T] = MessageStream(self._pack)
        session.peer = _address(addr)
        session.peer_certificate = stream.peer.cert() if stream.peer else None
        session.metadata = {k: v for k, v in (stream.metadata or {}).items() if isinstance(v, str)}
        if self._admit is not None:
            try:
                self._admit(session)
            except RpcAbortError as refused:
                guard = getattr(stream._stream.connection, "guard", None)
                if isinstance(guard, _GuardedProtocol):
                    guard.not_admitted()
                raise GRPCError(refused.status, refused.message) from None
        host = str(addr[0]) if isinstance(addr, tuple) else session.peer
        self._refuse_past_cap(stream, host)
        self.open_streams += 1
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        if stream.deadline is not None:
            session.deadline = trio.current_time() + stream.deadline.time_remaining()
        reader = asyncio.ensure_future(_pump_in(stream, session, self.request_type, self.limits.max_message_bytes))
        try:
            await self.accepted.aio_put(session)
            await _pump_out(stream, session)
            final = session.final or FinalStatus(Status.UNAVAILABLE, "server closed the session")
            if final.status is not Status.OK:
                raise GRPCError(final.status, final.message)
        except (StreamTerminatedError, ConnectionError) as exc:
            session.inbound.close(RpcAbortError(Status.UNAVAILABLE, f"stream terminated: {exc}"))
            session.outbound.close()
        except HandoffClosedError:
            raise GRPCError(Status.UNAVAILABLE, "server is shutting down") from None
        finally:
            self.open_streams -= 1
            self._per_peer[host] -= 1
            if not self._per_peer[host]:
                del self._per_peer[host]
            # A client that went away (reset, dead connection) or a deadline grpclib enforced
            # cancels this handler: the Trio side learns it here, or its receive loop would wait
            # forever with the session's nodes.
            # (No local holds the error: this frame outlives the handler in grpclib's task table,
            # and the error's traceback reaches the Trio session.)
            if session.deadline is not None and trio.current_time() >= session.deadline:
                status, why = Status.DEADLINE_EXCEEDED, "the call's deadline passed"
            else:
                status, why = Status.UNAVAILABLE, "the client went away"
            session.inbound.close(RpcAbortError(status, why))
            session.finish(status, why)
            session._mark_closed()
            # Once the handler ends, grpclib releases the stream (acking unread data) and nothing
            # will complete the reader's read: a pending task left to the GC would be reported
            # into trio-asyncio's loop and take the server down. No one reads this stream again,
            # so cancelling the read cannot corrupt framing.
            reader.add_done_callback(_log_task_error)
            reader.cancel()


def _address(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        return f"{host}:{addr[1]}"
    return str(addr or "")


def _log_task_error(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("grpc.pump_failed error=%r", task.exception())
