"""GENERATE backed by any OpenAI-compatible endpoint (a model server, or the gateway in front of a pool).

``open_backend(BackendSettings(url, model))`` gives an :class:`OpenAIBackend` whose ``generate`` is
the action handler; ``evergreen-trio serve --generate-backend URL --model NAME`` wires it from the
command line. See docs/generate.md.

The HTTP client (``httpx``, the ``generate`` extra) is imported only when a backend name is first
used, so the built-in GENERATE action's settings (``GenerateParams``) work in a core install.
"""

from typing import TYPE_CHECKING, Any

from evergreen_trio.generate.config import APIS, Api, BackendSettings
from evergreen_trio.generate.errors import (
    BackendConfigError,
    BackendError,
    GenerateConfigError,
    PromptTooLargeError,
    ResponseTooLargeError,
    SSEError,
    StreamFormatError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from evergreen_trio.generate.openai import PromptPart, StreamParser, request_body, status_code
from evergreen_trio.generate.params import GenerateParams, generate_config, parse_configs
from evergreen_trio.generate.sse import SSEDecoder, SSEEvent

if TYPE_CHECKING:
    from evergreen_trio.generate.backend import (
        OpenAIBackend,
        open_backend,
        read_prompt,
        response_metadata,
        served_by,
    )

_BACKEND_NAMES = frozenset({"OpenAIBackend", "open_backend", "read_prompt", "response_metadata", "served_by"})

__all__ = [
    "APIS",
    "Api",
    "BackendConfigError",
    "BackendError",
    "BackendSettings",
    "GenerateConfigError",
    "GenerateParams",
    "OpenAIBackend",
    "PromptPart",
    "PromptTooLargeError",
    "ResponseTooLargeError",
    "SSEDecoder",
    "SSEError",
    "SSEEvent",
    "StreamFormatError",
    "StreamParser",
    "UpstreamStatusError",
    "UpstreamTimeoutError",
    "UpstreamUnavailableError",
    "generate_config",
    "open_backend",
    "parse_configs",
    "read_prompt",
    "request_body",
    "response_metadata",
    "served_by",
    "status_code",
]


def __getattr__(name: str) -> Any:
    """The backend's names, imported on first use (raises MissingExtraError without httpx)."""
    if name in _BACKEND_NAMES:
        from evergreen_trio.generate import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
