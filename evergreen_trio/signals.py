"""Stopping a Trio program on SIGINT or SIGTERM by cancellation, the way every command here stops.

A KeyboardInterrupt raised at an arbitrary checkpoint can land inside a shielded shutdown step
(a gRPC stream sending its final status, the asyncio loop under grpclib closing) and leave it
half done. Cancelling a scope instead runs every ``finally`` in order. A second Ctrl-C while
that happens ends the process at once, as users expect of a stuck shutdown.
"""

from __future__ import annotations

import logging
import signal

import trio

log = logging.getLogger(__name__)


async def cancel_on_signals(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` on the first SIGINT or SIGTERM; a second SIGINT kills the process."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("stopping signal=%s", signal.Signals(signum).name)
            scope.cancel()
            break
    signal.signal(signal.SIGINT, signal.SIG_DFL)

