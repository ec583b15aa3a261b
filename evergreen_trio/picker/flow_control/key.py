"""The flow key of a request: its fairness id and the name of its InferenceObjective, from headers.

llm-d-router reads ``x-llm-d-inference-fairness-id`` (GIE's ``x-gateway-inference-fairness-id``
still accepted) and ``x-llm-d-inference-objective`` (``x-gateway-inference-objective``); the
first spelling wins when both come. A request without a fairness id is in ``default-flow``.
A fairness id names a queue, so it is bounded: at most :data:`MAX_FAIRNESS_ID_CHARS` visible
ASCII characters, else the request is a 400.
"""

from __future__ import annotations

from collections.abc import Mapping

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.gotext import trim_space

FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
DEFAULT_FAIRNESS_ID = "default-flow"
MAX_FAIRNESS_ID_CHARS = 256


def first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` present (even empty), as llm-d reads aliased headers."""
    for name in names:
        value = headers.get(name)
        if value is not None:
            return value
    return None


def fairness_id(headers: Mapping[str, str]) -> str:
    """The request's fairness id (``default-flow`` when absent or empty); RequestError 400 when it is
    longer than :data:`MAX_FAIRNESS_ID_CHARS` or holds anything but visible ASCII."""
    value = trim_space(first_header(headers, FAIRNESS_HEADERS) or "")
    if not value:
        return DEFAULT_FAIRNESS_ID
    # visible ASCII (0x21-0x7E): printable ASCII but the space, checked in C rather than per character
    if len(value) > MAX_FAIRNESS_ID_CHARS or not (value.isascii() and value.isprintable() and " " not in value):
        raise RequestError(400, f"{FAIRNESS_HEADERS[0]} must be at most {MAX_FAIRNESS_ID_CHARS} visible "
                                f"ASCII characters")
    return value


def objective_name(headers: Mapping[str, str]) -> str | None:
    """The InferenceObjective the request names, if any (an unknown name just sets no priority)."""
    value = first_header(headers, OBJECTIVE_HEADERS)
    return trim_space(value) or None if value is not None else None
