"""A message that arrives while the session's receive loop waits is taken at once, in the transport's
task (``Session._take_at_once``): the same graph, outputs, status and metrics as when the loop takes
it from the queue, and never once the session is ending."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from dataclasses import dataclass

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from evergreen_trio import Server, connect, text
from evergreen_trio._grpc.streams import HandoffClosedError, MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, NamedParameter, SessionMessage
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import SessionAbortedError, SessionLimits, StatusCode
from evergreen_trio.dag.graph import ATTACH_STEP
from evergreen_trio.nursery_session import (
    STEP_FRAGMENTS,
    ActionContext,
    Outbound,
    ServerSession,
    SessionOptions,
    pack_messages,
)
from evergreen_trio.serving.auth import Peer
from evergreen_trio.serving.metrics import SessionMetrics
from evergreen_trio.testing.model import Frag, Meta, Plan, Violation, echo, to_messages
from evergreen_trio.testing.strategies import invalid_sessions, sessions

LIMITS = SessionLimits(
    max_nodes=300, max_buffered_bytes=16384, max_fragment_bytes=1024, max_depth=24, max_children_per_fragment=64
)


class QueuedSession(ServerSession):
    """Every message goes through the receive loop's queue (the path before take-at-once)."""

    def _take_at_once(self, message: object) -> bool:
        return False


class CountingSession(ServerSession):
    """Counts the messages it took at once."""

    taken = 0

    def _take_at_once(self, message: object) -> bool:
        took = super()._take_at_once(message)  # type: ignore[arg-type]
        self.taken += took
        return took


@dataclass
class Outcome:
    status: tuple[int, str | None]
    received: dict[str, object]  # the peer's nodes, as the graph holds them
    produced: dict[str, object]  # the server's own nodes
    sent: list[bytes]  # outbound items, serialized, in order of node id and seq
    metrics: dict[str, float]
    taken: int


def _nodes(session: ServerSession, *, local: bool) -> dict[str, object]:
    return {node_id: (node.kind, dict(node.parts), node.final_seq, node.metadata)
            for node_id, node in session.graph.nodes.items() if node.local == local}


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample but the clock's (creation times, durations)."""
    return {f"{sample.name}{sorted(sample.labels.items())}": sample.value
            for family in registry.collect() for sample in family.samples
            if not sample.name.endswith(("_created", "_sum", "_bucket"))}


async def _drain(stream: MessageStream[Outbound], sent: list[bytes]) -> None:
    while batch := await stream.outbound.get_batch():
        sent.extend(item.SerializeToString(deterministic=True) for item in batch)


async def _serve(messages: list[SessionMessage], session_type: type[ServerSession], limits: SessionLimits) -> Outcome:
    """Each message pushed as a transport does once every task is blocked (the loop waits for it)."""
    server = Server()
    register_builtin_actions(server)
    metrics = SessionMetrics()
    stream: MessageStream[Outbound] = MessageStream(pack_messages)
    session = session_type(stream, SessionOptions(limits=limits, metrics=metrics), server.actions, server.targets)
    sent: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run_session)
        nursery.start_soon(_drain, stream, sent)
        for message in messages:
            await trio.testing.wait_all_tasks_blocked()
            with contextlib.suppress(HandoffClosedError):  # the session ended: a transport drops the rest
                stream.inbound.push(message)
        await trio.testing.wait_all_tasks_blocked()
        stream.inbound.close()
    assert stream.final is not None
    return Outcome((stream.final.status.value, stream.final.message), _nodes(session, local=False),
                   _nodes(session, local=True), sorted(sent), _samples(metrics.registry),
                   getattr(session, "taken", 0))


def _outcomes(messages: list[SessionMessage], limits: SessionLimits = LIMITS) -> tuple[Outcome, Outcome]:
    return trio.run(_serve, messages, QueuedSession, limits), trio.run(_serve, messages, CountingSession, limits)


@given(st.one_of(sessions(), invalid_sessions(list(Violation), limits=LIMITS)))
def test_taken_at_once_or_queued_a_session_ends_the_same(plan: Plan) -> None:
    queued, at_once = _outcomes(plan.messages())
    assert at_once.status[0] == queued.status[0], plan
    # Several actions that fail in one pass (a flattening limit each) race to name the session's error.
    if plan.violation is not Violation.OVER_LIMIT:
        assert at_once.status == queued.status, plan
    assert at_once.received == queued.received
    if queued.status[0] == StatusCode.OK:  # outputs of actions cancelled by an abort may be cut anywhere
        assert (at_once.produced, at_once.sent, at_once.metrics) == (queued.produced, queued.sent, queued.metrics)


def _two_echoes() -> list[SessionMessage]:
    leaf = Frag("in", 0, False, chunk=(Meta("text/plain"), b"hello"))
    return [*to_messages([echo("in", "o1")]), *to_messages([leaf]), *to_messages([echo("in", "o2")])]


def test_an_open_session_takes_its_messages_at_once() -> None:
    """The first action opens the session's nursery through the loop; the leaf and the second action,
    each arriving while the loop waits, are taken at once; outputs and metrics as through the queue."""
    queued, at_once = _outcomes(_two_echoes())
    assert at_once.taken == 2 and at_once.status == (StatusCode.OK, None)
    assert (at_once.sent, at_once.metrics) == (queued.sent, queued.metrics)
    assert at_once.metrics["evergreen_fragments_total[('direction', 'in')]"] == 1


def test_an_unknown_action_taken_at_once_aborts_as_through_the_queue() -> None:
    unknown = SessionMessage(actions=[Action(name="NOPE", outputs=[NamedParameter(name="output", id="o3")])])
    queued, at_once = _outcomes([*_two_echoes(), unknown])
    assert at_once.taken == 3
    assert at_once.status == queued.status and at_once.status[0] == StatusCode.UNIMPLEMENTED
    assert "unknown action" in (at_once.status[1] or "")


def test_a_message_the_loop_would_step_through_is_queued() -> None:
    """STEP_FRAGMENTS fragments, or one fragment with more children than one attach step, are the
    loop's to take (it lets other tasks run between them)."""
    many = to_messages([Frag(f"leaf{i}", 0, False, chunk=(None, b"x")) for i in range(STEP_FRAGMENTS)])
    wide = to_messages([Frag("wide", 0, False, children=tuple(f"c{i}" for i in range(ATTACH_STEP + 1)))])
    limits = SessionLimits(max_children_per_fragment=ATTACH_STEP + 1)
    queued, at_once = _outcomes([*_two_echoes(), *many, *wide], limits)
    assert at_once.taken == 2 and at_once.status == (StatusCode.OK, None)
    assert at_once.received == queued.received and len(at_once.received) == STEP_FRAGMENTS + 2


async def test_nothing_is_taken_at_once_once_the_session_is_ending() -> None:
    """A cancelled nursery (a failed action), a status sent, or a recorded error: the message is
    queued, and what comes of it is the loop's to decide in its own step."""
    server = Server()
    register_builtin_actions(server)
    for end in ("cancelled", "finished", "failed"):
        stream: MessageStream[Outbound] = MessageStream(pack_messages)
        session = ServerSession(stream, SessionOptions(), server.actions, server.targets)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run_session)
            nursery.start_soon(_drain, stream, [])
            for message in _two_echoes()[:2]:
                stream.inbound.push(message)
                await trio.testing.wait_all_tasks_blocked()
            assert session._nursery is not None
            if end == "cancelled":
                session._nursery.cancel_scope.cancel()
            elif end == "finished":
                stream.finish(StatusCode.UNAVAILABLE, "going away")
            else:
                session.fail(SessionAbortedError("gone", code=StatusCode.UNAVAILABLE))
            assert not stream.inbound.push(_two_echoes()[2])  # queued
            stream.inbound.close()


VARIABLE: contextvars.ContextVar[str] = contextvars.ContextVar("take_at_once_test", default="unset")


async def test_an_action_taken_at_once_sees_the_session_tasks_context(nursery: trio.Nursery) -> None:
    """Actions are tasks of the session: started in the transport's task, they still inherit the
    context variables of the session's (here set by an async authorize, which runs in it)."""

    async def authorize(metadata: Mapping[str, str], peer: Peer) -> str:
        VARIABLE.set("set by authorize")
        return "someone"

    server = Server(authorize=authorize)

    @server.action("VARIABLE", inputs=["input"], outputs=["output"])
    async def variable(ctx: ActionContext) -> None:
        await ctx.output("output").write(VARIABLE.get(), last=True)

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with connect(f"127.0.0.1:{port}") as session:
        for _ in range(3):  # the first through the loop, the others taken at once
            call = await session.run("VARIABLE", {"input": text("?")}, ["output"])
            assert await call["output"].read_text() == "set by authorize"
    nursery.cancel_scope.cancel()
