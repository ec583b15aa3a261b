"""The ``/debug/plugins/state`` body (``evergreen_trio.picker.plugin_state``): the reference's
handler tests (``server/plugin_state_debug_test.go``), its messages, and the list caps."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.plugin_state import (
    INVALID_JSON,
    MAX_ID_CHARS,
    MAX_LISTED,
    REUSE_S,
    UNSUPPORTED,
    PluginDump,
    StatePage,
    busiest,
    first_sorted,
    render,
    rfc3339_nano,
)

FROZEN = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_every_plugin_is_listed_by_name_with_its_state_or_the_unsupported_message() -> None:
    # TestPluginStateDebugHandlerIncludesPlugins
    body = render([
        PluginDump("skip", "skip-type"),
        PluginDump("z-dumper", "test-type", lambda: {"count": 2}),
        PluginDump("a-dumper", "test-type", lambda: {"value": "first"}),
    ], FROZEN)
    assert json.loads(body) == {
        "timestamp": "2025-01-02T03:04:05Z",
        "plugins": {
            "a-dumper": {"name": "a-dumper", "type": "test-type", "state": {"value": "first"}},
            "skip": {"name": "skip", "type": "skip-type", "message": UNSUPPORTED},
            "z-dumper": {"name": "z-dumper", "type": "test-type", "state": {"count": 2}},
        },
    }
    assert body.index(b'"a-dumper"') < body.index(b'"skip"') < body.index(b'"z-dumper"')  # Go's map order


def test_a_dump_of_invalid_json_costs_only_its_plugin() -> None:
    # TestPluginStateDebugHandlerReportsPluginStateErrors
    body = render([PluginDump("bad-dumper", "test-type", lambda: b"{"),
                   PluginDump("good-dumper", "test-type", lambda: b'{"ok":true}')], FROZEN)
    assert json.loads(body)["plugins"] == {
        "bad-dumper": {"name": "bad-dumper", "type": "test-type", "message": INVALID_JSON},
        "good-dumper": {"name": "good-dumper", "type": "test-type", "state": {"ok": True}},
    }


def test_an_empty_raw_dump_is_a_null_state() -> None:
    assert json.loads(render([PluginDump("p", "t", lambda: b"")], FROZEN))["plugins"]["p"]["state"] is None


def test_a_raising_or_non_finite_dump_is_its_failure_message() -> None:
    def boom() -> object:
        raise RuntimeError("x" * 10_000)

    body = json.loads(render([PluginDump("raises", "t", boom), PluginDump("nan", "t", lambda: {"v": math.nan}),
                              PluginDump("inf", "t", lambda: b'{"v": Infinity}'),
                              PluginDump("odd", "t", lambda: {"v": object()})], FROZEN))["plugins"]
    assert body["raises"]["message"].startswith("failed to dump plugin state: xxx")
    assert len(body["raises"]["message"]) < 400  # the error text is cut
    assert body["nan"]["message"].startswith("failed to dump plugin state: ")
    assert body["inf"]["message"] == INVALID_JSON  # as Go's json.Valid
    assert body["odd"]["message"].startswith("failed to dump plugin state: ")
    assert all("state" not in entry for entry in body.values())


def test_the_timestamp_is_go_rfc3339_nano_in_utc() -> None:
    assert rfc3339_nano(FROZEN) == "2025-01-02T03:04:05Z"
    assert rfc3339_nano(FROZEN.replace(microsecond=120_000)) == "2025-01-02T03:04:05.12Z"
    assert rfc3339_nano(datetime(2025, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2)))) == "2025-01-02T03:04:05Z"


def test_a_flood_of_requests_costs_one_dump_per_reuse_interval() -> None:
    dumps = []

    def dump() -> object:
        dumps.append(1)
        return {"dumps": len(dumps)}

    page = StatePage([PluginDump("p", "t", dump)])
    first = page.body(100.0, FROZEN)
    for i in range(1000):
        assert page.body(100.0 + i * REUSE_S / 1000, FROZEN + timedelta(seconds=i)) == first
    assert len(dumps) == 1
    later = json.loads(page.body(100.0 + REUSE_S, FROZEN + timedelta(seconds=5)))
    assert later == {"timestamp": "2025-01-02T03:04:10Z",
                     "plugins": {"p": {"name": "p", "type": "t", "state": {"dumps": 2}}}}


names = st.text(min_size=0, max_size=40)


@given(st.dictionaries(names, st.one_of(st.none(), st.booleans(), st.integers(), names,
                                         st.floats(allow_nan=True, allow_infinity=True)), max_size=20))
def test_any_set_of_dumps_renders_valid_json_with_one_entry_per_plugin(states: dict[str, object]) -> None:
    plugins = [PluginDump(name, "t", (lambda v=value: {"v": v}) if i % 3 else None)
               for i, (name, value) in enumerate(states.items())]
    body = json.loads(render(plugins, FROZEN))
    assert set(body["plugins"]) == set(states)
    for entry in body["plugins"].values():
        assert ("state" in entry) != ("message" in entry)


@given(st.lists(st.text(max_size=MAX_ID_CHARS + 20)), st.integers(0, 150))
def test_first_sorted_is_sort_then_truncate_with_each_name_cut(items: list[str], limit: int) -> None:
    assert first_sorted(items, limit) == [s[:MAX_ID_CHARS] for s in sorted(items)[:limit]]


@given(st.dictionaries(st.text(max_size=8), st.integers(0, 5)), st.integers(0, 150))
def test_busiest_is_the_reference_stable_sort_by_load_then_name(loads: dict[str, int], limit: int) -> None:
    expected = sorted(loads, key=lambda name: (-loads[name], name))[:limit]
    assert busiest(loads, limit) == expected
    assert len(busiest(loads)) == min(len(loads), MAX_LISTED)
