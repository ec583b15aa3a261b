"""The predicted-latency family's sans-IO core: llm-d-router's unit-test tables (ebab68792,
``scorer/latency``, ``filter/sloheadroomtier``, ``admitter/latencyslo``, ``dataproducer/predictedlatency``)
ported, the parameters, and properties."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import run_cli

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.latency import (
    AdmitterParams,
    LatencyInfo,
    LatencyRequest,
    PredictedLatency,
    ProducerParams,
    ScorerParams,
    TierFilterParams,
    _RunningQueue,
    admit_latency,
    composite_scores,
    headroom_scores,
    slo_denial,
    tier_filter,
)
from evergreen_trio.picker.latency_wire import Prediction, PredictionRow
from evergreen_trio.picker.plugins import PLUGIN_TYPES
from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
POOL = "pool: {name: p, endpoints: ['10.0.0.1:8000']}\n---\n"
TYPES = ("predicted-latency-producer", "latency-scorer", "slo-headroom-tier-filter", "latency-slo-admitter")


def info(ttft_headroom: float, tpot_headroom: float, dispatched: int = 0, ttft: float = 100.0,
         tpot: float = 10.0) -> LatencyInfo:
    return LatencyInfo(ttft_headroom >= 0, tpot_headroom >= 0, ttft_headroom, tpot_headroom, ttft, tpot, dispatched)


# -- latency-scorer (scorer/latency/plugin_test.go) ---------------------------------------------


def test_positive_headroom_scores_both() -> None:
    scores = headroom_scores(ScorerParams(), {"pod1": info(100, 20), "pod2": info(30, 5)})
    assert scores["pod1"] > 0 and scores["pod2"] > 0


def test_negative_only_prefers_the_smaller_violation() -> None:
    scores = headroom_scores(ScorerParams(), {"pod1": info(-10, -5, 1), "pod2": info(-100, -30, 1)})
    assert 0 < scores["pod2"] < scores["pod1"]


def test_least_strategy_prefers_the_least_headroom() -> None:
    scores = headroom_scores(ScorerParams(), {"ep1": info(10, 2), "ep2": info(50, 10)})
    assert scores["ep1"] > scores["ep2"] > 0
    most = headroom_scores(ScorerParams(strategy="most"), {"ep1": info(10, 2), "ep2": info(50, 10)})
    assert most["ep2"] > most["ep1"]


def test_idle_pods_are_preferred_when_all_miss() -> None:
    scores = headroom_scores(ScorerParams(), {"busy": info(-50, -10, 5), "idle": info(-50, -10, 0)})
    assert scores["idle"] > 0 and scores["busy"] == 0


def test_hierarchical_buckets() -> None:
    # The reference's table: no request dispatched anywhere, so all three are idle and all scored.
    infos = {"both-neg": info(-50, -10), "ttft-neg": info(-30, 5), "tpot-neg": info(10, -8)}
    assert all(score > 0 for score in headroom_scores(ScorerParams(), infos).values())


def test_busy_buckets_score_the_least_severe_only() -> None:
    infos = {"both-neg": info(-50, -10, 1), "ttft-neg": info(-30, 5, 1), "tpot-neg": info(10, -8, 1)}
    assert headroom_scores(ScorerParams(), infos) == {"both-neg": 0.0, "ttft-neg": 0.0, "tpot-neg": 0.51}
    del infos["tpot-neg"]
    assert headroom_scores(ScorerParams(), infos) == {"both-neg": 0.0, "ttft-neg": 0.51}


def test_composite_fallback_prefers_lower_kv_and_queue() -> None:
    metrics = {"pod1": EndpointMetrics(waiting=0, kv_usage=0.2), "pod2": EndpointMetrics(waiting=5, kv_usage=0.8)}
    scores = composite_scores(ScorerParams(), metrics, {})
    assert scores["pod1"] > scores["pod2"]
    # (1/3 x 0.8 + 1/3 x 1 + 0) rounded to hundredths, and (1/3 x 0.2 + 0 + 0).
    assert scores == {"pod1": 0.6, "pod2": 0.07}


def test_range_renormalization_and_the_best_clamped_to_one() -> None:
    # Equal TTFT headroom: TPOT alone decides; the best's weight 101 is clamped to 1 as the framework does.
    scores = headroom_scores(ScorerParams(), {"a": info(10, 1), "b": info(10, 3), "c": info(10, 5)})
    assert scores == {"a": 1.0, "b": 0.51, "c": 0.01}


def test_a_candidate_without_prediction_counts_as_zero_headroom() -> None:
    scores = headroom_scores(ScorerParams(), {"a": info(50, 5), "none": None})
    assert scores["none"] == 1.0 and scores["a"] == 0.01


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.one_of(st.none(), st.builds(
    info, st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False),
    st.integers(0, 3))), min_size=1, max_size=8),
       st.sampled_from(["least", "most"]), st.floats(0, 10), st.floats(0, 10))
def test_scores_are_in_unit_range(infos: Mapping[str, LatencyInfo | None], strategy: str, ttft_w: float,
                                  tpot_w: float) -> None:
    scores = headroom_scores(ScorerParams(ttft_w, tpot_w, strategy), infos)
    assert scores.keys() == infos.keys() and all(0.0 <= s <= 1.0 for s in scores.values())
    assert any(s > 0 for s in scores.values())


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.builds(
    EndpointMetrics, waiting=st.floats(0, 100), kv_usage=st.one_of(st.floats(-1, 2), st.just(math.nan))),
    min_size=1),
       st.floats(0, 5), st.floats(0, 5), st.floats(0, 5))
def test_composite_scores_are_in_unit_range(metrics: Mapping[str, EndpointMetrics], kv: float, queue: float,
                                            prefix: float) -> None:
    scores = composite_scores(ScorerParams(composite_kv_weight=kv, composite_queue_weight=queue,
                                           composite_prefix_weight=prefix), metrics, dict.fromkeys(metrics, 1.0))
    assert all(0.0 <= s <= 1.0 for s in scores.values())


# -- slo-headroom-tier-filter (filter/sloheadroomtier/plugin_test.go) ----------------------------


@pytest.mark.parametrize(("candidates", "infos", "epsilon", "kept"), [
    (["a"], {"a": info(10, 5)}, 0.01, ["a"]),  # single endpoint
    (["a", "b"], {}, 0.01, ["a", "b"]),  # no predictions
    (["a", "b"], {"a": info(100, 50), "b": info(200, 80)}, 0.0, ["a", "b"]),  # all positive
    (["a", "b"], {"a": info(-100, -50), "b": info(-200, -80)}, 0.0, ["a", "b"]),  # all negative
    (["pos1", "pos2", "neg1"], {"pos1": info(100, 50), "pos2": info(200, 80), "neg1": info(-100, -50)}, 0.0,
     ["pos1", "pos2"]),
    (["pos1", "neg1"], {"pos1": info(100, 50), "neg1": info(-100, -50)}, 1.0, ["neg1"]),  # always explore
    (["pos1", "nopred"], {"pos1": info(100, 50)}, 1.0, ["nopred"]),  # no prediction goes negative
])
def test_tier_filter_table(candidates: list[str], infos: dict[str, LatencyInfo], epsilon: float,
                           kept: list[str]) -> None:
    assert tier_filter(TierFilterParams(epsilon), candidates, infos, 0.5 if 0 < epsilon < 1 else 0.0) == kept


@given(st.lists(st.text(max_size=2), min_size=1, max_size=6, unique=True), st.data())
def test_tier_filter_never_empties_a_set(candidates: list[str], data: st.DataObject) -> None:
    infos = {a: data.draw(st.builds(info, st.floats(-10, 10), st.floats(-10, 10)))
             for a in candidates if data.draw(st.booleans())}
    kept = tier_filter(TierFilterParams(data.draw(st.floats(0, 1))), candidates, infos, data.draw(st.floats(0, 1)))
    assert kept and set(kept) <= set(candidates)


@pytest.mark.parametrize(("parameters", "field"), [
    ("{epsilonExploreNeg: 1.5}", "epsilonExploreNeg"), ("{epsilonExploreNeg: -0.1}", "epsilonExploreNeg")])
def test_tier_filter_bad_epsilon(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"plugins\\[0\\].parameters.{field}"):
        parse_config(POOL + HEAD + f"plugins: [{{type: slo-headroom-tier-filter, parameters: {parameters}}}]")


# -- latency-slo-admitter (admitter/latencyslo/plugin_test.go) -----------------------------------

NEW = {"x-llm-d-slo-ttft-ms": "100", "x-llm-d-slo-tpot-ms": "30"}
OLD = {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "30"}
BOTH = {"x-llm-d-slo-ttft-ms": "0", "x-slo-ttft-ms": "100", "x-llm-d-slo-tpot-ms": "0", "x-slo-tpot-ms": "30"}
INVALID = [info(-50, -10, ttft=150, tpot=40), info(-30, -5, ttft=130, tpot=35)]


@pytest.mark.parametrize(("priority", "headers", "metrics", "infos", "denied"), [
    (1, NEW, [(0.5, 5)], INVALID[:1], False),  # non-sheddable: always admitted
    (-1, {}, [(0.5, 5)], INVALID[:1], False),  # no SLO headers
    (-1, NEW, [(0.5, 5), (0.4, 3)], INVALID, True),  # all invalid, busy, none cold
    (-1, OLD, [(0.5, 5)], INVALID[:1], True),  # the deprecated header names
    (-1, BOTH, [(0.5, 5)], INVALID[:1], False),  # the new names win (0: no SLO)
    (-1, NEW, [(0.5, 5), (0.4, 0)], INVALID, False),  # one idle
    (-1, NEW, [(0.5, 5), (0.01, 3)], INVALID, False),  # one cold
    (-1, NEW, [(0.5, 5), (0.4, 3)], [INVALID[0], info(50, 5)], False),  # one valid
    (-1, NEW, [(0.5, 5), (0.4, 3)], [None, None], False),  # no predictions (predictor down)
])
def test_admitter_table(priority: int, headers: dict[str, str], metrics: list[tuple[float, int]],
                        infos: list[LatencyInfo | None], denied: bool) -> None:
    scraped = [EndpointMetrics(kv_usage=kv, running=running) for kv, running in metrics]
    reason = slo_denial(priority, headers, scraped, infos)
    assert (reason == "no valid endpoint available to serve the request") is denied


def test_the_admitter_is_a_500_as_the_other_admitters() -> None:
    producer = PredictedLatency(ProducerParams())
    context = producer.begin(NEW, [], {}, 0, 0, {}, {})
    context.infos = {"10.0.0.1:8000": INVALID[0]}
    state = EndpointState(Endpoint("10.0.0.1", 8000), EndpointMetrics(kv_usage=0.5, running=5), ready=True)
    request = PickRequest("m", -1, headers=NEW, latency={"predicted-latency-producer": context})
    with pytest.raises(RequestError) as caught:
        admit_latency([AdmitterParams()], request, [state])
    assert (caught.value.status, caught.value.message) == (
        500, "request cannot be admitted: no valid endpoint available to serve the request")


# -- predicted-latency-producer (prediction_test.go, running_request_tpot_slo_queue_test.go) ------


def _context(producer: PredictedLatency, ttft_slo: float, tpot_slo: float,
             labels: dict[str, str] | None = None) -> tuple[LatencyRequest, str]:
    endpoint = Endpoint("10.0.0.1", 8000, labels=tuple((labels or {}).items()))
    state = EndpointState(endpoint, EndpointMetrics(), ready=True)
    return producer.begin({"x-llm-d-slo-ttft-ms": str(ttft_slo), "x-llm-d-slo-tpot-ms": str(tpot_slo)}, [state],
                          {}, 0, 1, {}, {}), endpoint.address


@pytest.mark.parametrize(("ttft", "tpot", "running_min", "ttft_ok", "tpot_ok"), [
    (50, 20, 0, True, True),  # both within SLO
    (150, 20, 0, False, True),  # TTFT exceeds SLO
    (50, 40, 0, True, False),  # TPOT exceeds SLO
    (50, 25, 20, True, False),  # a running request's tighter TPOT SLO caps the threshold
])
def test_validate_prediction_streaming(ttft: float, tpot: float, running_min: float, ttft_ok: bool,
                                       tpot_ok: bool) -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=True))
    context, address = _context(producer, 100, 30)
    if running_min:
        producer.running.setdefault(address, _RunningQueue()).add(99, running_min, 0.0)
    result = producer.info(context, address, Prediction(ttft, tpot))
    assert (result.ttft_valid, result.tpot_valid, result.valid) == (ttft_ok, tpot_ok, ttft_ok and tpot_ok)
    assert (result.ttft_headroom > 0) is ttft_ok and (result.tpot_headroom > 0) is tpot_ok
    assert result.dispatched == (1 if running_min else 0)


def test_non_streaming_and_prefill_pods_neutralize_tpot() -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=False))
    context, address = _context(producer, 100, 30)
    assert producer.info(context, address, Prediction(50, 999)) == LatencyInfo(True, True, 50, 0, 50, 999, 0)
    producer = PredictedLatency(ProducerParams(streaming_mode=True, endpoint_role_label="role"))
    for role, tpot_ok in (("prefill", True), ("decode", False)):
        context, address = _context(producer, 100, 30, {"role": role})
        result = producer.info(context, address, Prediction(50, 999))
        assert (result.tpot_valid, result.valid) == (tpot_ok, tpot_ok)
        assert context.rows[address].pod_type == role


def test_the_running_queue_keeps_the_tightest_slo_first() -> None:
    queue = _RunningQueue()
    assert queue.add(1, 30, 0) and queue.add(2, 10, 0) and queue.add(3, 20, 0)
    assert not queue.add(2, 5, 0) and not queue.add(4, -1, 0) and not queue.add(5, float("nan"), 0)
    assert queue.min_slo() == 10
    queue.remove(2)
    assert queue.min_slo() == 20 and len(queue.slos) == 2
    queue.remove(7)  # not there: nothing happens
    queue.expire(1.0)
    assert queue.min_slo() == 0 and not queue.slos


def test_features_per_candidate() -> None:
    producer = PredictedLatency(ProducerParams())
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    states = [EndpointState(a, EndpointMetrics(waiting=3, kv_usage=0.4), ready=True),
              EndpointState(b, EndpointMetrics(waiting=float("nan"), kv_usage=7.0), ready=True)]
    context = producer.begin({}, states, {a.address: 3}, 4, 120, {a.address: 2}, {a.address: 500})
    assert context.rows[a.address] == PredictionRow(0.4, 120, 3, 2, 1, 0.75, prefill_tokens_in_flight=500)
    assert context.rows[b.address] == PredictionRow(1.0, 120, 0, 0, 1, 0.0)  # hostile scrapes clamped
    assert (context.ttft_slo, context.tpot_slo) == (0, 0)


def _scheduled(producer: PredictedLatency) -> tuple[LatencyRequest, str]:
    context, address = _context(producer, 100, 30)
    producer.predicted(context, [Prediction(80, 20)])
    request = PickRequest("m", 0, latency={"predicted-latency-producer": context})
    producer.scheduled(request, Schedule([address]), 10.0)
    assert producer.running[address].min_slo() == 30
    return context, address


def test_streaming_trains_ttft_at_the_first_token_and_tpot_at_the_end() -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=True))
    context, address = _scheduled(producer)
    producer.on_chunk(context, 10.05, False)  # the first token, 50 ms after dispatch
    producer.on_chunk(context, 10.07, False)
    producer.on_chunk(context, 10.09, False)
    producer.on_chunk(context, 10.11, True)
    ttft, tpot = producer.take_training()
    assert ttft.actual_ttft_ms == pytest.approx(50) and ttft.actual_tpot_ms == 0
    assert ttft.row.num_tokens_generated == 0
    # (110 ms end to end - 50 ms TTFT) / (4 tokens - 1)
    assert tpot.actual_tpot_ms == pytest.approx(20) and tpot.actual_ttft_ms == 0
    assert tpot.row.prefix_cache_score == 0  # as the reference sends it
    assert address not in producer.running and not producer.take_training()
    producer.on_chunk(context, 11.0, True)  # after the end: nothing
    assert not producer.take_training()


def test_non_streaming_trains_the_end_to_end_latency_at_the_end() -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=False))
    context, _ = _scheduled(producer)
    producer.on_chunk(context, 10.1, False)
    producer.on_chunk(context, 10.3, True)
    (entry,) = producer.take_training()
    assert entry.actual_ttft_ms == pytest.approx(300) and entry.actual_tpot_ms == 0


def test_a_stream_gone_leaves_its_queue_and_trains_nothing() -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=True))
    context, address = _scheduled(producer)
    producer.finished(context)
    assert address not in producer.running
    producer.on_chunk(context, 10.05, True)
    assert not producer.take_training()


def test_predictions_not_one_per_candidate_are_none() -> None:
    producer = PredictedLatency(ProducerParams())
    context, _ = _context(producer, 100, 30)
    producer.predicted(context, [Prediction(1, 1), Prediction(2, 2)])
    assert context.infos == {}
    producer.predicted(context, None)
    assert context.infos == {}


# -- parameters ---------------------------------------------------------------------------------


def test_types_are_registered_and_no_longer_refused() -> None:
    for kind in TYPES:
        assert kind in PLUGIN_TYPES


def test_defaults_are_the_references() -> None:
    config = parse_config(POOL + HEAD + "plugins:\n" + "".join(f"- {{type: {t}}}\n" for t in TYPES))
    assert config.epp is not None
    params = {p.type: p.params for p in config.epp.plugins.values()}
    assert params["predicted-latency-producer"] == ProducerParams(1.0, 300.0, False, "", True)
    assert params["latency-scorer"] == ScorerParams(0.8, 0.2, "least", 1, 1, 1, "predicted-latency-producer")
    assert params["slo-headroom-tier-filter"] == TierFilterParams(0.01)
    assert params["latency-slo-admitter"] == AdmitterParams()
    assert config.scheduler.uses_prefix  # the producer reads the prefix matches


@pytest.mark.parametrize(("plugin", "field"), [
    ("{type: predicted-latency-producer, parameters: {sloBufferFactor: 0}}", "sloBufferFactor"),
    ("{type: predicted-latency-producer, parameters: {contextTTL: 5m}}", "contextTTL"),
    ("{type: predicted-latency-producer, parameters: {streamingMode: yes please}}", "streamingMode"),
    ("{type: predicted-latency-producer, parameters: {sampling: 1}}", "sampling"),
    ("{type: latency-scorer, parameters: {headroomSelectionStrategy: fastest}}", "headroomSelectionStrategy"),
    ("{type: latency-scorer, parameters: {ttftWeight: -1}}", "ttftWeight"),
    ("{type: latency-slo-admitter, parameters: {latencyPredictionInfoProducerName: 3}}",
     "latencyPredictionInfoProducerName"),
])
def test_bad_parameters_name_their_field(plugin: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"plugins\\[0\\].parameters.{field}"):
        parse_config(POOL + HEAD + f"plugins: [{plugin}]")


def test_a_bad_value_is_one_line_and_exit_2_from_the_command() -> None:
    result = run_cli(["--pool-name", "p", "--config-text",
                      HEAD + "plugins: [{type: predicted-latency-producer, parameters: {sloBufferFactor: -1}}]"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "plugins[0].parameters.sloBufferFactor" in lines[0]


def test_a_bad_predictor_url_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(POOL + HEAD + "plugins: [{type: predicted-latency-producer}]")
    result = run_cli(["--config", str(config)], env={"PREDICTION_SERVER_URL": "https://x:1,ftp://y"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "PREDICTION_SERVER_URL" in lines[0], result.stderr


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), max_size=40), st.integers(1, 30),
       st.randoms(use_true_random=False))
def test_training_samples_keep_at_most_the_limit(latencies: list[tuple[float, float]], limit: int,
                                                 rng: random.Random) -> None:
    from evergreen_trio.picker.latency_wire import TrainingEntry, sample_training

    entries = [TrainingEntry(PredictionRow(0, 1, 0, 0, 0, 0), ttft, tpot, 0.0) for ttft, tpot in latencies]
    sample = sample_training(entries, limit, rng)
    assert len(sample) == min(limit, len(entries)) and all(e in entries for e in sample)


def test_the_affinity_filters_gate_reads_the_predicted_ttft() -> None:
    from evergreen_trio.picker.affinity import AFFINITY_FILTERS
    from evergreen_trio.picker.scheduler import PoolSnapshot, Scheduler

    pool = "pool: {name: p, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}\n---\n"
    config = parse_config(pool + HEAD + """plugins:
- {type: predicted-latency-producer}
- {type: prefix-cache-affinity-filter, parameters: {maxTTFTPenaltyMs: 100, ttftSource: latencyPredictor}}
schedulingProfiles: [{name: default, plugins: [{pluginRef: prefix-cache-affinity-filter}]}]
""")
    scheduler = Scheduler(config, PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0))
    (plugin,) = config.scheduler.effective_profiles[0].filters
    states = [EndpointState(e, EndpointMetrics(), ready=True) for e in config.pool.endpoints]
    sticky, other = (s.endpoint.address for s in states)
    scheduler.prefix_matches = {sticky: 4, other: 0}
    producer = scheduler.plugin_states["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatency)
    context = producer.begin({}, states, scheduler.prefix_matches, 4, 10, {}, {})
    request = PickRequest("m", 0, hashes=(1, 2, 3, 4), latency={"predicted-latency-producer": context})
    for sticky_ttft, kept in ((120.0, [sticky]), (500.0, [sticky, other])):
        producer.predicted(context, [Prediction(sticky_ttft, 1), Prediction(50, 1)])
        kept_states = AFFINITY_FILTERS[plugin.type](scheduler, request, states, plugin.params)
        assert [s.endpoint.address for s in kept_states] == kept


def test_the_producer_reports_the_references_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from evergreen_trio.picker.guards import ModelLabels
    from evergreen_trio.picker.latency_metrics import LatencyMetrics

    seen: list[tuple[str, str, float]] = []
    producer = PredictedLatency(ProducerParams(streaming_mode=True))
    producer.name = "plp"
    producer.observe = lambda name, context, kind, value: seen.append((name, kind, round(value, 6)))
    context, address = _context(producer, 100, 30)
    producer.predicted(context, [Prediction(80, 20)], 0.004)
    producer.scheduled(PickRequest("m", 0, latency={"plp": context}), Schedule([address]), 10.0)
    for at, end in ((10.15, False), (10.19, False), (10.23, True)):  # TTFT 150 ms > 100; TPOT 40 ms > 30
        producer.on_chunk(context, at, end)
    assert seen == [("plp", "ttft_prediction_duration", 0.004), ("plp", "tpot_prediction_duration", 0.004),
                    ("plp", "ttft", 0.15), ("plp", "predicted_ttft", 0.08), ("plp", "ttft_slo_violation", 1.0),
                    ("plp", "tpot", 0.04), ("plp", "predicted_tpot", 0.02), ("plp", "tpot_slo_violation", 1.0)]

    registry = CollectorRegistry()
    metrics = LatencyMetrics(registry, ModelLabels(["m"]))
    context.model = context.target_model = "m"
    for _, kind, value in seen:
        metrics.observe("plp", context, kind, value)
    text = generate_latest(registry).decode()
    labels = 'model_name="m",plugin_name="plp",plugin_type="predicted-latency-producer",target_model_name="m"'
    models = 'model_name="m",target_model_name="m"'
    for line in (f"llm_d_epp_request_predicted_ttft_seconds_count{{{labels}}} 1.0",
                 f'llm_d_epp_request_slo_violation_total{{{labels},type="tpot"}} 1.0',
                 f'llm_d_epp_inference_request_metric{{{labels},type="predicted_tpot"}} 0.02',
                 f'inference_objective_request_slo_violation_total{{{models},type="ttft"}} 1.0',
                 f"inference_objective_request_ttft_prediction_duration_seconds_count{{{models}}} 1.0",
                 "[Deprecated: Use llm_d_epp_request_slo_violation_total]"):
        assert line in text


@pytest.mark.parametrize("value", ["NaN", "nan", "Inf", "-inf", "infinity", "1e400", "fast", ""])
def test_an_slo_header_that_is_not_a_finite_number_counts_as_none(value: str) -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=True))
    state = EndpointState(Endpoint("10.0.0.1", 8000), EndpointMetrics(), ready=True)
    context = producer.begin({"x-llm-d-slo-ttft-ms": value, "x-slo-tpot-ms": value}, [state], {}, 0, 1, {}, {})
    assert (context.ttft_slo, context.tpot_slo) == (0, 0)
    producer.predicted(context, [Prediction(10, 1)])
    # No SLO: headroom is minus the prediction; the idle candidate alone is scored, finitely.
    assert headroom_scores(ScorerParams(), {**context.infos, "b": info(-20, -2, 1)}) == {"10.0.0.1:8000": 0.51,
                                                                                        "b": 0.0}


def test_huge_slos_and_predictions_keep_the_scores_finite() -> None:
    producer = PredictedLatency(ProducerParams(streaming_mode=True, slo_buffer_factor=4.0))
    states = [EndpointState(Endpoint(f"10.0.0.{i}", 8000), EndpointMetrics(), ready=True) for i in (1, 2)]
    context = producer.begin({"x-llm-d-slo-ttft-ms": "-1.7e308", "x-llm-d-slo-tpot-ms": "1.7e308"}, states, {}, 0,
                             1, {}, {})
    producer.predicted(context, [Prediction(1.7e308, 0), Prediction(1.0, 1.7e308)])
    assert all(math.isfinite(i.ttft_headroom) and math.isfinite(i.tpot_headroom) for i in context.infos.values())
    assert all(0 <= s <= 1 for s in headroom_scores(ScorerParams(), dict(context.infos)).values())
