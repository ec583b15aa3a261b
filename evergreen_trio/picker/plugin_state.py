"""llm-d-router's plugin state debug dump (``server/plugin_state_debug.go``), sans-IO.

``GET /debug/plugins/state`` on the metrics port answers one JSON object: ``timestamp`` (RFC 3339
with nanoseconds, UTC) and ``plugins``, by configured plugin name, each ``{name, type}`` with its
``state`` when the plugin dumps one (the reference's ``StateDumper``), else a ``message``:
:data:`UNSUPPORTED`, or why its dump failed. A :class:`PluginDump` pairs a plugin with its dump
(a callable returning JSON-able values, or raw JSON ``bytes`` as the reference's ``DumpState``);
:func:`render` builds the body. A dump that raises, holds a non-finite float or returns invalid
JSON costs that plugin its state, never the response.

The per-plugin shapes list at most ``MAX_LISTED`` items (the reference's ``maxDebugDump*`` and
``maxDump*`` caps, all 100), chosen by :func:`first_sorted` and :func:`busiest` in O(n log 100);
each listed identity is cut to ``MAX_ID_CHARS`` (256, our cap: a request id is a client's header).
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

PATH = "/debug/plugins/state"
UNSUPPORTED = "plugin does not support state collection"
INVALID_JSON = "plugin returned invalid JSON state"
MAX_LISTED = 100
MAX_ID_CHARS = 256
MAX_ERROR_CHARS = 300  # of a failed dump's error text in its message
REUSE_S = 1.0
"""A body rendered less than this ago is served again (:class:`StatePage`): a flood of requests
costs at most one dump a second (a dump at the caps' worst takes about 10 ms)."""

DumpState = Callable[[], object]
"""A plugin's dump: a JSON-able value (dicts, lists, strings, finite numbers), or raw JSON bytes."""


@dataclass(frozen=True)
class PluginDump:
    """One configured plugin: its name, its type, and its dump (None: it has no state to show)."""

    name: str
    type: str
    dump: DumpState | None = None


def identity(text: str) -> str:
    """``text`` as a dump lists it: at most :data:`MAX_ID_CHARS` characters."""
    return text if len(text) <= MAX_ID_CHARS else text[:MAX_ID_CHARS]


def first_sorted(names: Iterable[str], limit: int = MAX_LISTED) -> list[str]:
    """The ``limit`` smallest of ``names`` in order (the reference's sort, then truncate), each
    cut to :data:`MAX_ID_CHARS`."""
    return [identity(name) for name in heapq.nsmallest(limit, names)]


def busiest(loads: Mapping[str, float], limit: int = MAX_LISTED) -> list[str]:
    """The ``limit`` names of ``loads`` with the highest load, ties by name (the reference's stable
    sort by load descending, then name); list them with :func:`identity`."""
    return heapq.nsmallest(limit, loads, key=lambda name: (-loads[name], name))


def finite(value: float) -> float:
    """``value``, or 0 for NaN and infinities (which JSON cannot carry: the reference coerces them)."""
    return value if math.isfinite(value) else 0.0


def rfc3339_nano(now: datetime) -> str:
    """``now`` in UTC as Go's ``time.RFC3339Nano``: trailing zeros of the fraction dropped, ``Z``."""
    now = now.astimezone(UTC)
    text = now.strftime("%Y-%m-%dT%H:%M:%S")
    if now.microsecond:
        text += f".{now.microsecond:06d}".rstrip("0")
    return text + "Z"


def _state(dump: DumpState) -> tuple[str, Any]:
    """("state", the encoded JSON) or ("message", why not)."""
    try:
        state = dump()
        if isinstance(state, bytes | bytearray):
            raw = bytes(state) or b"null"
            try:
                return "state", json.dumps(json.loads(raw), allow_nan=False, separators=(",", ":"))
            except ValueError:
                return "message", INVALID_JSON
        return "state", json.dumps(state, allow_nan=False, separators=(",", ":"))
    except Exception as exc:  # a plugin's failure is its entry's message, never the response's
        return "message", f"failed to dump plugin state: {str(exc)[:MAX_ERROR_CHARS]}"


def render(plugins: Iterable[PluginDump], now: datetime) -> bytes:
    """The response body: every plugin's entry by name (sorted, as Go's map encoding), dumped now."""
    entries = []
    for plugin in sorted(plugins, key=lambda p: p.name):
        head = f'{json.dumps(plugin.name)}:{{"name":{json.dumps(plugin.name)},"type":{json.dumps(plugin.type)}'
        if plugin.dump is None:
            entries.append(f'{head},"message":{json.dumps(UNSUPPORTED)}}}')
            continue
        key, value = _state(plugin.dump)
        entries.append(f'{head},"state":{value}}}' if key == "state" else f'{head},"message":{json.dumps(value)}}}')
    return f'{{"timestamp":"{rfc3339_nano(now)}","plugins":{{{",".join(entries)}}}}}'.encode()


class StatePage:
    """The endpoint's body for ``plugins``, rendered at most once per ``reuse_s`` (the first
    request after that renders anew; the ones before get the same snapshot and timestamp)."""

    def __init__(self, plugins: Iterable[PluginDump], reuse_s: float = REUSE_S) -> None:
        self.plugins = list(plugins)  # render sorts them
        self.reuse_s = reuse_s
        self._body = b""
        self._at = -math.inf

    def body(self, monotonic: float, now: datetime) -> bytes:
        """The body at ``monotonic`` seconds (the reuse clock); ``now`` stamps a new one."""
        if not monotonic - self._at < self.reuse_s:
            self._body, self._at = render(self.plugins, now), monotonic
        return self._body

