"""The latency predictor client: its wire against hostile replies, the Trio client over real
sockets (coalescing, timeouts, refused connections, training flushes), and the ext_proc stream
parking for its predictions."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from test_processor import (
    A,
    B,
    C,
    Mode,
    make_picker,
    request_body,
    request_headers,
    response_body,
    response_headers,
)
from test_processor import set_headers as header_map

from evergreen_trio._http import host_port
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.latency import PredictedLatency, PredictionsDone
from evergreen_trio.picker.latency_client import LatencyPredictorClient
from evergreen_trio.picker.latency_wire import (
    MAX_REPLY_BYTES,
    Prediction,
    PredictionRow,
    PredictorConfig,
    PredictorError,
    Server,
    TrainingEntry,
    config_from_env,
    decode_bulk_strict,
    encode_bulk,
)
from evergreen_trio.picker.processor import DESTINATION

ROW = PredictionRow(0.5, 100, 1, 2, 1, 0.25)


def reply(*pairs: tuple[object, object]) -> bytes:
    return json.dumps({"predictions": [{"ttft_ms": t, "tpot_ms": p} for t, p in pairs]}).encode()


# -- the wire -----------------------------------------------------------------------------------


def test_a_good_reply_decodes_in_order() -> None:
    assert decode_bulk_strict(200, reply((10, 1), (20.5, 2)), 2) == [Prediction(10, 1), Prediction(20.5, 2)]


@pytest.mark.parametrize(("status", "body", "says"), [
    (500, b'{"detail":"Bulk prediction failed"}', "answered 500"),
    (503, b'{"detail":"Models not ready"}', "answered 503"),
    (200, b"not json", "not JSON"),
    (200, b"[1, 2]", "predictions list"),
    (200, b'{"predictions": {}}', "predictions list"),
    (200, reply((1, 1)), "expected 2 predictions, got 1"),
    (200, reply((1, 1), (1, 1), (1, 1)), "expected 2 predictions, got 3"),
    (200, b'{"predictions": [{"ttft_ms": NaN, "tpot_ms": 1}, {"ttft_ms": 1, "tpot_ms": 1}]}', "not JSON"),
    (200, b'{"predictions": [{"ttft_ms": 1, "tpot_ms": Infinity}, {"ttft_ms": 1, "tpot_ms": 1}]}', "not JSON"),
    (200, b'{"predictions": [{"ttft_ms": 1e999, "tpot_ms": 1}, {"ttft_ms": 1, "tpot_ms": 1}]}',
     "predictions[0].ttft_ms"),
    (200, reply((-1, 1), (1, 1)), "predictions[0].ttft_ms"),
    (200, reply((1, 1), (10**400, 1)), "predictions[1].ttft_ms"),  # was OverflowError, out of the client
    (200, reply((1, 1), (1, None)), "predictions[1].tpot_ms"),
    (200, reply((1, 1), (True, 1)), "predictions[1].ttft_ms"),
    (200, reply((1, 1), ("5", 1)), "predictions[1].ttft_ms"),
    (200, b'{"predictions": [1, 2]}', "predictions[0].ttft_ms"),
    (200, b"[" * 100_000, "not JSON"),
    (200, b" " * (MAX_REPLY_BYTES + 1), "larger than"),
])
def test_hostile_replies_are_predictor_errors(status: int, body: bytes, says: str) -> None:
    with pytest.raises(PredictorError, match=None) as caught:
        decode_bulk_strict(status, body, 2)
    assert says in str(caught.value)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_a_predictor_error(body: bytes) -> None:
    try:
        predictions = decode_bulk_strict(200, body, 1)
    except PredictorError:
        return
    assert all(math.isfinite(p.ttft_ms) and p.ttft_ms >= 0 for p in predictions)


def test_rows_go_as_the_servers_fields() -> None:
    sent = json.loads(encode_bulk([ROW, PredictionRow(0, 0, 0, 0, 1, 0, pod_type="prefill")]))
    assert sent["requests"][0] == {
        "kv_cache_percentage": 0.5, "input_token_length": 100, "num_request_waiting": 1, "num_request_running": 2,
        "num_tokens_generated": 1, "prefix_cache_score": 0.25, "encoder_input_size": 0, "encoder_matched_size": 0,
        "prefill_tokens_in_flight": 0, "decode_tokens_in_flight": 0}
    assert sent["requests"][1]["pod_type"] == "prefill"


def test_settings_from_the_environment(caplog: pytest.LogCaptureFixture) -> None:
    assert config_from_env({}) == PredictorConfig()
    config = config_from_env({
        "PREDICTION_SERVER_URL": "http://a:1, http://[::1]:2", "TRAINING_SERVER_URL": "http://t",
        "LATENCY_MAX_SAMPLE_SIZE": "5", "LATENCY_FLUSH_INTERVAL_SEC": "3", "LATENCY_HTTP_TIMEOUT_SEC": "2",
        "LATENCY_MAX_BULK_SIZE": "101", "LATENCY_COALESCE_WINDOW_MS": "0", "LATENCY_MAX_COALESCED_ROWS": "x",
        "LATENCY_MAX_CONCURRENT_DISPATCHES": "0"})
    assert config.predictions == (Server("a", 1, "http://a:1"), Server("::1", 2, "http://[::1]:2"))
    assert config.training == Server("t", 80, "http://t")
    assert (config.max_sample_size, config.flush_interval_s, config.http_timeout_s) == (5, 3.0, 2.0)
    # As the reference: a value it cannot use keeps the default (we also say so).
    assert (config.max_bulk_size, config.coalesce_window_s, config.max_coalesced_rows,
            config.max_concurrent_dispatches) == (100, 0.0, 0, 36)
    assert sum("picker.latency_env_ignored" in r.message for r in caplog.records) == 3
    assert host_port("::1", 2) == "[::1]:2"  # how post_once names an IPv6 predictor


@pytest.mark.parametrize("url", ["https://a:1", "a:1", "http://a:99999", "http://a:1/v1", "http://", "http://a:1?x"])
def test_a_url_not_http_host_port_names_its_variable(url: str) -> None:
    with pytest.raises(ConfigError, match="PREDICTION_SERVER_URL"):
        config_from_env({"PREDICTION_SERVER_URL": url})


# -- the client over sockets --------------------------------------------------------------------

Handler = Callable[[trio.SocketStream, bytes], Awaitable[None]]


async def serve(nursery: trio.Nursery, handler: Handler, gets: Handler | None = None) -> Server:
    """A TCP server reading one HTTP request per connection (head and content-length body) and
    handing it to ``handler``, a GET to ``gets`` (by default a 404: the client's refresh)."""

    async def connection(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += await stream.receive_some(65536)
        async with stream:
            if head.startswith(b"GET "):
                await (gets or _not_found)(stream, head)
            else:
                await handler(stream, head + b"\r\n\r\n" + body)

    listeners = await nursery.start(trio.serve_tcp, connection, 0)
    port = listeners[0].socket.getsockname()[1]
    return Server("127.0.0.1", port, f"http://127.0.0.1:{port}")


async def _not_found(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(http(404, b"{}"))


def http(status: int, body: bytes) -> bytes:
    return f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


def echo_predictions(calls: list[dict[str, Any]]) -> Handler:
    """A prediction server answering each row with ttft = its input tokens, tpot = 1."""

    async def handler(stream: trio.SocketStream, request: bytes) -> None:
        doc = json.loads(request.split(b"\r\n\r\n", 1)[1])
        calls.append(doc)
        status = 202 if "entries" in doc else 200
        body = b"{}" if "entries" in doc else reply(*((r["input_token_length"], 1) for r in doc["requests"]))
        await stream.send_all(http(status, body))

    return handler


async def ask(client: LatencyPredictorClient, rows: list[PredictionRow]) -> list[Prediction] | None:
    got: list[list[Prediction] | None] = []
    done = trio.Event()

    def callback(predictions: list[Prediction] | None) -> None:
        got.append(predictions)
        done.set()

    client.start(rows, callback)
    assert not got  # never before start() returns
    with trio.fail_after(10):
        await done.wait()
    return got[0]


async def client_for(nursery: trio.Nursery, server: Server, **settings: Any) -> LatencyPredictorClient:
    config = PredictorConfig(training=server, predictions=(server,), **{"http_timeout_s": 0.5, **settings})
    client = LatencyPredictorClient(config, [], random.Random(1))
    await nursery.start(client.run)
    return client


async def test_concurrent_asks_coalesce_into_one_bulk_call(nursery: trio.Nursery) -> None:
    calls: list[dict[str, Any]] = []
    client = await client_for(nursery, await serve(nursery, echo_predictions(calls)), coalesce_window_s=0.05)
    results: dict[int, list[Prediction] | None] = {}

    async def one(tokens: int) -> None:
        rows = [PredictionRow(0, tokens, 0, 0, 1, 0), PredictionRow(0, tokens + 1, 0, 0, 1, 0)]
        results[tokens] = await ask(client, rows)

    async with trio.open_nursery() as asking:
        for tokens in (10, 20, 30):
            asking.start_soon(one, tokens)
    assert client.bulk_calls == len(calls) == 1 and len(calls[0]["requests"]) == 6
    assert results == {t: [Prediction(t, 1), Prediction(t + 1, 1)] for t in (10, 20, 30)}


async def test_max_coalesced_rows_dispatches_early(nursery: trio.Nursery) -> None:
    calls: list[dict[str, Any]] = []
    client = await client_for(nursery, await serve(nursery, echo_predictions(calls)), coalesce_window_s=5.0,
                              max_coalesced_rows=2)
    with trio.fail_after(3):  # not the 5 s window
        assert await ask(client, [ROW, ROW]) == [Prediction(100, 1)] * 2


async def _slow(stream: trio.SocketStream, request: bytes) -> None:
    await trio.sleep_forever()


async def _huge(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(f"HTTP/1.1 200 OK\r\ncontent-length: {MAX_REPLY_BYTES * 2}\r\n\r\n".encode())
    with contextlib.suppress(trio.BrokenResourceError):  # the client hangs up past its limit
        for _ in range(MAX_REPLY_BYTES * 2 // 65536):
            await stream.send_all(b"[" * 65536)


async def _garbage(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(b"\x00\x01 not http at all\r\n\r\n")


async def _nan(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(http(200, b'{"predictions": [{"ttft_ms": NaN, "tpot_ms": 1}]}'))


async def _hang_up(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")


async def _huge_int(stream: trio.SocketStream, request: bytes) -> None:
    await stream.send_all(http(200, b'{"predictions": [{"ttft_ms": 1' + b"0" * 400 + b', "tpot_ms": 1}]}'))


@pytest.mark.parametrize("handler", [_slow, _huge, _garbage, _nan, _hang_up, _huge_int])
async def test_a_hostile_predictor_gives_no_predictions_and_one_warning(
        nursery: trio.Nursery, handler: Handler, caplog: pytest.LogCaptureFixture) -> None:
    client = await client_for(nursery, await serve(nursery, handler))
    assert await ask(client, [ROW]) is None
    assert await ask(client, [ROW]) is None
    warnings = [r for r in caplog.records if "picker.latency_prediction_failed" in r.message]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


async def test_a_refused_connection_then_recovery(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    closed = await serve(nursery, _slow)
    with trio.socket.socket() as sock:  # a port nothing listens on
        await sock.bind(("127.0.0.1", 0))
        refused = Server("127.0.0.1", sock.getsockname()[1], "")
    client = await client_for(nursery, refused)
    assert await ask(client, [ROW]) is None
    calls: list[dict[str, Any]] = []
    working = await serve(nursery, echo_predictions(calls))
    client.config = PredictorConfig(training=working, predictions=(working,))
    assert await ask(client, [ROW]) == [Prediction(100, 1)]
    assert [r.message.split(" ")[0] for r in caplog.records if "picker.latency_prediction" in r.message] == [
        "picker.latency_prediction_failed", "picker.latency_prediction_recovered"]
    del closed


@pytest.mark.parametrize("rows", [[], [ROW] * 101, [PredictionRow(1.5, 0, 0, 0, 1, 0)],
                                  [PredictionRow(0, -1, 0, 0, 1, 0)], [PredictionRow(math.nan, 0, 0, 0, 1, 0)]])
async def test_rows_the_reference_refuses_get_none_without_a_call(nursery: trio.Nursery,
                                                                  rows: list[PredictionRow]) -> None:
    calls: list[dict[str, Any]] = []
    client = await client_for(nursery, await serve(nursery, echo_predictions(calls)))
    assert await ask(client, rows) is None and not calls


async def test_training_is_flushed_sampled_and_a_failure_warned_once(nursery: trio.Nursery,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    calls: list[dict[str, Any]] = []
    server = await serve(nursery, echo_predictions(calls))
    producer = PredictedLatency(_producer_params())
    producer.pending = [TrainingEntry(ROW, 12.5, 0, 1_700_000_000.0)] * 5
    client = LatencyPredictorClient(PredictorConfig(training=server, max_sample_size=3, flush_interval_s=3600),
                                    [producer])
    await client.flush()
    (call,) = calls
    assert len(call["entries"]) == 3 and client.trained == 3 and not producer.pending
    assert call["entries"][0]["actual_ttft_ms"] == 12.5 and call["entries"][0]["timestamp"].startswith("2023-11-14T")
    await client.flush()  # nothing buffered: no call
    assert len(calls) == 1
    client.config = PredictorConfig(training=await serve(nursery, _garbage))
    for _ in range(2):
        producer.pending = [TrainingEntry(ROW, 1, 0, 0.0)]
        await client.flush()
    assert sum("picker.latency_training_failed" in r.message for r in caplog.records) == 1


def _producer_params() -> Any:
    from evergreen_trio.picker.latency import ProducerParams

    return ProducerParams(streaming_mode=True)


# -- the ext_proc stream ------------------------------------------------------------------------

CONFIG = """---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: predicted-latency-producer, parameters: {streamingMode: true}}
- {type: slo-headroom-tier-filter, parameters: {epsilonExploreNeg: 0}}
- {type: latency-scorer}
- {type: latency-slo-admitter}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: slo-headroom-tier-filter}, {pluginRef: latency-scorer}, {pluginRef: max-score-picker}]
"""
SLO = [("x-llm-d-slo-ttft-ms", "100"), ("x-llm-d-slo-tpot-ms", "20")]


class FakePredictor:
    """The picker's StartPredict, answered by the test."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[PredictionRow], PredictionsDone]] = []

    def __call__(self, rows: Any, done: PredictionsDone) -> None:
        self.asked.append((list(rows), done))


def _stream(config: str, metrics: list[EndpointMetrics], prompt: str) -> tuple[Any, FakePredictor, list[bool]]:
    """A stream of a picker with a fake predictor, its SLO request buffered in, parked."""
    picker = make_picker(config, metrics)
    fake = FakePredictor()
    picker.start_predict = fake
    stream = picker.new_stream()
    woken: list[bool] = []
    stream.on_unpark = lambda: woken.append(True)
    stream.on_message(request_headers("/v1/completions", extra=SLO, request_mode=Mode.BUFFERED))
    assert stream.on_message(request_body(json.dumps({"model": "plain", "prompt": prompt}).encode())) == []
    assert stream.parked
    return stream, fake, woken


def _parked_stream(metrics: list[EndpointMetrics] | None = None) -> tuple[Any, FakePredictor, Any]:
    stream, fake, woken = _stream(CONFIG, metrics or [EndpointMetrics(kv_usage=0.5, running=3)] * 3, "hi")
    assert len(fake.asked) == 1 and woken == []
    return stream, fake, woken


def test_the_stream_parks_for_predictions_and_routes_by_them() -> None:
    stream, fake, woken = _parked_stream()
    ticks = itertools.count(1)
    stream.picker.snapshot.clock = lambda: next(ticks) / 100  # 10 ms a read
    rows, done = fake.asked[0]
    assert [r.num_tokens_generated for r in rows] == [1, 1, 1]
    done([Prediction(150, 30), Prediction(90, 15), Prediction(40, 25)])  # only B meets both SLOs
    assert woken == [True] and not stream.parked
    (decision,) = stream.resume()
    assert header_map(decision.request_body.response.header_mutation)[DESTINATION] == B
    producer = next(iter(stream.picker.latency.values()))
    assert producer.running[B].min_slo() == 20
    stream.on_message(response_headers("text/event-stream"))
    for end in (False, False, True):
        stream.on_message(response_body(b"data: {}\n\n", end=end))
    assert [e.actual_ttft_ms > 0 for e in producer.pending] == [True, False] and B not in producer.running


def test_a_sealed_burst_window_leaves_the_stream_parked_for_its_predictions() -> None:
    """Both producers hold the pick: the window's seal starts the predictions, and only their
    answer wakes the stream (the seal used to unpark it with nothing to send)."""
    burst = "- {type: burst-prefix-cache-producer, name: burst, parameters: {blockSizeTokens: 4}}\n"
    stream, fake, woken = _stream(CONFIG.replace("plugins:\n", "plugins:\n" + burst, 1),
                                  [EndpointMetrics(kv_usage=0.5, running=3)] * 3, "hi " * 32)
    assert fake.asked == []
    assert stream.picker.burst is not None
    stream.picker.burst.seal()
    assert stream.parked and woken == [] and len(fake.asked) == 1
    fake.asked[0][1]([Prediction(150, 30), Prediction(90, 15), Prediction(40, 25)])
    assert woken == [True] and not stream.parked
    (decision,) = stream.resume()
    assert header_map(decision.request_body.response.header_mutation)[DESTINATION] == B


def test_without_predictions_the_composite_fallback_routes() -> None:
    stream, fake, _ = _parked_stream([EndpointMetrics(kv_usage=0.9), EndpointMetrics(kv_usage=0.1),
                                      EndpointMetrics(kv_usage=0.5)])
    fake.asked[0][1](None)  # the predictor is down
    (decision,) = stream.resume()
    assert header_map(decision.request_body.response.header_mutation)[DESTINATION] == B  # the most free KV


def test_a_sheddable_request_no_endpoint_meets_is_refused() -> None:
    picker = make_picker(CONFIG, [EndpointMetrics(kv_usage=0.5, running=3)] * 3)
    fake = FakePredictor()
    picker.start_predict = fake
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/completions", extra=SLO, request_mode=Mode.BUFFERED))
    stream.on_message(request_body(json.dumps({"model": "batch", "prompt": "hi"}).encode()))
    fake.asked[0][1]([Prediction(150, 30)] * 3)
    (reply,) = stream.resume()
    assert reply.immediate_response.status.code == 500


def test_a_stream_gone_while_parked_ignores_its_predictions() -> None:
    stream, fake, woken = _parked_stream()
    stream.on_abort()
    fake.asked[0][1]([Prediction(1, 1)] * 3)
    assert woken == [] and stream.route is None and list(stream.resume()) == []


def test_without_a_predictor_client_the_pick_is_made_at_once() -> None:
    picker = make_picker(CONFIG)
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/completions", request_mode=Mode.BUFFERED))
    (decision,) = stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "hi"}).encode()))
    assert header_map(decision.request_body.response.header_mutation)[DESTINATION] in (A, B, C)


async def test_asks_waiting_for_a_dispatch_slot_give_up_at_the_timeout(nursery: trio.Nursery) -> None:
    client = await client_for(nursery, await serve(nursery, _slow), max_concurrent_dispatches=1, coalesce_window_s=0)
    results: list[list[Prediction] | None] = []

    async def one() -> None:
        results.append(await ask(client, [ROW]))

    async with trio.open_nursery() as asking:
        for _ in range(3):
            asking.start_soon(one)
    assert results == [None, None, None]
    assert client.bulk_calls < 3  # one waited out its timeout for the slot, not behind the others' calls
