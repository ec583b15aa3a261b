"""A session is one Trio nursery: its receive loop and its action tasks live and die together.

The DAG core (``evergreen_trio.dag``) decides; this module waits. Each node that someone
waits for gets a Trio event (its data-dependency barrier), set when a new part of that node
arrives, so a consumer streams a flattened input while later parts are still on the way,
without polling. Any failure cancels the session's scope, which aborts the session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from evergreen_trio._grpc.bridge import HandoffClosedError, MessageStream, RpcAbortError
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, ChunkMetadata, NodeFragment, SessionMessage
from evergreen_trio.dag import (
    ActionFailedError,
    FlattenCursor,
    FragmentBuilder,
    LeafBytes,
    LeafEnd,
    LeafStart,
    LimitExceededError,
    Pause,
    ProtocolViolationError,
    SessionAbortedError,
    SessionError,
    SessionGraph,
    SessionLimits,
    StatusCode,
    UnknownActionError,
    UnknownTargetError,
    Wait,
)
from evergreen_trio.errors import leaf_exceptions
from evergreen_trio.metrics import SessionMetrics, abort_reason
from evergreen_trio.nodes import SERVER_ROLE
from evergreen_trio.refs import ExternalRef, RefResolver

log = logging.getLogger(__name__)

PACK_BYTES = 1 << 20
"""Fragments queued together are packed into one SessionMessage up to about this many bytes."""

FLATTEN_STEPS = 1024
"""An input's flattening lets other tasks run after about this much work: events, KiB of inline
bytes, or steps through nodes without an event (a shared node repeated 1000 x 1000 times, or a
4 MiB one 128 times, must not hold the one thread)."""

Outbound = NodeFragment | Action


def pack_messages(items: list[Outbound]) -> Iterable[SessionMessage]:
    """Pack queued items into few messages, keeping their order: a message's actions precede
    its fragments, so an action queued after fragments starts a new message."""
    message = SessionMessage()
    size = 0
    for item in items:
        if isinstance(item, Action):
            if len(message.node_fragments):
                yield message
                message, size = SessionMessage(), 0
            message.actions.append(item)
            continue
        if size >= PACK_BYTES:
            yield message
            message, size = SessionMessage(), 0
        message.node_fragments.append(item)
        size += len(item.chunk_fragment.data) + 32
    if len(message.node_fragments) or len(message.actions):
        yield message


class Barrier:
    """Per-node wakeups. Only nodes someone waits for hold an event."""

    def __init__(self) -> None:
        self._events: dict[str, trio.Event] = {}

    def notify(self, node_id: str) -> None:
        event = self._events.pop(node_id, None)
        if event is not None:
            event.set()

    def notify_all(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def wait(self, node_id: str) -> None:
        event = self._events.get(node_id)
        if event is None:
            event = self._events[node_id] = trio.Event()
        await event.wait()


@dataclass(frozen=True)
class SessionOptions:
    """How a session behaves: its limits, the ref resolvers it offers, the fragment size it writes,
    and where it records metrics (None: nowhere)."""

    limits: SessionLimits = field(default_factory=SessionLimits)
    resolvers: Mapping[str, RefResolver] = field(default_factory=dict)
    fragment_bytes: int = 256 * 1024
    metrics: SessionMetrics | None = None


class Session:
    """State shared by both ends of a session: the graph, the barriers, the outbound stream."""

    default_role = SERVER_ROLE
    """The role of chunks written with ``mimetype=`` only (the client's side overrides it)."""

    def __init__(self, stream: MessageStream[Outbound], options: SessionOptions) -> None:
        self.stream = stream
        self.options = options
        self.graph = SessionGraph(options.limits, ref_schemes=frozenset(options.resolvers))
        self.barrier = Barrier()
        self.error: SessionError | None = None

    # -- receiving ------------------------------------------------------------------------

    async def receive_loop(self, on_actions: Callable[[Sequence[Action]], None]) -> None:
        """Feed every received message into the graph until the peer ends its stream."""
        graph, barrier, resolvers = self.graph, self.barrier, self.options.resolvers
        metrics = self.options.metrics
        while True:
            batch = await self.stream.inbound.get_batch()
            if not batch:
                break
            fragments = nbytes = 0
            for message in batch:
                assert isinstance(message, SessionMessage)
                if message.actions:
                    on_actions(message.actions)
                for fragment in message.node_fragments:
                    if graph.add_fragment(fragment):
                        barrier.notify(fragment.id)
                        ref = fragment.chunk_fragment.ref
                        if ref:
                            resolvers[ref.partition(":")[0].lower()].check(ref)
                if metrics is not None:
                    fragments += len(message.node_fragments)
                    nbytes += sum(fragment.ByteSize() for fragment in message.node_fragments)
            if metrics is not None:
                metrics.received(fragments, nbytes)
            await trio.lowlevel.checkpoint()
        graph.peer_closed = True
        barrier.notify_all()

    def fail(self, error: SessionError) -> None:
        """Record why the session ends and wake every waiter so it can see it."""
        if self.error is None:
            self.error = error
        self.barrier.notify_all()

    async def wait_for(self, node_id: str) -> None:
        if self.error is not None:
            raise self.error
        await self.barrier.wait(node_id)
        if self.error is not None:
            raise self.error

    # -- sending --------------------------------------------------------------------------

    async def emit(self, fragments: Iterable[NodeFragment]) -> None:
        """Record produced fragments in the graph (later actions may read them) and send them."""
        metrics = self.options.metrics
        count = nbytes = 0
        try:
            for fragment in fragments:
                if self.graph.add_fragment(fragment, local=True):
                    self.barrier.notify(fragment.id)
                await self._put(fragment)
                if metrics is not None:
                    count += 1
                    nbytes += fragment.ByteSize()
        finally:
            if metrics is not None and count:
                metrics.sent(count, nbytes)

    async def send_action(self, action: Action) -> None:
        await self._put(action)

    async def _put(self, item: Outbound) -> None:
        try:
            await self.stream.outbound.put(item)
        except HandoffClosedError:
            raise self.error or SessionAbortedError("the session has ended", code=StatusCode.CANCELLED) from None

    def input(self, node_id: str) -> InputStream:
        return InputStream(self, node_id)

    def output(self, node_id: str, *, requested: bool = True) -> OutputNode:
        return OutputNode(self, node_id, requested=requested)


# ----------------------------------------------------------------------------------------
# Reading


class ChunkReader:
    """One flattened chunk (one leaf): its metadata, and its bytes as they arrive."""

    def __init__(self, stream: InputStream, node_id: str, metadata: ChunkMetadata) -> None:
        self._stream = stream
        self.node_id = node_id
        self.metadata = metadata
        self.done = False

    @property
    def mimetype(self) -> str:
        """The chunk's mimetype (from its metadata; empty when it has none)."""
        return self.metadata.mimetype

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream._leaf_bytes(self)

    def parts(self) -> AsyncIterator[bytes | ExternalRef]:
        """The chunk's inline bytes and its refs (with the resolver of each) as they arrive, unresolved."""
        return self._stream._leaf_parts(self)

    async def read(self) -> bytes:
        """The whole chunk, refs resolved. Raises what its resolver raises (RefRejectedError)
        or SessionError when the session aborts.
        """
        return b"".join([piece async for piece in self])


class InputStream:
    """A node's flattened content: chunks in depth-first order, each streamed as it arrives."""

    def __init__(self, session: Session, node_id: str) -> None:
        self._session = session
        self.node_id = node_id
        self._cursor = FlattenCursor(session.graph, node_id)
        self._current: ChunkReader | None = None
        self._work = 0

    async def _next(self) -> LeafStart | LeafBytes | LeafEnd | None:
        while True:
            event = self._cursor.next(FLATTEN_STEPS)
            if isinstance(event, Wait):
                await self._session.wait_for(event.node_id)
                continue
            self._work += 1 + (len(event.part.data) >> 10 if isinstance(event, LeafBytes) else 0)
            if isinstance(event, Pause) or self._work >= FLATTEN_STEPS:
                self._work = 0
                await trio.lowlevel.checkpoint()
            if not isinstance(event, Pause):
                return event

    async def _leaf_parts(self, reader: ChunkReader) -> AsyncIterator[bytes | ExternalRef]:
        while not reader.done and reader is self._current:
            event = await self._next()
            if not isinstance(event, LeafBytes):
                reader.done, self._current = True, None
                return
            part = event.part
            if part.ref is None:
                if part.data:
                    yield part.data
            else:
                yield ExternalRef(part.ref, self._session.options.resolvers[part.ref.partition(":")[0].lower()])

    async def _leaf_bytes(self, reader: ChunkReader) -> AsyncIterator[bytes]:
        async for part in self._leaf_parts(reader):
            if isinstance(part, ExternalRef):
                async for block in part.resolver.open(part.uri):
                    yield block
            else:
                yield part

    def __aiter__(self) -> AsyncIterator[ChunkReader]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[ChunkReader]:
        while True:
            if self._current is not None:
                async for _ in self._current:
                    pass
            event = await self._next()
            if event is None:
                return
            if isinstance(event, LeafStart):
                self._current = ChunkReader(self, event.node_id, event.metadata)
                yield self._current

    async def read_chunks(self) -> list[tuple[ChunkMetadata, bytes]]:
        """Every chunk with its bytes, in flattening order."""
        return [(chunk.metadata, await chunk.read()) async for chunk in self]

    async def read_bytes(self) -> bytes:
        """Every chunk's bytes joined in flattening order, refs resolved (raises as ``ChunkReader.read``)."""
        return b"".join([data for _, data in await self.read_chunks()])

    async def read_text(self, *, mimetype_prefix: str = "text/") -> str:
        """The UTF-8 text of the chunks whose mimetype starts with ``mimetype_prefix``."""
        parts = []
        async for chunk in self:
            data = await chunk.read()
            if chunk.mimetype.startswith(mimetype_prefix):
                parts.append(data.decode("utf-8", errors="replace"))
        return "".join(parts)


# ----------------------------------------------------------------------------------------
# Writing


class OutputNode:
    """A node this side produces: a leaf written in pieces, or an inner node whose children are added.

    An output the peer did not name is not produced: writes to it are dropped.
    """

    def __init__(self, session: Session, node_id: str, *, requested: bool = True) -> None:
        self._session = session
        self.id = node_id
        self.requested = requested
        self._builder = FragmentBuilder(node_id, fragment_bytes=session.options.fragment_bytes)
        self._children = 0

    def _metadata(self, mimetype: str | None, metadata: ChunkMetadata | None) -> ChunkMetadata | None:
        if metadata is None and mimetype is not None:
            metadata = ChunkMetadata(mimetype=mimetype, role=self._session.default_role)
        return metadata

    async def write(
        self,
        data: bytes | str,
        *,
        mimetype: str | None = None,
        metadata: ChunkMetadata | None = None,
        last: bool = False,
    ) -> None:
        """Append bytes (str is UTF-8 encoded, default mimetype text/plain) to this leaf."""
        if isinstance(data, str):
            data, mimetype = data.encode(), mimetype or "text/plain"
        if self.requested:
            await self._session.emit(self._builder.data(data, self._metadata(mimetype, metadata), last=last))

    async def write_ref(self, uri: str, *, mimetype: str | None = None, last: bool = False) -> None:
        """Append a chunk that names ``uri`` instead of carrying bytes (the reader's resolver fetches it)."""
        if self.requested:
            await self._session.emit([self._builder.ref(uri, self._metadata(mimetype, None), last=last)])

    async def add_children(self, child_ids: Sequence[str], *, last: bool = False) -> None:
        """Name existing (or future) nodes as the next children of this inner node."""
        if self.requested:
            await self._session.emit([self._builder.children(child_ids, last=last)])

    async def child(self) -> OutputNode:
        """A new leaf or inner node appended as this node's next child."""
        graph = self._session.graph
        while True:
            self._children += 1
            child_id = f"{self.id}/{self._children}"
            if graph.is_new(child_id):
                break
        if self.requested:
            # Claimed before it is named: a reader of this node that reaches the child before its
            # first fragment must know it is produced here, not awaited from the peer.
            graph.reserve_output(child_id, f"output {self.id!r}", local=True)
        await self.add_children([child_id])
        return OutputNode(self._session, child_id, requested=self.requested)

    async def close(self) -> None:
        """Send the final fragment unless one was already sent."""
        if self.requested:
            fragment = self._builder.close()
            if fragment is not None:
                await self._session.emit([fragment])

    async def __aenter__(self) -> OutputNode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            await self.close()


# ----------------------------------------------------------------------------------------
# Actions


@dataclass
class ActionContext:
    """What an action handler gets: its inputs as streams, its outputs as writers."""

    name: str
    action: Action
    session: Session
    inputs: dict[str, InputStream]
    outputs: dict[str, OutputNode]
    principal: str | None = None
    """Who opened the session, as the server's ``authorize`` named them (``None`` without one)."""

    def input(self, *names: str) -> InputStream:
        """The first of ``names`` the caller gave (aliases, e.g. "prompt", "text")."""
        for name in names:
            if name in self.inputs:
                return self.inputs[name]
        raise ProtocolViolationError(f"action {self.name}: needs input {' or '.join(map(repr, names))}")

    def output(self, *names: str) -> OutputNode:
        """The first of ``names`` the caller asked for, or a writer that drops what it gets."""
        for name in names:
            if name in self.outputs:
                return self.outputs[name]
        return self.session.output(f"<unrequested {names[0]}>", requested=False)


Handler = Callable[[ActionContext], Awaitable[None]]


@dataclass(frozen=True)
class ActionSpec:
    """A registered action: its handler and the input and output names it accepts."""

    name: str
    handler: Handler
    inputs: frozenset[str]
    outputs: frozenset[str]


def describe(action: Action) -> str:
    outputs = ", ".join(f"{p.name}={p.id}" for p in action.outputs)
    return f"action {action.name}" + (f" (outputs {outputs})" if outputs else "")


class ServerSession(Session):
    """The serving end: starts registered actions as they arrive, in the session's nursery."""

    def __init__(
        self,
        stream: MessageStream[Outbound],
        options: SessionOptions,
        actions: Mapping[str, ActionSpec],
        targets: frozenset[str],
        *,
        principal: str | None = None,
    ) -> None:
        super().__init__(stream, options)
        self.principal = principal
        self._actions = actions
        self._targets = targets
        self._running = 0
        self._nursery: trio.Nursery | None = None

    @property
    def running_actions(self) -> int:
        return self._running

    async def run(self) -> None:
        """Serve the session to its end and send the final status (OK, or why it aborted)."""
        status, message = StatusCode.OK, None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.receive_loop(self._start_actions)
        except BaseException as exc:  # the nursery's group, or cancellation from a shutting-down server
            error = _session_error(exc)
            if error is None:
                self.stream.finish(StatusCode.UNAVAILABLE, "the server is shutting down")
                self._record_abort("shutdown")
                raise
            status, message = error.code, error.message
            log.info("session.abort peer=%s code=%s reason=%s", self.stream.peer, status.name, message)
            self._record_abort(abort_reason(error))
            if isinstance(error, LimitExceededError) and self.options.metrics is not None:
                self.options.metrics.limit_hit(error.limit)
        finally:
            self._nursery = None
            self.barrier.notify_all()
        self.stream.finish(status, message)

    def _record_abort(self, reason: str) -> None:
        if self.options.metrics is not None:
            self.options.metrics.aborted(reason)

    def _start_actions(self, actions: Sequence[Action]) -> None:
        assert self._nursery is not None
        for action in actions:
            context, spec = self._accept(action)
            if self._running >= self.options.limits.max_concurrent_actions:
                raise LimitExceededError(f"{describe(action)}: {self._running} actions already running, the limit",
                                    limit="max_concurrent_actions")
            self._running += 1
            self._nursery.start_soon(self._run_action, spec, context, name=f"evergreen.action.{action.name}")

    def _accept(self, action: Action) -> tuple[ActionContext, ActionSpec]:
        where = describe(action)
        spec = self._actions.get(action.name)
        if spec is None:
            offered = ", ".join(sorted(self._actions)) or "none"
            raise UnknownActionError(f"{where}: unknown action (this server offers: {offered})")
        if action.target_spec.id not in self._targets:
            raise UnknownTargetError(f"{where}: unknown target {action.target_spec.id!r}")
        inputs: dict[str, InputStream] = {}
        for param in action.inputs:
            if param.name not in spec.inputs:
                raise ProtocolViolationError(f"{where}: unknown input {param.name!r} (accepts {sorted(spec.inputs)})")
            if not param.id:
                raise ProtocolViolationError(f"{where}: input {param.name!r} names no node")
            if param.name in inputs:
                raise ProtocolViolationError(f"{where}: input {param.name!r} given twice (each name once per action)")
            inputs[param.name] = self.input(param.id)
        outputs: dict[str, OutputNode] = {}
        for param in action.outputs:
            if param.name not in spec.outputs:
                raise ProtocolViolationError(f"{where}: unknown output {param.name!r} (offers {sorted(spec.outputs)})")
            if param.name in outputs:
                raise ProtocolViolationError(f"{where}: output {param.name!r} given twice (each name once per action)")
            self.graph.reserve_output(param.id, where, local=True)
            outputs[param.name] = self.output(param.id)
        return ActionContext(action.name, action, self, inputs, outputs, self.principal), spec

    async def _run_action(self, spec: ActionSpec, context: ActionContext) -> None:
        started = time.perf_counter()
        code = StatusCode.CANCELLED  # unless it ends otherwise: cancelled with its session
        try:
            await spec.handler(context)
            for output in context.outputs.values():
                await output.close()
            code = StatusCode.OK
        except SessionError as error:
            code = error.code
            raise
        except Exception as exc:
            code = StatusCode.INTERNAL
            log.exception("action.failed name=%s", spec.name)
            raise ActionFailedError(f"{describe(context.action)} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running -= 1
            if self.options.metrics is not None:
                self.options.metrics.action_finished(spec.name, code, time.perf_counter() - started)


def _session_error(exc: BaseException) -> SessionError | None:
    """The error that explains a session's end, out of a (nested) exception group."""
    for leaf in leaf_exceptions(exc):
        if isinstance(leaf, SessionError):
            return leaf
        if isinstance(leaf, RpcAbortError):
            return SessionAbortedError(leaf.message, code=StatusCode(leaf.status.value))
    for leaf in leaf_exceptions(exc):
        if isinstance(leaf, Exception):
            return SessionError(f"internal error: {type(leaf).__name__}: {leaf}", code=StatusCode.INTERNAL)
    return None
