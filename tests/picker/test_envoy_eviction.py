"""In-flight eviction through a real Envoy: the evicted sheddable request's client gets 429 with
``x-llm-d-request-dropped-reason: evicted`` while its model server still works on it, and the
urgent request that was blocked is served."""

from __future__ import annotations

import httpx
import pytest
import trio
from conftest import Ports
from picker_fakes import FakeModelServer, Gateway
from test_envoy_e2e import config_text, post, start_picker
from test_envoy_flow_control import REASON, wait_sample

pytestmark = pytest.mark.envoy
EVICTION = """
objectives: [{name: urgent, priority: 5}, {name: bulk, priority: -1}]
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
  enableEviction: true
"""


@pytest.mark.parametrize("mode", ["duplex_gateway", "buffered_gateway"])
async def test_the_evicted_client_gets_429_evicted_and_the_urgent_one_is_served(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], mode: str, request: pytest.FixtureRequest
) -> None:
    gateway: Gateway = request.getfixturevalue(mode)
    for backend in backends:
        backend.response_delay_s = 2.0
    bound = await start_picker(nursery, ports, config_text(ports.pool, EVICTION))
    answers: dict[str, httpx.Response] = {}
    done = {name: trio.Event() for name in ("plain-1", "plain-2", "bulk", "urgent")}

    async def send(name: str, objective: str | None) -> None:
        headers = {"x-llm-d-inference-objective": objective} if objective else {}
        answers[name] = await post(gateway, "/v1/completions", {"model": "plain", "prompt": name},
                                   headers=headers)
        done[name].set()

    for count, (name, objective) in enumerate((("plain-1", None), ("plain-2", None), ("bulk", "bulk")), 1):
        nursery.start_soon(send, name, objective)
        await wait_sample(bound, "llm_d_epp_inflight_requests", count)  # 3 of 3: the pool is full
    nursery.start_soon(send, "urgent", "urgent")
    with trio.fail_after(10):
        await done["bulk"].wait()
    assert answers["bulk"].status_code == 429 and answers["bulk"].headers[REASON] == "evicted"
    with trio.fail_after(15):
        for name in ("plain-1", "plain-2", "urgent"):
            await done[name].wait()
            assert answers[name].status_code == 200 and REASON not in answers[name].headers
    assert sum(len(b.requests) for b in backends) == 4  # the bulk request reached a model server first
