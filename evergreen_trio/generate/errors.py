"""Why a GENERATE backed by an OpenAI-compatible endpoint fails.

Everything that aborts a session is a :class:`BackendError`, a ``SessionError`` whose ``code`` is the
gRPC status the Evergreen client sees; settings that make no sense are a :class:`BackendConfigError`.
"""

from __future__ import annotations

from evergreen_trio.dag.errors import SessionError, StatusCode
from evergreen_trio.errors import ConfigurationError


class BackendConfigError(ConfigurationError):
    """A ``BackendSettings`` field is out of range; the message names the field and what came."""


class BackendError(SessionError):
    """The upstream request failed; aborts the session with ``code``."""

    code = StatusCode.UNAVAILABLE


class UpstreamStatusError(BackendError):
    """The upstream answered with an HTTP error status (or sent an error object in the stream)."""

    def __init__(self, message: str, *, status: int, code: StatusCode) -> None:
        super().__init__(message, code=code)
        self.status = status


class StreamFormatError(BackendError):
    """The upstream's stream is not the OpenAI SSE format: the backend broke its contract."""

    code = StatusCode.INTERNAL


class SSEError(StreamFormatError):
    """Bytes that are not a valid ``text/event-stream`` (not UTF-8, a line or event over its limit)."""


class ResponseTooLargeError(BackendError):
    """The upstream's response (or one of its lines) crossed a configured size limit."""

    code = StatusCode.RESOURCE_EXHAUSTED


class PromptTooLargeError(BackendError):
    """The flattened prompt's text crossed ``max_prompt_bytes``."""

    code = StatusCode.RESOURCE_EXHAUSTED


class UpstreamUnavailableError(BackendError):
    """The upstream could not be reached, or dropped the connection before ``[DONE]``."""

    code = StatusCode.UNAVAILABLE


class UpstreamTimeoutError(BackendError):
    """The upstream was too slow: no bytes within the read timeout, or no ``[DONE]`` within the total."""

    code = StatusCode.DEADLINE_EXCEEDED


class GenerateConfigError(SessionError):
    """An ``Action.configs`` entry GENERATE cannot take: an unknown key or config type, a wrong type, out of
    range; the message names the key."""

    code = StatusCode.INVALID_ARGUMENT
