"""The client end of a session, for async scripts.

``async with Client("host:port") as client`` holds one HTTP/2 connection; ``client.session()`` opens a
session on it (as many, one after another or at once, as the server allows per connection);
``async with connect("host:port") as session`` is the one-shot form.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType

import trio
from google.protobuf.any_pb2 import Any as AnyProto

from evergreen_trio._grpc.bridge import (
    ClientChannel,
    ClientOptions,
    ConnectFailedError,
    MessageStream,
    RpcAbortError,
    open_client_channel,
)
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, ChunkMetadata, NamedParameter, SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.dag import FragmentBuilder, SessionAbortedError, SessionError, SessionLimits, StatusCode
from evergreen_trio.errors import ArgumentTypeError, ConfigurationError, EvergreenTrioError, plain_errors
from evergreen_trio.nodes import CLIENT_ROLE, Inner, Leaf, NodeLike, NodeRef, RefURI
from evergreen_trio.nursery_session import (
    InputStream,
    Outbound,
    OutputNode,
    Session,
    SessionOptions,
    describe,
    pack_messages,
)
from evergreen_trio.refs import RefResolver, resolver_map


@dataclass
class Call:
    """A running action: its outputs by parameter name, each readable as a stream and reusable as a node."""

    action: Action
    outputs: dict[str, Output]

    def __getitem__(self, name: str) -> Output:
        return self.outputs[name]


class Output(InputStream):
    """An action's output as this side sees it: a stream to read and a node to reuse by reference."""

    @property
    def ref(self) -> NodeRef:
        """A reference to this output node, to pass as another action's input."""
        return NodeRef(self.node_id)


class ClientSession(Session):
    """Builds and sends nodes and actions, and reads what the server produces."""

    default_role = CLIENT_ROLE

    def __init__(self, stream: MessageStream[Outbound], options: SessionOptions) -> None:
        super().__init__(stream, options)
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)

    def new_id(self, hint: str = "n") -> str:
        """A node id unique to this session: ``{hint}-{random prefix}-{counter}``."""
        return f"{hint}-{self._prefix}-{next(self._ids)}"

    async def send(self, node: NodeLike) -> NodeRef:
        """Send a node (and its children, parents first); return a reference to reuse it."""
        if isinstance(node, NodeRef):
            return node
        if not isinstance(node, Leaf | Inner):
            what = "text(), blob(), ref(), inner() or a NodeRef"
            raise ArgumentTypeError(f"send: expected a node ({what}), got {_kind(node)}")
        node_id = node.id or self.new_id()
        builder = FragmentBuilder(node_id, fragment_bytes=self.options.fragment_bytes)
        if isinstance(node, Leaf):
            metadata = ChunkMetadata(mimetype=node.mimetype, role=node.role or self.default_role)
            last = len(node.parts) - 1
            for index, part in enumerate(node.parts):
                meta = metadata if index == 0 else None
                if isinstance(part, RefURI):
                    await self.emit([builder.ref(part.uri, meta, last=index == last)])
                else:
                    await self.emit(builder.data(part, meta, last=index == last))
            if not node.parts:
                await self.emit(builder.data(b"", metadata, last=True))
            return NodeRef(node_id)
        children = [c if isinstance(c, NodeRef) else NodeRef(c.id or self.new_id()) for c in node.children]
        await self.emit([builder.children([c.id for c in children], last=True)])
        for child, ref in zip(node.children, children, strict=True):
            if not isinstance(child, NodeRef):
                await self.send(_with_id(child, ref.id))
        return NodeRef(node_id)

    def open_leaf(self, *, id: str | None = None) -> OutputNode:
        """A leaf to stream into with ``write`` (and ``close``); ``NodeRef(leaf.id)`` names it in inputs."""
        node_id = id or self.new_id("leaf")
        # Claimed now, so that a NodeRef to it is known to this session before its first write.
        self.graph.reserve_output(node_id, "open_leaf", local=True)
        return self.output(node_id)

    async def run(
        self,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        *,
        configs: Iterable[AnyProto] = (),
        target: str = "",
    ) -> Call:
        """Start action ``name``: the action goes out first, then its input nodes (pipelining).

        ``inputs`` maps each input name to a node (``text()``, ``blob()``, ``ref()``, ``inner()``), a
        ``NodeRef`` to a node of this session, or an earlier call's output; ``outputs`` names the
        outputs wanted (their node ids are made up) or maps them to node ids. Raises
        :class:`ArgumentTypeError` for anything else, and :class:`UnknownNodeError` (NOT_FOUND) for a
        ``NodeRef`` that names no node this session sent, received, opened or expects as an output.
        """
        if isinstance(outputs, str) or not isinstance(outputs, Sequence | Mapping):
            raise ArgumentTypeError(f"run({name!r}): outputs must be a list of output names or a mapping of "
                                    f"name to node id, got {_kind(outputs)}")
        named = dict(outputs) if isinstance(outputs, Mapping) else {o: self.new_id(o) for o in outputs}
        resolved = {k: self._input(name, k, v) for k, v in inputs.items()}
        input_ids = {k: (v.id if isinstance(v, NodeRef) else v.id or self.new_id(k)) for k, v in resolved.items()}
        action = Action(
            name=name,
            inputs=[NamedParameter(name=k, id=v) for k, v in input_ids.items()],
            outputs=[NamedParameter(name=k, id=v) for k, v in named.items()],
            configs=list(configs),
        )
        action.target_spec.id = target
        for node_id in named.values():
            self.graph.reserve_output(node_id, describe(action), local=False)
        await self.send_action(action)
        for key, node in resolved.items():
            if not isinstance(node, NodeRef):
                await self.send(_with_id(node, input_ids[key]))
        return Call(action, {k: Output(self, v) for k, v in named.items()})


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
                                f"a NodeRef or a call's output, got {_kind(value)}{hint}")


class UnknownNodeError(SessionError):
    """A ``NodeRef`` given as an input names no node of this session (NOT_FOUND); raised before anything is sent."""

    code = StatusCode.NOT_FOUND


def _kind(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def _with_id(node: Leaf | Inner, node_id: str) -> Leaf | Inner:
    if node.id == node_id:
        return node
    if isinstance(node, Leaf):
        return Leaf(node.parts, node.mimetype, node_id, node.role)
    return Inner(node.children, node_id)


def parse_target(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; raises :class:`ConfigurationError` naming ``target``."""
    if not isinstance(target, str):
        raise ArgumentTypeError(f"target: expected 'host:port', got {_kind(target)}")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or host.endswith(":"):
        raise ConfigurationError(f"target {target!r}: expected host:port (e.g. 127.0.0.1:50051)")
    return host.strip("[]") or "127.0.0.1", int(port)


class ClientStateError(EvergreenTrioError, RuntimeError):
    """A :class:`Client` used while not open (or opened twice)."""


class Client:
    """One HTTP/2 connection to an Evergreen server, for many sessions: ``async with Client(target) as client``.

    ``client.session()`` opens a session on the connection (the same :class:`ClientSession` as
    :func:`connect`); sessions may follow one another or run at once, up to the server's
    ``max_sessions_per_connection``. Leaving the block closes the connection; open sessions must end
    first (open them inside the block).

    ``tls``: ``True`` verifies the server against the system's CAs, an ``ssl.SSLContext``
    (:func:`evergreen_trio.tls.client_context`) as it says. ``metadata`` goes with every session (a
    bearer token: ``{"authorization": "Bearer ..."}``). ``timeout`` bounds each session: it is sent as
    ``grpc-timeout``, and past it the session aborts with DEADLINE_EXCEEDED on both sides.
    ``connect_timeout`` bounds the connection's setup (TCP, TLS, the server's HTTP/2 preface);
    ``retries`` more attempts are made when the server is unreachable, ``backoff`` seconds apart
    (doubling, at most 5 s). A connection that cannot be made raises :class:`SessionAbortedError`
    (UNAVAILABLE) from ``async with``, saying why (refused, a TLS mismatch, no answer in time).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: bool | ssl.SSLContext | None = None,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
        limits: SessionLimits | None = None,
        resolvers: Iterable[RefResolver] = (),
        fragment_bytes: int = 256 * 1024,
        connect_timeout: float = 10.0,
        retries: int = 0,
        backoff: float = 0.2,
    ) -> None:
        self.host, self.port = parse_target(target)
        self.target = target
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout), ("backoff", backoff)):
            if value is not None and not value > 0:
                raise ConfigurationError(f"Client {name}: expected a positive number of seconds, got {value!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"Client retries: expected a count >= 0, got {retries!r}")
        self.tls = tls
        self.metadata = dict(metadata or {})
        self.timeout = timeout
        self.options = SessionOptions(limits or SessionLimits(), resolver_map(resolvers), fragment_bytes)
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self._channel: ClientChannel | None = None
        self._exit: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Client:
        if self._exit is not None:
            raise ClientStateError(f"Client({self.target!r}) is already open")
        stack = contextlib.AsyncExitStack()
        try:
            self._channel = await stack.enter_async_context(self._connect())
        except BaseException:
            await stack.aclose()
            raise
        self._exit = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._exit, self._channel = self._exit, None, None
        assert stack is not None
        return await stack.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[ClientChannel]:
        try:
            with plain_errors():
                async with open_client_channel(
                    self.host, self.port, tls=self.tls, connect_timeout=self.connect_timeout,
                    retries=self.retries, backoff=self.backoff,
                ) as channel:
                    yield channel
        except ConnectFailedError as error:
            # connect()'s timeout bounds the whole session, its connection included.
            code = StatusCode.UNAVAILABLE
            if error.timed_out and self.timeout is not None and self.timeout <= self.connect_timeout:
                code = StatusCode.DEADLINE_EXCEEDED
            raise SessionAbortedError(error.message, code=code) from None

    @asynccontextmanager
    async def session(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - it becomes grpc-timeout
    ) -> AsyncIterator[ClientSession]:
        """Open a session on this connection. Leaving the block ends the client's side of the stream and
        waits for the server to finish; a server abort raises :class:`SessionAbortedError` here.

        ``metadata`` is added to the client's; ``timeout`` replaces the client's for this session.
        """
        if self._channel is None:
            raise ClientStateError(f"Client({self.target!r}) is not open (async with Client(target) as client)")
        seconds = self.timeout if timeout is None else timeout
        wire = ClientOptions(tls=self.tls, metadata={**self.metadata, **(metadata or {})}, timeout=seconds)
        with plain_errors():
            async with self._channel.open_stream(
                START_SESSION, SessionMessage, SessionMessage, pack_messages, options=wire
            ) as stream:
                session = ClientSession(stream, self.options)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_receive, session, nursery.cancel_scope, seconds)
                    try:
                        yield session
                    except SessionError as error:
                        session.fail(error)
                        stream.finish(error.code, error.message)
                    except BaseException:
                        if session.error is None:
                            stream.finish(StatusCode.CANCELLED, "the client gave up")
                        raise
                    stream.finish()
            if session.error is not None:
                raise session.error


@asynccontextmanager
async def connect(
    target: str,
    *,
    tls: bool | ssl.SSLContext | None = None,
    metadata: Mapping[str, str] | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - the pinned interface; it becomes grpc-timeout too
    limits: SessionLimits | None = None,
    resolvers: Iterable[RefResolver] = (),
    fragment_bytes: int = 256 * 1024,
    connect_timeout: float = 10.0,
    retries: int = 0,
) -> AsyncIterator[ClientSession]:
    """Open one session to ``host:port`` on a connection of its own (a one-shot :class:`Client`; the
    arguments are the Client's). Leaving the block ends the client's side of the stream, waits for
    the server to finish and closes the connection; a server abort raises
    :class:`SessionAbortedError` here. For many sessions, open a :class:`Client` and reuse it.
    """
    client = Client(
        target, tls=tls, metadata=metadata, timeout=timeout, limits=limits, resolvers=resolvers,
        fragment_bytes=fragment_bytes, connect_timeout=min(connect_timeout, timeout or connect_timeout),
        retries=retries,
    )
    async with client, client.session() as session:
        yield session


async def _receive(session: ClientSession, scope: trio.CancelScope, seconds: float | None) -> None:
    # The client's side of the deadline: a server that does not answer in time is not waited for.
    with trio.move_on_after(math.inf if seconds is None else seconds) as timer:
        try:
            await session.receive_loop(_no_actions)
        except RpcAbortError as abort:
            _abort(session, scope, SessionAbortedError(abort.message, code=StatusCode(abort.status.value)))
        except SessionError as error:
            _abort(session, scope, error)
    if timer.cancelled_caught:
        why = f"no answer within the {seconds:g} s timeout"
        _abort(session, scope, SessionAbortedError(why, code=StatusCode.DEADLINE_EXCEEDED))


def _abort(session: ClientSession, scope: trio.CancelScope, error: SessionError) -> None:
    session.fail(error)
    session.stream.finish(error.code, error.message)
    scope.cancel()


def _no_actions(actions: Sequence[Action]) -> None:
    raise SessionError(f"{describe(actions[0])}: this client serves no actions", code=StatusCode.UNIMPLEMENTED)
