"""The client end of a session, for async scripts: ``async with connect("host:port") as session``."""

from __future__ import annotations

import itertools
import math
import secrets
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from google.protobuf.any_pb2 import Any as AnyProto

from evergreen_trio._grpc.bridge import ClientOptions, MessageStream, RpcAbortError, open_client_stream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, ChunkMetadata, NamedParameter, SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.dag import FragmentBuilder, SessionAbortedError, SessionError, SessionLimits, StatusCode
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
        assert isinstance(node, Inner)
        children = [c if isinstance(c, NodeRef) else NodeRef(c.id or self.new_id()) for c in node.children]
        await self.emit([builder.children([c.id for c in children], last=True)])
        for child, ref in zip(node.children, children, strict=True):
            if not isinstance(child, NodeRef):
                await self.send(_with_id(child, ref.id))
        return NodeRef(node_id)

    def open_leaf(self, *, id: str | None = None) -> OutputNode:
        """A leaf to stream into with ``write`` (and ``close``); use ``.id`` to name it in inputs."""
        return self.output(id or self.new_id("leaf"))

    async def run(
        self,
        name: str,
        inputs: Mapping[str, NodeLike | Output],
        outputs: Sequence[str] | Mapping[str, str],
        *,
        configs: Iterable[AnyProto] = (),
        target: str = "",
    ) -> Call:
        """Start action ``name``: the action goes out first, then its input nodes (pipelining)."""
        named = dict(outputs) if isinstance(outputs, Mapping) else {o: self.new_id(o) for o in outputs}
        resolved = {k: (v.ref if isinstance(v, Output) else v) for k, v in inputs.items()}
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


def _with_id(node: Leaf | Inner, node_id: str) -> Leaf | Inner:
    if node.id == node_id:
        return node
    if isinstance(node, Leaf):
        return Leaf(node.parts, node.mimetype, node_id, node.role)
    return Inner(node.children, node_id)


def parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {target!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


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
) -> AsyncIterator[ClientSession]:
    """Open a session to ``host:port``. Leaving the block ends the client's side of the stream and
    waits for the server to finish; a server abort raises :class:`SessionAbortedError` here.

    ``tls``: ``True`` verifies the server against the system's CAs, an ``ssl.SSLContext``
    (:func:`evergreen_trio.tls.client_context`) as it says. ``metadata`` goes with the call (a bearer
    token: ``{"authorization": "Bearer ..."}``). ``timeout`` bounds the whole session: it is sent as
    ``grpc-timeout``, and past it the session aborts with DEADLINE_EXCEEDED on both sides.
    """
    host, port = parse_target(target)
    options = SessionOptions(limits or SessionLimits(), resolver_map(resolvers), fragment_bytes)
    wire = ClientOptions(tls=tls, metadata=metadata, timeout=timeout)
    async with open_client_stream(
        host, port, START_SESSION, SessionMessage, SessionMessage, pack_messages, options=wire
    ) as stream:
        session = ClientSession(stream, options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_receive, session, nursery.cancel_scope, timeout)
            try:
                yield session
            except SessionError as error:
                # Raised plainly below, not wrapped in the nurseries' exception groups.
                session.fail(error)
                stream.finish(error.code, error.message)
            except BaseException:
                if session.error is None:
                    stream.finish(StatusCode.CANCELLED, "the client gave up")
                raise
            stream.finish()
    if session.error is not None:
        raise session.error


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
