"""The Trio shell of ``burst-prefix-cache-producer``: seal each window when its time is up."""

from __future__ import annotations

import trio

from evergreen_trio.picker.burst_prefix import BurstWindow


async def seal_windows(window: BurstWindow) -> None:
    """Seal ``window`` at each open window's deadline, until cancelled; on the way out the open
    window seals at once, so that no parked request is left waiting."""
    try:
        while True:
            opened = trio.Event()
            window.on_open = opened.set
            if window.deadline is None:
                await opened.wait()
            assert window.deadline is not None
            # The window's deadline is on its own clock (monotonic seconds), not Trio's.
            await trio.sleep(max(0.0, window.deadline - window.clock()))
            window.seal()
    finally:
        window.on_open = None
        if window.deadline is not None:
            window.seal()
