"""Objects for the stand-in Kubernetes API server (evergreen_trio.testing.kube_api): pools and pods."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from evergreen_trio._http import HttpRequest, HttpResponse
from evergreen_trio.testing.kube_api import KubeApiServer, kubeconfig_text

PODS = "api/v1/pods"
POOLS_V1 = "apis/inference.networking.k8s.io/v1/inferencepools"
POOLS_V1ALPHA2 = "apis/inference.networking.x-k8s.io/v1alpha2/inferencepools"
LEASES = "apis/coordination.k8s.io/v1/leases"
NAMESPACE = "llm"


def pool_v1(
    name: str = "pool", labels: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,)
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": labels or {"app": "model"}},
                 "targetPorts": [{"number": p} for p in ports],
                 "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}}},
    }


def pool_v1alpha2(name: str = "pool", labels: dict[str, str] | None = None, port: int = 8000) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": labels or {"app": "model"}, "targetPortNumber": port,
                 "extensionRef": {"name": f"{name}-epp"}},
    }


def pod(name: str, ip: str | None, *, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or {"app": "model"}},
            "spec": {"containers": [{"name": "server", "image": "sim"}]}, "status": status}


def write_kubeconfig(directory: Path, port: int) -> Path:
    path = directory / "kubeconfig"
    path.write_text(kubeconfig_text(port, NAMESPACE))
    return path


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` holds (a generous ceiling: these tests assert behaviour, not speed)."""
    with trio.fail_after(timeout_s):
        while not check():  # noqa: ASYNC110 (polls state other tasks change, with no event to wait on)
            await trio.sleep(0.02)


__all__ = ["KubeApiServer"]

# Answers an API server (or a proxy in front of it) may give instead of the one asked for.
NO_CONTENT_TYPE_503 = HttpResponse(503, [], b"upstream connect error or disconnect/reset before headers")
DEEP_JSON_500 = HttpResponse(500, [("content-type", "application/json")], b"[" * 100_000 + b"]" * 100_000)


class FaultyKubeApi(KubeApiServer):
    """The stand-in, but a request whose target contains a key of :attr:`faults` gets its answer
    (:attr:`faulted` counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, HttpResponse] = {}
        self.faulted = 0

    async def _handle(self, request: HttpRequest) -> HttpResponse:
        for part, answer in self.faults.items():
            if part in request.target:
                self.faulted += 1
                return answer
        return await super()._handle(request)


def free_port_on(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (the pods of a pool share the pool's target port)."""
    import socket

    for _ in range(50):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    with socket.socket() as other:
                        other.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port free on all of {hosts}")


async def start_sims(nursery: trio.Nursery, hosts: tuple[str, ...], model: str = "food-review") -> int:
    """One simulated vLLM per host (127.0.0.2, 127.0.0.3, ...), all on one port, which is returned."""
    from functools import partial

    from evergreen_trio.sim.config import SimConfig
    from evergreen_trio.sim.server import run_sim

    port = free_port_on(*hosts)
    for host in hosts:
        await nursery.start(partial(run_sim, SimConfig(model=model), host=host, port=port))
    return port


def metrics_reader(api: KubeApiServer, path: str = "/metrics") -> dict[str, str]:
    """Headers of a scraper the stand-in authenticates (a Prometheus service account) and allows to
    GET ``path``: the picker's metrics port checks them in cluster mode (``--metrics-endpoint-auth``)."""
    user = "system:serviceaccount:monitoring:prometheus"
    api.users["prometheus-token"] = {"username": user, "uid": "1", "groups": ["system:serviceaccounts"]}
    api.grants.add((user, "get", path))
    return {"authorization": "Bearer prometheus-token"}
