"""``endpoint-attribute-filter`` and ``endpoint-attribute-scorer`` with core-metrics-extractor's
``customMetrics``: llm-d-router's own test tables, invariants, the scheduler, the command's bad
input, and a started picker scraping engines and driven by grpcio as Envoy."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.endpoint_attribute import (
    AttributeFilterParams,
    AttributeKey,
    AttributeScorerParams,
    attribute_filter,
    attribute_scores,
)
from evergreen_trio.picker.engine_metrics import (
    ENGINE_METRICS,
    EndpointMetrics,
    EngineSpec,
    parse_engine_metrics,
    parse_spec,
    render_metrics,
)
from evergreen_trio.picker.errors import ConfigError, MetricsError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.scheduler import EndpointState, PickRequest, PoolSnapshot, Scheduler

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import LEGIT_BODY, ext_proc, wait_routable

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
KEY = AttributeKey("num_requests_running")
THRESHOLD = "algorithm: {type: threshold, threshold: {operator: LessThan, value: 10}}"
LOWER = "algorithm: {type: linear_lower_is_better}"
# vLLM's core metrics plus one custom metric, as a user writes an engine with customMetrics.
VLLM_WITH_DEPTH = """- type: core-metrics-extractor
  parameters:
    engineConfigs:
    - name: vllm
      queuedRequestsSpec: vllm:num_requests_waiting
      runningRequestsSpec: vllm:num_requests_running
      kvUsageSpec: vllm:kv_cache_usage_perc
      customMetrics: [{attributeKey: custom.queue_depth, metricSpec: 'custom_queue_depth{tier=gold}'}]
"""


def _plugin(plugin_type: str, parameters: str) -> object:
    config = parse_config(HEAD + f"plugins:\n- {{type: {plugin_type}, name: p, parameters: {{{parameters}}}}}\n",
                          cluster_pool="pool")
    return config.epp.plugins["p"].params if config.epp is not None else None


def _filter(operator: str = "LessThan", value: float = 10.0, *, on_missing_pass: bool = True,
            fallback: bool = False) -> AttributeFilterParams:
    return AttributeFilterParams(KEY, operator, value, on_missing_pass, fallback)


# -- llm-d-router's filter tests (filter/endpointattribute/filter_test.go) -------------------------


@pytest.mark.parametrize("parameters", [
    f"attribute: num_requests_running, {THRESHOLD}",
    "attribute: num_requests_running, onMissing: Fail, fallbackOnEmpty: true, "
    "algorithm: {type: threshold, threshold: {operator: GreaterThanOrEqual, value: 0.5}}",
    "attribute: GPUUtilization, producer: dcgm-extractor, "
    "algorithm: {type: threshold, threshold: {operator: LessThan, value: 0.8}}",
    f"attribute: llm-d.ai/multicluster-queue-size, producer: '', {THRESHOLD}",
])
def test_filter_factory_accepts(parameters: str) -> None:
    assert isinstance(_plugin("endpoint-attribute-filter", parameters), AttributeFilterParams)


@pytest.mark.parametrize(("parameters", "field", "message"), [
    (THRESHOLD, f"{P}.attribute", "attribute name"),
    ("attribute: GPUUtilization/dcgm-extractor, algorithm: {type: threshold, threshold: {operator: LessThan, "
     "value: 0.8}}", f"{P}.attribute", "attribute: 'GPUUtilization', producer: 'dcgm-extractor'"),
    (f"attribute: num_requests_running, onMissing: Maybe, {THRESHOLD}", f"{P}.onMissing", "Pass | Fail"),
    ("attribute: num_requests_running", f"{P}.algorithm.type", "threshold"),
    ("attribute: num_requests_running, algorithm: {type: percentile}", f"{P}.algorithm.type", "threshold"),
    ("attribute: num_requests_running, algorithm: {type: threshold}", f"{P}.algorithm.threshold", "threshold"),
    ("attribute: num_requests_running, algorithm: {type: threshold, threshold: {operator: Around, value: 10}}",
     f"{P}.algorithm.threshold.operator", "LessThan"),
])
def test_filter_factory_refuses(parameters: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _plugin("endpoint-attribute-filter", parameters)
    assert caught.value.field == field and message in str(caught.value), caught.value


@pytest.mark.parametrize(("operator", "values", "kept"), [
    ("LessThan", (5, 10, 15), [0]),
    ("LessThanOrEqual", (5, 10, 15), [0, 1]),
    ("GreaterThan", (5, 10, 15), [2]),
    ("GreaterThanOrEqual", (5, 10, 15), [1, 2]),
    ("Equal", (5, 10), [1]),
    ("NotEqual", (5, 10), [0]),
])
def test_each_operator(operator: str, values: tuple[float, ...], kept: list[int]) -> None:
    endpoints = {str(i): float(v) for i, v in enumerate(values)}
    assert attribute_filter(_filter(operator), endpoints) == [str(i) for i in kept]


def test_missing_attribute_passes_by_default_and_fails_when_told() -> None:
    assert attribute_filter(_filter(), {"a": 15.0, "b": None}) == ["b"]
    assert attribute_filter(_filter(on_missing_pass=False), {"a": 5.0, "b": None}) == ["a"]


def test_an_empty_result_and_fallback_on_empty() -> None:
    assert attribute_filter(_filter(), {"a": 15.0, "b": 20.0}) == []
    assert attribute_filter(_filter(fallback=True), {"a": 15.0, "b": 20.0}) == ["a", "b"]
    assert attribute_filter(_filter(fallback=True), {"a": 5.0, "b": 20.0}) == ["a"]  # some survive: no fallback


def test_the_filter_reads_the_attribute_of_its_named_producer() -> None:
    """The reference's TestFilterReadsAttributeOfNamedProducer: the key keeps the producer, and the
    core extractor's attribute of the same name is another one."""
    params = _plugin("endpoint-attribute-filter", "attribute: GPUUtilization, producer: dcgm-extractor, "
                     "onMissing: Fail, algorithm: {type: threshold, threshold: {operator: LessThan, value: 0.8}}")
    assert isinstance(params, AttributeFilterParams)
    assert params.key == AttributeKey("GPUUtilization", "dcgm-extractor")
    state = EndpointState(Endpoint("10.0.0.1", 8000), EndpointMetrics(attributes={"GPUUtilization": 0.5}))
    assert params.key.read(state) is None
    assert AttributeKey("GPUUtilization").read(state) == 0.5
    state.attributes[("GPUUtilization", "dcgm-extractor")] = 0.25
    assert params.key.read(state) == 0.25 and AttributeKey("GPUUtilization", "other").read(state) is None


def test_nan_compares_as_go_compares() -> None:
    values = {"nan": math.nan, "low": 1.0}
    assert attribute_filter(_filter("LessThan"), values) == ["low"]
    assert attribute_filter(_filter("NotEqual"), values) == ["nan", "low"]
    assert attribute_filter(_filter("GreaterThanOrEqual", -math.inf), values) == ["low"]


# -- llm-d-router's scorer tests (scorer/endpointattribute/endpointattribute_test.go) --------------


@pytest.mark.parametrize(("parameters", "expected"), [
    (f"attributeKey: custom.queue_depth, {LOWER}", AttributeScorerParams(AttributeKey("custom.queue_depth"))),
    (f"attributeKey: GPUUtilization, producer: dcgm-extractor, {LOWER}",
     AttributeScorerParams(AttributeKey("GPUUtilization", "dcgm-extractor"))),
    (f"attributeKey: llm-d.ai/multicluster-queue-size, producer: '', {LOWER}",
     AttributeScorerParams(AttributeKey("llm-d.ai/multicluster-queue-size", ""))),
    ("attributeKey: custom.tokens_per_second, algorithm: {type: linear_higher_is_better, "
     "normalization: {adaptiveRange: {}}}", AttributeScorerParams(AttributeKey("custom.tokens_per_second"), False)),
    ("attributeKey: custom.kv, algorithm: {type: linear_lower_is_better, normalization: {fixedRange: "
     "{min: 0, max: 1}}}", AttributeScorerParams(AttributeKey("custom.kv"), True, (0.0, 1.0))),
])
def test_scorer_factory_accepts(parameters: str, expected: AttributeScorerParams) -> None:
    assert _plugin("endpoint-attribute-scorer", parameters) == expected


@pytest.mark.parametrize(("parameters", "field", "message"), [
    (LOWER, f"{P}.attributeKey", "attribute name"),
    (f"attributeKey: GPUUtilization/dcgm-extractor, {LOWER}", f"{P}.attributeKey",
     "attributeKey: 'GPUUtilization', producer: 'dcgm-extractor'"),
    ("attributeKey: custom.queue_depth", f"{P}.algorithm.type", "linear_lower_is_better"),
    ("attributeKey: custom.queue_depth, algorithm: {type: log_lower_is_better}", f"{P}.algorithm.type",
     "linear_higher_is_better"),
    ("attributeKey: q, algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0, max: 1}, "
     "adaptiveRange: {}}}", f"{P}.algorithm.normalization", "at most one normalization strategy"),
    ("attributeKey: q, algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 1, max: 1}}}",
     f"{P}.algorithm.normalization.fixedRange", "min < max"),
])
def test_scorer_factory_refuses(parameters: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _plugin("endpoint-attribute-scorer", parameters)
    assert caught.value.field == field and message in str(caught.value), caught.value


ADAPTIVE = AttributeScorerParams(KEY)


@pytest.mark.parametrize(("lower", "values", "scores"), [
    (True, (10, 5, 0), (0.0, 0.5, 1.0)),
    (False, (10, 5, 0), (1.0, 0.5, 0.0)),
    (True, (7, 7), (1.0, 1.0)),  # equal values: neutral
    (True, (10, None, 0), (0.0, 0.0, 1.0)),  # missing: 0, and out of the range
    (True, (None, None), (0.0, 0.0)),
])
def test_adaptive_range(lower: bool, values: tuple[float | None, ...], scores: tuple[float, ...]) -> None:
    params = AttributeScorerParams(KEY, lower)
    got = attribute_scores(params, {str(i): v for i, v in enumerate(values)})
    assert list(got.values()) == pytest.approx(scores)


@pytest.mark.parametrize(("lower", "values", "scores"), [
    (True, (10, 5, 0), (0.0, 0.5, 1.0)),
    (False, (10, 5, 0), (1.0, 0.5, 0.0)),
    (True, (7, 7), (0.3, 0.3)),  # scored by range position, not neutrally
    (True, (15, -5), (0.0, 1.0)),  # clamped
    (False, (10, None), (1.0, 0.0)),
])
def test_fixed_range(lower: bool, values: tuple[float | None, ...], scores: tuple[float, ...]) -> None:
    params = AttributeScorerParams(KEY, lower, (0.0, 10.0))
    got = attribute_scores(params, {str(i): v for i, v in enumerate(values)})
    assert list(got.values()) == pytest.approx(scores)


def test_a_nan_score_is_zero() -> None:
    """Where the reference's arithmetic gives NaN (a NaN value, infinities) we score 0."""
    assert attribute_scores(ADAPTIVE, {"nan": math.nan, "a": 1.0, "b": 3.0}) == {"nan": 0.0, "a": 1.0, "b": 0.0}
    assert attribute_scores(ADAPTIVE, {"inf": math.inf, "a": 1.0}) == {"inf": 0.0, "a": 1.0}
    assert attribute_scores(ADAPTIVE, {"x": math.inf, "y": math.inf}) == {"x": 1.0, "y": 1.0}  # all equal
    fixed = AttributeScorerParams(KEY, False, (0.0, 1.0))
    assert attribute_scores(fixed, {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}) == {
        "nan": 0.0, "inf": 1.0, "-inf": 0.0}


# -- invariants ---------------------------------------------------------------------------------

_value = st.none() | st.floats(allow_nan=True, allow_infinity=True)
_values = st.dictionaries(st.text(max_size=4), _value, max_size=8)
_range = st.tuples(st.floats(-1e300, 1e300), st.floats(-1e300, 1e300)).filter(lambda r: r[0] < r[1])


@given(_values, st.booleans(), st.none() | _range)
def test_every_candidate_scores_within_0_and_1(values: dict[str, float | None], lower: bool,
                                               fixed: tuple[float, float] | None) -> None:
    scores = attribute_scores(AttributeScorerParams(KEY, lower, fixed), values)
    assert list(scores) == list(values)
    assert all(0.0 <= s <= 1.0 for s in scores.values())
    assert all(scores[a] == 0.0 for a, v in values.items() if v is None)


@given(st.dictionaries(st.text(max_size=4), st.floats(-1e6, 1e6), min_size=2, max_size=8))
def test_the_two_directions_mirror_each_other(values: dict[str, float]) -> None:
    lower = attribute_scores(AttributeScorerParams(KEY, True), values)
    higher = attribute_scores(AttributeScorerParams(KEY, False), values)
    if len(set(values.values())) > 1:
        assert all(lower[a] + higher[a] == pytest.approx(1.0) for a in values)
        assert lower[min(values, key=values.__getitem__)] == 1.0 == higher[max(values, key=values.__getitem__)]


@given(_values, st.sampled_from(["LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual", "Equal",
                                 "NotEqual"]), st.floats(-100, 100), st.booleans(), st.booleans())
def test_the_filter_keeps_an_ordered_subset_by_its_rule(values: dict[str, float | None], operator: str, value: float,
                                                        on_missing_pass: bool, fallback: bool) -> None:
    params = _filter(operator, value, on_missing_pass=on_missing_pass, fallback=fallback)
    kept = attribute_filter(params, values)
    passing = [a for a, v in values.items() if params.passes(v)]
    assert kept == (list(values) if fallback and not passing else passing)


# -- customMetrics (datalayer/extractor/metrics) ------------------------------------------------

DEPTH_SPEC = EngineSpec("e", None, None, custom=(("custom.queue_depth", parse_spec("custom_queue_depth{tier=gold}")),))


def test_a_custom_gauge_with_labels_is_an_attribute() -> None:
    """The reference's TestMetricsExtractionCustomScalarFromConfig: an engine of custom metrics alone."""
    text = '# TYPE custom_queue_depth gauge\ncustom_queue_depth{tier="gold"} 42.5\n'
    metrics = parse_engine_metrics(DEPTH_SPEC, text)
    assert metrics.attributes == {"custom.queue_depth": 42.5}
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (0, 0, 0)
    assert hash(metrics) == hash(EndpointMetrics())  # still hashable: the attributes are not hashed


def test_a_custom_counter_is_an_attribute() -> None:
    spec = EngineSpec("e", None, None, custom=(("custom.total_requests", parse_spec("custom_total_requests")),))
    text = "# TYPE custom_total_requests counter\ncustom_total_requests 12\n"
    assert parse_engine_metrics(spec, text).attributes == {"custom.total_requests": 12.0}
    served = EngineSpec("e", None, None, custom=(("ok", parse_spec("vllm:request_success_total")),))
    text = "# TYPE vllm:request_success_total counter\nvllm:request_success_total 5\n"  # as vLLM writes one
    assert parse_engine_metrics(served, text).attributes == {"ok": 5.0}


def test_the_latest_matching_series_counts_and_an_untyped_one_reads_zero() -> None:
    text = ('# TYPE custom_queue_depth gauge\ncustom_queue_depth{tier="gold",model="a"} 1 1000\n'
            'custom_queue_depth{tier="gold",model="b"} 2 3000\ncustom_queue_depth{tier="gold",model="c"} 3 2000\n'
            'custom_queue_depth{tier="silver"} 9 9000\n')
    assert parse_engine_metrics(DEPTH_SPEC, text).attributes == {"custom.queue_depth": 2.0}
    untimed = '# TYPE custom_queue_depth gauge\ncustom_queue_depth{tier="gold"} 4\ncustom_queue_depth{tier="gold"} 5\n'
    assert parse_engine_metrics(DEPTH_SPEC, untimed).attributes == {"custom.queue_depth": 4.0}  # the first
    assert parse_engine_metrics(DEPTH_SPEC, 'custom_queue_depth{tier="gold"} 7\n').attributes == {
        "custom.queue_depth": 0.0}  # no TYPE line: untyped, which the reference's extractValue reads as 0


def test_a_missing_custom_metric_leaves_the_attribute_out_not_the_scrape() -> None:
    spec = EngineSpec("vllm", *(ENGINE_METRICS["vllm"].waiting, ENGINE_METRICS["vllm"].running),
                      custom=DEPTH_SPEC.custom)
    metrics = parse_engine_metrics(spec, "vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n"
                                         'custom_queue_depth{tier="silver"} 9\n')
    assert metrics.waiting == 3 and metrics.attributes == {}


@given(st.dictionaries(st.sampled_from(["a.b", "c", "d_e"]), st.floats(-1e9, 1e9), max_size=3))
def test_custom_metrics_round_trip(attributes: dict[str, float]) -> None:
    spec = EngineSpec("e", None, None, custom=tuple((key, parse_spec(f"m_{i}{{k=v}}"))
                                                    for i, key in enumerate(["a.b", "c", "d_e"])))
    assert parse_engine_metrics(spec, render_metrics(spec, EndpointMetrics(attributes=attributes))).attributes == \
        attributes


@given(st.text(max_size=300))
def test_any_text_is_read_or_a_metrics_error(text: str) -> None:
    with contextlib.suppress(MetricsError):
        parse_engine_metrics(DEPTH_SPEC, text)


def test_custom_metrics_in_the_config() -> None:
    config = parse_config(HEAD + "plugins:\n" + VLLM_WITH_DEPTH, cluster_pool="p")
    (custom,) = config.pool.engines.spec("vllm").custom
    assert custom == ("custom.queue_depth", parse_spec("custom_queue_depth{tier=gold}"))


@pytest.mark.parametrize(("entries", "field"), [
    ("[{metricSpec: custom_queue_depth}]", "customMetrics[0].attributeKey"),  # "attributeKey cannot be empty"
    ("[{attributeKey: custom.queue_depth}]", "customMetrics[0].metricSpec"),  # "spec cannot be empty"
    ("[{attributeKey: a, metricSpec: m}, {attributeKey: a, metricSpec: n}]", "customMetrics[1].attributeKey"),
    ("[{attributeKey: a, metricSpec: 'm{'}]", "customMetrics[0].metricSpec"),
    ("[{attributeKey: a, metricSpec: m, spec: n}]", "customMetrics[0].spec"),
    ("{attributeKey: a}", "customMetrics"),
])
def test_bad_custom_metrics_name_the_field(entries: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: core-metrics-extractor, parameters: {{engineConfigs: [{{name: x, " \
                  f"customMetrics: {entries}}}]}}}}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == f"{P}.engineConfigs[0].{field}", caught.value


# -- the registry and the startup warnings ------------------------------------------------------


def test_both_types_are_implemented_alpha_types() -> None:
    for kind, category in (("endpoint-attribute-filter", Category.FILTER),
                           ("endpoint-attribute-scorer", Category.SCORER)):
        assert kind in ALPHA_TYPES
        assert PLUGIN_TYPES[kind].category is category


def test_an_attribute_nothing_publishes_is_warned_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    text = HEAD + "plugins:\n" + VLLM_WITH_DEPTH + f"""\
- {{type: endpoint-attribute-filter, name: published, parameters: {{attribute: custom.queue_depth, {THRESHOLD}}}}}
- {{type: endpoint-attribute-filter, name: typo, parameters: {{attribute: custom.queue_dpth, {THRESHOLD}}}}}
- {{type: endpoint-attribute-scorer, name: gpu, parameters: {{attributeKey: GPUUtilization, producer: dcgm-extractor,
    {LOWER}}}}}
"""
    with caplog.at_level(logging.WARNING, "evergreen_trio.picker.endpoint_attribute"):
        parse_config(text, cluster_pool="p")
    lines = [r.getMessage() for r in caplog.records if "attribute_not_published" in r.getMessage()]
    assert len(lines) == 2
    assert "plugin=typo attribute='custom.queue_dpth': no customMetrics entry" in lines[0]
    assert "plugin=gpu attribute='GPUUtilization': no plugin declared here publishes 'GPUUtilization' of producer " \
           "'dcgm-extractor'" in lines[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, "evergreen_trio.picker.endpoint_attribute"):
        parse_config(text + "- {type: dcgm-extractor}\n", cluster_pool="p")
    assert "plugin=gpu" not in caplog.text and "plugin=typo" in caplog.text


# -- through the scheduler ----------------------------------------------------------------------

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
ROUTING = VLLM_WITH_DEPTH + f"""\
- {{type: endpoint-attribute-filter, name: shallow, parameters: {{attribute: custom.queue_depth, onMissing: Fail,
    {THRESHOLD}}}}}
- {{type: endpoint-attribute-scorer, name: deepest, parameters: {{attributeKey: custom.queue_depth,
    algorithm: {{type: linear_higher_is_better}}}}}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: shallow}}, {{pluginRef: deepest}}]}}
"""


def vllm_text(depth: float | None) -> str:
    text = render_metrics("vllm", EndpointMetrics())
    custom = f'# TYPE custom_queue_depth gauge\ncustom_queue_depth{{tier="gold"}} {depth}\n'
    return text if depth is None else text + custom


def test_the_filter_and_the_scorer_through_the_scheduler() -> None:
    """A (depth 3) and B (5) pass the filter, C (20) and D (no metric, onMissing: Fail) do not; the
    scorer, higher is better, prefers B; once B's scrape lacks the metric only A is left."""
    d = "10.0.0.4:8000"
    config = parse_config(f"pool: {{endpoints: ['{A}', '{B}', '{C}', '{d}']}}\n---\n" + HEAD + "plugins:\n" + ROUTING)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    spec = config.pool.engines.spec("vllm")
    for address, depth in ((A, 3), (B, 5), (C, 20), (d, None)):
        snapshot.update(address, parse_engine_metrics(spec, vllm_text(depth)))
    scheduler = Scheduler(config, snapshot, random.Random(1))
    assert scheduler.schedule(PickRequest("m", 0), 4).endpoints == [B, A]
    assert scheduler.schedule(PickRequest("m", 0)).scores == {A: 0.0, B: 1.0}
    snapshot.update(B, parse_engine_metrics(spec, vllm_text(None)))
    assert scheduler.pick(PickRequest("m", 0), 4) == [A]


# -- the command --------------------------------------------------------------------------------

FILTER_OK = {"attribute": "a", "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 1}}}
SCORER_OK = {"attributeKey": "a", "algorithm": {"type": "linear_lower_is_better"}}
RANGE = {"type": "linear_lower_is_better", "normalization": {"fixedRange": {"min": 0, "max": 1}}}


@pytest.mark.parametrize(("plugin_type", "parameters", "field"), [
    ("endpoint-attribute-filter", {**FILTER_OK, "attribute": ""}, "attribute"),
    ("endpoint-attribute-filter", {**FILTER_OK, "producer": 3}, "producer"),
    ("endpoint-attribute-filter", {**FILTER_OK, "onMissing": "Drop"}, "onMissing"),
    ("endpoint-attribute-filter", {**FILTER_OK, "fallbackOnEmpty": "yes"}, "fallbackOnEmpty"),
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {"type": "topK"}}, "algorithm.type"),
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {"type": "threshold"}}, "algorithm.threshold"),
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {"type": "threshold", "threshold": {
        "operator": "Below", "value": 1}}}, "algorithm.threshold.operator"),
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {"type": "threshold", "threshold": {
        "operator": "LessThan", "value": "1"}}}, "algorithm.threshold.value"),
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {"type": "threshold", "threshold": {
        "operator": "LessThan", "value": 10**400}}}, "algorithm.threshold.value"),  # past float64
    ("endpoint-attribute-filter", {**FILTER_OK, "algorithm": {**FILTER_OK["algorithm"], "k": 3}}, "algorithm.k"),
    ("endpoint-attribute-filter", {**FILTER_OK, "operator": "LessThan"}, "operator"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "attributeKey": "a/b"}, "attributeKey"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "producer": []}, "producer"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {"type": "log"}}, "algorithm.type"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {**RANGE, "normalization": {
        "fixedRange": {"min": 0, "max": 1}, "adaptiveRange": {}}}}, "algorithm.normalization"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {**RANGE, "normalization": {
        "fixedRange": {"min": 2, "max": 1}}}}, "algorithm.normalization.fixedRange"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {**RANGE, "normalization": {
        "fixedRange": {"min": "low", "max": 1}}}}, "algorithm.normalization.fixedRange.min"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {**RANGE, "normalization": {
        "fixedRange": {"min": 0, "max": ".inf"}}}}, "algorithm.normalization.fixedRange.max"),
    ("endpoint-attribute-scorer", {**SCORER_OK, "algorithm": {**RANGE, "normalization": {
        "adaptiveRange": {"window": 3}}}}, "algorithm.normalization.adaptiveRange.window"),
    ("core-metrics-extractor", {"engineConfigs": [{"name": "x", "customMetrics": [{"metricSpec": "m"}]}]},
     "engineConfigs[0].customMetrics[0].attributeKey"),
    ("core-metrics-extractor", {"engineConfigs": [{"name": "x", "customMetrics": [{"attributeKey": "a",
                                                                                   "metricSpec": "m{"}]}]},
     "engineConfigs[0].customMetrics[0].metricSpec"),
])
def test_each_bad_parameter_is_one_line_and_exit_2_from_the_command(plugin_type: str, parameters: dict[str, object],
                                                                    field: str) -> None:
    # JSON is YAML: the parameters go in as written (".inf" as a YAML float, not a string).
    text = HEAD + f"plugins:\n- {{type: {plugin_type}, parameters: {_yaml(parameters)}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"EndpointPickerConfig.plugins[0].parameters.{field}: expected" in line, line


def _yaml(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, str) and value != ".inf":
        return repr(value)
    return str(value)


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


async def serve_engine(depth: float | None, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A model server's idle vLLM ``/metrics`` with ``custom_queue_depth`` (none: without it)."""
    text = vllm_text(depth).encode()

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], text)

    await serve_http(handle, "127.0.0.1", 0, task_status=task_status)


async def test_a_started_picker_routes_by_the_scraped_attribute(nursery: trio.Nursery, tmp_path: Path) -> None:
    shallow, middle, deep, bare = [f"127.0.0.1:{await nursery.start(serve_engine, depth)}"
                                   for depth in (3, 5, 20, None)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: attr, endpoints: ['{shallow}', '{middle}', '{deep}', '{bare}']}}\n---\n"
                      + HEAD + "plugins:\n" + ROUTING)
    args = ["--config", str(config), "--allow-experimental-plugins=true", "--refresh-metrics-interval", "50ms",
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await wait_routable(picker.grpc)
        with trio.fail_after(10):  # until every engine's first scrape is in: then only the middle one wins
            while (await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)).endpoint != middle:  # noqa: ASYNC110
                await trio.sleep(0.05)
        for _ in range(5):
            answer = await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)
            assert (answer.status, answer.endpoint) == (200, middle)
