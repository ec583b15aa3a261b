"""Issue 11, items 9-12: the session server under raw HTTP/2 attacks, over a real socket.

Each test runs one attack client from ``benchmarks/security_session.py`` against an in-process
server and asserts the server's answer (status, RST_STREAM, GOAWAY), that a legitimate session on
another connection still completes, and that this process's RSS stays bounded. Ceilings are
generous; the measured stall and memory figures are in ``python -m benchmarks.security_session``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import trio

from benchmarks.security_session import (
    CANCEL,
    REFUSED_STREAM,
    RawH2,
    echo_once,
    message_prefix,
    oversized_prefix,
    rapid_reset,
    rss_mib,
    silent_connection,
    silent_session,
    too_many_streams,
)
from evergreen_trio import Server
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    Chunk,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio.actions import register_builtin_actions

MEMORY_CEILING_MIB = 64
"""RSS growth allowed per attacking connection (issue 11's target)."""

LEGIT_CEILING_S = 5.0
"""A legitimate session during an attack must complete within this (a hang guard, not a timing claim)."""


def rss() -> float:
    import os

    return rss_mib(os.getpid())


async def start(nursery: trio.Nursery, **options: object) -> tuple[Server, int]:
    server = Server(**options)  # type: ignore[arg-type]
    register_builtin_actions(server)
    port: int = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


async def legit_session_completes(port: int) -> None:
    with trio.fail_after(LEGIT_CEILING_S):
        await echo_once(f"127.0.0.1:{port}")


async def wait_for(condition: Callable[[], bool], what: str, seconds: float = 10) -> None:
    with trio.fail_after(seconds):  # a hang guard
        while not condition():  # noqa: ASYNC110 - server counters have no event
            await trio.sleep(0.02)
    assert condition(), what


def echo_message(text: bytes) -> bytes:
    """One whole session's input as a gRPC message: ECHO of a leaf holding ``text``."""
    message = SessionMessage(
        actions=[Action(name="ECHO", inputs=[NamedParameter(name="input", id="p")],
                        outputs=[NamedParameter(name="output", id="o")])],
        node_fragments=[NodeFragment(id="p", chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain"),
                                                                  data=text))],
    ).SerializeToString()
    return message_prefix(len(message)) + message


@pytest.fixture
async def nursery_() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


async def test_item9_a_4_gib_prefix_is_refused_before_anything_is_buffered(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_)
    before = rss()
    observed = await oversized_prefix(port)
    assert observed.startswith("grpc-status 8 "), observed  # RESOURCE_EXHAUSTED
    assert "4294967295 bytes" in observed
    await legit_session_completes(port)
    assert rss() - before < MEMORY_CEILING_MIB
    await wait_for(lambda: server.open_sessions == 0, "the refused session is gone")


async def test_item9_a_message_at_the_limit_is_accepted_and_one_byte_more_is_not(nursery_: trio.Nursery) -> None:
    limit = 4096
    _, port = await start(nursery_, max_message_bytes=limit)
    client = await RawH2.open(port)
    fits = echo_message(b"x" * 100)
    await client.send(client.headers(1) + client.data(1, fits, end_stream=True))
    await client.send(client.headers(3) + client.data(3, message_prefix(limit + 1) + bytes(limit + 1)))
    await client.until(lambda c: 1 in c.statuses and 3 in c.statuses, 10)
    assert client.statuses[1].startswith("0"), client.statuses
    assert client.statuses[3].startswith("8 "), client.statuses
    await client.aclose()


async def test_item11_a_101st_stream_is_refused_alone_and_the_other_sessions_live_on(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_)
    before = rss()
    observed = await too_many_streams(port, streams=150)
    assert observed == "max_concurrent_streams=100 refused=50 no GOAWAY ping=answered"

    # On one connection: 100 open sessions, a refused 101st, then session 1 still completes.
    client = await RawH2.open(port)
    await client.send(b"".join(client.headers(2 * i + 1) for i in range(101)))
    await client.until(lambda c: 201 in c.resets, 10)
    assert client.resets[201] == REFUSED_STREAM
    await client.send(client.data(1, echo_message(b"still here"), end_stream=True))
    await client.until(lambda c: 1 in c.statuses, 10)
    assert client.statuses[1].startswith("0"), client.statuses
    assert client.goaway is None
    await legit_session_completes(port)
    await client.aclose()
    await wait_for(lambda: server.open_sessions == 0, "every session of the closed connections ended")
    assert rss() - before < 2 * MEMORY_CEILING_MIB  # two attacking connections


async def test_item11_a_burst_of_streams_far_past_the_limit_gets_goaway_enhance_your_calm(
    nursery_: trio.Nursery,
) -> None:
    """4,000 HEADERS in one write: h2 would have walked every open stream per frame (quadratic,
    1.3 s of CPU); now about 100 are refused, then GOAWAY, and the rest of the write is not parsed."""
    server, port = await start(nursery_)
    observed = await too_many_streams(port, streams=4000)
    assert "GOAWAY ENHANCE_YOUR_CALM" in observed, observed
    await legit_session_completes(port)
    await wait_for(lambda: server.open_sessions == 0, "the connection's sessions ended")


async def test_item11_past_the_server_cap_a_new_session_gets_resource_exhausted(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_, max_sessions=5)
    first, second = await RawH2.open(port), await RawH2.open(port)
    await first.send(b"".join(first.headers(2 * i + 1) for i in range(4)))
    await wait_for(lambda: server.open_sessions == 4, "four sessions open")
    await second.send(b"".join(second.headers(2 * i + 1) for i in range(4)))
    await second.until(lambda c: len(c.statuses) >= 3, 10)
    assert sorted(status.split()[0] for status in second.statuses.values()) == ["8", "8", "8"]
    assert first.statuses == {}  # the sessions already open are untouched
    hits = server.metrics.registry.get_sample_value("evergreen_limit_hits_total", {"limit": "max_sessions"})
    assert hits == 3
    for client in (first, second):
        await client.aclose()
    await wait_for(lambda: server.open_sessions == 0, "the held sessions ended with their connections")
    await legit_session_completes(port)


async def test_item12_rapid_reset_gets_goaway_enhance_your_calm_and_leaves_nothing(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_)
    before = rss()
    observed = await rapid_reset(port, 3000)
    _, connections, calmed = [int(word) for word in observed.replace(",", "").split() if word.isdigit()]
    assert calmed >= connections - 1, observed  # the last one may stop short of the budget
    await legit_session_completes(port)
    await wait_for(lambda: server.open_sessions == 0, "no session of the attack is left")
    assert rss() - before < MEMORY_CEILING_MIB


async def test_malformed_call_headers_are_read_safely_and_the_server_serves_on(nursery_: trio.Nursery) -> None:
    """A stream's headers as the wire reads them into its Call: a grpc-timeout that is not one (too
    long, a bad unit, not digits) is no deadline, metadata values of any byte go through as they came,
    binary metadata is left out; each session is served whole, and a 1 ns timeout ends its session
    with DEADLINE_EXCEEDED."""
    _, port = await start(nursery_)
    client = await RawH2.open(port)
    odd = (("grpc-timeout", "99999999999H"), ("grpc-timeout", "12x"), ("grpc-timeout", "-5S"),
           ("x-odd", "\x7f\u00ff\u00fe"), ("x-bin", "@@not base64@@"))
    for stream_id, header in zip(range(1, 2 * len(odd), 2), odd, strict=True):
        await client.send(client.headers(stream_id, metadata=(header,))
                          + client.data(stream_id, echo_message(b"hi"), end_stream=True))
    late = 2 * len(odd) + 1
    await client.send(client.headers(late, metadata=(("grpc-timeout", "1n"),))
                      + client.data(late, echo_message(b"late"), end_stream=True))
    await client.until(lambda c: len(c.statuses) == len(odd) + 1, 10)
    assert [client.statuses[i].split()[0] for i in range(1, late, 2)] == ["0"] * len(odd), client.statuses
    assert client.statuses[late].startswith("4 "), client.statuses[late]  # DEADLINE_EXCEEDED
    await client.aclose()
    await legit_session_completes(port)


async def test_item12_streams_opened_and_reset_in_one_write_start_no_session(nursery_: trio.Nursery) -> None:
    """HEADERS and their RST_STREAMs in one write: admitted, counted and given back, but no session
    task starts for them (rapid reset costs the server no task)."""
    server, port = await start(nursery_)
    client = await RawH2.open(port)
    ids = range(1, 101, 2)
    await client.send(b"".join(client.headers(i) + client.reset(i, CANCEL) for i in ids))
    await client.until(lambda c: False, 0.3)
    assert server.metrics.registry.get_sample_value("evergreen_sessions_started_total") == 0
    assert server.open_sessions == 0
    await client.aclose()
    await legit_session_completes(port)


async def test_item12_resets_spread_over_reads_start_no_more_than_the_stream_cap(nursery_: trio.Nursery) -> None:
    """HEADERS in one write, their RST_STREAMs in the next: handlers start, but never more than
    the per-connection cap at once, and the connection is told to calm down."""
    server, port = await start(nursery_)
    client = await RawH2.open(port)
    peak = 0
    stream_id = 1
    # Until the GOAWAY: the budget is resets per second as the server reads them, and a loaded machine
    # reads a round's resets more slowly (ten rounds, then 1,000 resets, were not always enough).
    for _ in range(100):
        ids = range(stream_id, stream_id + 200, 2)
        stream_id += 200
        await client.send(b"".join(client.headers(i) for i in ids))
        await trio.sleep(0.01)
        peak = max(peak, server.open_sessions)
        await client.send(b"".join(client.reset(i, CANCEL) for i in ids))
        await client.until(lambda c: c.goaway is not None, 0.01)
        if client.goaway is not None or client.closed:
            break
    # The server opens one stream per turn of the connection's input (STREAMS_PER_TURN): on a busy
    # machine the last resets may still wait for their turn.
    await client.until(lambda c: c.goaway is not None, 10)
    assert peak <= 100
    assert client.goaway is not None and client.goaway == 0xB
    await client.aclose()
    await wait_for(lambda: server.open_sessions == 0, "every started session ended")
    await legit_session_completes(port)


async def test_item10_a_silent_session_ends_with_deadline_exceeded(nursery_: trio.Nursery) -> None:
    _, port = await start(nursery_, first_message_timeout=0.3)
    observed = await silent_session(port)
    assert observed.startswith("grpc-status 4 no message within 0.3 s"), observed
    await legit_session_completes(port)


async def test_item10_a_connection_without_preface_is_closed(nursery_: trio.Nursery) -> None:
    _, port = await start(nursery_, first_message_timeout=0.3)
    observed = await silent_connection(port, preface=False)
    assert observed.startswith(("closed after", "GOAWAY 0 then closed after")), observed


async def test_item10_a_connection_without_sessions_gets_goaway_after_the_idle_timeout(nursery_: trio.Nursery) -> None:
    _, port = await start(nursery_, idle_timeout=0.3)
    observed = await silent_connection(port, preface=True)
    assert observed.startswith("GOAWAY 0 then closed"), observed


async def test_item10_a_session_silent_after_its_first_message_ends_after_the_idle_timeout(
    nursery_: trio.Nursery,
) -> None:
    _, port = await start(nursery_, idle_timeout=0.3)
    client = await RawH2.open(port)
    leaf = SessionMessage(node_fragments=[NodeFragment(id="a", chunk_fragment=Chunk(data=b"x"), continued=True)])
    body = leaf.SerializeToString()
    await client.send(client.headers(1) + client.data(1, message_prefix(len(body)) + body))
    await client.until(lambda c: 1 in c.statuses, 10)
    assert client.statuses[1].startswith("4 no message either way for 0.3 s"), client.statuses
    await client.aclose()


async def test_item10_a_running_action_keeps_a_quiet_session_open(nursery_: trio.Nursery) -> None:
    server = Server(idle_timeout=0.2)

    @server.action("SLOW", inputs=["input"], outputs=["output"])
    async def slow(ctx: object) -> None:
        await trio.sleep(0.6)  # three idle timeouts without a message either way

    port = await nursery_.start(server.serve, "127.0.0.1", 0)
    from evergreen_trio import connect, text

    with trio.fail_after(LEGIT_CEILING_S):
        async with connect(f"127.0.0.1:{port}") as session:
            call = await session.run("SLOW", {"input": text("x")}, ["output"])
            assert await call["output"].read_bytes() == b""


@pytest.mark.parametrize("chained", [False, True])
async def test_item10_actions_waiting_for_input_the_client_never_sends_end_after_the_idle_timeout(
    nursery_: trio.Nursery, chained: bool
) -> None:
    """A running action keeps a quiet session open only while it works: one that waits for the rest
    of its input (or for the output of another that does) waits for the client, whose silence is
    idleness. Before, such a session stayed open, holding its share of the caps, until the client left."""
    _, port = await start(nursery_, idle_timeout=0.3)
    actions = [Action(name="ECHO", inputs=[NamedParameter(name="input", id="p")],
                      outputs=[NamedParameter(name="output", id="o")])]
    if chained:  # the second waits for the first's output, the first for the client
        actions.append(Action(name="ECHO", inputs=[NamedParameter(name="input", id="o")],
                              outputs=[NamedParameter(name="output", id="o2")]))
    partial = NodeFragment(id="p", continued=True,
                           chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain"), data=b"x"))
    body = SessionMessage(actions=actions, node_fragments=[partial]).SerializeToString()
    client = await RawH2.open(port)
    await client.send(client.headers(1) + client.data(1, message_prefix(len(body)) + body))
    await client.until(lambda c: 1 in c.statuses, 10)
    assert client.statuses[1].startswith("4 no message either way for 0.3 s"), client.statuses
    await client.aclose()
    await legit_session_completes(port)


async def test_a_client_goaway_mid_read_closes_the_connection_quietly(nursery_: trio.Nursery) -> None:
    """A GOAWAY followed by more frames in the same write: the stream opened after it starts nothing,
    the server closes the connection once the stream opened before it has ended (here silent: at the
    first-message timeout), logs no error, serves on."""
    from hyperframe.frame import GoAwayFrame

    server, port = await start(nursery_, first_message_timeout=0.5)
    client = await RawH2.open(port)
    await client.send(client.headers(1) + GoAwayFrame(0, last_stream_id=1).serialize() + client.headers(3))
    await client.until(lambda c: c.closed, 10)
    assert client.closed
    assert client.statuses.keys() == {1}, client.statuses
    await client.aclose()
    await wait_for(lambda: server.open_sessions == 0, "the session of the closed connection ended")
    await legit_session_completes(port)


async def test_frames_on_streams_a_draining_server_did_not_take_are_dropped_quietly(nursery_: trio.Nursery) -> None:
    """A drain's GOAWAY names the last stream taken; a client that then opens, feeds and resets a new
    stream (as a racing or hostile peer may) gets no protocol error: the open session still ends OK
    and the connection closes after it."""
    server, port = await start(nursery_)
    client = await RawH2.open(port)
    await client.send(client.headers(1))
    await wait_for(lambda: server.open_sessions == 1, "the first session is open")
    nursery_.start_soon(server.drain, 30)
    await client.until(lambda c: c.goaway is not None, 10)
    assert (client.goaway, client.goaway_last_stream) == (0, 1)
    await client.send(client.headers(3) + client.data(3, echo_message(b"late")) + client.reset(3, CANCEL))
    await client.send(client.data(1, echo_message(b"still here"), end_stream=True))
    await client.until(lambda c: 1 in c.statuses and c.closed, 10)
    assert client.statuses[1].startswith("0"), client.statuses
    assert 3 not in client.statuses and client.goaway == 0  # no PROTOCOL_ERROR GOAWAY
    await client.aclose()



@pytest.mark.parametrize("limit", ["max_parts", "max_nodes"])
async def test_fragments_without_bytes_are_counted_and_the_session_ends_at_the_limit(
        nursery_: trio.Nursery, limit: str) -> None:
    """Empty fragments and ids named as children hold 60-100 bytes each for a few on the wire, and
    max_buffered_bytes counts none of them: before ``max_parts``, and named ids counting against
    ``max_nodes``, one session could hold ever more of them (8-12x what it sent)."""
    from evergreen_trio import SessionLimits, StatusCode
    from evergreen_trio.testing.wire import SyncClient

    server, port = await start(nursery_, limits=SessionLimits(**{limit: 10_000}))
    action = Action(name="ECHO", inputs=[NamedParameter(name="input", id="p")],
                    outputs=[NamedParameter(name="output", id="o")])
    if limit == "max_parts":  # 20,000 empty fragments of one node
        fragments = [NodeFragment(id="p", seq=seq, continued=True) for seq in range(20_000)]
        said = "10001 fragments and child ids, limit 10000"
    else:  # 4 fragments naming 20,000 distinct ids, none of them sent
        fragments = [NodeFragment(id=f"p{seq}", child_ids=[f"c{seq}-{i}" for i in range(5_000)]) for seq in range(4)]
        said = "names more than 10000 nodes as children"
    messages = [SessionMessage(actions=[action], node_fragments=fragments)]
    with SyncClient(f"127.0.0.1:{port}") as client:
        outcome = await trio.to_thread.run_sync(client.run, messages)
    assert outcome.code == StatusCode.RESOURCE_EXHAUSTED, outcome.describe()
    assert said in outcome.details, outcome.details
    assert server.metrics.registry.get_sample_value("evergreen_limit_hits_total", {"limit": limit}) == 1
    await legit_session_completes(port)


@pytest.mark.parametrize("where", ["node ids", "child ids"])
async def test_ids_of_megabytes_count_against_max_buffered_bytes(nursery_: trio.Nursery, where: str) -> None:
    """Fragments without a byte of data, each with an id (or child id) of 3 MiB: before, no byte limit
    counted ids, and one session could hold ``max_nodes`` times a message's size (1M x 4 MiB)."""
    from evergreen_trio import SessionLimits, StatusCode
    from evergreen_trio.testing.wire import SyncClient

    server, port = await start(nursery_, limits=SessionLimits(max_buffered_bytes=16 << 20))
    huge = "x" * (3 << 20)
    if where == "node ids":
        messages = [SessionMessage(node_fragments=[NodeFragment(id=f"{huge}{i}", continued=True)]) for i in range(10)]
        said = "with its id of 3145729 characters the session would hold 18874374 bytes, limit 16777216"
    else:
        messages = [SessionMessage(node_fragments=[NodeFragment(id=f"p{i}", child_ids=[f"{huge}{i}"])])
                    for i in range(10)]
        said = "with its 1 child ids the session would hold 18874386 bytes, limit 16777216"
    with SyncClient(f"127.0.0.1:{port}") as client:
        outcome = await trio.to_thread.run_sync(client.run, messages)
    assert outcome.code == StatusCode.RESOURCE_EXHAUSTED, outcome.describe()
    assert said in outcome.details, outcome.details
    limit = {"limit": "max_buffered_bytes"}
    assert server.metrics.registry.get_sample_value("evergreen_limit_hits_total", limit) == 1
    await legit_session_completes(port)
