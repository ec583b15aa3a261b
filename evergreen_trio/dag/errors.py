"""Why a session aborts: each error carries the gRPC status code the peer will see."""

from __future__ import annotations

from enum import IntEnum

from evergreen_trio.errors import EvergreenTrioError


class StatusCode(IntEnum):
    """gRPC status codes, kept here so the core needs no gRPC import."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class SessionError(EvergreenTrioError):
    """Aborts the session; ``code`` is the status sent to the peer, the message names what is at fault."""

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str, *, code: StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class ProtocolViolationError(SessionError):
    """The peer broke a rule of the Evergreen protocol."""

    code = StatusCode.INVALID_ARGUMENT


class LimitExceededError(SessionError):
    """A configured limit (nodes, bytes, fragment size, depth, concurrent actions) was crossed.

    ``limit`` names it (the :class:`SessionLimits` field, e.g. ``"max_nodes"``), for metrics.
    """

    code = StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, limit: str = "unknown", code: StatusCode | None = None) -> None:
        super().__init__(message, code=code)
        self.limit = limit


class ActionFailedError(SessionError):
    """An action's handler raised an exception that is not a :class:`~evergreen_trio.SessionError`."""

    code = StatusCode.INTERNAL


class UnknownActionError(SessionError):
    """The peer asked for an action this side does not offer."""

    code = StatusCode.UNIMPLEMENTED


class UnknownTargetError(SessionError):
    """The action's target_spec names no configured target."""

    code = StatusCode.NOT_FOUND


class RefRejectedError(SessionError):
    """A chunk's external ref cannot be resolved here (no resolver for its scheme, or outside the roots)."""

    code = StatusCode.INVALID_ARGUMENT


class SessionAbortedError(SessionError):
    """The session ended with a non-OK status; raised on the side that did not choose to abort.

    Its text names the status: ``DEADLINE_EXCEEDED: no answer within the 5 s timeout``.
    """

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class NotTextError(SessionError):
    """``read_text()`` met a chunk whose mimetype is not text; ``mimetype`` is the chunk's."""

    code = StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, mimetype: str, code: StatusCode | None = None) -> None:
        super().__init__(message, code=code)
        self.mimetype = mimetype
