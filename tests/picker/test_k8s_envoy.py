"""A real Envoy routes through the cluster-mode picker (a subprocess watching the stand-in API
server) to simulated vLLM pods on 127.0.0.2, 127.0.0.3, ...; a pod added to the pool gets traffic."""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from kube_fakes import (
    NAMESPACE,
    PODS,
    POOLS_V1,
    KubeApiServer,
    metrics_reader,
    pod,
    pool_v1,
    start_sims,
    write_kubeconfig,
)
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from picker_fakes import free_port

from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import run_envoy
from evergreen_trio.picker.tls import self_signed_context
from evergreen_trio.sim.server import SERVED_BY_HEADER
from evergreen_trio.stack.gateway import GatewayInfo, GatewaySettings, run_gateway

pytestmark = pytest.mark.envoy
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@pytest.mark.parametrize("tls", [False, True])
async def test_envoy_routes_to_discovered_pods(nursery: trio.Nursery, tmp_path: Path, tls: bool) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = await start_sims(nursery, HOSTS)
    api.put(POOLS_V1, pool_v1(ports=(port,)))
    for i, host in enumerate(HOSTS[:2]):
        api.put(PODS, pod(f"model-{i}", host))
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, f"--secure-serving={str(tls).lower()}",
            "--kubeconfig", str(write_kubeconfig(tmp_path, api.port)), "--refresh-metrics-interval", "20ms",
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        assert picker.tls is tls
        await wait_health("127.0.0.1", picker.health, "inference-extension")
        listen, admin = free_port(), free_port()
        config = write_gateway_config(tmp_path / "envoy.json", gateway_config(
            f"127.0.0.1:{picker.grpc}", listen, admin_port=admin, picker_tls=tls))
        await nursery.start(partial(run_envoy, config, admin_port=admin))
        served: set[str] = set()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:

            async def ask(i: int) -> None:
                body = {"model": "food-review", "prompt": f"request {i} " * 20, "max_tokens": 2}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                served.add(response.headers[SERVED_BY_HEADER])

            for i in range(12):
                await ask(i)
            assert served <= {f"{h}:{port}" for h in HOSTS[:2]} and served
            api.put(PODS, pod("model-2", HOSTS[2]))  # scale up: the new pod gets requests
            new = f"{HOSTS[2]}:{port}"
            i = 100

            def routed_to_new() -> bool:
                return new in served

            with trio.fail_after(30):
                while not routed_to_new():
                    i += 1
                    await ask(i)
            bad = await client.post("/v1/completions", json={"prompt": "no model"})
            assert bad.status_code == 400
            metrics = await client.get(f"http://127.0.0.1:{picker.metrics}/metrics", headers=metrics_reader(api))
        text = metrics.text
        labels = 'model_name="food-review",target_model_name="food-review"'
        total = 'model_name="food-review",priority="0",target_model_name="food-review"'
        assert f"inference_objective_request_total{{{total}}} {i - 100 + 12}.0" in text
        new_labels = f'fairness_id="default-flow",{total}'
        assert f"llm_d_epp_request_total{{{new_labels}}} {i - 100 + 12}.0" in text
        error_labels = 'error_code="BadRequest",model_name="",target_model_name=""'
        assert f"inference_objective_request_error_total{{{error_labels}}} 1.0" in text
        for name in ("inference_objective_request_duration_seconds_count", "inference_objective_request_sizes_count",
                     "inference_objective_response_sizes_count", "inference_objective_input_tokens_count",
                     "inference_objective_output_tokens_count",
                     "inference_objective_normalized_time_per_output_token_seconds_count"):
            assert f"{name}{{{labels}}}" in text, name
        assert 'inference_objective_running_requests{model_name="food-review"} 0.0' in text
        assert f'inference_pool_per_pod_queue_size{{model_server_pod="{new}",name="pool"}}' in text
        assert 'inference_extension_plugin_duration_seconds_count{extension_point="Scorer"' in text
        assert "inference_extension_prefix_indexer_size " in text and "inference_extension_info{" in text


async def _tls_terminator(target_port: int, *, task_status: trio.TaskStatus[int]) -> None:
    """TLS in front of a plaintext picker, with our self-signed context (ALPN h2): what a secure
    picker's listener does, so Envoy's upstream TLS config and our certificate are checked today."""
    context = self_signed_context()

    async def relay(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await sink.aclose()

    async def handle(raw: trio.SocketStream) -> None:
        tls = trio.SSLStream(raw, context, server_side=True)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await tls.do_handshake()
            assert tls.selected_alpn_protocol() == "h2"
            upstream = await trio.open_tcp_stream("127.0.0.1", target_port)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay, tls, upstream)
                nursery.start_soon(relay, upstream, tls)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_envoy_speaks_tls_with_alpn_h2_to_a_self_signed_picker(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = await start_sims(nursery, HOSTS[:1])
    api.put(POOLS_V1, pool_v1(ports=(port,)))
    api.put(PODS, pod("model-0", HOSTS[0]))
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--secure-serving=false",
            "--kubeconfig", str(write_kubeconfig(tmp_path, api.port)), *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "inference-extension")
        tls_port = await nursery.start(_tls_terminator, picker.grpc)
        listen, admin = free_port(), free_port()
        config = write_gateway_config(tmp_path / "envoy.json", gateway_config(
            f"127.0.0.1:{tls_port}", listen, admin_port=admin, picker_tls=True))
        await nursery.start(partial(run_envoy, config, admin_port=admin))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
            body = {"model": "food-review", "prompt": "hi", "max_tokens": 2}
            response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.headers[SERVED_BY_HEADER] == f"{HOSTS[0]}:{port}"


async def test_gateway_with_a_secure_picker(nursery: trio.Nursery) -> None:
    settings = GatewaySettings(listen="127.0.0.1:0", simulate=1, secure_picker=True)
    info: GatewayInfo = await nursery.start(run_gateway, settings)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        response = await client.post("/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200, response.text
    nursery.cancel_scope.cancel()
