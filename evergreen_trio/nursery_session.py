"""A session is one Trio nursery: its receive loop and its action tasks live and die together.

The DAG core (``evergreen_trio.dag``) decides; this module waits. Each node that someone
waits for gets a Trio event (its data-dependency barrier), set when a new part of that node
arrives, so a consumer streams a flattened input while later parts are still on the way,
without polling. Any failure cancels the session's scope, which aborts the session.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import trio
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.message import Message

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.streams import HandoffClosedError, MessageStream
from evergreen_trio._logsafe import peer_text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio.dag import (
    ActionFailedError,
    FlattenCursor,
    FragmentBuilder,
    LeafBytes,
    LeafEnd,
    LeafStart,
    LimitExceededError,
    NotTextError,
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
from evergreen_trio.dag.graph import ATTACH_STEP
from evergreen_trio.errors import ArgumentTypeError, describe_kind, leaf_exceptions
from evergreen_trio.nodes import SERVER_ROLE, Inner, Leaf, NodeLike, NodeRef, RefURI, check_names
from evergreen_trio.refs import ExternalRef, RefResolver
from evergreen_trio.serving.metrics import SessionMetrics, abort_reason

log = logging.getLogger(__name__)

PACK_BYTES = 1 << 20
"""Fragments queued together are packed into one SessionMessage up to about this many bytes."""

FLATTEN_STEPS = 1024
"""An input's flattening lets other tasks run after about this much work: events, KiB of inline
bytes, or steps through nodes without an event (a shared node repeated 1000 x 1000 times, or a
4 MiB one 128 times, must not hold the one thread)."""

STEP_FRAGMENTS = 64
"""A session's receive loop, and a task sending fragments, let other tasks run after this many
fragments (an ECHO of a 1-byte leaf shared 50,000 times emitted ~3,000 fragments per step, 35-85 ms,
and its client received 64 messages of them in one)."""

Outbound = NodeFragment | Action

REASON_LOG_CHARS = 512
"""An abort's reason is logged cut to this many characters (as many as its status message carries)."""

PASS_THROUGH = (trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)
"""What a handler may raise (alone or in a group) that ends more than its action. Anything else
(an Exception, or another BaseException such as asyncio.CancelledError) fails the action: INTERNAL."""


def pack_messages(items: list[Outbound]) -> list[SessionMessage]:
    """Pack queued items into few messages, keeping their order: a message's actions precede
    its fragments, so an action queued after fragments starts a new message."""
    message = SessionMessage()
    messages, size = [message], 0
    for item in items:
        if isinstance(item, Action):
            if len(message.node_fragments):
                message, size = SessionMessage(), 0
                messages.append(message)
            message.actions.append(item)
            continue
        if size >= PACK_BYTES:
            message, size = SessionMessage(), 0
            messages.append(message)
        message.node_fragments.append(item)
        size += len(item.chunk_fragment.data) + 32
    return messages if items else []  # a message is started only for an item it then takes


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

    def event(self, node_id: str) -> trio.Event:
        """The event set at ``node_id``'s next change (``await barrier.event(node_id).wait()``: one
        frame less than a wait method in every wakeup's chain)."""
        event = self._events.get(node_id)
        if event is None:
            event = self._events[node_id] = trio.Event()
        return event

    async def wait(self, node_id: str) -> None:
        """Wait for ``node_id``'s next change."""
        await self.event(node_id).wait()


OCTET_STREAM = "application/octet-stream"
"""The mimetype of bytes written without one."""


@dataclass(frozen=True)
class SessionOptions:
    """How a session behaves: its limits, the ref resolvers it offers, the fragment size it writes,
    where it records metrics (None: nowhere), and whether a failed handler's exception text goes to
    the peer (``error_details``; by default the peer gets the status and an error id the log also has)."""

    limits: SessionLimits = field(default_factory=SessionLimits)
    resolvers: Mapping[str, RefResolver] = field(default_factory=dict)
    fragment_bytes: int = 256 * 1024
    metrics: SessionMetrics | None = None
    error_details: bool = False


@dataclass
class Call:
    """A running action: its outputs by parameter name, each readable as a stream and reusable as a node."""

    action: Action
    outputs: dict[str, Output]

    def __getitem__(self, name: str) -> Output:
        return self.outputs[name]


class Session:
    """State shared by both ends of a session: the graph, the barriers, the outbound stream, the
    actions this side serves (``actions``, run as the peer sends them) and the ones it sends (:meth:`run`)."""

    default_role = SERVER_ROLE
    """The role of chunks written with ``mimetype=`` only (the client's side overrides it)."""
    side = "server"
    """This end, as messages name it."""

    def __init__(self, stream: MessageStream[Outbound], options: SessionOptions) -> None:
        self.stream = stream
        self.options = options
        self.graph = SessionGraph(options.limits, ref_schemes=frozenset(options.resolvers))
        self.barrier = Barrier()
        self.error: SessionError | None = None
        self.actions: dict[str, ActionSpec] = {}
        self.targets: frozenset[str] = frozenset({""})
        self.principal: str | None = None
        self._prefix = f"{random.getrandbits(32):08x}"  # tells the two ends' ids apart; no secret (one session's graph)
        self._ids = itertools.count(1)
        self._private: set[str] = set()
        self._ran: list[str] = []
        self._running = 0
        self._waiting = 0  # reads of the session's nodes waiting for a part to arrive (wait_for)
        self._sent = 0  # items put on the outbound stream
        self._nursery: trio.Nursery | None = None
        self._idle: trio.Event | None = None
        self._received_all = False  # the peer's stream ended, while a nursery runs actions
        self._reading = False  # the receive loop waits for the peer's next message
        self._context: contextvars.Context | None = None  # the receive loop's, while its nursery is open

    @property
    def running_actions(self) -> int:
        """Actions of this side running now (the peer's requests and in-process calls)."""
        return self._running

    @property
    def working(self) -> bool:
        """An action runs that is not waiting for a node to arrive: the session is busy though quiet.
        (Actions that all wait for nodes wait for the peer, whose silence is the session's idleness.)"""
        return self._running > self._waiting

    # -- receiving ------------------------------------------------------------------------

    async def serve(self) -> None:
        """Receive until the peer ends its stream, running the actions it sends as tasks of one nursery.

        Raises the one :class:`~evergreen_trio.SessionError` that ends the session (a transport abort becomes
        :class:`~evergreen_trio.SessionAbortedError`); cancellation passes through.
        """
        inbound = self.stream.inbound
        inbound.consumer = self._take_at_once
        try:
            # The nursery opens with the first action: a session that never gets one (a client's,
            # mostly) ends without leaving a nursery, a scheduling pass at its very end.
            pending = await self.receive_loop(None)
            if pending:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    # Actions started in the transport's step (_take_at_once) see this task's context vars.
                    self._context = contextvars.copy_context()
                    await self.receive_loop(self._start_actions, pending)
                    self._received_all = True
                    self._check_served()
        except BaseException as exc:  # the nursery's group
            error = self._session_error(exc)
            if error is None:
                raise
            raise error from None
        finally:
            inbound.consumer = None  # and the stream no longer holds the session
            self._nursery = self._context = None
            self.barrier.notify_all()

    async def receive_loop(
        self, on_actions: Callable[[Sequence[Action]], None] | None, pending: list[Message] | None = None
    ) -> list[Message] | None:
        """Feed every received message into the graph until the peer ends its stream (then None).

        Without ``on_actions``, it stops at the first message with actions instead, returning it and
        the rest of its batch unread (the ``pending`` of the next call, which starts with them).
        """
        graph, metrics = self.graph, self.options.metrics
        while True:
            if pending:
                batch, pending = pending, None
            else:
                self._reading = True  # a message that arrives meanwhile may be taken at once (_take_at_once)
                try:
                    batch = await self.stream.inbound.get_batch()
                finally:
                    self._reading = False
                if not batch:
                    break
            fragments = nbytes = 0
            for position, message in enumerate(batch):
                assert isinstance(message, SessionMessage)
                if message.actions:
                    if on_actions is None:
                        if metrics is not None and fragments:
                            metrics.received(fragments, nbytes)
                        return batch[position:]
                    on_actions(message.actions)
                for index, fragment in enumerate(message.node_fragments, 1):
                    self._add_received(fragment)
                    if index % STEP_FRAGMENTS == 0 or graph.attaching:
                        await self._attach_in_steps()
                if metrics is not None:
                    fragments += len(message.node_fragments)
                    nbytes += sum(map(NodeFragment.ByteSize, message.node_fragments))
            if metrics is not None:
                metrics.received(fragments, nbytes)
        graph.peer_closed = True
        self.barrier.notify_all()
        return None

    def _add_received(self, fragment: NodeFragment) -> None:
        """Add a fragment from the peer to the graph, wake whoever waits for its node, check its ref."""
        if self.graph.add_fragment(fragment):
            self.barrier.notify(fragment.id)
            resolvers = self.options.resolvers
            ref = fragment.chunk_fragment.ref if resolvers else ""  # without, the graph refused any
            if ref:
                resolvers[ref.partition(":")[0].lower()].check(ref)

    def _take_at_once(self, message: Message) -> bool:
        """The inbound stream's consumer (see :class:`Handoff`): a message that arrives while the receive
        loop waits for one, nothing queued, is fed into the graph (its actions started) in the
        transport's task, not the loop's: a task step and a scheduling pass fewer per message.

        Only what the loop would do with nothing to await (fewer than STEP_FRAGMENTS fragments, none
        with children to attach in steps), and only while the session goes on (no error, no status,
        its nursery not cancelled; actions only once it is open); anything else is queued for the loop.
        An error closes the inbound stream with it, so that the loop raises it as its own.
        """
        if not self._reading or self.error is not None or self.stream.final is not None:
            return False
        assert isinstance(message, SessionMessage)
        fragments, actions, nursery = message.node_fragments, message.actions, self._nursery
        if len(fragments) >= STEP_FRAGMENTS or self.graph.attaching:
            return False
        if nursery is None:
            if actions:  # the loop opens the nursery for the first
                return False
        elif nursery.cancel_scope.cancel_called:
            return False
        for fragment in fragments:
            if len(fragment.child_ids) > ATTACH_STEP:
                return False
        try:
            if actions:
                assert self._context is not None
                self._context.run(self._start_actions, actions)
            for fragment in fragments:
                self._add_received(fragment)
            if self.options.metrics is not None:
                self.options.metrics.received(len(fragments), sum(map(NodeFragment.ByteSize, fragments)))
        except Exception as error:
            self.stream.inbound.close(error)
        return True

    def _check_served(self) -> None:
        """Once the peer's stream has ended and no action of the session runs, the session's outcome is
        settled (unless it is cancelled or failed): :meth:`_served` says so before the nursery closes."""
        if (self._received_all and not self._running and self.error is None and self._nursery is not None
                and not self._nursery.cancel_scope.cancel_called):
            self._served()

    def _served(self) -> None:
        """The session ends without error (on a server: send the OK status now)."""

    async def _attach_in_steps(self) -> None:
        """Let other tasks run, and between runs attach the children a large fragment left waiting."""
        await trio.lowlevel.checkpoint()
        while self.graph.attaching:
            self.graph.attach_more()
            await trio.lowlevel.checkpoint()

    def fail(self, error: SessionError) -> None:
        """Record why the session ends and wake every waiter so it can see it."""
        if self.error is None:
            self.error = error
        self.barrier.notify_all()
        if self._idle is not None:
            self._idle.set()

    async def wait_for(self, node_id: str) -> None:
        if self.error is not None:
            raise self.error
        self._waiting += 1
        try:
            await self.barrier.event(node_id).wait()
        finally:
            self._waiting -= 1
        if self.error is not None:
            raise self.error

    def _session_error(self, exc: BaseException) -> SessionError | None:
        """The error that explains a session's end, out of a (nested) exception group; None for cancellation."""
        for leaf in leaf_exceptions(exc):
            if isinstance(leaf, SessionError):
                return leaf
            if isinstance(leaf, RpcAbortError):
                return SessionAbortedError(leaf.message, code=StatusCode(leaf.status.value))
        for leaf in leaf_exceptions(exc):
            if isinstance(leaf, Exception):
                return SessionError(self._failure_text("internal error", leaf, event="session.failed"),
                                    code=StatusCode.INTERNAL)
        return None

    def _failure_text(self, what: str, exc: BaseException, *, event: str) -> str:
        """``what`` and the exception's text when ``error_details`` allows it, else an error id; either way
        the exception is logged (``event``) with that id."""
        error_id = secrets.token_hex(4)
        # ``what`` quotes the peer's names and ids (an action's output ids): one escaped, bounded token.
        log.error("%s side=%s error_id=%s what=%s", event, self.side, error_id, peer_text(what, REASON_LOG_CHARS),
                  exc_info=exc)
        if self.options.error_details:
            return f"{what}: {type(exc).__name__}: {exc} (error id {error_id})"
        return f"{what} (error id {error_id}: the {self.side}'s log has the details)"

    # -- sending --------------------------------------------------------------------------

    async def emit(self, fragments: Iterable[NodeFragment], *, private: bool = False) -> None:
        """Record produced fragments in the graph (later actions may read them) and send them;
        ``private`` ones (an in-process call's) stay on this side."""
        metrics, graph = self.options.metrics, self.graph
        count = nbytes = 0
        try:
            for fragment in fragments:
                if self._private and not private and fragment.child_ids:
                    self._check_public(fragment.child_ids, f"node {fragment.id!r}")
                if graph.add_fragment(fragment, local=True):
                    self.barrier.notify(fragment.id)
                if graph.attaching:
                    await self._attach_in_steps()
                if private:
                    continue
                await self._put(fragment)
                if metrics is not None:
                    count += 1
                    nbytes += fragment.ByteSize()
        finally:
            if metrics is not None and count:
                metrics.sent(count, nbytes)

    def _check_public(self, node_ids: Iterable[str], where: str) -> None:
        for node_id in node_ids:
            if node_id in self._private:
                raise SessionError(
                    f"{where}: node {node_id!r} was made by ctx.call and stays on this side; "
                    "read it and write its content to send it", code=StatusCode.FAILED_PRECONDITION)

    async def send_action(self, action: Action) -> None:
        await self._put(action)

    async def _put(self, item: Outbound) -> None:
        try:
            await self.stream.outbound.put(item)
        except HandoffClosedError as closed:
            if self.error is None and closed.__cause__ is not None:  # the stream ended so, before our reader saw it
                self.fail(self._session_error(closed.__cause__) or SessionAbortedError("the session has ended",
                                                                                       code=StatusCode.CANCELLED))
            raise self.error or SessionAbortedError("the session has ended", code=StatusCode.CANCELLED) from None
        self._sent += 1
        if self._sent % STEP_FRAGMENTS == 0:  # put waits only when the queue is full
            await trio.lowlevel.checkpoint()

    def new_id(self, hint: str = "n") -> str:
        """A node id unique to this session: ``{hint}-{random prefix}-{counter}``."""
        return f"{hint}-{self._prefix}-{next(self._ids)}"

    async def send(self, node: NodeLike) -> NodeRef:
        """Send a node (and its children, parents first); return a reference to reuse it."""
        if not isinstance(node, Leaf | Inner | NodeRef):
            what = "text(), blob(), ref(), inner() or a NodeRef"
            raise ArgumentTypeError(f"send: expected a node ({what}), got {describe_kind(node)}")
        return await self._send(node, node.id or self.new_id(), private=False)

    async def _send(self, node: NodeLike, node_id: str, *, private: bool) -> NodeRef:
        if isinstance(node, NodeRef):
            return node
        builder = FragmentBuilder(node_id, fragment_bytes=self.options.fragment_bytes)
        if private:
            self._private.add(node_id)
        if isinstance(node, Leaf):
            metadata = ChunkMetadata(mimetype=node.mimetype, role=node.role or self.default_role)
            last = len(node.parts) - 1
            for index, part in enumerate(node.parts):
                meta = metadata if index == 0 else None
                if isinstance(part, RefURI):
                    await self.emit([builder.ref(part.uri, meta, last=index == last)], private=private)
                else:
                    await self.emit(builder.data(part, meta, last=index == last), private=private)
            if not node.parts:
                await self.emit(builder.data(b"", metadata, last=True), private=private)
            return NodeRef(node_id)
        assert isinstance(node, Inner)
        # One pass over the children (an Inner may name 100,000 of them), new nodes sent after.
        ids: list[str] = []
        new: list[tuple[NodeLike, str]] = []
        for child in node.children:
            if isinstance(child, NodeRef):
                ids.append(child.id)
            else:
                ids.append(child.id or self.new_id())
                new.append((child, ids[-1]))
        await self.emit([builder.children(ids, last=True)], private=private)
        for child, child_id in new:
            await self._send(child, child_id, private=private)
        return NodeRef(node_id)

    def open_leaf(self, *, id: str | None = None) -> OutputNode:
        """A leaf to stream into with ``write`` (and ``close``); ``NodeRef(leaf.id)`` names it in inputs."""
        node_id = id or self.new_id("leaf")
        # Claimed now, so that a NodeRef to it is known to this session before its first write.
        self.graph.reserve_output(node_id, "open_leaf", local=True)
        return self.output(node_id)

    def _new_action(
        self,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        configs: Iterable[AnyProto],
        target: str,
    ) -> tuple[Action, dict[str, Leaf | Inner]]:
        """The Action message ``run`` and ``ctx.call`` build, and the new input nodes by id.

        Raises :class:`ArgumentTypeError` for an input that is not a node (an ``open_leaf()`` writer
        included), outputs that are not names, and a name, id, target or config of the wrong type;
        :class:`UnknownNodeError` for a ``NodeRef`` to no node of this session.
        """
        if not isinstance(name, str) or not isinstance(target, str):
            what, value = ("the action name", name) if not isinstance(name, str) else ("target", target)
            raise ArgumentTypeError(f"run({name!r}): {what} must be a str, got {describe_kind(value)}")
        # A list or a tuple first: the ABC checks cost an ECHO round trip four calls.
        if type(outputs) is list or type(outputs) is tuple or (
                isinstance(outputs, Sequence) and not isinstance(outputs, str)):
            named = {output: self.new_id(output) for output in outputs}
        elif isinstance(outputs, Mapping):
            named = dict(outputs)
        else:
            raise ArgumentTypeError(f"run({name!r}): outputs must be a list of output names or a mapping of "
                                    f"name to node id, got {describe_kind(outputs)}")
        for key, node_id in named.items():
            if not isinstance(key, str) or not isinstance(node_id, str):
                raise ArgumentTypeError(_not_str(name, "output", key, node_id))
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise ArgumentTypeError(f"run({name!r}): inputs must be a mapping of input name to node, "
                                    f"got {describe_kind(inputs)}")
        resolved = [(key, self._input(name, key, value)) for key, value in inputs.items()]
        params, new = [], {}
        try:
            for key, node in resolved:
                if isinstance(node, NodeRef):
                    node_id = node.id
                else:
                    node_id = node.id or self.new_id(key)
                    new[node_id] = node
                if not isinstance(key, str):  # node ids: checked as the nodes were built
                    raise ArgumentTypeError(_not_str(name, "input", key, node_id))
                params.append(NamedParameter(name=key, id=node_id))
            config_list = list(configs)
            action = Action(name=name, inputs=params, configs=config_list,
                            outputs=[NamedParameter(name=k, id=v) for k, v in named.items()])
            action.target_spec.id = target
        except UnicodeEncodeError:  # a lone surrogate: protobuf's error names no argument
            check_names(f"run({name!r})", _run_names(name, target, named, [key for key, _ in resolved]))
            raise ArgumentTypeError(f"run({name!r}): a name or node id cannot be encoded as UTF-8") from None
        except ArgumentTypeError:  # an input name's, raised above: it names its argument
            raise
        except TypeError:  # protobuf's own words name no argument; the rest were checked above
            raise ArgumentTypeError(f"run({name!r}): configs must be an iterable of google.protobuf.Any, "
                                    f"got {describe_kind(configs)}") from None
        return action, new

    def _input(self, action: str, key: str, value: object) -> NodeLike:
        if isinstance(value, Output):
            return value.ref
        if isinstance(value, NodeRef):
            if self.graph.is_new(value.id):
                raise UnknownNodeError(f"run({action!r}): input {key!r} is NodeRef({value.id!r}), a node this session "
                                       "has neither sent nor received nor expects")
            return value
        if isinstance(value, Leaf | Inner):
            return value
        hint = ""
        if isinstance(value, OutputNode):
            hint = f"; for an open_leaf(), pass NodeRef(leaf.id) (here {value.id!r})"
        raise ArgumentTypeError(f"run({action!r}): input {key!r} must be a node (text(), blob(), ref(), inner()), "
                                f"a NodeRef or a call's output, got {describe_kind(value)}{hint}")

    async def run(
        self,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        *,
        configs: Iterable[AnyProto] = (),
        target: str = "",
    ) -> Call:
        """Ask the peer to run action ``name``: the action goes out first, then its new input nodes
        (pipelining). ``inputs`` are new nodes (``text()``, ``inner()``, ...) or NodeRefs of nodes in
        the session; ``outputs`` names the outputs wanted (ids chosen here), or maps them to ids."""
        action, new = self._new_action(name, inputs, outputs, configs, target)
        if self.graph.peer_closed and action.outputs:
            peer = "client" if self.side == "server" else "server"
            raise SessionError(f"{describe(action)}: the {peer} ended its side of the stream, so it can send "
                               "no outputs", code=StatusCode.FAILED_PRECONDITION)
        if self._private:
            self._check_public((p.id for p in action.inputs if p.id not in new), describe(action))
        where = _Described(action)
        for param in action.outputs:
            self.graph.reserve_output(param.id, where, local=False)
            self._ran.append(param.id)
        await self.send_action(action)
        for node_id, node in new.items():
            await self._send(node, node_id, private=False)
        return Call(action, {p.name: Output(self, p.id) for p in action.outputs})

    async def _call(
        self,
        caller: ActionContext,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        configs: Iterable[AnyProto],
        target: str,
    ) -> Call:
        """Run this side's action ``name`` in-process, as a task of the session; its nodes stay here."""
        if self._nursery is None:
            raise RuntimeError(f"action {caller.name}: ctx.call needs the session to be running")
        action, new = self._new_action(name, inputs, outputs, configs, target)
        context, spec = self._accept(action, private=True)
        context.principal = caller.principal
        for node_id, node in new.items():
            await self._send(node, node_id, private=True)
        self._start(spec, context, self._nursery)
        return Call(action, {p.name: Output(self, p.id) for p in action.outputs})

    def input(self, node_id: str, *, public: bool = False) -> InputStream:
        return InputStream(self, node_id, public=public)

    def output(self, node_id: str, *, requested: bool = True, private: bool = False) -> OutputNode:
        return OutputNode(self, node_id, requested=requested, private=private)

    # -- running actions ------------------------------------------------------------------

    def _start_actions(self, actions: Sequence[Action]) -> None:
        assert self._nursery is not None
        for action in actions:
            context, spec = self._accept(action)
            self._start(spec, context, self._nursery)

    def _start(self, spec: ActionSpec, context: ActionContext, nursery: trio.Nursery) -> None:
        if self._running >= self.options.limits.max_concurrent_actions:
            raise LimitExceededError(f"{describe(context.action)}: {self._running} actions already running, the limit",
                                     limit="max_concurrent_actions")
        self._running += 1
        nursery.start_soon(self._run_action, spec, context, name=f"evergreen.action.{spec.name}")

    def _accept(self, action: Action, *, private: bool = False) -> tuple[ActionContext, ActionSpec]:
        where = _Described(action)
        spec = self.actions.get(action.name)
        if spec is None:
            offered = ", ".join(sorted(self.actions)) or "none"
            raise UnknownActionError(f"{where}: unknown action (this {self.side} offers: {offered})")
        if action.target_spec.id not in self.targets:
            raise UnknownTargetError(f"{where}: unknown target {action.target_spec.id!r}")
        inputs: dict[str, InputStream] = {}
        for param in action.inputs:
            if param.name not in spec.inputs:
                raise ProtocolViolationError(f"{where}: unknown input {param.name!r} (accepts {sorted(spec.inputs)})")
            if not param.id:
                raise ProtocolViolationError(f"{where}: input {param.name!r} names no node")
            if param.name in inputs:
                raise ProtocolViolationError(f"{where}: input {param.name!r} given twice (each name once per action)")
            inputs[param.name] = self.input(param.id, public=not private)
        outputs: dict[str, OutputNode] = {}
        for param in action.outputs:
            if param.name not in spec.outputs:
                raise ProtocolViolationError(f"{where}: unknown output {param.name!r} (offers {sorted(spec.outputs)})")
            if param.name in outputs:
                raise ProtocolViolationError(f"{where}: output {param.name!r} given twice (each name once per action)")
            self.graph.reserve_output(param.id, where, local=True)
            outputs[param.name] = self.output(param.id, private=private)
        return ActionContext(action.name, action, self, inputs, outputs, self.principal), spec

    async def _run_action(self, spec: ActionSpec, context: ActionContext) -> None:
        started = time.perf_counter()
        code = StatusCode.CANCELLED  # unless it ends otherwise: cancelled with its session
        try:
            await spec.handler(context)
            for output in context.outputs.values():
                await output.close_tree()
            code = StatusCode.OK
        except SessionError as error:
            code = error.code
            raise
        except BaseException as exc:
            if any(isinstance(leaf, PASS_THROUGH) for leaf in leaf_exceptions(exc)):
                raise
            code = StatusCode.INTERNAL
            raise ActionFailedError(
                self._failure_text(f"{describe(context.action)} failed", exc, event="action.failed")) from exc
        finally:
            self._running -= 1
            if self._running == 0:
                # The idle timeout counts from the last action's end, not from the last message before
                # it ran: its outputs may still be on their way out when the expiry timer looks.
                self.stream.last_activity = trio.current_time()
                if self._idle is not None:
                    self._idle.set()
            if code is StatusCode.OK:
                self._check_served()
            if self.options.metrics is not None:
                self.options.metrics.action_finished(spec.name, code, time.perf_counter() - started)


# ----------------------------------------------------------------------------------------
# Reading


class _Walk:
    """One read of a node's flattened content from its start: the cursor and the chunk being read.

    Readers are plain async iterators over :meth:`next_chunk` and :meth:`next_part`, not async
    generators: a one-chunk ECHO read three of those per side (a frame each, Trio's hooks, a finalizer).
    """

    def __init__(self, session: Session, node_id: str, public: bool = False) -> None:
        self._session = session
        self._cursor = FlattenCursor(session.graph, node_id)
        self.current: ChunkReader | None = None
        self._work = 0
        self._public = public  # for the peer: no chunk of a node ctx.call made

    async def next(self) -> LeafStart | LeafBytes | LeafEnd | None:
        # The walk yields to other tasks every FLATTEN_STEPS steps (events, KiB or nodes entered),
        # so a wide or deeply shared input cannot hold the event loop.
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

    async def next_chunk(self) -> ChunkReader | None:
        """The next chunk (the rest of the current one skipped, its refs unopened), or None at the end."""
        while True:
            while self.current is not None:
                await self.next_part(self.current)
            event = await self.next()
            if event is None:
                return None
            if isinstance(event, LeafStart):
                if self._public and event.node_id in self._session._private:
                    raise SessionError(f"node {event.node_id!r} was made by ctx.call and stays on this side: "
                                       "an input the peer names cannot include it", code=StatusCode.PERMISSION_DENIED)
                self.current = ChunkReader(self, event.node_id, event.metadata, last=event.last)
                return self.current

    async def next_part(self, reader: ChunkReader) -> bytes | ExternalRef | None:
        """``reader``'s next part: inline bytes (never empty) or a ref; None at the chunk's end."""
        while not reader.done and reader is self.current:
            event = await self.next()
            if not isinstance(event, LeafBytes):
                reader.done, self.current = True, None
                return None
            part = event.part
            if part.ref is None:
                if part.data:
                    reader.ended = event.last
                    return part.data
            else:
                return ExternalRef(part.ref, self._session.options.resolvers[part.ref.partition(":")[0].lower()])
        return None


class _ChunkBytes:
    """A chunk's bytes as they arrive, its refs resolved (``async for piece in chunk``)."""

    __slots__ = ("_blocks", "_reader")

    def __init__(self, reader: ChunkReader) -> None:
        self._reader = reader
        self._blocks: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> _ChunkBytes:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._blocks is not None:
                try:
                    return await self._blocks.__anext__()
                except StopAsyncIteration:
                    self._blocks = None
            part = await self._reader._walk.next_part(self._reader)
            if part is None:
                raise StopAsyncIteration
            if isinstance(part, bytes):
                return part
            self._blocks = part.resolver.open(part.uri)


class UnknownNodeError(SessionError):
    """A ``NodeRef`` given as an input names no node of this session (NOT_FOUND); raised before anything is sent."""

    code = StatusCode.NOT_FOUND


def _run_names(action: str, target: str, outputs: Mapping[str, str], inputs: list[str]) -> list[tuple[str, str]]:
    """The names and ids ``run`` sends, as :func:`~evergreen_trio.nodes.check_names` takes them. Input
    nodes' own ids were checked as the nodes were built; one ``run`` chose has its input's name in it."""
    fields = [("the action name", action), ("target", target)]
    for key, node_id in outputs.items():
        fields += [("output name", key), (f"output {key!r}'s node id", node_id)]
    return fields + [("input name", key) for key in inputs]


def _not_str(action: str, side: str, key: object, node_id: object) -> str:
    """How ``run`` names an input or output whose name or node id is not a str."""
    if not isinstance(key, str):
        return f"run({action!r}): {side} names must be str, got {describe_kind(key)} {key!r}"
    return f"run({action!r}): {side} {key!r}: its node id must be a str, got {describe_kind(node_id)} {node_id!r}"


class ChunkReader:
    """One flattened chunk (one leaf): its metadata, and its bytes as they arrive.

    ``last``: no chunk follows this one in the input (known when it began; False when not known
    yet). ``ended``: the bytes read so far are all the chunk's (its final fragment's were the last
    read; False for a ref's blocks), so a writer copying it can mark its own fragment final.
    """

    def __init__(self, walk: _Walk, node_id: str, metadata: ChunkMetadata, *, last: bool = False) -> None:
        self._walk = walk
        self.node_id = node_id
        self.metadata = metadata
        self.done = False
        self.last = last
        self.ended = False

    @property
    def mimetype(self) -> str:
        """The chunk's mimetype (from its metadata; empty when it has none)."""
        return self.metadata.mimetype

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _ChunkBytes(self)

    async def parts(self) -> AsyncIterator[bytes | ExternalRef]:
        """The chunk's inline bytes and its refs (with the resolver of each) as they arrive, unresolved."""
        while (part := await self._walk.next_part(self)) is not None:
            yield part

    async def read(self) -> bytes:
        """The whole chunk, refs resolved. Raises what its resolver raises (RefRejectedError)
        or SessionError when the session aborts.
        """
        pieces = []
        while (part := await self._walk.next_part(self)) is not None:
            if isinstance(part, bytes):
                pieces.append(part)
            else:
                pieces.extend([block async for block in part.resolver.open(part.uri)])
        return b"".join(pieces)


class _Chunks:
    """An input's chunks, as ``async for chunk in ctx.input(...)`` gets them."""

    __slots__ = ("_walk",)

    def __init__(self, walk: _Walk) -> None:
        self._walk = walk

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> ChunkReader:
        chunk = await self._walk.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class InputStream:
    """A node's flattened content: chunks in depth-first order, each streamed as it arrives.

    Each iteration (and each ``read_*``) reads the node from its start: nodes live for the session.
    A ``public`` one (an input the peer named) refuses to reach a node that ``ctx.call`` made.
    """

    def __init__(self, session: Session, node_id: str, *, public: bool = False) -> None:
        self._session = session
        self.node_id = node_id
        self.public = public

    def __aiter__(self) -> AsyncIterator[ChunkReader]:
        return _Chunks(_Walk(self._session, self.node_id, self.public))

    async def read_chunks(self) -> list[tuple[ChunkMetadata, bytes]]:
        """Every chunk with its bytes, in flattening order."""
        walk = _Walk(self._session, self.node_id, self.public)
        chunks = []
        while (chunk := await walk.next_chunk()) is not None:
            chunks.append((chunk.metadata, await chunk.read()))
        return chunks

    async def read_bytes(self) -> bytes:
        """Every chunk's bytes joined in flattening order, refs resolved (raises as ``ChunkReader.read``)."""
        walk = _Walk(self._session, self.node_id, self.public)  # read_chunks' loop without its pairs: a frame less
        pieces = []
        while (chunk := await walk.next_chunk()) is not None:
            pieces.append(await chunk.read())
        return b"".join(pieces)

    async def read_text(self, *, mimetype_prefix: str = "text/") -> str:
        """The UTF-8 text of every chunk, which must all have a mimetype starting with ``mimetype_prefix``
        (``""``: any); :class:`~evergreen_trio.dag.NotTextError` names the first chunk that does not."""
        parts = []
        async for chunk in self:
            if not chunk.mimetype.startswith(mimetype_prefix):
                raise NotTextError(
                    f"node {self.node_id!r}: chunk {chunk.node_id!r} has mimetype {chunk.mimetype!r}, "
                    f"not {mimetype_prefix}*", mimetype=chunk.mimetype)
            parts.append((await chunk.read()).decode("utf-8", errors="replace"))
        return "".join(parts)


class Output(InputStream):
    """An action's output as this side sees it: a stream to read and a node to reuse by reference."""

    @property
    def ref(self) -> NodeRef:
        """A reference to this output node, to pass as another action's input."""
        return NodeRef(self.node_id)


# ----------------------------------------------------------------------------------------
# Writing


class OutputNode:
    """A node this side produces: a leaf written in pieces, or an inner node whose children are added.

    An output the peer did not name is not produced: writes to it are dropped. A ``private`` one
    (an output of ``ctx.call``) stays on this side.
    """

    def __init__(self, session: Session, node_id: str, *, requested: bool = True, private: bool = False,
                 tree: dict[str, OutputNode] | None = None) -> None:
        self._session = session
        self.id = node_id
        self.requested = requested
        self.private = private
        if private:
            session._private.add(node_id)
        self._builder = FragmentBuilder(node_id, fragment_bytes=session.options.fragment_bytes)
        self._children = 0
        # The nodes below the output this one belongs to that child() made and that are not closed yet,
        # shared by all of them: an action's end closes them (close_tree) as it closes its outputs.
        self._tree: dict[str, OutputNode] = {} if tree is None else tree

    def _metadata(self, mimetype: str | None, metadata: ChunkMetadata | None) -> ChunkMetadata | None:
        if metadata is None and not self._builder.started:  # only seq 0 carries metadata
            metadata = ChunkMetadata(mimetype=mimetype or OCTET_STREAM, role=self._session.default_role)
        return metadata

    async def write(
        self,
        data: bytes | str,
        *,
        mimetype: str | None = None,
        metadata: ChunkMetadata | None = None,
        last: bool = False,
    ) -> None:
        """Append bytes to this leaf: str is UTF-8 encoded (default mimetype text/plain), bytes default
        to application/octet-stream. The first write's mimetype or metadata is the chunk's."""
        if isinstance(data, str):
            data, mimetype = data.encode(), mimetype or "text/plain"
        if self.requested:
            await self._session.emit(self._builder.data(data, self._metadata(mimetype, metadata), last=last),
                                     private=self.private)
            if last:
                self._tree.pop(self.id, None)

    async def write_ref(self, uri: str, *, mimetype: str | None = None, last: bool = False) -> None:
        """Append a chunk that names ``uri`` instead of carrying bytes (the reader's resolver fetches it)."""
        if self.requested:
            await self._session.emit([self._builder.ref(uri, self._metadata(mimetype, None), last=last)],
                                     private=self.private)
            if last:
                self._tree.pop(self.id, None)

    async def add_children(self, child_ids: Sequence[str], *, last: bool = False) -> None:
        """Name existing (or future) nodes as the next children of this inner node."""
        if self.requested:
            await self._session.emit([self._builder.children(child_ids, last=last)], private=self.private)
            if last:
                self._tree.pop(self.id, None)

    async def child(self, *, last: bool = False) -> OutputNode:
        """A new leaf or inner node appended as this node's next child (``last``: and its last one:
        this node's final fragment names it)."""
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
        child = OutputNode(self._session, child_id, requested=self.requested, private=self.private, tree=self._tree)
        if self.requested:
            self._tree[child_id] = child
        await self.add_children([child_id], last=last)
        return child

    async def close(self) -> None:
        """Send the final fragment unless one was already sent."""
        if self.requested:
            self._tree.pop(self.id, None)
            fragment = self._builder.close()
            if fragment is not None:
                await self._session.emit([fragment], private=self.private)

    async def close_tree(self) -> None:
        """Close this output and every node below it that :meth:`child` made and nothing closed:
        a reader of the output would wait for their final fragments forever."""
        while self._tree:
            await next(iter(self._tree.values())).close()
        await self.close()

    async def __aenter__(self) -> OutputNode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            await self.close()


# ----------------------------------------------------------------------------------------
# Actions


@dataclass
class ActionContext:
    """What an action handler gets: its inputs as streams, its outputs as writers, and the session
    (``ctx.session.run(...)`` asks the peer to run an action, e.g. a tool call to the client)."""

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

    async def call(
        self,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        *,
        configs: Iterable[AnyProto] = (),
        target: str = "",
    ) -> Call:
        """Run action ``name`` of this side in-process, with no connection: same arguments and result
        as :meth:`~evergreen_trio.nursery_session.Session.run` (new nodes, or
        ``NodeRef(ctx.input("input").node_id)`` of nodes in the session). It runs as a task of the
        session, with this action's principal; if it fails, the session aborts with its status,
        cancelling this action. Its input and output nodes stay on this side (not sent to the peer).
        """
        return await self.session._call(self, name, inputs, outputs, configs, target)


Handler = Callable[[ActionContext], Awaitable[None]]


@dataclass(frozen=True)
class ActionSpec:
    """A registered action: its handler and the input and output names it accepts."""

    name: str
    handler: Handler
    inputs: frozenset[str]
    outputs: frozenset[str]


class ActionRegistry:
    """Handlers by action name, registered with ``add_action`` or the ``action`` decorator
    (:class:`~evergreen_trio.Server` and :class:`~evergreen_trio.ClientSession` both are one)."""

    actions: dict[str, ActionSpec]

    def add_action(self, name: str, handler: Handler, *, inputs: Iterable[str], outputs: Iterable[str]) -> None:
        """Register ``handler`` as action ``name`` with its parameter names; ValueError if ``name`` is taken."""
        if name in self.actions:
            raise ValueError(f"action {name!r} is already registered")
        self.actions[name] = ActionSpec(name, handler, frozenset(inputs), frozenset(outputs))

    def action(
        self, name: str, *, inputs: Iterable[str] = (), outputs: Iterable[str] = ()
    ) -> Callable[[Handler], Handler]:
        """Register the decorated coroutine function as action ``name``."""

        def register(handler: Handler) -> Handler:
            self.add_action(name, handler, inputs=inputs, outputs=outputs)
            return handler

        return register


def describe(action: Action) -> str:
    outputs = ", ".join(f"{p.name}={p.id}" for p in action.outputs)
    return f"action {action.name}" + (f" (outputs {outputs})" if outputs else "")


class _Described:
    """``describe(action)``, made only when an error message formats it (most actions raise none)."""

    __slots__ = ("action",)

    def __init__(self, action: Action) -> None:
        self.action = action

    def __str__(self) -> str:
        return describe(self.action)


class ServerSession(Session):
    """The serving end: starts registered actions as they arrive, in the session's nursery."""

    def __init__(
        self,
        stream: MessageStream[Outbound],
        options: SessionOptions,
        actions: dict[str, ActionSpec],
        targets: frozenset[str],
        *,
        principal: str | None = None,
    ) -> None:
        super().__init__(stream, options)
        self.principal = principal
        self.actions = actions
        self.targets = targets

    async def run_session(self) -> None:
        """Serve the session to its end and send the final status (OK, or why it aborted)."""
        status, message = StatusCode.OK, None
        try:
            await self.serve()
        except SessionError as error:
            status, message = error.code, error.message
            # The reason quotes the peer's names and ids: one escaped, bounded token, never a forged line.
            log.info("session.abort peer=%s code=%s reason=%s", self.stream.peer, status.name,
                     peer_text(message, REASON_LOG_CHARS))
            self._record_abort(abort_reason(error))
            if isinstance(error, LimitExceededError) and self.options.metrics is not None:
                self.options.metrics.limit_hit(error.limit)
        except BaseException:  # cancellation from a shutting-down server
            if self.stream.final is None:  # else its outcome went out before (see _served)
                self.stream.finish(StatusCode.UNAVAILABLE, "the server is shutting down")
                self._record_abort("shutdown")
            raise
        self.stream.finish(status, message)

    def _served(self) -> None:
        self.stream.finish()

    def _record_abort(self, reason: str) -> None:
        if self.options.metrics is not None:
            self.options.metrics.aborted(reason)
