"""The Evergreen session DAG, sans-IO: fragment rules, graph bookkeeping, limits, flattening order."""

from evergreen_trio.dag.errors import (
    ActionFailedError,
    LimitExceeded,
    ProtocolViolation,
    RefRejected,
    SessionAborted,
    SessionError,
    StatusCode,
    UnknownAction,
    UnknownTarget,
)
from evergreen_trio.dag.flatten import FlattenCursor, FlattenEvent, LeafBytes, LeafEnd, LeafStart, Wait
from evergreen_trio.dag.graph import LeafPart, Node, NodeKind, SessionGraph
from evergreen_trio.dag.limits import LimitsError, SessionLimits
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
    "LimitExceeded",
    "LimitsError",
    "Node",
    "NodeKind",
    "ProtocolViolation",
    "RefRejected",
    "SessionAborted",
    "SessionError",
    "SessionGraph",
    "SessionLimits",
    "StatusCode",
    "UnknownAction",
    "UnknownTarget",
    "Wait",
]
