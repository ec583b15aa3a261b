"""A client that disappears mid-action: the server frees every node and task of that session.

Measured, not assumed: the server's open-session count, the live ServerSession and graph
Node objects (gc), and the Trio tasks under the test's root task all return to where they
were before the session, and the server serves the next session.

How it is freed: grpclib cancels the stream's handler (``SessionAcceptor._handle`` in
evergreen_trio/_grpc/bridge.py) when the client resets its stream or its connection dies; the
handler's ``finally`` closes ``inbound`` with UNAVAILABLE, which ends the Trio session's receive
loop and with it the session's nursery. The server then releases the stream, because grpclib
keeps finished handler tasks (whose tracebacks reach the stream) until its periodic cleanup.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import trio

from evergreen_trio import NodeRef, Server, connect, text
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag.graph import Node
from evergreen_trio.nursery_session import ServerSession

# A grpcio client in its own process: it starts ECHO, sends part of the input (so the action
# is running and waiting for more) and, with "big", a large input it never reads back (so the
# server is blocked writing), then waits to be killed.
CLIENT = """
import sys, threading, grpc
from evergreen_trio._wire import START_SESSION
from evergreen_trio.testing.model import Frag, Meta, echo, to_messages
big = sys.argv[2] == "big"
items = [echo("c:a", "o:0"), Frag("c:a", 0, True, chunk=(Meta("text/plain"), b"first part"))]
items += [Frag("c:a", i, True, chunk=(None, b"x" * 65536)) for i in range(1, 400 if big else 1)]
channel = grpc.insecure_channel(sys.argv[1])
call = channel.stream_stream(START_SESSION, request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=lambda b: b)
def requests():
    yield from to_messages(items, range(1, len(items)))
    print("sent", flush=True)
    threading.Event().wait()
replies = call(requests())
threading.Event().wait()
"""


def _tasks() -> int:
    """Trio tasks alive under the root task."""
    count, stack = 0, [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += 1
        stack.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return count


def _live(kind: type) -> int:
    gc.collect()
    return sum(isinstance(obj, kind) for obj in gc.get_objects())


@pytest.fixture
def client_process() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()



async def _wait_until(condition: Callable[[], bool], what: str) -> None:
    with trio.fail_after(10):  # a hang guard, not a timing assertion
        while not condition():  # noqa: ASYNC110 - the server's counters have no event to wait on
            await trio.sleep(0.02)
    assert condition(), what


@pytest.mark.parametrize("input_kind", ["small", "big"])
async def test_a_killed_client_leaves_nothing_behind(
    input_kind: str, client_process: list[subprocess.Popen[str]]
) -> None:
    server = Server()
    register_builtin_actions(server)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with connect(f"127.0.0.1:{port}") as session:  # warm up: the first session's one-off objects
            await (await session.run("ECHO", {"input": text("warm")}, ["output"]))["output"].read_chunks()
        await _wait_until(lambda: server.open_sessions == 0, "warm-up session closed")
        tasks, sessions, nodes = _tasks(), _live(ServerSession), _live(Node)

        process = subprocess.Popen(  # noqa: ASYNC220 - starting it does not wait for it
            [sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", input_kind], stdout=subprocess.PIPE, text=True
        )
        client_process.append(process)
        assert process.stdout is not None
        assert await trio.to_thread.run_sync(process.stdout.readline) == "sent\n"
        await _wait_until(lambda: server.open_sessions == 1, "the session is open")
        await _wait_until(lambda: _live(Node) > nodes, "the session holds nodes")
        assert _tasks() > tasks

        process.send_signal(signal.SIGKILL)
        await _wait_until(lambda: server.open_sessions == 0, "the session is closed")
        await _wait_until(lambda: _tasks() == tasks, "its tasks are gone")
        assert _live(ServerSession) == sessions
        assert _live(Node) == nodes

        async with connect(f"127.0.0.1:{port}") as session:
            call = await session.run("ECHO", {"input": text("next")}, ["output"])
            assert await call["output"].read_bytes() == b"next"
        nursery.cancel_scope.cancel()


async def test_a_client_that_gives_up_mid_action_leaves_nothing_behind() -> None:
    server = Server()
    register_builtin_actions(server)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        tasks, sessions = _tasks(), _live(ServerSession)
        with trio.move_on_after(0.5) as gave_up:
            async with connect(f"127.0.0.1:{port}") as session:
                leaf = session.open_leaf()
                await session.run("ECHO", {"input": NodeRef(leaf.id)}, ["output"])
                await leaf.write("never finished")
                await trio.sleep_forever()
        assert gave_up.cancelled_caught
        await _wait_until(lambda: server.open_sessions == 0, "the session is closed")
        await _wait_until(lambda: _tasks() == tasks, "its tasks are gone")
        assert _live(ServerSession) == sessions
        nursery.cancel_scope.cancel()
