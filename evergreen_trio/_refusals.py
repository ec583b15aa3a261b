"""When a server at its connection cap logs: once an episode of refusals, however the cap flickers (sans-IO)."""

from __future__ import annotations

import math

QUIET_S = 5.0
"""An episode of refusals ends at the first admission this long after its last refusal."""


class RefusalEpisodes:
    """A server's refusals at its connection cap, grouped into episodes: one warning and one info line each.

    An episode begins at a refusal and ends at the first admission ``quiet_s`` or more after its
    last refusal. A slot freed while the cap is full (a connection ending mid-flood, taken at once
    by the next one) does not end it, so a peer cycling one connection at the cap gets no more log
    lines than one holding every slot. ``now`` is any monotonic clock in seconds.
    """

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self.refused = 0  # refusals in the current episode
        self._last_refused = -math.inf

    def refuse(self, now: float) -> bool:
        """Count one refusal; True when it begins an episode (log the warning then)."""
        self.refused += 1
        self._last_refused = now
        return self.refused == 1

    def admit(self, now: float) -> int:
        """Note one admission; the episode's refusal count when this ends it (log it then), else 0."""
        if not self.refused or now - self._last_refused < self.quiet_s:
            return 0
        refused, self.refused = self.refused, 0
        return refused
