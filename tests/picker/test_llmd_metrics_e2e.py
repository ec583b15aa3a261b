"""The llm_d_epp_* families through a started picker: grpcio plays Envoy, httpx scrapes the metrics port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import grpc
import httpx
import trio
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from picker_fakes import PolledServer
from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker import PickerPorts, parse_config, run_picker
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.guards import MAX_FAIRNESS_LABEL_VALUES, OTHER_MODEL
from evergreen_trio.picker.runtime import PROCESS_PATH

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
FAIRNESS = "x-gateway-inference-fairness-id"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def serve_engine(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    text = render_metrics("vllm", EndpointMetrics(waiting=1, running=2, kv_usage=0.25)).encode()

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], text)

    await serve_http(handle, "127.0.0.1", 0, task_status=task_status)


async def start(nursery: trio.Nursery) -> PickerPorts:
    engine = await nursery.start(serve_engine)
    config = parse_config(f"""pool: {{name: pool, endpoints: ['127.0.0.1:{engine}']}}
models:
  - {{name: food-review, targetModels: [{{name: food-review-v1, weight: 1}}]}}
""")
    ports: PickerPorts = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0,
                                                     metrics_port=0))
    with trio.fail_after(10):
        while not (await scrape(ports)).get(("llm_d_epp_ready_endpoints", frozenset({("name", "pool")}))):  # noqa: ASYNC110
            await trio.sleep(0.02)
    return ports


async def scrape(ports: PickerPorts) -> Samples:
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"http://127.0.0.1:{ports.metrics}/metrics")).text
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def headers(fairness: str) -> ep.ProcessingRequest:
    pairs = [(":path", "/v1/completions"), (":method", "POST"), (FAIRNESS, fairness)]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=DUPLEX, response_body_mode=DUPLEX))


def body(data: bytes, end: bool) -> ep.HttpBody:
    return ep.HttpBody(body=data, end_of_stream=end)


def streamed_request(fairness: str) -> Iterator[ep.ProcessingRequest]:
    """A streamed completion as Envoy sends it: the request, then an SSE response in three chunks
    with a pause between (the chunk gaps) and usage in the last event."""
    yield headers(fairness)
    yield ep.ProcessingRequest(request_body=body(b'{"model":"food-review","prompt":"hi","stream":true}', True))
    yield ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")])))
    for chunk in (b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n'):
        time.sleep(0.02)
        yield ep.ProcessingRequest(response_body=body(chunk, False))
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"prompt_tokens_details":' \
            b'{"cached_tokens":2}}}\n\ndata: [DONE]\n\n'
    yield ep.ProcessingRequest(response_body=body(usage, True))


def routed_only(fairness: str) -> Iterator[ep.ProcessingRequest]:
    yield headers(fairness)
    yield ep.ProcessingRequest(request_body=body(b'{"model":"food-review","prompt":"hi"}', True))
    yield ep.ProcessingRequest(response_headers=ep.HttpHeaders(end_of_stream=True))


def send(port: int, requests: list[Iterator[ep.ProcessingRequest]]) -> None:
    """Each request on its own stream of one connection, one after another (blocking: run in a thread)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS_PATH, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        for messages in requests:
            replies = list(call(messages, timeout=30))
            assert not any(reply.HasField("immediate_response") for reply in replies)


def value(samples: Samples, name: str, /, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_a_streamed_request_shows_in_every_request_family(nursery: trio.Nursery) -> None:
    ports = await start(nursery)
    await trio.to_thread.run_sync(send, ports.grpc, [streamed_request("tenant-a")])
    got = await scrape(ports)
    labels = {"model_name": "food-review", "target_model_name": "food-review-v1", "fairness_id": "tenant-a",
              "priority": "0"}
    legacy = {"model_name": "food-review", "target_model_name": "food-review-v1"}
    assert value(got, "llm_d_epp_request_total", **labels) == 1
    assert value(got, "inference_objective_request_total", **legacy, priority="0") == 1
    assert value(got, "llm_d_epp_request_running", **labels) == 0
    for family in ("llm_d_epp_request_duration_seconds", "llm_d_epp_request_size_bytes",
                   "llm_d_epp_response_size_bytes", "llm_d_epp_request_input_tokens",
                   "llm_d_epp_request_output_tokens", "llm_d_epp_request_cached_tokens",
                   "llm_d_epp_request_ntpot_seconds", "llm_d_epp_request_streaming_tpot_seconds"):
        assert value(got, f"{family}_count", **labels) == 1, family
    assert value(got, "llm_d_epp_request_cached_tokens_sum", **labels) == 2
    assert value(got, "inference_objective_prompt_cached_tokens_count", **legacy) == 1
    assert value(got, "llm_d_epp_request_ttft_seconds_count", **labels, streaming="true") == 1
    assert value(got, "llm_d_epp_request_streaming_itl_seconds_count", **labels) == 2  # three chunks, two gaps
    assert value(got, "llm_d_epp_request_streaming_itl_seconds_sum", **labels) > 0.015
    for family in ("llm_d_epp_scheduler_e2e_duration_seconds", "inference_extension_scheduler_e2e_duration_seconds",
                   "llm_d_epp_request_processing_duration_seconds", "llm_d_epp_response_processing_duration_seconds"):
        assert value(got, f"{family}_count") == 1, family
    attempt = {key: v for (name, key), v in got.items() if name == "llm_d_epp_scheduler_attempts_total"}
    assert list(attempt.values()) == [1]
    assert dict(next(iter(attempt)))["status"] == "success"
    assert value(got, "llm_d_epp_model_rewrite_decisions_total", model_rewrite_name="food-review",
                 model_name="food-review", target_model="food-review-v1") == 1
    for name, expected in (("llm_d_epp_average_queue_size", 1), ("llm_d_epp_average_running_requests", 2),
                           ("inference_pool_average_running_requests", 2), ("llm_d_epp_std_dev_queue_size", 0),
                           ("llm_d_epp_average_kv_cache_utilization", 0.25), ("llm_d_epp_ready_endpoints", 1)):
        assert value(got, name, name="pool") == expected, name
    assert value(got, "llm_d_epp_info", commit="", build_ref=next(
        dict(k)["build_ref"] for n, k in got if n == "inference_extension_info")) == 1


async def test_thousands_of_fairness_ids_get_at_most_the_cap_of_series(nursery: trio.Nursery) -> None:
    """Hostile clients: every request names a new fairness id; the metrics page stays bounded."""
    ports = await start(nursery)
    count = MAX_FAIRNESS_LABEL_VALUES + 1500
    await trio.to_thread.run_sync(send, ports.grpc, [routed_only(f"tenant-{i}") for i in range(count)])
    got = await scrape(ports)
    ids = [dict(labels)["fairness_id"] for name, labels in got if name == "llm_d_epp_request_total"]
    assert len(ids) == MAX_FAIRNESS_LABEL_VALUES + 1 and OTHER_MODEL in ids
    labels = {"model_name": "food-review", "target_model_name": "food-review-v1", "priority": "0"}
    assert value(got, "llm_d_epp_request_total", **labels, fairness_id=OTHER_MODEL) == count - MAX_FAIRNESS_LABEL_VALUES
    assert value(got, "inference_objective_request_total", **labels) == count
    per_family: dict[str, set[frozenset[tuple[str, str]]]] = {}
    for name, labels in got:
        per_family.setdefault(name, set()).add(frozenset((k, v) for k, v in labels if k != "le"))
    assert max(len(series) for series in per_family.values()) == MAX_FAIRNESS_LABEL_VALUES + 1


async def test_the_models_and_dcgm_sources_count_their_poll_and_extract_errors(nursery: trio.Nursery) -> None:
    # As llm-d-router's HTTPDataSource: a failed GET or a page its parser refuses is a poll error of the
    # source's type; a parsed page the extractor refuses (no DCGM utilization) an extract error.
    models_down = PolledServer("/v1/models", (503, "busy"))  # its /dcgm: vLLM's page, no GPU utilization
    dcgm_down = PolledServer("/dcgm", (500, "down"))  # its /v1/models: vLLM's metrics text, not JSON
    a, b = [await nursery.start(server.serve) for server in (models_down, dcgm_down)]
    config = parse_config(f"""pool: {{name: pool, endpoints: ['127.0.0.1:{a}', '127.0.0.1:{b}']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: models-data-source, name: models, parameters: {{interval: 20ms}}}}
- {{type: models-data-extractor}}
- {{type: dcgm-data-source, name: gpus, parameters: {{port: 0, path: /dcgm, interval: 20ms}}}}
- {{type: dcgm-extractor}}
- {{type: queue-scorer}}
dataLayer:
  sources:
  - {{pluginRef: models, extractors: [{{pluginRef: models-data-extractor}}]}}
  - {{pluginRef: gpus, extractors: [{{pluginRef: dcgm-extractor}}]}}
""")
    ports: PickerPorts = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0,
                                                     metrics_port=0))
    await models_down.next_polls(3)
    await dcgm_down.next_polls(3)
    polls = {"source_type": "models-data-source"}, {"source_type": "dcgm-data-source"}
    extracts = {"source_type": "dcgm-data-source", "extractor_type": "dcgm-extractor"},
    with trio.fail_after(10):
        while True:
            got = await scrape(ports)
            counted = [got.get((f"{prefix}_datalayer_{kind}_errors_total", frozenset(labels.items())), 0)
                       for prefix in ("llm_d_epp", "llm_d_inference_scheduler")
                       for kind, each in (("poll", polls), ("extract", extracts)) for labels in each]
            if all(counted):
                break
            await trio.sleep(0.05)
    for prefix in ("llm_d_epp", "llm_d_inference_scheduler"):  # none from what served well
        for name, labels in ((f"{prefix}_datalayer_poll_errors_total", {"source_type": "metrics-data-source"}),
                             (f"{prefix}_datalayer_extract_errors_total",
                              {"source_type": "models-data-source", "extractor_type": "models-data-extractor"})):
            assert got.get((name, frozenset(labels.items())), 0) == 0
