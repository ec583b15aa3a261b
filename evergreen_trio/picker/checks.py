"""Type checks of decoded YAML values, shared by the picker's config readers; each raises
:class:`ConfigError` naming the value's path, what was expected and what came."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from evergreen_trio.picker.errors import ConfigError

FLOAT_LIMIT = 2**1024 - 2**970
"""The least integer float() cannot hold (it rounds to infinity): a number parameter is below it
in magnitude, as JSON (the reference's configs are YAML turned into JSON) has no NaN or infinity
and Go's decoding into a float64 refuses an integer past its range."""


def mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(path, "a mapping", value)
    return value


def sequence(value: object, path: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise ConfigError(path, "a list", value)
    return value


def string(value: object, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, "a non-empty string", value)
    return value


def integer(value: object, path: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ConfigError(path, "an integer" + ("" if minimum is None else f" >= {minimum}"), value)
    return value


def number(value: object, path: str, *, positive: bool = False) -> float:
    """A number >= 0 (> 0 with ``positive``) that float64 holds: YAML's ``.nan`` and ``.inf`` are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < FLOAT_LIMIT or (
            positive and value == 0):
        raise ConfigError(path, "a finite positive number" if positive else "a finite number >= 0", value)
    return float(value)
