"""GENERATE's generation settings from ``Action.configs``, sans-IO: parsed, type- and range-checked once.

A config is a ``google.protobuf.Struct`` packed in a ``google.protobuf.Any`` (the spec's
"proto.Any wrapping GenerateConfig", with the shared OpenAI names). Keys:

============  =================================  ======================================
key           value                              OpenAI request field
============  =================================  ======================================
max_tokens    integer, 1 .. 1,000,000            ``max_tokens`` (overrides the server's)
temperature   number, 0 .. 2                     ``temperature``
top_p         number, > 0 .. 1                   ``top_p``
stop          string, or list of 1-4 strings     ``stop`` (non-empty strings, each <= 256 chars)
seed          integer, -2**53 .. 2**53           ``seed``
============  =================================  ======================================

Anything else (another key, another message type, a later Struct repeating a key) is refused with
`GenerateConfigError` (INVALID_ARGUMENT) naming the key or type.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.message import DecodeError
from google.protobuf.struct_pb2 import Struct, Value

from evergreen_trio.generate.errors import GenerateConfigError

MAX_TOKENS_LIMIT = 1_000_000
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
_SEED_LIMIT = 2**53  # a Struct number is a double: integers are exact up to here


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """The settings a GENERATE call asked for; None: not asked (the backend's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None

    def openai_fields(self) -> dict[str, Any]:
        """The request fields to set (``stop`` as a list)."""
        out: dict[str, Any] = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                out[spec.name] = list(value) if spec.name == "stop" else value
        return out


KEYS = tuple(spec.name for spec in fields(GenerateParams))


def _number(key: str, value: Value, where: str) -> float:
    if value.WhichOneof("kind") != "number_value" or not math.isfinite(value.number_value):
        raise GenerateConfigError(f"{where}: config {key!r}: expected a finite number, got {_kind(value)}")
    return value.number_value


def _integer(key: str, value: Value, low: int, high: int, where: str) -> int:
    number = _number(key, value, where)
    if not number.is_integer() or not low <= number <= high:
        raise GenerateConfigError(f"{where}: config {key!r}: expected an integer in {low}..{high}, got {number!r}")
    return int(number)


def _kind(value: Value) -> str:
    kind = value.WhichOneof("kind") or "nothing"
    if kind == "number_value":
        return f"the number {value.number_value!r}"
    return kind.removesuffix("_value")


def _stop(value: Value, where: str) -> tuple[str, ...]:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value]
    elif kind == "list_value" and 1 <= len(value.list_value.values) <= MAX_STOP_SEQUENCES:
        items = list(value.list_value.values)
    else:
        raise GenerateConfigError(
            f"{where}: config 'stop': expected a string or a list of 1..{MAX_STOP_SEQUENCES} strings, "
            f"got {_kind(value) if kind != 'list_value' else f'a list of {len(value.list_value.values)}'}"
        )
    stops = []
    for item in items:
        if item.WhichOneof("kind") != "string_value" or not 1 <= len(item.string_value) <= MAX_STOP_CHARS:
            raise GenerateConfigError(
                f"{where}: config 'stop': expected non-empty strings of at most {MAX_STOP_CHARS} chars, got "
                f"{_kind(item) if item.WhichOneof('kind') != 'string_value' else f'{len(item.string_value)} chars'}"
            )
        stops.append(item.string_value)
    return tuple(stops)


def _value(key: str, value: Value, where: str) -> Any:
    if key == "max_tokens":
        return _integer(key, value, 1, MAX_TOKENS_LIMIT, where)
    if key == "seed":
        return _integer(key, value, -_SEED_LIMIT, _SEED_LIMIT, where)
    if key == "stop":
        return _stop(value, where)
    number = _number(key, value, where)
    in_range = 0.0 <= number <= 2.0 if key == "temperature" else 0.0 < number <= 1.0
    if not in_range:
        bounds = "0 .. 2" if key == "temperature" else "> 0 .. 1"
        raise GenerateConfigError(f"{where}: config {key!r}: expected a number in {bounds}, got {number!r}")
    return number


def parse_configs(configs: Iterable[AnyProto], *, where: str) -> GenerateParams:
    """The settings in ``configs`` (each a packed Struct); raises `GenerateConfigError` naming the culprit."""
    found: dict[str, Any] = {}
    for packed in configs:
        if not packed.Is(Struct.DESCRIPTOR):
            raise GenerateConfigError(
                f"{where}: config of type {packed.type_url!r}: expected google.protobuf.Struct "
                f"with keys {', '.join(KEYS)}"
            )
        struct = Struct()
        try:
            unpacked = packed.Unpack(struct)
        except DecodeError:  # Unpack returns False only for another type; a corrupt Struct raises
            unpacked = False
        if not unpacked:
            raise GenerateConfigError(f"{where}: config of type {packed.type_url!r}: expected a valid Struct")
        for key, value in struct.fields.items():
            if key not in KEYS:
                raise GenerateConfigError(f"{where}: config {key!r}: unknown key (GENERATE reads {', '.join(KEYS)})")
            if key in found:
                raise GenerateConfigError(f"{where}: config {key!r}: given twice")
            found[key] = _value(key, value, where)
    return GenerateParams(**found)


def generate_config(**settings: Any) -> AnyProto:
    """One config for ``session.run(..., configs=[...])``: ``generate_config(max_tokens=64, temperature=0.2)``."""
    struct = Struct()
    struct.update({key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()})
    packed = AnyProto()
    packed.Pack(struct)
    return packed
