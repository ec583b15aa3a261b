"""The latency predictor client's refresh (llm-d-router's ``refreshServerStatus`` and
``refreshModelInfo``): its replies decoded against hostile bytes, the current model read as the
reference's ``GetCurrent*`` read it, and the calls against stand-in and the real servers."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from latency_servers import latency_servers, needs_predictor
from test_latency_client import Handler, echo_predictions, http, serve

from evergreen_trio.picker.latency_client import LatencyPredictorClient
from evergreen_trio.picker.latency_wire import (
    MAX_REPORT_BYTES,
    MODEL_INFO_PATH,
    STATUS_PATH,
    ModelReport,
    PredictorConfig,
    PredictorError,
    Server,
    config_from_env,
    current_model,
    decode_model_report,
    parse_server,
)

# The real prediction server's /status and training server's /model/download/info, abridged.
STATUS = {"is_ready": True, "model_type": "bayesian_ridge", "objective_type": "quantile", "quantile": 0.9,
          "last_model_load": "2026-01-01T00:00:00", "training_server_url": "http://t:8000",
          "models_exist": {"ttft_model": True}, "ensemble_active": False}
INFO = {"model_type": "bayesian_ridge", "quantile": 0.9, "available_endpoints": {"coefficients": "/metrics"},
        "model_status": {"ttft_model_ready": True, "tpot_model_ready": True}}


def test_the_real_servers_replies_decode() -> None:
    assert decode_model_report(200, json.dumps(STATUS).encode(), "s") == ModelReport(
        "bayesian_ridge", "quantile", 0.9, True)
    assert decode_model_report(200, json.dumps(INFO).encode(), "i") == ModelReport("bayesian_ridge", "", 0.9)
    # Go leaves a field that is absent or null at its zero value.
    assert decode_model_report(200, b'{"model_type": null, "quantile": null}', "i") == ModelReport("", "", 0.0)


@pytest.mark.parametrize(("status", "body", "says"), [
    (503, b'{"detail": "not ready"}', "answered 503"),
    (200, b"not json", "not JSON"),
    (200, b"[]", "a JSON object"),
    (200, b'{"model_type": 5}', "model_type"),
    (200, json.dumps({"model_type": "x" * 65}).encode(), "model_type"),
    (200, b'{"objective_type": ["mean"]}', "objective_type"),
    (200, b'{"quantile": "0.9"}', "quantile"),
    (200, b'{"quantile": true}', "quantile"),
    (200, b'{"quantile": 1e999}', "quantile"),
    (200, b'{"quantile": 1' + b"0" * 400 + b"}", "quantile"),  # was OverflowError, out of the refresh
    (200, b'{"quantile": NaN}', "not JSON"),
    (200, b'{"is_ready": 1}', "is_ready"),
    (200, b"[" * 60_000, "not JSON"),
    (200, b" " * (MAX_REPORT_BYTES + 1), "larger than"),
])
def test_hostile_reports_are_predictor_errors(status: int, body: bytes, says: str) -> None:
    with pytest.raises(PredictorError) as caught:
        decode_model_report(status, body, "GET http://p/status")
    assert says in str(caught.value) and "GET http://p/status" in str(caught.value)


@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_a_predictor_error(body: bytes) -> None:
    try:
        report = decode_model_report(200, body, "x")
    except PredictorError:
        return
    assert math.isfinite(report.quantile) and len(report.model_type) <= 64


def test_the_current_model_prefers_the_prediction_servers_report() -> None:
    status, info = ModelReport("xgboost", "mean", 0.5, False), ModelReport("lightgbm", "quantile", 0.8)
    assert current_model(status, info) == ModelReport("xgboost", "mean", 0.5, False)
    assert current_model(None, info) == ModelReport("lightgbm", "quantile", 0.8, None)
    # The reference's defaults: its status's type even when empty, then quantile 0.9 and "quantile".
    assert current_model(ModelReport("", "", 0.0), info) == ModelReport("", "quantile", 0.8, None)
    assert current_model(ModelReport("", "", 0.0), None) == ModelReport("", "quantile", 0.9, None)
    assert current_model(None, None) == ModelReport("", "quantile", 0.9, None)


def test_the_refresh_interval_from_the_environment() -> None:
    assert config_from_env({}).metrics_interval_s == 60.0
    assert config_from_env({"LATENCY_METRICS_INTERVAL_SEC": "5"}).metrics_interval_s == 5.0
    assert config_from_env({"LATENCY_METRICS_INTERVAL_SEC": "0"}).metrics_interval_s == 60.0


def _reports(replies: dict[str, bytes], seen: list[str], after: tuple[int, trio.Event] | None = None) -> Handler:
    """Answers GETs from ``replies`` by path; sets ``after``'s event at its count of GETs."""

    async def gets(stream: trio.SocketStream, head: bytes) -> None:
        path = head.split(b" ")[1].decode()
        seen.append(path)
        if after is not None and len(seen) >= after[0]:
            after[1].set()
        await stream.send_all(http(200, replies[path]) if path in replies else http(404, b"{}"))

    return gets


async def test_a_started_client_refreshes_and_logs_the_model_once(nursery: trio.Nursery,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    seen: list[str] = []
    replies = {STATUS_PATH: json.dumps(STATUS).encode(), MODEL_INFO_PATH: json.dumps(INFO).encode()}
    three_refreshes = trio.Event()
    server = await serve(nursery, echo_predictions([]), _reports(replies, seen, (6, three_refreshes)))
    client = LatencyPredictorClient(PredictorConfig(training=server, predictions=(server,), metrics_interval_s=0.05),
                                    [], random.Random(1))
    await nursery.start(client.run)
    with trio.fail_after(10):
        await three_refreshes.wait()
    assert seen[:2] == [STATUS_PATH, MODEL_INFO_PATH]
    assert client.model == ModelReport("bayesian_ridge", "quantile", 0.9, True)
    lines = [r.message for r in caplog.records if "picker.latency_predictor_model" in r.message]
    assert lines == ["picker.latency_predictor_model model_type=bayesian_ridge objective=quantile quantile=0.9 "
                     "ready=True"]


async def test_a_hostile_refresh_keeps_the_last_good_report_and_warns_once(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    replies = {STATUS_PATH: json.dumps(STATUS).encode(), MODEL_INFO_PATH: json.dumps(INFO).encode()}
    server = await serve(nursery, echo_predictions([]), _reports(replies, []))
    client = LatencyPredictorClient(PredictorConfig(training=server, predictions=(server,), http_timeout_s=0.5), [])
    await client.refresh()
    good = client.model
    replies[STATUS_PATH] = b'{"model_type": "x\\n forged line", "quantile": NaN}'
    del replies[MODEL_INFO_PATH]  # a 404
    for _ in range(3):
        await client.refresh()
    assert client.model == good
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" ")[0] for m in warned] == ["picker.latency_status_failed", "picker.latency_model_info_failed"]
    assert all("\n" not in m for m in warned)


async def test_a_refresh_against_nothing_leaves_no_model(caplog: pytest.LogCaptureFixture) -> None:
    with trio.socket.socket() as sock:  # a port nothing listens on
        await sock.bind(("127.0.0.1", 0))
        refused = Server("127.0.0.1", sock.getsockname()[1], "")
    client = LatencyPredictorClient(PredictorConfig(training=refused, predictions=(refused,)), [])
    await client.refresh()
    assert client.model is None and client.status.failing and client.model_info.failing


@needs_predictor
async def test_the_real_servers_report_their_model(tmp_path: Path) -> None:
    async with latency_servers(tmp_path) as servers:
        config = PredictorConfig(training=parse_server(servers.training, "t"),
                                 predictions=(parse_server(servers.prediction, "p"),))
        client = LatencyPredictorClient(config, [])
        await client.refresh()
    assert client.model is not None and client.model.model_type == "bayesian_ridge" and client.model.ready
    assert 0 < client.model.quantile < 1 and client.model.objective_type in ("quantile", "mean")
