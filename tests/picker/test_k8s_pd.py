"""Cluster mode as llm-d deploys it, through a real Envoy: the picker (a subprocess) watches the
stand-in API server, runs llm-d-router's own pd-epp-config.yaml, and routes to simulated pods
labelled with llm-d.ai/role and an engine type (each simulator presents that engine's metric
names). The decode pod answers; the prefill pod it was told of comes back in x-prefilled-by."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from kube_fakes import NAMESPACE, PODS, POOLS_V1, KubeApiServer, free_port_on, pod, pool_v1, write_kubeconfig
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from picker_fakes import free_port

from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import run_envoy
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import PREFILLED_BY_HEADER, PREFILLER_HEADER, SERVED_BY_HEADER, run_sim

pytestmark = pytest.mark.envoy
FIXTURE = Path(__file__).parent / "fixtures" / "llm-d-router" / "pd-epp-config.yaml"
# host -> (engine the simulator presents, the pod's labels beyond app=model)
PODS_AS_DEPLOYED = {
    "127.0.0.2": ("vllm", {"llm-d.ai/role": "prefill"}),
    "127.0.0.3": ("sglang", {"llm-d.ai/role": "decode", "llm-d.ai/engine-type": "sglang"}),
    "127.0.0.4": ("triton-tensorrt-llm", {"inference.networking.k8s.io/engine-type": "triton-tensorrt-llm"}),
}


async def test_pd_through_envoy_with_llmd_labels_and_engines(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = free_port_on(*PODS_AS_DEPLOYED)
    for i, (host, (engine, labels)) in enumerate(PODS_AS_DEPLOYED.items()):
        await nursery.start(partial(run_sim, SimConfig(model="m", metrics_engine=engine), host=host, port=port))
        api.put(PODS, pod(f"model-{i}", host, labels={"app": "model", **labels}))
    api.put(POOLS_V1, pool_v1(ports=(port,)))
    prefill = f"127.0.0.2:{port}"
    decodes = {f"127.0.0.3:{port}", f"127.0.0.4:{port}"}
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--secure-serving=false",
            "--kubeconfig", str(write_kubeconfig(tmp_path, api.port)), "--refresh-metrics-interval", "20ms",
            "--config-file", str(FIXTURE), *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "inference-extension")
        listen, admin = free_port(), free_port()
        config = write_gateway_config(tmp_path / "envoy.json", gateway_config(
            f"127.0.0.1:{picker.grpc}", listen, admin_port=admin))
        await nursery.start(partial(run_envoy, config, admin_port=admin))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:

            async def ask(prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
                body = {"model": "m", "prompt": prompt, "max_tokens": 2}
                response = await client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                assert response.headers[SERVED_BY_HEADER] in decodes  # the prefill pod never decodes
                return response

            long = "a long uncached prompt " * 20  # ~115 tokens estimated, none cached: P/D
            first = await ask(long)
            assert first.headers[PREFILLED_BY_HEADER] == prefill
            again = await ask(long)  # now cached on its decode pod: fewer than 16 tokens left to prefill
            assert again.headers[SERVED_BY_HEADER] == first.headers[SERVED_BY_HEADER]
            assert PREFILLED_BY_HEADER not in again.headers
            forged = await ask("short", {PREFILLER_HEADER: "10.9.9.9:80"})  # a client's header never passes
            assert PREFILLED_BY_HEADER not in forged.headers
            served = {first.headers[SERVED_BY_HEADER]}
            with trio.fail_after(30):  # both decode pods are ready: SGLang and Triton metric names are read
                i = 0
                while served != decodes:
                    i += 1
                    served.add((await ask(f"{i} other")).headers[SERVED_BY_HEADER])
        api.put(PODS, pod("model-0", "127.0.0.2", labels={"app": "model", "llm-d.ai/role": "decode"}))
        with trio.fail_after(30):  # relabelled to decode: no prefill candidate, requests proceed without
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:
                while True:
                    body = {"model": "m", "prompt": "fresh " * 40 + str(trio.current_time()), "max_tokens": 2}
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200
                    if PREFILLED_BY_HEADER not in response.headers:
                        break
                    await trio.sleep(0.05)
