"""The legacy admission (the ``flowControl`` gate off) reads the configured saturation detector, as
llm-d-router's ``LegacyAdmissionController``: ``flowControl.saturationDetector``, or the deprecated
top-level ``saturationDetector.pluginRef``, else the ``utilization-detector``; the Gateway API
Inference Extension's older top-level thresholds still make a detector of their own."""

from __future__ import annotations

import random

import pytest
from test_admission import HEAD, POOL, SHEDDABLE

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.flow_control.config import ConcurrencyDetector, UtilizationDetector
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

IDLE = EndpointMetrics()
CONCURRENCY = "plugins:\n- {type: concurrency-detector, name: slots, parameters: {maxConcurrency: 1}}\n"


def scheduler(text: str, metrics: EndpointMetrics = IDLE, age_s: float = 0.0) -> Scheduler:
    """Both endpoints scraped ``age_s`` ago (the pool's own staleness threshold is 2 s)."""
    config = parse_config(POOL + HEAD + text)
    now = [0.0]
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: now[0])
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, metrics)
    now[0] = age_s
    return Scheduler(config, snapshot, random.Random(1))


def sheds(scheduler: Scheduler) -> bool:
    """Whether a sheddable request is dropped 429 (a protected one is always picked)."""
    assert scheduler.pick(PickRequest("m", 0))
    try:
        scheduler.pick(PickRequest("m", SHEDDABLE))
    except RequestError as exc:
        assert exc.status == 429
        return True
    return False


def fill(scheduler: Scheduler) -> None:
    """One request in flight on each endpoint (the concurrency detector's capacity here)."""
    for address in scheduler.snapshot.states:
        scheduler.inflight.dispatch(address, 0)


@pytest.mark.parametrize("where", [
    "saturationDetector: {pluginRef: slots}\n",  # llm-d-router's deprecated top-level form
    "flowControl: {saturationDetector: {pluginRef: slots}}\n",  # honoured with the gate off
])
def test_the_named_detector_sheds_with_the_gate_off(where: str) -> None:
    picker = scheduler(CONCURRENCY + where)
    assert picker.shed_detector == ConcurrencyDetector(max_concurrency=1)
    assert not sheds(picker)
    fill(picker)
    assert sheds(picker)


def test_flow_controls_detector_wins_over_the_deprecated_top_level_one() -> None:
    text = CONCURRENCY + ("saturationDetector: {pluginRef: slots}\n"
                          "flowControl: {saturationDetector: {pluginRef: utilization-detector}}\n")
    assert scheduler(text).shed_detector == UtilizationDetector()


def test_without_a_detector_the_utilization_detector_reads_its_own_staleness() -> None:
    """200 ms by default: metrics a second old count as saturated, though the pool's 2 s keeps them."""
    assert scheduler("plugins: []\n").shed_detector == UtilizationDetector()
    assert not sheds(scheduler("plugins: []\n", age_s=0.1))
    assert sheds(scheduler("plugins: []\n", age_s=1.0))


def test_a_declared_utilization_detector_is_the_default() -> None:
    text = "plugins:\n- {type: utilization-detector, parameters: {queueDepthThreshold: 2}}\n"
    assert not sheds(scheduler(text, EndpointMetrics(waiting=1)))
    assert sheds(scheduler(text, EndpointMetrics(waiting=2)))


def test_the_older_thresholds_form_reads_the_pools_staleness() -> None:
    text = "plugins: []\nsaturationDetector: {queueDepthThreshold: 2, kvCacheUtilThreshold: 0.5}\n"
    assert scheduler(text).shed_detector == UtilizationDetector(2.0, 0.5, 2.0)
    assert not sheds(scheduler(text, EndpointMetrics(waiting=1), age_s=1.0))
    assert sheds(scheduler(text, EndpointMetrics(kv_usage=0.5)))


def test_flow_control_on_takes_the_deprecated_reference_too() -> None:
    config = parse_config(POOL + HEAD + CONCURRENCY + "featureGates: [flowControl]\n"
                          "saturationDetector: {pluginRef: slots}\n")
    assert config.flow_control is not None
    assert config.flow_control.detector == ConcurrencyDetector(max_concurrency=1)


@pytest.mark.parametrize(("text", "field", "got"), [
    ("saturationDetector: {pluginRef: slots, queueDepthThreshold: 3}\n", "EndpointPickerConfig.saturationDetector",
     "either pluginRef or the thresholds"),
    ("saturationDetector: {pluginRef: nowhere}\n", "EndpointPickerConfig.flowControl.saturationDetector.pluginRef",
     "nowhere"),
    ("saturationDetector: {pluginRef: 3}\n", "EndpointPickerConfig.flowControl.saturationDetector.pluginRef", "3"),
    ("saturationDetector: {plugin: slots}\n", "EndpointPickerConfig.saturationDetector.plugin", "pluginRef"),
])
def test_a_bad_detector_reference_names_the_field(text: str, field: str, got: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(POOL + HEAD + CONCURRENCY + text)
    assert caught.value.field == field
    assert got in str(caught.value)
