"""What the reference parsers' JSON checks owe to Go's ``encoding/json``, for bodies decoded here.

A reference parser reads a body into a map (what it forwards; ``model`` and ``stream`` come from
it) and into a struct of the fields it checks. The map decode refuses NaN and Infinity literals
and, into ``float64``, any number beyond its range; :func:`load` parses the same way and keeps
every member of an object that repeats a key. The struct decode fails on any member of the wrong
JSON type; the ``Spec`` functions below check a decoded value as decoding it into a Go type
would: member names match field names case-insensitively (Unicode simple folding, of which
U+017F, U+212A, U+0131 and U+0130 fold into ASCII), every member counts in document order (the
last one wins), and null leaves a Go zero value (None here). Invalid UTF-8, and lone surrogate
escapes in the strings read (:func:`text`), become U+FFFD, as Go decodes them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from string import ascii_lowercase
from typing import Any

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.request import load_object, no_constant

Spec = Callable[[object, str], Any]
"""A Go type: checks a decoded JSON value at a path, returns it decoded (raises :class:`Mismatch`)."""


class Mismatch(ValueError):
    """A JSON value that does not decode into the Go type at its path."""

    def __init__(self, path: str, expected: str, value: object) -> None:
        super().__init__(f"cannot unmarshal {_json_type(value)} into {path} of type {expected}")


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class _Repeated(dict[str, Any]):
    """An object whose members repeat a key: ``pairs`` holds them all, in document order."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    repeated = _Repeated(obj)
    repeated.pairs = pairs
    return repeated


def members(obj: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    """An object's members in document order, a repeated key each time it came."""
    return obj.pairs if isinstance(obj, _Repeated) else obj.items()


def _float64(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError(f"number {literal[:32]} is out of float64's range")
    return value


def _integer_in_float64(literal: str) -> int:
    _float64(literal)
    return int(literal)


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_constant=no_constant)
_FLOAT64_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_constant=no_constant,
                                    parse_float=_float64, parse_int=_integer_in_float64)
# A literal beyond float64 has a 3-digit exponent or 210 digits before it; only a body holding
# one pays for parsing every number in Python.
_MAY_OVERFLOW = re.compile(rb"[eE][+-]?\d{3}|\d{210}")


def _utf8(body: bytes) -> str:
    return body.decode("utf-8", "replace")


def load(body: bytes, *, float64: bool = True) -> tuple[dict[str, Any], str, tuple[int, int] | None]:
    """:func:`~evergreen_trio.picker.request.load_object` with Go's rules: ``float64`` (a map
    decode) refuses numbers beyond float64's range."""
    decoder = _FLOAT64_DECODER if float64 and _MAY_OVERFLOW.search(body) else _DECODER
    return load_object(body, decoder, _utf8)


_SURROGATE = re.compile("[\ud800-\udfff]")


def text(value: str) -> str:
    """A decoded JSON string as Go holds it: each lone surrogate escape is U+FFFD."""
    return value if value.isascii() or not _SURROGATE.search(value) else _SURROGATE.sub("\ufffd", value)


def checked(spec: Spec, value: object, what: str) -> Any:
    """``value`` decoded by ``spec``; RequestError(400) naming ``what`` when it does not decode."""
    try:
        return spec(value, what)
    except Mismatch as exc:
        raise RequestError(400, f"invalid {what}: {exc}") from None
    except RecursionError:
        raise RequestError(400, f"invalid {what}: nested too deeply") from None


# -- Go types ----------------------------------------------------------------------------------


def string(value: object, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise Mismatch(path, "string", value)


def boolean(value: object, path: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise Mismatch(path, "bool", value)


def float64(value: object, path: str) -> float | None:
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise Mismatch(path, "float64", value)


def integer(low: int, high: int, name: str) -> Spec:
    """A Go integer type of range ``low..high``: an integer literal (no fraction, no exponent)."""

    def decode(value: object, path: str) -> int | None:
        if value is None or (type(value) is int and low <= value <= high):
            return value
        raise Mismatch(path, name, value)

    return decode


INT = integer(-(2**63), 2**63 - 1, "int")
UINT32 = integer(0, 2**32 - 1, "uint32")


def raw(value: object, path: str) -> object:
    """``json.RawMessage`` and ``any``: every value."""
    return value


def slice_of(element: Spec) -> Spec:
    def decode(value: object, path: str) -> list[Any] | None:
        if value is None:
            return None
        if not isinstance(value, list):
            raise Mismatch(path, "slice", value)
        return [element(item, f"{path}[{i}]") for i, item in enumerate(value)]

    return decode


def string_or_blocks(go_type: str, blocks: Callable[[], Spec]) -> Spec:
    """A content type the reference unmarshals from a string (null: an empty one) or else an array
    of content blocks (``blocks()``, asked late so that a block may hold content in turn)."""

    def decode(value: object, path: str) -> Any:
        if value is None or isinstance(value, str):
            return value or ""
        if isinstance(value, list):
            try:
                return blocks()(value, path)
            except Mismatch:
                pass
        raise Mismatch(path, f"{go_type} (a string or an array of content blocks)", value)

    return decode


def map_of(element: Spec) -> Spec:
    def decode(value: object, path: str) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise Mismatch(path, "map", value)
        return {key: element(item, f"{path}.{key}") for key, item in members(value)}

    return decode


# Go's foldName upper-cases after lower-casing: these four non-ASCII letters fold into ASCII.
_FOLD = str.maketrans({**{c: c.upper() for c in ascii_lowercase},
                       "\u017f": "S", "\u212a": "K", "\u0131": "I", "\u0130": "I"})


MAX_FOLDED_NAMES = 4096
"""Member names a struct keeps the field of at hand (they are the client's: cleared when full)."""
_UNSEEN = ("", raw)


def struct(go_type: str, /, **fields: Spec) -> Spec:
    """The Go struct ``go_type`` of JSON fields ``fields`` (decoded as a dict of the fields present)."""
    by_fold = {field.upper(): (field, spec) for field, spec in fields.items()}
    by_name: dict[str, tuple[str, Spec] | None] = {}  # a member name's field (None: none), once folded

    def decode(value: object, path: str) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise Mismatch(path, go_type, value)
        out: dict[str, Any] = {}
        for key, item in value.pairs if type(value) is _Repeated else value.items():  # members(value), inline
            found = by_name.get(key, _UNSEEN)
            if found is _UNSEEN:
                if len(by_name) >= MAX_FOLDED_NAMES:
                    by_name.clear()
                found = by_name[key] = by_fold.get(key.translate(_FOLD))
            if found is not None:
                field, spec = found
                if spec is string and (item is None or type(item) is str):  # string(), inline: the usual field
                    out[field] = item
                else:
                    out[field] = spec(item, f"{path}.{field}")
        return out

    return decode


def max_output_tokens(obj: Mapping[str, Any], *keys: str) -> int | None:
    """llm-d-router's MaxOutputTokensFromPayload: the first key holding a whole number >= 0 (a
    value of another type, negative or fractional counts as absent)."""
    for key in keys:
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if value >= 0 and (isinstance(value, int) or (math.isfinite(value) and value == int(value))):
            return int(value)
    return None
