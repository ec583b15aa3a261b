"""What the session layer costs the scheduler: a client and a server session linked in memory (no gRPC,
so a transport's own tasks do not count), with a Trio instrument counting task steps and passes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from grpclib.const import Status

from benchmarks.session_calls import relay
from evergreen_trio import NodeRef, Server, text
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientSession
from evergreen_trio.nursery_session import Outbound, ServerSession, SessionOptions, pack_messages
from evergreen_trio.serving.metrics import SessionMetrics


class Counter(trio.abc.Instrument):
    """Task steps and scheduling passes (one per wait for I/O)."""

    def __init__(self) -> None:
        self.steps = 0
        self.passes = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def after_io_wait(self, timeout: float) -> None:
        self.passes += 1


class Link:
    """One ECHO server, and whole sessions with it linked in memory."""

    def __init__(self) -> None:
        server = Server()
        register_builtin_actions(server)
        self.server = server
        self.metrics = SessionMetrics()
        self.options = SessionOptions(metrics=self.metrics)
        self.client_options = SessionOptions()

    async def session(self, body: Callable[[ClientSession], Awaitable[None]]) -> None:
        """Run ``body`` in a session, then end it as ``Client.session()`` does and wait for both ends."""
        client_stream: MessageStream[Outbound] = MessageStream(pack_messages)
        server_stream: MessageStream[Outbound] = MessageStream(pack_messages)
        session = ClientSession(client_stream, self.client_options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay, client_stream, server_stream)
            nursery.start_soon(relay, server_stream, client_stream)
            self.served_stream = server_stream
            served = ServerSession(server_stream, self.options, self.server.actions, self.server.targets)
            nursery.start_soon(served.run_session)
            nursery.start_soon(session.serve)
            await body(session)
            client_stream.finish()
        assert server_stream.final is not None and server_stream.final.status is Status.OK

    def sent(self) -> float:
        """Fragments the server sent so far."""
        return self.metrics.registry.get_sample_value("evergreen_fragments_total", {"direction": "out"}) or 0.0


async def one_echo(session: ClientSession) -> None:
    echo = await session.run("ECHO", {"input": text("x" * 64)}, ["output"])
    assert await echo["output"].read_bytes() == b"x" * 64


async def test_a_one_chunk_echo_costs_two_fragments_and_one_step_per_task_on_its_path() -> None:
    """ECHO marks its output's fragments final when it knows they are: a one-chunk ECHO sends its
    output node's one fragment and its leaf's one (it sent two more, empty, to close them). A round
    trip is one step of each task on its path: the caller, the action and the two relays (no
    checkpoint of the session layer adds a pass). The receive loops take none: a message arriving
    while one waits is taken in the relay's step (6 steps a round trip when each loop took it)."""
    link = Link()
    rounds = 50
    counter = Counter()

    async def body(session: ClientSession) -> None:
        await one_echo(session)
        sent = link.sent()
        trio.lowlevel.add_instrument(counter)
        try:
            for _ in range(rounds):
                await one_echo(session)
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert link.sent() - sent == 2 * rounds

    await link.session(body)
    assert counter.passes <= 4 * rounds + 2
    assert counter.steps <= 4.5 * rounds


async def test_a_whole_one_echo_session_ends_without_extra_passes() -> None:
    """A session that gets no action (the client's) opens no nursery, and the server sends OK when
    the client's stream ended with no action running, before its nursery closes; the client's
    receive loop takes the echo in the relay's step: 9-10 passes and 13-14 steps a whole one-ECHO
    session here (10-11 and 14-15 when the loop took it; 14 and 17 when each end left a nursery
    first)."""
    link = Link()
    sessions = 20
    await link.session(one_echo)
    counter = Counter()
    trio.lowlevel.add_instrument(counter)
    try:
        for _ in range(sessions):
            await link.session(one_echo)
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert counter.passes <= 10 * sessions + 2
    assert counter.steps <= 14 * sessions


async def test_an_action_after_fragments_in_one_batch_starts_with_all_of_them_counted() -> None:
    """The receive loop stops at the first message with actions to open the session's nursery, and
    goes on from that message: nothing of the batch is lost or counted twice."""
    link = Link()

    async def body(session: ClientSession) -> None:
        first = await session.send(text("a", id="first"))
        await session.send(text("b", id="second"))
        echo = await session.run("ECHO", {"input": NodeRef("first")}, ["output"])
        assert await echo["output"].read_bytes() == b"a"
        again = await session.run("ECHO", {"input": first}, ["output"])
        assert await again["output"].read_bytes() == b"a"

    await link.session(body)
    received = link.metrics.registry.get_sample_value("evergreen_fragments_total", {"direction": "in"})
    assert received == 2
    assert link.sent() == 4
