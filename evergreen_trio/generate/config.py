"""``BackendSettings``: where GENERATE sends its prompts and the limits it keeps, validated once."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from evergreen_trio.generate.errors import BackendConfigError

Api = Literal["completions", "chat"]
"""The OpenAI API a backend speaks: ``/completions`` or ``/chat/completions``."""
APIS: tuple[Api, ...] = ("completions", "chat")
"""Every ``Api`` value, for validation and help texts."""
_TOKEN = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class BackendSettings:
    """An OpenAI-compatible endpoint for GENERATE, and the limits of each request to it.

    ``url`` is the API base as OpenAI clients take it (``http://host:port/v1``); a URL with no
    path gets ``/v1``. ``api`` picks ``POST {base}/completions`` (the flattened prompt as one
    string, the default) or ``POST {base}/chat/completions`` (one message per run of chunks with
    the same ``role``).
    """

    url: str
    model: str
    api: Api = "completions"
    max_tokens: int | None = 256
    """Sent as ``max_tokens``; None leaves it to the backend."""
    include_usage: bool = True
    """Ask for ``stream_options.include_usage`` (token counts in the log line)."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as ``Authorization: Bearer ...`` when set: printable ASCII, no spaces (a token)."""
    served_by_header: str = "x-served-by"
    """Response header naming the model server that answered (the simulator and the demo set it)."""
    connect_timeout_s: float = 5.0
    """Connecting, or waiting for a free pooled connection: past it, UNAVAILABLE."""
    read_timeout_s: float = 60.0
    """Longest wait for the next bytes (the first token included): past it, DEADLINE_EXCEEDED."""
    total_timeout_s: float = 600.0
    """Whole upstream request, headers to ``[DONE]``: past it, DEADLINE_EXCEEDED."""
    max_prompt_bytes: int = 1 << 20
    """UTF-8 bytes of prompt text sent: past it, RESOURCE_EXHAUSTED."""
    max_response_bytes: int = 16 << 20
    """Bytes of one streamed response: past it, RESOURCE_EXHAUSTED."""
    max_line_bytes: int = 1 << 20
    """One SSE line, and one event's data: past it, RESOURCE_EXHAUSTED."""
    max_error_bytes: int = 64 << 10
    """Bytes of an error response read for its message (the rest is dropped)."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise BackendConfigError(f"url: expected http(s)://host[:port][/path], got {self.url!r}")
        try:
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError:
            raise BackendConfigError(f"url: expected a port in 1..65535, got {self.url!r}") from None
        if not self.model:
            raise BackendConfigError("model: expected a model name, got ''")
        if self.api not in APIS:
            raise BackendConfigError(f"api: expected one of {', '.join(APIS)}, got {self.api!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BackendConfigError(f"max_tokens: expected >= 1 or None, got {self.max_tokens}")
        if self.api_key is not None and not _TOKEN.fullmatch(self.api_key):
            # Never echo the key: httpx's error for a bad header value quoted it to every client.
            raise BackendConfigError(
                f"api_key: expected printable ASCII without spaces or line ends, got {len(self.api_key)} "
                "characters that are not (a trailing newline from a secret file?)"
            )
        if not self.served_by_header:
            raise BackendConfigError("served_by_header: expected a header name, got ''")
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise BackendConfigError(f"{name}: expected a finite number of seconds > 0, got {value}")
        for name in ("max_prompt_bytes", "max_response_bytes", "max_line_bytes", "max_error_bytes"):
            if getattr(self, name) < 1:
                raise BackendConfigError(f"{name}: expected >= 1, got {getattr(self, name)}")

    @property
    def base_url(self) -> str:
        """The API base: ``url`` without a trailing slash, ``/v1`` when it has no path."""
        base = self.url.rstrip("/")
        return base if urlsplit(base).path else f"{base}/v1"

    @property
    def endpoint(self) -> str:
        """The URL requests go to: ``base_url`` + ``/chat/completions`` or ``/completions``."""
        return f"{self.base_url}/{'chat/completions' if self.api == 'chat' else 'completions'}"
