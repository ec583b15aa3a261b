"""How long a pod change takes to reach the picker's endpoint set: the stand-in Kubernetes API
server (evergreen_trio.testing.kube_api) and lightkube on loopback, 50 pods added one at a time.

    PYTHONPATH=. python benchmarks/discovery_latency.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import trio

from evergreen_trio.picker import Endpoint, PoolConfig
from evergreen_trio.picker.k8s import ClusterAccess, PoolRef, pool_discovery
from evergreen_trio.testing.kube_api import KubeApiServer, kubeconfig_text

PODS = "api/v1/pods"
POOLS = "apis/inference.networking.k8s.io/v1/inferencepools"


def pod(name: str, ip: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "llm", "labels": {"app": "m"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


async def main(count: int = 50) -> None:
    api = KubeApiServer()
    seen: list[float] = []
    changed = trio.Event()

    def on_endpoints(endpoints: Sequence[Endpoint]) -> None:
        nonlocal changed
        seen.append(time.monotonic())
        changed.set()
        changed = trio.Event()

    async with trio.open_nursery() as nursery:
        await nursery.start(api.serve)
        api.put(POOLS, {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                        "metadata": {"name": "pool", "namespace": "llm"},
                        "spec": {"selector": {"matchLabels": {"app": "m"}}, "targetPorts": [{"number": 8000}],
                                 "endpointPickerRef": {"name": "epp"}}})
        with tempfile.TemporaryDirectory() as folder:
            path = trio.Path(folder, "kubeconfig")
            await path.write_text(kubeconfig_text(api.port, "llm"))
            access = ClusterAccess.load(str(path))
        first = changed
        nursery.start_soon(pool_discovery, access, PoolRef("pool", "llm"), PoolConfig("pool", ()), on_endpoints)
        await first.wait()
        latencies = []
        for i in range(count):
            waiting, began = changed, time.monotonic()
            api.put(PODS, pod(f"m-{i}", f"10.0.{i // 250}.{i % 250 + 1}"))
            await waiting.wait()
            latencies.append(seen[-1] - began)
        latencies.sort()
        print(f"pod added -> endpoint set: n={count} median {statistics.median(latencies) * 1000:.1f} ms "
              f"p90 {latencies[int(count * 0.9) - 1] * 1000:.1f} ms max {latencies[-1] * 1000:.1f} ms")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 50)
