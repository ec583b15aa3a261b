"""One way to validate a frozen dataclass of limits, so every protocol's limits fail alike.

A bad limit is a :class:`~evergreen_trio.errors.ConfigurationError` raised when the limits are
built; a limit crossed at run time is each protocol's own error (``dag.LimitExceededError``,
``ipc.LimitExceededError``, ``avp.AVPLimitError``, a gRPC or HTTP/2 status on the picker's wire).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from evergreen_trio.errors import ConfigurationError


def check_limits(limits: Any, *, minimum: int = 1, maximum: Mapping[str, int] | None = None) -> None:
    """Check every field of the dataclass ``limits`` (call it from ``__post_init__``).

    A field annotated ``int`` must be an int (not a bool) >= ``minimum``; one annotated
    ``float`` may also be a float, and must be > 0; one whose annotation allows ``None`` may be
    None. ``maximum`` caps named fields. Raises ConfigurationError naming ``Class.field``.
    """
    maximum = maximum or {}
    for field in fields(limits):
        value = getattr(limits, field.name)
        annotation = str(field.type)
        name = f"{type(limits).__name__}.{field.name}"
        if value is None and "None" in annotation:
            continue
        if "float" in annotation:
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigurationError(f"{name}: expected a number > 0, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigurationError(f"{name}: expected an int >= {minimum}, got {value!r}")
        if field.name in maximum and value > maximum[field.name]:
            raise ConfigurationError(f"{name}: expected at most {maximum[field.name]}, got {value!r}")
