"""``--tracing`` through a real Envoy: the client's ``traceparent`` reaches the picker in Envoy's
ext_proc request headers, and the request reaches the model server with the picker's span as parent;
with Envoy's own OpenTelemetry tracer on, the picker's span is a child of Envoy's."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from conftest import Ports
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from picker_fakes import FakeModelServer, Gateway, free_port, wait_serving
from test_tracing_otlp import collector

from evergreen_trio.picker import PickerPorts, parse_config, run_picker
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import run_envoy
from evergreen_trio.picker.tracing import Tracing, new_tracing
from evergreen_trio.picker.tracing_env import TracingSettings

pytestmark = pytest.mark.envoy

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


async def traced_picker(nursery: trio.Nursery, ports: Ports) -> Tracing:
    """A picker of the test's pool on its port, every request traced into memory."""
    tracing = new_tracing(TracingSettings(ratio=1.0, delay_s=600.0), InMemorySpanExporter())
    endpoints = "\n".join(f"    - address: {a}" for a in ports.pool)
    config = parse_config(f"pool:\n  name: traced\n  endpoints:\n{endpoints}\n")
    bound: PickerPorts = await nursery.start(partial(
        run_picker, config, grpc_port=ports.picker, health_port=0, metrics_port=0, tracing=tracing))
    await wait_serving(bound.health)
    return tracing


async def test_the_clients_trace_goes_through_envoy_and_the_picker_to_the_model_server(
        nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway) -> None:
    tracing = await traced_picker(nursery, ports)
    async with httpx.AsyncClient(timeout=20) as client:
        response = await client.post(duplex_gateway.url("/v1/completions"), headers={"traceparent": TRACEPARENT},
                                     content=json.dumps({"model": "m", "prompt": "hi"}).encode())
    assert response.status_code == 200, response.text
    received = response.json()["received_headers"]
    with trio.fail_after(10):
        while not [s for s in tracing.buffer.spans if s.name == "gateway.request"]:  # noqa: ASYNC110
            await trio.sleep(0.02)  # the stream ends after the response
    (request,) = [s for s in tracing.buffer.spans if s.name == "gateway.request"]
    assert request.context is not None and request.parent is not None
    assert f"{request.context.trace_id:032x}" == TRACE_ID and f"{request.parent.span_id:016x}" == TRACEPARENT[36:52]
    assert received["traceparent"] == f"00-{TRACE_ID}-{request.context.span_id:016x}-01"


def traced_gateway_config(picker_port: int, port: int, admin_port: int, collector_port: int) -> dict[str, Any]:
    """Our gateway config with Envoy's own OpenTelemetry tracer on (every request sampled), its
    spans sent to ``collector_port``."""
    config = gateway_config(f"127.0.0.1:{picker_port}", port, admin_port=admin_port)
    clusters = config["static_resources"]["clusters"]
    collector = copy.deepcopy(next(c for c in clusters if c["name"] == "endpoint_picker"))
    collector["name"] = collector["load_assignment"]["cluster_name"] = "otel_collector"
    collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = collector_port
    clusters.append(collector)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["tracing"] = {"random_sampling": {"value": 100}, "provider": {
        "name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"envoy_grpc": {"cluster_name": "otel_collector"}, "timeout": "2s"},
            "service_name": "envoy-gateway"}}}
    return config


async def test_envoys_own_tracer_puts_no_trace_context_where_the_picker_reads_it(
        nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], tmp_path: Path) -> None:
    # Envoy's tracer injects its span's context at the router, after ext_proc: the picker (as the
    # reference, which reads the same headers) starts a trace of its own, and the model server gets
    # Envoy's traceparent, which replaces the picker's (docs/picker.md, Tracing).
    with collector() as (_, collector_port):
        port, admin_port = free_port(), free_port()
        path = write_gateway_config(tmp_path / "envoy.json",
                                    traced_gateway_config(ports.picker, port, admin_port, collector_port))
        await nursery.start(partial(run_envoy, path, admin_port=admin_port))
        tracing = await traced_picker(nursery, ports)
        async with httpx.AsyncClient(timeout=20) as client:  # no traceparent: Envoy starts the trace
            response = await client.post(f"http://127.0.0.1:{port}/v1/completions",
                                         content=json.dumps({"model": "m", "prompt": "hi"}).encode())
        assert response.status_code == 200, response.text
        with trio.fail_after(10):
            while not [s for s in tracing.buffer.spans if s.name == "gateway.request"]:  # noqa: ASYNC110
                await trio.sleep(0.02)
    (request,) = [s for s in tracing.buffer.spans if s.name == "gateway.request"]
    assert request.context is not None and request.parent is None
    received = response.json()["received_headers"]["traceparent"]
    assert received.split("-")[1] != f"{request.context.trace_id:032x}"
