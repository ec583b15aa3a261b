"""``utilization-filter``, sans-IO: llm-d-router's own test cases, its invariants, through the
scheduler, and its parameters in an EndpointPickerConfig."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_processor import request_body, request_headers, set_headers

from evergreen_trio.picker.config import PickerConfig, load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.filters import (
    ACTIVE_REQUESTS,
    KV_CACHE_UTILIZATION,
    RUNNING_REQUESTS,
    UTILIZATION_METRICS,
    WAITING_QUEUE,
    Condition,
    UtilizationParams,
    metric_value,
    utilization,
)
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
NONE = EndpointMetrics()


def _caps(*caps: tuple[str, float], fallback: bool = False) -> UtilizationParams:
    return UtilizationParams(tuple(Condition(metric, value) for metric, value in caps), fallback)


def _active(**requests: int) -> dict[str, tuple[EndpointMetrics | None, int]]:
    return {name: (NONE, n) for name, n in requests.items()}


# -- llm-d-router's cases (filter_test.go) ------------------------------------------------------


def test_each_metric_keeps_endpoints_at_or_below_the_cap() -> None:
    assert utilization(_caps((ACTIVE_REQUESTS, 2)), _active(a=1, b=2, c=3)) == ["a", "b"]
    running = {"a": (EndpointMetrics(running=4), 0), "b": (EndpointMetrics(running=5), 0)}
    assert utilization(_caps((RUNNING_REQUESTS, 4)), running) == ["a"]
    waiting = {"a": (EndpointMetrics(waiting=0), 0), "b": (EndpointMetrics(waiting=3), 0)}
    assert utilization(_caps((WAITING_QUEUE, 0)), waiting) == ["a"]
    kv = {"a": (EndpointMetrics(kv_usage=0.5), 0), "b": (EndpointMetrics(kv_usage=0.9), 0)}
    assert utilization(_caps((KV_CACHE_UTILIZATION, 0.8)), kv) == ["a"]


def test_a_missing_value_counts_zero() -> None:
    # No in-flight request recorded is 0 active requests; no scrape is 0 of every scraped metric.
    assert utilization(_caps((ACTIVE_REQUESTS, 1)), {"a": (None, 0), "b": (None, 5)}) == ["a"]
    for metric in (RUNNING_REQUESTS, WAITING_QUEUE, KV_CACHE_UTILIZATION):
        assert metric_value(metric, None, 7) == 0.0
    assert metric_value(ACTIVE_REQUESTS, None, 7) == 7.0


def test_any_exceeded_cap_drops_the_endpoint() -> None:
    loads = {"a": (EndpointMetrics(running=10, waiting=0), 0), "b": (EndpointMetrics(running=41, waiting=0), 0),
             "c": (EndpointMetrics(running=10, waiting=1), 0)}
    assert utilization(_caps((RUNNING_REQUESTS, 40), (WAITING_QUEUE, 0)), loads) == ["a"]
    mixed = {"a": (NONE, 5), "b": (NONE, 11), "c": (EndpointMetrics(kv_usage=0.9), 0)}
    assert utilization(_caps((ACTIVE_REQUESTS, 10), (KV_CACHE_UTILIZATION, 0.8)), mixed) == ["a"]


def test_all_filtered_out_is_empty_unless_falling_back() -> None:
    assert utilization(_caps((ACTIVE_REQUESTS, 1)), _active(a=2, b=3)) == []
    assert utilization(_caps((ACTIVE_REQUESTS, 1), fallback=True), _active(a=2, b=3)) == ["a", "b"]


def test_a_nan_metric_passes_as_the_reference_compares() -> None:
    # The reference drops an endpoint when its value is greater than the cap: NaN never is.
    loads = {"a": (EndpointMetrics(kv_usage=math.nan), 0), "b": (EndpointMetrics(kv_usage=1.0), 0)}
    assert utilization(_caps((KV_CACHE_UTILIZATION, 0.5)), loads) == ["a"]


# -- invariants ---------------------------------------------------------------------------------

_metrics = st.builds(EndpointMetrics, waiting=st.integers(0, 50).map(float), running=st.integers(0, 50).map(float),
                     kv_usage=st.floats(0.0, 1.0))
_loads = st.dictionaries(st.text(min_size=1, max_size=3), st.tuples(st.none() | _metrics, st.integers(0, 50)),
                         max_size=6)
_conditions = st.lists(st.tuples(st.sampled_from(UTILIZATION_METRICS), st.floats(0.0, 1.0) | st.integers(0, 50)),
                       min_size=1, max_size=4)


@given(_loads, _conditions, st.booleans())
def test_filter_keeps_an_ordered_subset_of_those_within_every_cap(
        loads: dict[str, tuple[EndpointMetrics | None, int]], caps: list[tuple[str, float]], fallback: bool) -> None:
    params = _caps(*caps, fallback=fallback)
    kept = utilization(params, loads)
    assert kept == [a for a in loads if a in kept]  # a subset, in the candidates' order
    within = [a for a, (m, n) in loads.items() if all(metric_value(c.metric, m, n) <= c.max_value
                                                      for c in params.conditions)]
    if fallback and not within:
        assert kept == list(loads)  # never empties a non-empty set
    else:
        assert kept == within


# -- through the scheduler ----------------------------------------------------------------------

POOL = f"pool: {{endpoints: ['{A}', '{B}', '{C}']}}\n"


def _scheduler(plugins: str, metrics: tuple[EndpointMetrics, ...]) -> tuple[PickerConfig, Scheduler]:
    config = parse_config(POOL + HEAD + plugins)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, given_metrics in zip(config.pool.endpoints, metrics, strict=True):
        snapshot.update(endpoint.address, given_metrics)
    return config, Scheduler(config, snapshot, random.Random(5))


def test_utilization_filter_through_the_scheduler() -> None:
    _, scheduler = _scheduler("""plugins:
- {type: utilization-filter, name: cap, parameters: {conditions: [{metric: active-requests, maxValue: 1},
                                                                   {metric: kv-cache-utilization, maxValue: 0.8}]}}
- {type: queue-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: cap}, {pluginRef: queue-scorer}]}
""", (EndpointMetrics(waiting=0, kv_usage=0.9), EndpointMetrics(waiting=3), EndpointMetrics(waiting=6)))
    assert scheduler.pick(PickRequest("m", 0)) == [B]  # A (the shortest queue) is over its KV cap
    tickets = [scheduler.inflight.dispatch(B, 0), scheduler.inflight.dispatch(B, 0)]
    assert scheduler.pick(PickRequest("m", 0)) == [C]  # B now has 2 requests in flight
    scheduler.inflight.dispatch(C, 0)
    scheduler.inflight.dispatch(C, 0)
    with pytest.raises(RequestError) as caught:  # every endpoint over a cap, no fallback: busy, not broken
        scheduler.pick(PickRequest("m", 0))
    assert (caught.value.status, caught.value.dropped_reason) == (429, "rejected-saturated")
    for ticket in tickets:
        ticket.release()
    assert scheduler.pick(PickRequest("m", 0)) == [B]


def test_fallback_on_empty_through_the_scheduler() -> None:
    _, scheduler = _scheduler("""plugins:
- {type: utilization-filter, parameters: {conditions: [{metric: waiting-queue, maxValue: 0}], fallbackOnEmpty: true}}
- {type: queue-scorer}
""", (EndpointMetrics(waiting=4), EndpointMetrics(waiting=2), EndpointMetrics(waiting=9)))
    assert scheduler.pick(PickRequest("m", 0)) == [B]  # all queued: every candidate, the queue decides


# -- EndpointPickerConfig -----------------------------------------------------------------------


def test_the_type_is_implemented() -> None:
    assert PLUGIN_TYPES["utilization-filter"].category is Category.FILTER


def test_loads_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + """plugins:
- type: utilization-filter
  name: drop-overloaded-endpoints
  parameters:
    conditions:
    - {metric: running-requests, maxValue: 40}
    - {metric: waiting-queue, maxValue: 0}
    - {metric: kv-cache-utilization, maxValue: 0.8}
    - {metric: active-requests, maxValue: 12.5}
    fallbackOnEmpty: true
    inFlightLoadProducerName: inflight-load-producer
schedulingProfiles:
- {name: default, plugins: [{pluginRef: drop-overloaded-endpoints}]}
""")
    (plugin,) = load_config(path).scheduler.effective_profiles[0].filters
    assert plugin.params == _caps((RUNNING_REQUESTS, 40), (WAITING_QUEUE, 0), (KV_CACHE_UTILIZATION, 0.8),
                                  (ACTIVE_REQUESTS, 12.5), fallback=True)


@pytest.mark.parametrize(("parameters", "field"), [
    ("", f"{P}.conditions"),
    ("{conditions: []}", f"{P}.conditions"),
    ("{conditions: ~}", f"{P}.conditions"),
    ("{conditions: {metric: waiting-queue}}", f"{P}.conditions"),
    ("{conditions: [{maxValue: 1}]}", f"{P}.conditions[0].metric"),
    ("{conditions: [{metric: unknown, maxValue: 1}]}", f"{P}.conditions[0].metric"),
    ("{conditions: [{metric: active-requests}]}", f"{P}.conditions[0].maxValue"),
    ("{conditions: [{metric: active-requests, maxValue: -1}]}", f"{P}.conditions[0].maxValue"),
    ("{conditions: [{metric: active-requests, maxValue: .inf}]}", f"{P}.conditions[0].maxValue"),
    ("{conditions: [{metric: active-requests, maxValue: '3'}]}", f"{P}.conditions[0].maxValue"),
    # An integer past float64's range (float() would overflow): Go's decoding refuses it too.
    (f"{{conditions: [{{metric: active-requests, maxValue: {2**1024 - 2**970}}}]}}", f"{P}.conditions[0].maxValue"),
    ("{conditions: [{metric: kv-cache-utilization, maxValue: 80}]}", f"{P}.conditions[0].maxValue"),
    ("{conditions: [{metric: waiting-queue, maxValue: 0}, {metric: waiting-queue, maxValue: 1, max: 2}]}",
     f"{P}.conditions[1].max"),
    ("{conditions: [{metric: waiting-queue, maxValue: 0}], fallbackOnEmpty: 'yes'}", f"{P}.fallbackOnEmpty"),
    ("{conditions: [{metric: waiting-queue, maxValue: 0}], fallback: true}", f"{P}.fallback"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    entry = "{type: utilization-filter" + (f", parameters: {parameters}" if parameters else "") + "}"
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {entry}\n", cluster_pool="p")
    assert caught.value.field == field, caught.value


def test_filters_keeping_none_answer_429_with_the_saturated_drop_reason_on_the_stream() -> None:
    """As llm-d-router's scheduler profile: a busy pool, not a broken one (an empty pool is 503)."""
    config, scheduler = _scheduler("""plugins:
- {type: utilization-filter, name: cap, parameters: {conditions: [{metric: waiting-queue, maxValue: 1}]}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: cap}]}
""", (EndpointMetrics(waiting=2), EndpointMetrics(waiting=3), EndpointMetrics(waiting=6)))
    stream = Picker(config, scheduler.snapshot, rng=random.Random(5)).new_stream()
    stream.on_message(request_headers())
    (answer,) = stream.on_message(request_body(b'{"model":"m","prompt":"p"}'))
    immediate = answer.immediate_response
    assert immediate.status.code == 429
    assert set_headers(immediate.headers)["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert b"no endpoints available for the given request" in immediate.body
