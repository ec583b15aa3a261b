"""Stopping a Trio program on SIGINT or SIGTERM by cancellation, the way every command here stops.

A KeyboardInterrupt raised at an arbitrary checkpoint can land inside a shielded shutdown step
(a gRPC stream sending its final status, the asyncio loop under grpclib closing) and leave it
half done. Cancelling a scope instead runs every ``finally`` in order. A second Ctrl-C while
that happens ends the process at once, as users expect of a stuck shutdown. A server that
drains (``serve``) first lets open work finish, then cancels; a second signal cuts that short.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

STOP_DEADLINE_SECONDS = 15.0
"""How long ``serve`` may take to stop once its drain is over (its own close deadlines: 5 s for the
sessions' final statuses, 5 s for grpclib's connections); past it the process exits with status 1."""


def with_stop_deadline(
    drain: Callable[[], Awaitable[object]], seconds: float = STOP_DEADLINE_SECONDS,
    exit_now: Callable[[int], object] = os._exit,
) -> Callable[[], Awaitable[object]]:
    """``drain``, after which the process has ``seconds`` to finish stopping, or ``exit_now(1)`` ends it.

    A shutdown step that waits forever (shielded, on work that will never end: the asyncio loop under
    grpclib, once dead, left a server that ignored SIGTERM with its connections in CLOSE-WAIT) cannot
    be cancelled; a process that stops is worth more than its unfinished ``finally`` blocks.
    """

    async def draining() -> object:
        result = await drain()
        trio.lowlevel.spawn_system_task(_exit_after, seconds, exit_now)  # cancelled when the run ends
        return result

    return draining


async def _exit_after(seconds: float, exit_now: Callable[[int], object]) -> None:
    await trio.sleep(seconds)
    log.error("stop_timeout: still stopping %g s after the drain; exiting", seconds)
    sys.stderr.flush()
    exit_now(1)


async def cancel_on_signals(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` on the first SIGINT or SIGTERM; a second SIGINT kills the process."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("stopping signal=%s", signal.Signals(signum).name)
            scope.cancel()
            break
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def run_until_signal(
    run: Callable[..., Awaitable[object]],
    *args: object,
    started: Callable[[Any], object] | None = None,
    drain: Callable[[], Awaitable[object]] | None = None,
) -> bool:
    """Run ``run(*args)`` until it returns or the first SIGINT or SIGTERM cancels it.

    With ``started``, ``run`` is started the way ``nursery.start`` starts a task (it gets
    ``task_status``) and ``started`` is called with the value it reports, e.g. to print the
    bound port. With ``drain``, the first signal awaits ``drain()`` before cancelling (a second
    one cancels at once: :func:`drain_on_signals`). Returns True when ``run`` returned, False
    when a signal stopped it. Errors from ``run`` propagate (in an exception group, as from any
    nursery).
    """
    returned = False
    async with trio.open_nursery() as nursery:

        async def run_then_stop(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
            nonlocal returned
            if started is None:
                await run(*args)
            else:
                await run(*args, task_status=task_status)
            returned = True
            nursery.cancel_scope.cancel()

        scope = nursery.cancel_scope
        if drain is None:
            nursery.start_soon(cancel_on_signals, scope)
        else:
            nursery.start_soon(drain_on_signals, drain, scope.cancel, scope)
        if started is None:
            nursery.start_soon(run_then_stop)
        else:
            started(await nursery.start(run_then_stop))
    return returned


async def drain_on_signals(
    drain: Callable[[], Awaitable[object]], stop_now: Callable[[], object], scope: trio.CancelScope
) -> None:
    """On the first SIGINT or SIGTERM await ``drain()``, then cancel ``scope``.

    A signal while it drains calls ``stop_now()`` (which should end the drain at once); once
    this returns, a SIGINT kills the process.
    """
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("draining signal=%s", signal.Signals(signum).name)
                break
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_second_signal, signals, stop_now)
                await drain()
                nursery.cancel_scope.cancel()
        scope.cancel()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


async def _stop_on_second_signal(signals: AsyncIterator[int], stop_now: Callable[[], object]) -> None:
    async for signum in signals:
        log.info("stopping signal=%s", signal.Signals(signum).name)
        stop_now()


__all__ = [
    "STOP_DEADLINE_SECONDS",
    "cancel_on_signals",
    "drain_on_signals",
    "run_until_signal",
    "with_stop_deadline",
]
