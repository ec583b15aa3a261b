"""Flow control and in-flight load end to end through a real Envoy: a 429 with its dropped reason,
a queued request that later succeeds, TTL expiry, and nothing left behind when the client goes."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from conftest import Ports
from picker_fakes import FakeModelServer, Gateway
from test_envoy_e2e import config_text, picker_metrics, post, start_picker

from evergreen_trio.picker import PickerPorts
from evergreen_trio.picker.engine_metrics import EndpointMetrics

pytestmark = pytest.mark.envoy
REASON = "x-llm-d-request-dropped-reason"
FLOW_CONTROL = """
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
flowControl:
  defaultRequestTTL: 2s
  defaultPriorityBand: {maxRequests: 1}
"""
SATURATED, IDLE = EndpointMetrics(waiting=10), EndpointMetrics(waiting=0)


def set_metrics(backends: list[FakeModelServer], metrics: EndpointMetrics) -> None:
    for backend in backends:
        backend.metrics = metrics


async def wait_sample(bound: PickerPorts, name: str, value: float, timeout_s: float = 10.0) -> None:
    """Until the picker exports ``name`` (summed over labels) equal to ``value``."""
    with trio.fail_after(timeout_s):
        while True:
            samples = await picker_metrics(bound)
            if sum(v for (n, _), v in samples.items() if n == name) == value:
                return
            await trio.sleep(0.05)


async def test_queue_429_with_reason_then_the_queued_request_succeeds_then_ttl(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    set_metrics(backends, SATURATED)
    bound = await start_picker(nursery, ports, config_text(ports.pool) + FLOW_CONTROL)
    queued: list[httpx.Response] = []
    answered = trio.Event()

    async def send_queued() -> None:
        queued.append(await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "wait"}))
        answered.set()

    nursery.start_soon(send_queued)
    await wait_sample(bound, "llm_d_epp_flow_control_queue_size", 1)
    full = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "no room"})
    assert full.status_code == 429 and full.headers[REASON] == "rejected-saturated"
    assert json.loads(full.content)["error"]["code"] == 429
    await trio.sleep(0.5)
    assert not queued  # still waiting inside its ext_proc stream
    set_metrics(backends, IDLE)
    with trio.fail_after(5):
        await answered.wait()
    assert queued[0].status_code == 200, queued[0].text
    assert REASON not in queued[0].headers
    set_metrics(backends, SATURATED)
    await wait_sample(bound, "llm_d_epp_flow_control_pool_saturation", 4.0)  # decode and effective: 2.0 each
    started = trio.current_time()
    expired = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "too late"})
    assert expired.status_code == 429 and expired.headers[REASON] == "rejected-ttl-expired"
    assert trio.current_time() - started >= 1.5


async def test_client_gone_leaves_the_queue_and_releases_its_in_flight_load(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    set_metrics(backends, SATURATED)
    bound = await start_picker(nursery, ports, config_text(ports.pool) + FLOW_CONTROL.replace("2s", "30s"))
    async with httpx.AsyncClient(timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(duplex_gateway.url("/v1/completions"), json={"model": "plain", "prompt": "bye"})
    await wait_sample(bound, "llm_d_epp_flow_control_queue_size", 0)
    # Dispatched, then the client goes while the model server still works on it.
    set_metrics(backends, IDLE)
    for backend in backends:
        backend.response_delay_s = 5.0
    async with httpx.AsyncClient(timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(duplex_gateway.url("/v1/completions"), json={"model": "plain", "prompt": "bye"})
    assert sum(len(b.requests) for b in backends) == 1
    await wait_sample(bound, "llm_d_epp_inflight_requests", 0)
