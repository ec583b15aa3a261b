"""The simulator's error hierarchy: bad configuration, bad requests, overload."""

from __future__ import annotations

from evergreen_trio.errors import ConfigurationError, EvergreenTrioError


class SimError(EvergreenTrioError):
    """Base of every error the model-server simulator raises on purpose."""


class SimConfigError(SimError, ConfigurationError):
    """A simulator knob is out of range; the message names the knob, what it must be and what came."""


class SimRequestError(SimError):
    """A request the simulated server refuses, with the HTTP status and OpenAI error type it answers with."""

    def __init__(self, status: int, message: str, *, error_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
