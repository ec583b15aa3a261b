"""The predicted-latency family end to end: the REAL llm-d latency predictor (its training and
prediction servers, vendored, as subprocesses), simulated vLLM servers, and `evergreen-trio picker`
started with llm-d-router's "predicted-latency-slo" well-known config, grpcio playing Envoy.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
import trio
from ext_proc_rounds import streamed_round
from latency_servers import latency_servers, needs_predictor
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim

pytestmark = needs_predictor
# llm-d-router's test/integration/epp/wellknown_configs_test.go "predicted-latency-slo", as written there.
WELL_KNOWN = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    insecureSkipVerify: true
    path: /metrics
    scheme: http
- type: core-metrics-extractor
- type: predicted-latency-producer
  parameters:
    streamingMode: true
- type: prefix-cache-affinity-filter
  name: strict-affinity-filter
  parameters:
    affinityThreshold: 0.99
- type: prefix-cache-affinity-filter
  name: loose-affinity-filter
  parameters:
    affinityThreshold: 0.8
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-producer
  - pluginRef: strict-affinity-filter
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: loose-affinity-filter
  - pluginRef: latency-scorer
  - pluginRef: weighted-random-picker
"""


def envoy_round(port: int, body: bytes, extra: list[tuple[str, str]]) -> str | None:
    """One request as Envoy sends it: routed by the picker, sent to the endpoint it chose (a
    streamed chat), the response streamed back through the picker. The endpoint, or None when
    the picker answered (before its first scrapes)."""

    def from_endpoint(destination: str, send: Callable[[bytes], None]) -> None:
        with httpx.stream("POST", f"http://{destination}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30) as reply:
            for chunk in reply.iter_bytes():
                send(chunk)

    return streamed_round(port, "/v1/chat/completions", body, from_endpoint, extra)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def sample(text: str, series: str) -> float:
    """The value of ``series`` (its name and labels as written in ``text``; labels sorted)."""
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and _canonical(name) == _canonical(series):
            return float(value)
    raise AssertionError(f"no {series} in the picker's metrics")


def _canonical(series: str) -> str:
    name, _, labels = series.partition("{")
    return name + "{" + ",".join(sorted(labels.rstrip("}").split(","))) + "}" if labels else name


async def test_the_real_predictor_trains_and_predicts_for_a_started_picker(nursery: trio.Nursery,
                                                                          tmp_path: Path) -> None:
    sims = [f"127.0.0.1:{await nursery.start(run_sim, SimConfig(model='m', decode_ms_per_token=2.0))}"
            for _ in range(2)]
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  name: latency\n  endpoints:\n" + "".join(f"  - {{address: '{s}'}}\n" for s in sims)
                      + "---\n" + WELL_KNOWN)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 6,
                       "messages": [{"role": "user", "content": "tell me about latency " * 8}]}).encode()
    async with latency_servers(tmp_path) as servers, picker_process(
            ["--config", str(config), *EPHEMERAL_PORTS], env=servers.env()) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        routed: list[str] = []
        with trio.fail_after(60):
            while len(routed) < 6:
                slo = [("x-llm-d-slo-ttft-ms", "5000"), ("x-llm-d-slo-tpot-ms", "500")] if routed else []
                destination = await trio.to_thread.run_sync(envoy_round, picker.grpc, body, slo)
                if destination is None:
                    await trio.sleep(0.1)
                    continue
                routed.append(destination)
        assert set(routed) <= set(sims)
        with trio.fail_after(30):  # the picker flushes its training entries every second
            while True:
                ttft, tpot = await servers.samples()
                if ttft >= 6 and tpot >= 1:
                    break
                await trio.sleep(0.2)
        assert servers.bulk_calls() >= 6  # one bulk call a request, each answered 200
        # The picker used the predictions: each of its requests timed its prediction call, and
        # those with an SLO and a stream had their predicted TTFT and TPOT, and their SLO check.
        text = await trio.to_thread.run_sync(metrics_text, picker.metrics)
        labels = '{model_name="m",plugin_name="predicted-latency-producer",plugin_type="predicted-latency-producer",' \
                 'target_model_name="m"}'
        assert sample(text, "llm_d_epp_request_ttft_prediction_duration_seconds_count" + labels) >= 6
        assert sample(text, "llm_d_epp_request_predicted_ttft_seconds_count" + labels) >= 6
        assert sample(text, "llm_d_epp_request_predicted_tpot_seconds_count" + labels) >= 1
        assert 'llm_d_epp_inference_request_metric{model_name="m"' in text and 'type="ttft_slo_violation"' in text
