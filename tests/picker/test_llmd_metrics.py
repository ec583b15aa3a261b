"""The llm_d_epp_* metrics' behaviour, as llm-d-router's metrics_test and cardinality_test pin it.

The exposition of each family against prometheus_client's own classes is in test_telemetry; here:
the reference's TTFT/TPOT/ITL tables, fairness-id bounding, the stream timings the processor
notes, the pool summaries, flow control's capacity gauges and the data-layer error counters.
"""

from __future__ import annotations

import math

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_flow_control import epp
from test_processor import make_picker, request_body, request_headers, response_body, response_headers

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.attributes import fairness_label
from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.flow_control.config import BandConfig, FlowControlConfig
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.flow_control.queue import FlowQueue, Outcome, QueueItem
from evergreen_trio.picker.flow_metrics import FlowControlMetrics, outcome_name
from evergreen_trio.picker.guards import OTHER_MODEL, BoundedLabel
from evergreen_trio.picker.inflight import InflightLoad, LoadConfig
from evergreen_trio.picker.llmd_gauges import LlmdGauges, go_round2, mean_and_deviation
from evergreen_trio.picker.processor import StreamReport
from evergreen_trio.picker.runtime import METRICS_EXTRACTOR, METRICS_SOURCE, Scrapers
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.telemetry import CounterFamily, DerivedFamily, PickerMetrics, RequestSeries
from evergreen_trio.picker.usage import Usage

Key = tuple[str, frozenset[tuple[str, str]]]
LABELS = {"model_name": "m10", "target_model_name": "t10", "fairness_id": "tenant-a", "priority": "3"}


def key(name: str, /, **labels: str) -> Key:
    return name, frozenset(labels.items())


def samples(registry: CollectorRegistry) -> dict[Key, float]:
    text = generate_latest(registry).decode()
    return {key(s.name, **s.labels): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def routed(**fields: object) -> StreamReport:
    values: dict[str, object] = {"client_model": "m10", "target_model": "t10", "fairness_id": "tenant-a",
                                 "priority": 3, "routed": True, **fields}
    return StreamReport(**values)  # type: ignore[arg-type]


def recorded(*reports: tuple[StreamReport, float]) -> dict[Key, float]:
    metrics = PickerMetrics("pool")
    for report, duration_s in reports:
        metrics.started(report)
        metrics.record(report, duration_s)
    return samples(metrics.registry)


# -- TTFT, TPOT, ITL: metrics_test's TestRecordRequestTTFT / TPOT / InterTokenLatency ------------------


def test_ttft_per_streaming_label() -> None:
    got = recorded((routed(streaming=True, ttft_s=0.01), 1.0), (routed(streaming=True, ttft_s=1.6), 2.0),
                   (routed(client_model="m20", target_model="t20", fairness_id="tenant-b", priority=5,
                           ttft_s=0.12), 1.0))
    streaming = key("llm_d_epp_request_ttft_seconds_count", **LABELS, streaming="true")
    assert got[streaming] == 2
    assert got[key("llm_d_epp_request_ttft_seconds_sum", **LABELS, streaming="true")] == pytest.approx(1.61)
    other = {"model_name": "m20", "target_model_name": "t20", "fairness_id": "tenant-b", "priority": "5"}
    assert got[key("llm_d_epp_request_ttft_seconds_sum", **other, streaming="false")] == pytest.approx(0.12)


@pytest.mark.parametrize("ttft_s", [None, 0.0, -0.01], ids=["no first byte", "at receipt", "before receipt"])
def test_no_ttft_without_a_first_byte_after_the_request(ttft_s: float | None) -> None:
    got = recorded((routed(streaming=True, ttft_s=ttft_s, usage=Usage(completion_tokens=10)), 2.0))
    assert not any(name.startswith("llm_d_epp_request_ttft") for name, _ in got)
    assert not any(name.startswith("llm_d_epp_request_streaming_tpot") for name, _ in got)


def test_tpot_is_the_time_after_the_first_token_per_further_token() -> None:
    got = recorded((routed(streaming=True, ttft_s=0.5, usage=Usage(completion_tokens=11)), 2.0))
    assert got[key("llm_d_epp_request_streaming_tpot_seconds_count", **LABELS)] == 1
    assert got[key("llm_d_epp_request_streaming_tpot_seconds_sum", **LABELS)] == pytest.approx(0.15)


@pytest.mark.parametrize(("streaming", "ttft_s", "tokens", "duration_s"), [
    (False, 0.5, 11, 2.0),  # non-streaming: skipped
    (True, 0.1, 1, 0.2),  # a single token
    (True, 0.1, 0, 0.2),  # no tokens
    (True, None, 10, 0.2),  # no first byte
    (True, 0.2, 10, 0.1),  # complete before the first token
])
def test_no_tpot(streaming: bool, ttft_s: float | None, tokens: int, duration_s: float) -> None:
    got = recorded((routed(streaming=streaming, ttft_s=ttft_s, usage=Usage(completion_tokens=tokens)), duration_s))
    assert not any(name.startswith("llm_d_epp_request_streaming_tpot") for name, _ in got)


def test_inter_token_latency_per_label_set_zero_kept_negative_dropped() -> None:
    metrics = PickerMetrics("pool")
    first, second = routed(), routed(client_model="m20", target_model="t20", fairness_id="tenant-b", priority=5)
    for report, gaps in ((first, (0.05, 0.08, 0.12, 0.0, -0.01)), (second, (0.03,))):
        metrics.started(report)
        assert isinstance(report.itl, RequestSeries)
        for gap in gaps:
            report.itl.observe(gap)
    got = samples(metrics.registry)
    assert got[key("llm_d_epp_request_streaming_itl_seconds_count", **LABELS)] == 4
    assert got[key("llm_d_epp_request_streaming_itl_seconds_sum", **LABELS)] == pytest.approx(0.25)
    other = {"model_name": "m20", "target_model_name": "t20", "fairness_id": "tenant-b", "priority": "5"}
    assert got[key("llm_d_epp_request_streaming_itl_seconds_sum", **other)] == pytest.approx(0.03)


def test_no_running_request_without_a_model_name_and_cached_tokens_zero_is_observed() -> None:
    got = recorded((routed(client_model="", usage=Usage(prompt_tokens=0, cached_tokens=0)), 1.0))
    assert not any(name == "llm_d_epp_request_running" for name, _ in got)
    labels = {**LABELS, "model_name": ""}
    assert got[key("llm_d_epp_request_cached_tokens_count", **labels)] == 1  # details present, 0 cached
    assert not any(name.startswith("llm_d_epp_request_input_tokens") for name, _ in got)  # 0 is no observation


def test_a_weighted_rewrite_is_counted_under_its_rule_and_both_names() -> None:
    got = recorded((routed(rewrite="food-review"), 1.0))
    for name in ("llm_d_epp_model_rewrite_decisions_total", "inference_extension_model_rewrite_decisions_total"):
        assert got[key(name, model_rewrite_name="food-review", model_name="m10", target_model="t10")] == 1


def test_a_failed_scheduling_attempt_has_no_endpoint() -> None:
    got = recorded((StreamReport(client_model="m10", target_model="t10", scheduled=False, error=503), 0.1))
    assert got[key("llm_d_epp_scheduler_attempts_total", status="failure", target_model_name="t10",
                   endpoint_name="", namespace="", port="")] == 1
    labels = {**LABELS, "priority": "0", "fairness_id": "default-flow"}
    assert got[key("llm_d_epp_request_error_total", **labels, error_code="ServiceUnavailable")] == 1


# -- fairness_id: cardinality_test ---------------------------------------------------------------------


def test_bounded_label() -> None:
    label = BoundedLabel(2)
    assert (label.bound("a"), label.bound("b")) == ("a", "b")
    assert label.bound("c") == OTHER_MODEL  # beyond the cap
    assert label.bound("d") == OTHER_MODEL
    assert (label.bound("a"), label.bound("")) == ("a", "")  # admitted stays itself; "" takes no slot


@given(st.lists(st.text(max_size=8), max_size=60), st.integers(0, 10))
def test_bounded_label_admits_the_first_cap_values_for_good(values: list[str], cap: int) -> None:
    label = BoundedLabel(cap)
    bounded = [label.bound(v) for v in values]
    admitted = list(dict.fromkeys(v for v in values if v))[:cap]
    assert {b for b in bounded if b} <= {*admitted, OTHER_MODEL}
    assert [label.bound(v) for v in admitted] == admitted


def test_a_fairness_flood_collapses_to_the_cap_plus_other() -> None:
    metrics = PickerMetrics("pool")
    metrics.fairness = BoundedLabel(10)
    for i in range(1000):
        report = routed(fairness_id=f"tenant-{i}")
        metrics.started(report)
        metrics.record(report, 0.1)
    ids = {labels for name, labels in samples(metrics.registry) if name == "llm_d_epp_request_total"}
    assert len(ids) == 11


def test_the_fairness_label_without_flow_control() -> None:
    assert fairness_label({}, {}) == "default-flow"
    assert fairness_label({"x-gateway-inference-fairness-id": "tenant-a"}, {}) == "tenant-a"
    assert fairness_label({"x-gateway-inference-fairness-id": "bad id\x01"}, {}) == OTHER_MODEL


# -- what the processor notes for them ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01  # every reading is 10 ms after the last
        return self.now


def test_a_streamed_response_notes_its_timings_and_chunk_gaps() -> None:
    picker = make_picker()
    picker.snapshot.clock = Clock()
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=[("x-gateway-inference-fairness-id", "tenant-a")]))
    stream.on_message(request_body(b'{"model":"food-review","stream":true,"prompt":"p"}'))
    report = stream.report
    assert (report.fairness_id, report.priority, report.streaming) == ("tenant-a", 0, True)
    assert report.scheduled and report.endpoint and report.rewrite == "food-review"
    assert report.processing_s is not None and report.processing_s > 0
    gaps: list[float] = []

    class Gaps:
        def observe(self, gap: float) -> None:
            gaps.append(gap)

    report.itl = Gaps()
    stream.on_message(response_headers("text/event-stream"))
    for chunk in (b"data: {}\n\n", b"", b"data: {}\n\n"):
        stream.on_message(response_body(chunk, end=False))
    stream.on_message(response_body(b"data: [DONE]\n\n", end=True))
    assert report.ttft_s is not None and report.ttft_s > 0
    assert len(gaps) == 2 and all(g > 0 for g in gaps)  # between the three non-empty chunks
    assert report.response_processing_s > 0


def test_a_non_streaming_response_is_timed_from_its_headers_to_its_end() -> None:
    picker = make_picker()
    picker.snapshot.clock = clock = Clock()
    stream = picker.new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    stream.on_message(response_headers())
    headers_done = clock.now
    stream.on_message(response_body(b'{"usage":{"completion_tokens":2}}', end=True))
    report = stream.report
    assert not report.streaming and report.rewrite is None
    assert report.response_processing_s == pytest.approx(clock.now - headers_done + 0.01)


def test_without_flow_control_a_bad_fairness_header_is_no_error() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers(extra=[("x-gateway-inference-fairness-id", "x" * 300)]))
    replies = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert not any(reply.HasField("immediate_response") for reply in replies)
    assert stream.report.fairness_id == OTHER_MODEL


# -- pool summaries: the reference's calculateSummary -----------------------------------------------------


def test_go_rounding_halves_away_from_zero() -> None:
    assert [go_round2(v) for v in (0.125, 0.135, 1.005, 2.5, 0.0, 0.004999)] == [0.13, 0.14, 1.0, 2.5, 0.0, 0.0]
    assert go_round2(0.115) == 0.12 and round(0.115, 2) == 0.12  # a binary value above .115: both agree
    assert go_round2(0.125) != round(0.125, 2)  # an exact half: Go away from zero, Python to even


def test_mean_and_sample_deviation() -> None:
    assert mean_and_deviation([1, 2, 3, 4]) == (2.5, 1.29)
    assert mean_and_deviation([5]) == (5, 0)  # n - 1 is at least 1


def snapshot_of(*metrics: EndpointMetrics) -> PoolSnapshot:
    config = parse_config("pool: {name: p, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, values in zip(config.pool.endpoints, metrics, strict=False):
        snapshot.update(endpoint.address, values)
    return snapshot


def test_pool_gauges_under_both_names() -> None:
    registry = CollectorRegistry()
    gauges = LlmdGauges(registry, "p", "build")
    gauges.observe_pool(snapshot_of(EndpointMetrics(waiting=1, running=2, kv_usage=0.2),
                                    EndpointMetrics(waiting=4, running=6, kv_usage=0.5)))
    got = samples(registry)
    for name, value in (("inference_pool_average_queue_size", 2.5), ("llm_d_epp_average_queue_size", 2.5),
                        ("inference_pool_average_running_requests", 4), ("llm_d_epp_average_running_requests", 4),
                        ("llm_d_epp_average_kv_cache_utilization", 0.35), ("llm_d_epp_std_dev_queue_size", 2.12),
                        ("llm_d_epp_std_dev_running_requests", 2.83), ("llm_d_epp_std_dev_kv_cache_utilization", 0.21),
                        ("inference_pool_ready_pods", 2), ("llm_d_epp_ready_endpoints", 2)):
        assert got[key(name, name="p")] == pytest.approx(value), name
    assert got[key("llm_d_epp_per_endpoint_queue_size", name="p", model_server_endpoint="10.0.0.2:8000")] == 4
    assert got[key("llm_d_epp_info", commit="", build_ref="build")] == 1


def test_with_no_ready_endpoint_only_the_ready_count_changes() -> None:
    registry = CollectorRegistry()
    gauges = LlmdGauges(registry, "p", "build")
    gauges.observe_pool(snapshot_of(EndpointMetrics(waiting=3)))
    gauges.observe_pool(snapshot_of())
    got = samples(registry)
    assert got[key("llm_d_epp_ready_endpoints", name="p")] == 0
    assert got[key("llm_d_epp_average_queue_size", name="p")] == 3  # as the reference: the last summary stays


# -- the in-flight load producer's gauges ----------------------------------------------------------------


def test_inflight_series_carry_the_producers_labels_stay_at_zero_and_go_with_their_endpoint() -> None:
    registry, load, fairness = CollectorRegistry(), InflightLoad(LoadConfig(producer_name="load")), BoundedLabel(1)
    gauges = LlmdGauges(registry, "p", "build")
    a, b = Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)
    tickets = [load.dispatch(a.address, 10, group=("tenant-a", 1)), load.dispatch(a.address, 5, group=("tenant-b", 1)),
               load.dispatch(a.address, 2, group=("tenant-c", 1)), load.dispatch(b.address, 7, group=("", -1))]
    gauges.observe_load(PoolSnapshot([a, b], 2.0, lambda: 0.0), load, None, fairness)

    def inflight(endpoint: Endpoint, fairness_id: str, priority: str) -> tuple[float, float] | None:
        labels = {"endpoint_name": endpoint.address, "namespace": "", "producer_name": "load",
                  "fairness_id": fairness_id, "priority": priority}
        got = samples(registry)
        if key("llm_d_epp_inflight_requests", **labels) not in got:
            return None
        return got[key("llm_d_epp_inflight_requests", **labels)], got[key("llm_d_epp_inflight_tokens", **labels)]

    assert inflight(a, "tenant-a", "1") == (1, 10)
    assert inflight(a, OTHER_MODEL, "1") == (2, 7)  # past the cap of fairness ids, summed
    assert inflight(b, "", "-1") == (1, 7)
    tickets[0].release_prompt()
    tickets[3].release()
    gauges.observe_load(PoolSnapshot([a, b], 2.0, lambda: 0.0), load, None, fairness)
    assert inflight(a, "tenant-a", "1") == (1, 0)
    assert inflight(b, "", "-1") == (0, 0)  # idle: the series stays, as the reference's
    gauges.observe_load(PoolSnapshot([b], 2.0, lambda: 0.0), load, None, fairness)  # a left the pool
    assert inflight(a, "tenant-a", "1") is None and inflight(a, OTHER_MODEL, "1") is None
    assert inflight(b, "", "-1") == (0, 0)


# -- flow control's capacity use -------------------------------------------------------------------------


def flow_gate(section: str) -> FlowGate:
    config = parse_config(epp(section))
    assert config.flow_control is not None
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    return FlowGate(config.flow_control, snapshot, InflightLoad())


def capacity(gate: FlowGate) -> dict[Key, float]:
    registry = CollectorRegistry()
    LlmdGauges(registry, "p", "build").observe_load(gate.snapshot, gate.load, gate)
    return {k: v for k, v in samples(registry).items() if "capacity_utilization" in k[0]}


def test_every_band_reports_its_capacity_use_and_the_global_one_only_when_configured() -> None:
    got = capacity(flow_gate("  priorityBands: [{priority: 5, maxRequests: 10}]"))
    assert got[key("llm_d_epp_flow_control_capacity_utilization_requests", priority="5", inference_pool="p")] == 0
    assert got[key("llm_d_epp_flow_control_capacity_utilization_bytes", priority="0", inference_pool="p")] == 0
    assert not any("global" in name for name, _ in got)
    got = capacity(flow_gate("  maxRequests: 100\n  maxBytes: 1000"))
    assert got[key("llm_d_epp_flow_control_global_capacity_utilization_requests", inference_pool="p")] == 0
    assert got[key("llm_d_epp_flow_control_global_capacity_utilization_bytes", inference_pool="p")] == 0


# -- derived families --------------------------------------------------------------------------------------


def test_a_derived_family_needs_one_source_label_per_name() -> None:
    registry = CollectorRegistry()
    source = CounterFamily("c", "doc", ["a", "b"], registry=registry)
    with pytest.raises(ValueError, match="one source label index per label name of d"):
        DerivedFamily(source, "d", "doc", ["a"], [0, 1], registry)
    with pytest.raises(ValueError, match="one source label index"):
        DerivedFamily(source, "d", "doc", ["a"], [2], registry)


def test_a_derived_histogram_sum_may_round_differently_but_counts_are_exact() -> None:
    """The documented trade: the deprecated _sum adds per-series sums."""
    metrics = PickerMetrics("pool")
    values = [0.1, 0.2, 0.3, 1e-17, 1e16]
    for i, value in enumerate(values):
        report = routed(fairness_id=f"t{i}")
        metrics.started(report)
        metrics.record(report, value)
    got = samples(metrics.registry)
    legacy = {"model_name": "m10", "target_model_name": "t10"}
    assert got[key("inference_objective_request_duration_seconds_count", **legacy)] == len(values)
    assert math.isclose(got[key("inference_objective_request_duration_seconds_sum", **legacy)], math.fsum(values))


# -- the data layer's error counters ----------------------------------------------------------------------


async def test_a_scrape_that_fails_or_does_not_parse_is_a_poll_error_and_one_without_metrics_an_extract_error(
        nursery: trio.Nursery) -> None:
    good = render_metrics("vllm", EndpointMetrics()).encode()
    # as the reference's metrics source: its parser failing is the poll's error, a parsed page
    # without the engine's metrics the extractor's
    answers = iter([(500, b"down"), (200, b"not {metrics"), (200, b"other_metric 1\n"), *[(200, good)] * 10_000])

    async def handle(request: HttpRequest) -> HttpResponse:
        status, body = next(answers)
        return HttpResponse(status, [("content-type", "text/plain")], body)

    port = await nursery.start(serve_http, handle, "127.0.0.1", 0)
    config = parse_config(f"pool: {{name: p, endpoints: ['127.0.0.1:{port}'], refreshMetricsInterval: 5ms}}")
    snapshot = PoolSnapshot((), config.pool.staleness_threshold_s, trio.current_time)
    registry = CollectorRegistry()
    gauges = LlmdGauges(registry, "p", "build")
    ready = trio.Event()
    Scrapers(nursery, config, snapshot, lambda: snapshot.ready_states() and ready.set(), gauges).sync(
        config.pool.endpoints)
    with trio.fail_after(10):
        await ready.wait()
    got = samples(registry)
    for name in ("llm_d_epp_datalayer_poll_errors_total", "llm_d_inference_scheduler_datalayer_poll_errors_total"):
        assert got[key(name, source_type=METRICS_SOURCE)] == 2
    for name in ("llm_d_epp_datalayer_extract_errors_total",
                 "llm_d_inference_scheduler_datalayer_extract_errors_total"):
        assert got[key(name, source_type=METRICS_SOURCE, extractor_type=METRICS_EXTRACTOR)] == 1


@pytest.mark.parametrize("count", ["\u00b2", "9" * 5000, "\u0661\u0662", "9" * 19])
async def test_a_count_label_that_is_no_plain_number_is_unknown_and_the_scraper_goes_on(
        nursery: trio.Nursery, count: str) -> None:
    # "²" passes str.isdigit and 5000 digits pass it too, but int() refuses both with ValueError:
    # that escaped the scrape loop and took the picker down with it.
    page = render_metrics("vllm", EndpointMetrics(max_lora=2, block_size=16, num_blocks=8))
    page = page.replace('max_lora="2"', f'max_lora="{count}"').replace('block_size="16"', f'block_size="{count}"')

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], page.encode())

    port = await nursery.start(serve_http, handle, "127.0.0.1", 0)
    config = parse_config(f"pool: {{name: p, endpoints: ['127.0.0.1:{port}'], refreshMetricsInterval: 5ms}}")
    snapshot = PoolSnapshot((), config.pool.staleness_threshold_s, trio.current_time)
    ready = trio.Event()
    Scrapers(nursery, config, snapshot, lambda: snapshot.ready_states() and ready.set()).sync(config.pool.endpoints)
    with trio.fail_after(10):
        await ready.wait()
    [state] = snapshot.ready_states()
    assert state.metrics is not None
    assert (state.metrics.block_size, state.metrics.num_blocks, state.metrics.max_lora) == (None, 8, 0)


async def test_a_scrape_that_fails_on_a_long_bad_answer_is_logged_as_one_short_line(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    # h11 quotes the bytes it could not parse: a 16 KiB header line made a 16 KiB warning.
    page = render_metrics("vllm", EndpointMetrics()).encode()
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(page), page)]

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)
            await stream.send_all(answers.pop() if answers else b"HTTP/1.1 200 OK\r\n" + b"x" * 15000 + b"\r\n\r\n")

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    nursery.start_soon(trio.serve_listeners, answer, [listener])
    port = listener.socket.getsockname()[1]
    config = parse_config(f"pool: {{name: p, endpoints: ['127.0.0.1:{port}'], refreshMetricsInterval: 5ms}}")
    snapshot = PoolSnapshot((), config.pool.staleness_threshold_s, trio.current_time)
    scrapes, failed = [], trio.Event()

    def after_scrape() -> None:  # the first scrape is ready, the second fails and logs
        scrapes.append(1)
        if len(scrapes) == 2:
            failed.set()

    Scrapers(nursery, config, snapshot, after_scrape).sync(config.pool.endpoints)
    with trio.fail_after(10):
        await failed.wait()
    [line] = [r.getMessage() for r in caplog.records if "picker.endpoint_not_ready" in r.getMessage()]
    assert len(line) < 600 and "\n" not in line


# -- flow control's per-request metrics ------------------------------------------------------------------


class StepClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_flow_control_holds_counts_and_times_each_request_under_both_names() -> None:
    metrics = PickerMetrics("pool")
    flow = FlowControlMetrics(metrics)
    clock = StepClock()
    queue = FlowQueue(FlowControlConfig(bands=(BandConfig(5, max_bytes=100, max_requests=1),)), clock)
    queue.observer = flow
    outcomes: list[Outcome] = []
    first, second = (QueueItem("tenant-a", 5, 60, outcomes.append, models=("m10", "t10")) for _ in range(2))
    assert queue.enqueue(first) and not queue.enqueue(second)  # the band holds one
    held = {"fairness_id": "tenant-a", "priority": "5", "inference_pool": "pool", "model_name": "m10",
            "target_model_name": "t10"}
    got = samples(metrics.registry)
    for prefix in ("llm_d_epp", "inference_extension"):
        assert got[key(f"{prefix}_flow_control_queue_size", **held)] == 1
        assert got[key(f"{prefix}_flow_control_queue_bytes", **held)] == 60
        assert got[key(f"{prefix}_flow_control_request_queue_duration_seconds_count", **held,
                       outcome="RejectedCapacity")] == 1
        assert got[key(f"{prefix}_flow_control_request_enqueue_duration_seconds_count", fairness_id="tenant-a",
                       priority="5", outcome="NotYetFinalized")] == 1
    clock.now += 0.3
    assert queue.dispatch(lambda: 0.0) == 1
    got = samples(metrics.registry)
    assert got[key("llm_d_epp_flow_control_queue_size", **held)] == 0
    assert got[key("llm_d_epp_flow_control_request_queue_duration_seconds_sum", **held,
                   outcome="Dispatched")] == pytest.approx(0.3)
    for outcome in ("Dispatched", "RejectedCapacity"):
        assert got[key("llm_d_epp_flow_control_requests_total", outcome=outcome, priority="5",
                       inference_pool="pool")] == 1
    assert got[key("llm_d_epp_flow_control_dispatch_cycle_duration_seconds_count")] >= 1
    assert not any(name.startswith("inference_extension_flow_control_requests") for name, _ in got)  # no alias


def test_a_shutdown_rejects_newcomers_and_evicts_the_queued() -> None:
    item = QueueItem("f", 0, 1, lambda outcome: None)
    assert outcome_name(item, Outcome.SHUTTING_DOWN) == "RejectedOther"
    item.seq = 3
    assert outcome_name(item, Outcome.SHUTTING_DOWN) == "EvictedOther"
    assert outcome_name(item, None) == "NotYetFinalized"


def test_a_refused_request_is_processed_when_refused() -> None:
    """The reference records the processing time of request-phase failures too (they are its slowest)."""
    for body, status in ((b'{"model":"nope","prompt":"p"}', 404), (b"x" * (16 << 20 | 1), 413)):
        picker = make_picker()
        picker.snapshot.clock = Clock()
        stream = picker.new_stream()
        stream.on_message(request_headers())
        (reply,) = stream.on_message(request_body(body))
        assert reply.immediate_response.status.code == status
        assert stream.report.processing_s is not None and stream.report.processing_s > 0
