"""The Evergreen session DAG, sans-IO: fragment rules, graph bookkeeping, limits, flattening order."""

from evergreen_trio.dag.errors import (
    ActionFailedError,
    LimitExceededError,
    NotTextError,
    ProtocolViolationError,
    RefRejectedError,
    SessionAbortedError,
    SessionError,
    StatusCode,
    UnknownActionError,
    UnknownTargetError,
)
from evergreen_trio.dag.flatten import FlattenCursor, FlattenEvent, LeafBytes, LeafEnd, LeafStart, Pause, Wait
from evergreen_trio.dag.graph import LeafPart, Node, NodeKind, SessionGraph
from evergreen_trio.dag.limits import SessionLimits
from evergreen_trio.dag.produce import FragmentBuilder

__all__ = [
    "ActionFailedError",
    "FlattenCursor",
    "FlattenEvent",
    "FragmentBuilder",
    "LeafBytes",
    "LeafEnd",
    "LeafPart",
    "LeafStart",
    "LimitExceededError",
    "Node",
    "NodeKind",
    "NotTextError",
    "Pause",
    "ProtocolViolationError",
    "RefRejectedError",
    "SessionAbortedError",
    "SessionError",
    "SessionGraph",
    "SessionLimits",
    "StatusCode",
    "UnknownActionError",
    "UnknownTargetError",
    "Wait",
]
