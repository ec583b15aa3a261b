"""Work many peers cause at once is shared out: new streams one per turn of a connection's input,
expired sessions one per scheduling pass, silent sessions cheap (issue 22, the session server's stall).

The flood runs over a real socket against an in-process server while a legitimate ECHO session
loops on other connections; ceilings are hang guards, not timings (the stall is measured by
``python -m benchmarks.security_session``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio
from hyperframe.frame import HeadersFrame

from benchmarks.security_session import PREFACE, flatten_fanout, many_sessions
from evergreen_trio import Server
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, NodeFragment
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import ProtocolViolationError, SessionGraph
from evergreen_trio.dag.graph import ATTACH_STEP
from evergreen_trio.nursery_session import STEP_FRAGMENTS
from evergreen_trio.serving.server import GC_THRESHOLDS
from tests.security.test_session_attacks import nursery_
from tests.security.test_session_cost import LEGIT_CEILING_MS, with_legit_probe

__all__ = ["nursery_"]  # the fixture, shared with the session attacks


async def test_a_flood_of_silent_sessions_ends_in_turn_while_others_are_served(nursery_: trio.Nursery) -> None:
    """10 connections x 100 silent sessions, each opened in one write and all expiring together
    (before: a 2-5 s stall on a quiet machine with 50 connections)."""
    server = Server(first_message_timeout=0.5, max_sessions_per_peer=10_000)
    register_builtin_actions(server)
    port = await nursery_.start(server.serve, "127.0.0.1", 0)
    with trio.fail_after(60):  # a hang guard
        observed, samples = await with_legit_probe(port, many_sessions(port, 10))
    assert observed == "1000/1000 sessions ended, grpc-status 4", observed
    assert max(samples) < LEGIT_CEILING_MS, samples
    assert server.open_sessions == 0


def frames(*parts: bytes) -> bytes:
    return PREFACE + b"".join(parts)


def headers(stream_id: int) -> bytes:
    frame = HeadersFrame(stream_id, b"\x82")
    frame.flags.add("END_HEADERS")
    return frame.serialize()


def test_serve_tunes_the_garbage_collector() -> None:
    """Objects alive at start are frozen and full collections are rare (``serve`` calls ``tune_gc``)."""
    code = ("import gc; from evergreen_trio.serving.server import tune_gc; tune_gc(); "
            "print(gc.get_threshold(), gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(")")[0] + ")" == str(GC_THRESHOLDS) and out.strip().endswith("True"), out


async def test_a_session_streaming_many_small_outputs_takes_turns_with_others(nursery_: trio.Nursery) -> None:
    """Issue 22 item 3's served case: ECHO over a 1-byte leaf shared 10 x 1000 times streams
    10,000 outputs (20,000 fragments each way: child, and bytes marked final). Sending and receiving let other tasks
    run every STEP_FRAGMENTS fragments: a task that only counts passes runs hundreds of times meanwhile."""
    server = Server()
    register_builtin_actions(server)
    port = await nursery_.start(server.serve, "127.0.0.1", 0)
    passes = 0

    async def count_passes() -> None:
        nonlocal passes
        while True:
            await trio.lowlevel.checkpoint()
            passes += 1

    with trio.fail_after(120):  # a hang guard
        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_passes)
            observed = await flatten_fanout(port, "ECHO", 1, (10, 1000))
            nursery.cancel_scope.cancel()
    assert observed == "grpc-status 0", observed
    assert passes >= 20_000 // STEP_FRAGMENTS, passes  # the server's ECHO alone takes that many turns


def test_a_graph_is_forgotten_in_steps() -> None:
    graph = SessionGraph()
    graph.add_fragment(NodeFragment(id="root", child_ids=[f"c{i}" for i in range(10)]))
    graph.add_fragment(NodeFragment(id="c0", chunk_fragment=Chunk(data=b"x")))
    steps = 1
    while not graph.forget(4):  # 2 nodes, root's height, 10 children's parent
        steps += 1
    assert steps == 4
    assert graph.get("root") is None and graph.forget(4)


def test_a_fragment_with_many_children_is_attached_in_steps() -> None:
    """Issue 22 item 2's hub (100,000 children in one fragment) cost 50-130 ms of one step on each
    side; its children past ATTACH_STEP wait for attach_more, a cycle among them still refused."""
    graph = SessionGraph()
    graph.add_fragment(NodeFragment(id="top", child_ids=["hub"]))
    children = [f"leaf{i}" for i in range(2 * ATTACH_STEP)] + ["top"]
    graph.add_fragment(NodeFragment(id="hub", child_ids=children))
    assert graph.attaching
    graph.attach_more()
    with pytest.raises(ProtocolViolationError, match="child 'top' makes the node include itself"):
        graph.attach_more()
