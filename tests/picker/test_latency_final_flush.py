"""A SIGTERM'd picker sends its buffered training entries (llm-d-router's predictor ``Stop``:
a final flush), and a training server that never answers does not hold its exit past the bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from ext_proc_rounds import completion, streamed_round
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from test_latency_client import Handler, echo_predictions, serve

from evergreen_trio.picker.latency import PredictedLatency, ProducerParams
from evergreen_trio.picker.latency_client import FINAL_FLUSH_S, LatencyPredictorClient
from evergreen_trio.picker.latency_wire import PredictionRow, PredictorConfig, TrainingEntry
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim

CONFIG = """---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: predicted-latency-producer, parameters: {streamingMode: true}}
- {type: latency-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}, {pluginRef: max-score-picker}]
"""


def _two_chunks(destination: str, send: Callable[[bytes], None]) -> None:
    """A response played back without an endpoint: a first chunk, a second (a TTFT and a TPOT
    training entry, each above 0 ms)."""
    for _ in range(2):
        time.sleep(0.01)
        send(b"data: {}\n\n")


def one_round(port: int) -> str | None:
    return streamed_round(port, "/v1/completions", completion("hello " * 20), _two_chunks)


async def _buffer_then_stop(nursery: trio.Nursery, tmp_path: Path, training: Handler,
                            calls: list[dict[str, Any]]) -> float:
    """A picker with one streamed request's training entries buffered (flushes an hour apart),
    SIGTERM'd: how long it took to exit."""
    sim = f"127.0.0.1:{await nursery.start(run_sim, SimConfig(model='m'))}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool:\n  name: latency\n  endpoints: ['{sim}']\n" + CONFIG)
    predictions = await serve(nursery, echo_predictions(calls))
    trainer = await serve(nursery, training)
    env = {"PREDICTION_SERVER_URL": predictions.url, "TRAINING_SERVER_URL": trainer.url,
           "LATENCY_FLUSH_INTERVAL_SEC": "3600", "LATENCY_HTTP_TIMEOUT_SEC": "30"}
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS], env=env) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(30):
            while await trio.to_thread.run_sync(one_round, picker.grpc) is None:  # noqa: ASYNC110 (its scrape)
                await trio.sleep(0.1)
        assert not [c for c in calls if "entries" in c]  # buffered, not yet flushed
        started = trio.current_time()
        picker.process.terminate()
        with trio.fail_after(20):
            assert await picker.process.wait() == 0
        return trio.current_time() - started


async def test_a_sigterm_flushes_the_buffered_training_entries(nursery: trio.Nursery, tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []
    await _buffer_then_stop(nursery, tmp_path, echo_predictions(calls), calls)
    (flush,) = [c["entries"] for c in calls if "entries" in c]
    assert sorted(e["actual_ttft_ms"] > 0 for e in flush) == [False, True]  # the TTFT and the TPOT entry
    assert all(e["actual_ttft_ms"] > 0 or e["actual_tpot_ms"] > 0 for e in flush)


async def test_a_hung_training_server_does_not_hold_the_exit(nursery: trio.Nursery, tmp_path: Path) -> None:
    reached = trio.Event()

    async def hung(stream: trio.SocketStream, request: bytes) -> None:
        reached.set()
        await trio.sleep_forever()

    # The HTTP timeout is 30 s: only the final flush's bound lets the picker go sooner.
    took = await _buffer_then_stop(nursery, tmp_path, hung, [])
    assert reached.is_set() and took < FINAL_FLUSH_S + 10



async def test_a_cancelled_client_flushes_within_its_bound_and_says_what_it_lost(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    async def hung(stream: trio.SocketStream, request: bytes) -> None:
        await trio.sleep_forever()

    server = await serve(nursery, hung)
    producer = PredictedLatency(ProducerParams())
    client = LatencyPredictorClient(PredictorConfig(training=server, predictions=(server,), flush_interval_s=3600,
                                                    http_timeout_s=30), [producer])
    async with trio.open_nursery() as running:
        await running.start(client.run)
        producer.pending = [TrainingEntry(PredictionRow(0, 1, 0, 0, 0, 0), 5.0, 0, 0.0)]
        started = trio.current_time()
        running.cancel_scope.cancel()
    assert FINAL_FLUSH_S <= trio.current_time() - started < FINAL_FLUSH_S + 5 and not producer.pending
    assert sum("picker.latency_final_flush_timeout" in r.message for r in caplog.records) == 1
