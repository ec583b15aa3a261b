"""Files a user names, opened without blocking on them (a FIFO's ``open()`` waits for a writer)."""

from __future__ import annotations

import os
import stat

READ_WITHOUT_WAITING = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
"""``os.open`` flags for a file that may turn out to be a FIFO: the open returns at once."""


def not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is, for an error message, when it is not a regular file; else None."""
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
