"""The picker's error hierarchy, rooted in :class:`evergreen_trio.errors.EvergreenTrioError`."""

from __future__ import annotations

from evergreen_trio.errors import ConfigurationError, EvergreenTrioError


class PickerError(EvergreenTrioError):
    """Base of every error the Endpoint Picker raises on purpose."""


class ConfigError(PickerError, ConfigurationError):
    """A configuration document is invalid; ``field`` names the offending field by its path."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        shown = repr(got)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{field}: expected {expected}, got {shown}")


class RequestError(PickerError):
    """A request the picker answers itself with an HTTP error status (400, 404, 413, 429, 500, 502, 503),
    and for a request dropped under load the reference's ``x-llm-d-request-dropped-reason``."""

    def __init__(self, status: int, message: str, dropped_reason: str = "") -> None:
        self.status = status
        self.message = message
        self.dropped_reason = dropped_reason
        super().__init__(f"HTTP {status}: {message}")


class MetricsError(PickerError):
    """A model server's ``/metrics`` text could not be read as the expected engine's metrics."""


class ModelsError(PickerError):
    """A model server's ``/v1/models`` answer could not be read as its list of served models."""


class ExtProcError(PickerError):
    """Envoy sent an ext_proc message the stream's state does not allow (the stream is aborted)."""


class EnvoyError(PickerError):
    """The Envoy binary is missing, exited, or did not become ready in time."""
