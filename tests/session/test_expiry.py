"""The sessions' one timer (serving/expiry.py): due times, activity, release and compaction."""

from __future__ import annotations

import gc
import weakref

import trio
import trio.testing

from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio.serving.expiry import COMPACT_AFTER, SessionExpiry


class Session:
    working = False


def stream(received: int = 1) -> MessageStream[object]:
    made: MessageStream[object] = MessageStream(lambda items: [])
    made.received = received
    return made


async def test_an_idle_session_expires_and_an_active_one_is_looked_at_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expired: list[tuple[MessageStream[object], str, float]] = []

    async def on_expired(which: MessageStream[object], why: str) -> None:
        expired.append((which, why, trio.current_time()))

    expiry = SessionExpiry(first_message_timeout=5, idle_timeout=10, on_expired=on_expired)
    idle, busy = stream(), stream()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(expiry.run)
        with trio.CancelScope() as idle_scope, trio.CancelScope() as busy_scope:
            started = trio.current_time()
            expiry.watch(idle, Session(), idle_scope)
            expiry.watch(busy, Session(), busy_scope)
            for _ in range(30):  # busy: a message either way every 5 s
                await trio.sleep(5)
                busy.last_activity = trio.current_time()
        assert [(which, why) for which, why, _ in expired] == [(idle, "no message either way for 10 s")]
        assert 10 <= expired[0][2] - started <= 11  # the timeout and its jitter (up to 10%)
        assert idle_scope.cancel_called and not busy_scope.cancel_called
        nursery.cancel_scope.cancel()


async def test_ended_sessions_are_let_go_and_the_heap_is_rebuilt(autojump_clock: trio.testing.MockClock) -> None:
    async def on_expired(which: MessageStream[object], why: str) -> None:
        raise AssertionError("nothing expires here")

    expiry = SessionExpiry(first_message_timeout=5, idle_timeout=3600, on_expired=on_expired)
    sessions = [Session() for _ in range(COMPACT_AFTER * 3)]
    watched = [expiry.watch(stream(), session, trio.CancelScope()) for session in sessions]
    refs = [weakref.ref(session) for session in sessions]
    for entry in watched:
        expiry.forget(entry)
    del sessions
    gc.collect()
    assert all(ref() is None for ref in refs)  # an ended session is not kept by its entry
    assert len(expiry._heap) < COMPACT_AFTER * 2  # rebuilt along the way


async def test_the_idle_clock_restarts_when_the_last_action_ends(autojump_clock: trio.testing.MockClock) -> None:
    """A session quiet while its action ran counts its idle time from the action's end: else the
    timer, looking between the action's end and its outputs going out, found it idle since the
    message that started it (a running action keeps a quiet session open, then ended it)."""
    from evergreen_trio import text
    from tests.session.test_scheduling import Link

    link = Link()

    @link.server.action("SLOW", inputs=["input"], outputs=["output"])
    async def slow(ctx: object) -> None:
        await trio.sleep(30)

    async def body(session: object) -> None:
        started = trio.current_time()
        call = await session.run("SLOW", {"input": text("x")}, ["output"])  # type: ignore[attr-defined]
        assert await call["output"].read_bytes() == b""
        assert link.served_stream.last_activity >= started + 30

    await link.session(body)  # type: ignore[arg-type]
