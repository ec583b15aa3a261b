"""Per-session limits. Crossing any of them aborts the session with RESOURCE_EXHAUSTED (LimitExceededError)."""

from __future__ import annotations

from dataclasses import dataclass

from evergreen_trio.limits import check_limits


@dataclass(frozen=True)
class SessionLimits:
    """What one session may hold. Every field has a default a small server can live with."""

    max_nodes: int = 1_000_000
    """Nodes (received and produced) alive in one session."""
    max_buffered_bytes: int = 1 << 30
    """Bytes held by one session, received and produced: inline chunk bytes, refs' URIs, node ids and
    the child ids inner fragments name (ids and URIs counted a byte per character)."""
    max_fragment_bytes: int = 4 << 20
    """Inline bytes in one chunk fragment (gRPC's default message limit is 4 MiB)."""
    max_depth: int = 256
    """Nesting levels below an action's input node."""
    max_concurrent_actions: int = 256
    """Actions running at once in one session."""
    max_children_per_fragment: int = 100_000
    """child_ids in one fragment."""
    max_parts: int = 10_000_000
    """Fragments (received and produced) one session holds, each child id they name counting one more:
    an empty fragment or a child id holds 60-100 bytes for a few on the wire, of which
    ``max_buffered_bytes`` counts only the id's characters."""
    max_flattened_bytes: int = 1 << 30
    """Inline bytes one action input flattens to, a shared node counted each time it is repeated
    (1 GiB, as ``max_buffered_bytes``: an input repeating nothing flattens to what was sent, so only
    repetition can cross it; a 256 MiB Arrow table sent inline is still served)."""
    max_flattened_nodes: int = 1_000_000
    """Nodes (leaves and inner nodes) the flattening of one action input enters, counted the same
    way: this bounds its chunks and the walk's work (an input repeating nothing has at most ``max_nodes``)."""

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a field that is not an int >= 1."""
        check_limits(self)
