"""JSON text as Go's ``json.Marshal`` writes it, for values ``json.loads`` made.

llm-d-router's estimate token backend packs request parts as Go marshals them: :func:`go_marshal`
(what Go's decoder made of the JSON: maps with their keys sorted, numbers as float64) and
:func:`go_compact` (a ``json.RawMessage``: the wire's key order). Both write no spaces, escape
``<``, ``>``, ``&``, U+2028 and U+2029, and walk with a stack, not recursion: a client's nesting
depth must not reach Python's limit. Pure functions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from evergreen_trio.picker.parsers.gojson import text as go_text

_HTML = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _go_string(value: str) -> str:
    # Python's escapes of control characters are Go's (since Go 1.22: \b and \f short too); a lone
    # surrogate cannot be in a Go string (its decoder made it U+FFFD).
    return json.dumps(go_text(value), ensure_ascii=False).translate(_HTML)


def go_float(value: float) -> str:
    """A float64 as Go's encoding/json writes it: the shortest digits, plain between 1e-6 and
    1e21, else an exponent without padding (``1e-07`` -> ``1e-7``)."""
    if not math.isfinite(value):
        raise ValueError(f"json: unsupported value: {value}")
    magnitude = abs(value)
    if magnitude == 0 or 1e-6 <= magnitude < 1e21:
        return format(Decimal(repr(value)).normalize(), "f")
    mantissa, _, exponent = repr(value).partition("e")
    sign = exponent[0] if exponent[0] in "+-" else "+"
    return f"{mantissa.removesuffix('.0')}e{sign}{int(exponent.lstrip('+-')):02d}".replace("e+0", "e+").replace(
        "e-0", "e-") if exponent else mantissa


def go_marshal(value: object) -> str:
    """``value`` (as ``json.loads`` made it) as Go marshals what its decoder made of the same JSON
    (objects into maps, numbers into float64); ValueError for a number beyond float64."""
    return _walk(value, _go_scalar, lambda obj: sorted(obj.items()), ",", ":")


def go_compact(value: object) -> str:
    """``value`` as Go writes a ``json.RawMessage`` of it: the wire's key order kept, compact, Go's
    string escapes (a number as Python writes it back: the wire's literal when it was canonical)."""
    return _walk(value, _compact_scalar, lambda obj: obj.items(), ",", ":")


def _compact_scalar(value: object) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return json.dumps(value)
    return _go_scalar(value)


def _go_scalar(value: object) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _go_string(value)
    if isinstance(value, int | float):
        return go_float(float(value))
    raise ValueError(f"json: unsupported type {type(value).__name__}")


def _walk(value: object, scalar: Callable[[object], str], members: Callable[[Any], Any], comma: str,
          colon: str) -> str:
    out: list[str] = []
    # Work items: a value to write, or a piece of text to write as it is (a 1-tuple).
    stack: list[object] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            out.append(item[0])
            continue
        if isinstance(item, Mapping):
            pending: list[object] = [("{",)]
            for i, (key, member) in enumerate(members(item)):
                pending += [(f"{comma if i else ''}{scalar(key)}{colon}",), member]
            pending.append(("}",))
        elif isinstance(item, list):
            pending = [("[",)]
            for i, member in enumerate(item):
                pending += [(comma,), member] if i else [member]
            pending.append(("]",))
        else:
            out.append(scalar(item))
            continue
        stack.extend(reversed(pending))
    return "".join(out)
