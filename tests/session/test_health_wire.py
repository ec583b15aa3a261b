"""gRPC health on the server wire: Check through a :class:`GrpcWireConnection` in memory, Watch as
the shell's task-per-stream method runs it (a :class:`MessageStream` driven from Trio)."""

from __future__ import annotations

from functools import partial
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from grpclib.const import Status
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from hypothesis import given
from hypothesis import strategies as st
from test_reflection_wire import exchange

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.health import CHECK_PATH, WATCH_PATH, ServerHealth
from evergreen_trio._grpc.server import serve_grpc
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio.testing.wire import health_status

T = TypeVar("T")
SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN



def check(health: ServerHealth, service: str) -> str:
    """Check ``service`` over the wire: the status's name, or ``grpc-status N``."""
    replies, trailers = exchange([health.check], CHECK_PATH, [HealthCheckRequest(service=service)],
                                 HealthCheckResponse, end=False)
    if trailers["grpc-status"] != "0":
        return f"grpc-status {trailers['grpc-status']}"
    [reply] = replies
    return str(HealthCheckResponse.ServingStatus.Name(reply.status))


def test_check_reports_readiness_liveness_and_the_overall_status() -> None:
    health = ServerHealth(("", "svc"))
    assert [check(health, name) for name in ("", "svc", "liveness")] == ["NOT_SERVING"] * 3
    health.set(ready=True, live=True)
    assert [check(health, name) for name in ("", "svc", "liveness")] == ["SERVING"] * 3
    assert health.ready
    health.set(ready=False, live=True)  # draining: live, not ready
    assert [check(health, name) for name in ("", "svc", "liveness")] == ["NOT_SERVING", "NOT_SERVING", "SERVING"]


def test_the_overall_status_unnamed_is_ready_and_live() -> None:
    health = ServerHealth(("svc",))
    health.set(ready=True, live=False)
    assert check(health, "") == "NOT_SERVING"
    health.set(ready=True, live=True)
    assert check(health, "") == "SERVING"


def test_check_of_an_unknown_service_is_not_found() -> None:
    health = ServerHealth(("",))
    health.set(ready=True, live=True)
    assert check(health, "no.Such") == f"grpc-status {Status.NOT_FOUND.value}"
    assert check(health, "x" * (1 << 20)) == f"grpc-status {Status.NOT_FOUND.value}"


def test_check_without_a_request_is_internal() -> None:
    replies, trailers = exchange([ServerHealth(("",)).check], CHECK_PATH, [], HealthCheckResponse)
    assert (replies, trailers["grpc-status"]) == ([], str(Status.INTERNAL.value))


async def test_grpcio_checks_over_tcp(nursery: trio.Nursery) -> None:
    health = ServerHealth(("",))
    port = await nursery.start(partial(serve_grpc, [health.check], "127.0.0.1", 0))
    ask = partial(trio.to_thread.run_sync, health_status, f"127.0.0.1:{port}")
    assert await ask("") == "NOT_SERVING"
    health.set(ready=True, live=True)
    assert [await ask(name) for name in ("", "liveness", "no.Such")] == ["SERVING", "SERVING", "NOT_FOUND"]


@given(st.text(max_size=30) | st.sampled_from(["", "svc", "liveness"]), st.booleans(), st.booleans())
def test_fuzzed_checks_answer_or_abort(service: str, ready: bool, live: bool) -> None:
    health = ServerHealth(("", "svc"))
    health.set(ready=ready, live=live)
    processor = health.check.new_processor()
    try:
        [reply] = processor.on_message(HealthCheckRequest(service=service))
    except RpcAbortError as refused:
        assert refused.status is Status.NOT_FOUND and service not in ("", "svc", "liveness")
    else:
        assert processor.finished and reply.status == health.status(service) != SERVICE_UNKNOWN


def test_methods_are_check_and_watch() -> None:
    health = ServerHealth(("",))
    check_method, watch_method = health.methods
    assert (check_method.path, check_method.request_type) == (CHECK_PATH, HealthCheckRequest)
    assert (watch_method.path, watch_method.request_type) == (WATCH_PATH, HealthCheckRequest)
    assert (watch_method.handle, watch_method.admit) == (health.watch, health.admit_watch)


async def open_watch(health: ServerHealth, nursery: trio.Nursery, service: str = "") -> MessageStream[Any]:
    """A Watch stream as the shell opens it: admitted, its request received, its task started."""
    stream: MessageStream[Any] = MessageStream(list)
    health.admit_watch(stream)
    stream.inbound.push(HealthCheckRequest(service=service))
    nursery.start_soon(health.watch, stream)
    return stream


async def statuses(stream: MessageStream[Any]) -> list[int]:
    return [reply.status for reply in await stream.outbound.get_batch()]


async def test_watch_sends_the_status_at_once_then_each_change(nursery: trio.Nursery) -> None:
    health = ServerHealth(("", "svc"))
    stream = await open_watch(health, nursery, "svc")
    assert await statuses(stream) == [NOT_SERVING]
    health.set(ready=True, live=True)
    assert await statuses(stream) == [SERVING]
    health.set(ready=True, live=True)  # no change
    health.set(ready=True, live=False)  # no change for "svc" (readiness)
    health.set(ready=False, live=True)
    assert await statuses(stream) == [NOT_SERVING]
    liveness = await open_watch(health, nursery, "liveness")
    assert await statuses(liveness) == [SERVING]
    assert health.watches == 2


async def test_watch_of_an_unknown_service_says_so_and_keeps_watching(nursery: trio.Nursery) -> None:
    health = ServerHealth(("",))
    stream = await open_watch(health, nursery, "no.Such")
    assert await statuses(stream) == [SERVICE_UNKNOWN]
    health.set(ready=True, live=True)
    await trio.testing.wait_all_tasks_blocked()
    assert stream.final is None and stream.outbound._take(10) == []


async def test_watches_past_the_cap_are_refused_until_one_ends(nursery: trio.Nursery) -> None:
    health = ServerHealth(("",), max_watches=3)
    streams = [await open_watch(health, nursery) for _ in range(3)]
    with pytest.raises(RpcAbortError) as refused:
        health.admit_watch(MessageStream(list))
    assert (refused.value.status, refused.value.message) == (Status.RESOURCE_EXHAUSTED,
                                                              "3 health watches open, the limit")
    streams[0].inbound.close(RpcAbortError(Status.CANCELLED, "client gone"))
    await trio.testing.wait_all_tasks_blocked()
    assert health.watches == 2
    await open_watch(health, nursery)


async def test_a_watch_ends_ok_after_watch_seconds(autojump_clock: trio.testing.MockClock) -> None:
    health = ServerHealth(("",), watch_seconds=30)
    async with trio.open_nursery() as nursery:
        stream = await open_watch(health, nursery)
        stream.inbound.close()  # the client half-closed after its request, as clients do
        started = trio.current_time()
    assert trio.current_time() - started == pytest.approx(30)
    assert stream.final is not None and stream.final.status is Status.OK
    assert [reply.status for reply in stream.outbound._take(10)] == [NOT_SERVING]
    assert health.watches == 0


async def test_a_watch_ends_when_its_client_is_gone() -> None:
    health = ServerHealth(("",))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            reset = await open_watch(health, nursery)
            half_closed = await open_watch(health, nursery)
            await trio.testing.wait_all_tasks_blocked()
            reset.inbound.close(RpcAbortError(Status.CANCELLED, "stream reset"))  # before its half-close
            half_closed.inbound.close()
            await trio.testing.wait_all_tasks_blocked()
            assert half_closed.final is None  # half-closed: still watching
            half_closed._mark_closed()  # the shell released the stream
    assert health.watches == 0


async def test_a_watch_without_a_request_is_internal() -> None:
    health = ServerHealth(("",))
    stream: MessageStream[Any] = MessageStream(list)
    health.admit_watch(stream)
    stream.inbound.close()
    with pytest.raises(RpcAbortError) as refused:
        await health.watch(stream)
    assert refused.value.status is Status.INTERNAL and health.watches == 0


async def test_a_watch_finished_elsewhere_ends() -> None:
    health = ServerHealth(("",))
    with trio.fail_after(5):
        async with trio.open_nursery() as watching:
            stream = await open_watch(health, watching)
            await trio.testing.wait_all_tasks_blocked()
            stream.finish(Status.UNAVAILABLE, "server stopping")
            health.set(ready=True, live=True)
    assert health.watches == 0 and stream.final is not None and stream.final.status is Status.UNAVAILABLE
