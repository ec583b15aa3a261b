"""Flow control in cluster mode, through a real Envoy: the picker (a subprocess) watches the stand-in
API server's pods and InferenceObjectives (llm-d.ai/v1alpha2 and the legacy group), queues what a
one-slot pool cannot take, serves the higher priority first, and sheds a full band with 429."""

from __future__ import annotations

from collections.abc import Mapping
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
    eventually,
    free_port_on,
    pod,
    pool_v1,
    write_kubeconfig,
)
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from picker_fakes import free_port

from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import run_envoy
from evergreen_trio.picker.k8s import objectives as objectives_module
from evergreen_trio.picker.k8s.objectives import objective_priority
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim

pytestmark = pytest.mark.envoy
OBJECTIVES_LLMD = "apis/llm-d.ai/v1alpha2/inferenceobjectives"
OBJECTIVES_LEGACY = "apis/inference.networking.x-k8s.io/v1alpha2/inferenceobjectives"
CONFIG = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
flowControl:
  priorityBands: [{priority: -1, maxRequests: 1}]
  saturationDetector: {pluginRef: concurrency-detector}
"""


def objective(api_version: str, name: str, priority: object, pool: str = "pool") -> dict[str, object]:
    return {"apiVersion": api_version, "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"priority": priority, "poolRef": {"group": "inference.networking.k8s.io", "name": pool}}}


def test_objective_specs() -> None:
    assert objective_priority(objective("llm-d.ai/v1alpha2", "a", 5), "pool") == ("a", 5)
    assert objective_priority(objective("llm-d.ai/v1alpha2", "a", None), "pool") == ("a", 0)
    assert objective_priority(objective("llm-d.ai/v1alpha2", "a", 5, pool="other"), "pool") is None
    for bad in ("high", 2**40, True, 1.5):
        assert objective_priority(objective("llm-d.ai/v1alpha2", "a", bad), "pool") is None
    assert objective_priority({"metadata": {"name": "a"}, "spec": {}}, "pool") is None
    assert objective_priority({"metadata": [], "spec": "x"}, "pool") is None


def test_objectives_over_the_cap_are_one_line_a_list(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(objectives_module, "MAX_OBJECTIVES", 3)
    seen: list[Mapping[str, int]] = []
    objectives = objectives_module._Objectives("pool", seen.append)
    objectives.replace("llm-d.ai", [objective("llm-d.ai/v1alpha2", f"o-{i}", i) for i in range(10)])
    assert seen == [{"o-0": 0, "o-1": 1, "o-2": 2}]
    lines = [r.getMessage() for r in caplog.records if "too_many_objectives" in r.getMessage()]
    assert lines == ["picker.too_many_objectives limit=3 left_out=7"]  # was a line each
    objectives.apply("llm-d.ai", "ADDED", objective("llm-d.ai/v1alpha2", "late\nforged", 1))
    assert caplog.records[-1].getMessage() == "picker.too_many_objectives limit=3 (skipping late\\nforged)"


async def test_queued_by_priority_from_watched_objectives(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = free_port_on("127.0.0.2")
    await nursery.start(partial(run_sim, SimConfig(model="m"), host="127.0.0.2", port=port))
    api.put(PODS, pod("model-0", "127.0.0.2"))
    api.put(POOLS_V1, pool_v1(ports=(port,)))
    api.put(OBJECTIVES_LLMD, objective("llm-d.ai/v1alpha2", "critical", 10))
    api.put(OBJECTIVES_LEGACY, objective("inference.networking.x-k8s.io/v1alpha2", "batch", -1))
    api.put(OBJECTIVES_LEGACY, objective("inference.networking.x-k8s.io/v1alpha2", "broken", "high"))
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--secure-serving=false",
            "--kubeconfig", str(write_kubeconfig(tmp_path, api.port)), "--refresh-metrics-interval", "20ms",
            "--config-text", CONFIG, *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "inference-extension")
        await eventually(lambda: any("inferenceobjectives" in r and "watch=true" in r for r in api.requests))
        await trio.sleep(0.3)  # the watch is open: both lists are in
        listen, admin = free_port(), free_port()
        config = write_gateway_config(tmp_path / "envoy.json", gateway_config(
            f"127.0.0.1:{picker.grpc}", listen, admin_port=admin, request_body_mode="BUFFERED",
            response_body_mode="BUFFERED", queue_wait_s=60.0))
        await nursery.start(partial(run_envoy, config, admin_port=admin))
        done: list[str] = []
        statuses: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=30) as client:

            async def ask(name: str, objective_name: str | None, tokens: int) -> httpx.Response:
                headers = {"x-llm-d-inference-objective": objective_name} if objective_name else {}
                body = {"model": "m", "prompt": name, "max_tokens": tokens}
                response = await client.post("/v1/completions", json=body, headers=headers)
                done.append(name)
                statuses[name] = response.status_code
                return response

            async with trio.open_nursery() as requests:
                requests.start_soon(ask, "long", None, 300)  # takes the only slot for about 1.5 s
                await trio.sleep(0.3)
                requests.start_soon(ask, "batch", "batch", 2)  # waits in band -1
                await trio.sleep(0.3)
                shed = await ask("shed", "batch", 2)  # band -1 holds one: full
                assert shed.status_code == 429, shed.text
                assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
                requests.start_soon(ask, "critical", "critical", 2)  # priority 10: before the batch one
                await trio.sleep(0.3)
                assert done == ["shed"]  # the others wait inside their ext_proc streams (BUFFERED)
        assert done == ["shed", "long", "critical", "batch"]
        assert statuses == {"shed": 429, "long": 200, "critical": 200, "batch": 200}
