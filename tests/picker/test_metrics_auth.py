"""The metrics port's review caches and token parsing (``evergreen_trio.picker.k8s.metrics_auth``), and a
flood of new tokens against the reviews, in process against the stand-in API server."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from hypothesis import given
from hypothesis import strategies as st
from kube_fakes import metrics_reader, write_kubeconfig
from prometheus_client import CollectorRegistry

from evergreen_trio.picker.k8s import ClusterAccess
from evergreen_trio.picker.k8s.metrics_auth import MAX_CACHED, MetricsAuth, TtlCache, bearer_token
from evergreen_trio.serving.metrics import serve_metrics
from evergreen_trio.testing.kube_api import KubeApiServer


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0.5, 10), st.floats(0, 3)), max_size=200))
def test_a_ttl_cache_never_holds_more_than_its_size_nor_answers_after_a_deadline(
        puts: list[tuple[int, float, float]]) -> None:
    now = [0.0]
    cache: TtlCache[int, float] = TtlCache(8, lambda: now[0])
    for key, ttl, elapse in puts:
        cache.put(key, now[0] + ttl, ttl)
        now[0] += elapse
        assert len(cache) <= 8
        value = cache.get(key)
        assert value is None or value > now[0]  # a value is its own deadline


def test_bearer_tokens_are_read_as_kubernetes_reads_them() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer abc extra") == "abc"
    for header in (None, "", "Bearer", "Bearer ", "Basic abc", "Token abc"):
        assert bearer_token(header) is None


async def test_a_flood_of_new_tokens_keeps_the_caches_bounded_and_a_reader_served(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    reader = metrics_reader(api)
    auth = MetricsAuth(ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port))))

    async def serve(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with auth.serving() as authorize:
            await serve_metrics(CollectorRegistry(), "127.0.0.1", 0, authorize=authorize, task_status=task_status)

    url = f"http://127.0.0.1:{await nursery.start(serve)}/metrics"
    async with httpx.AsyncClient() as client:
        for i in range(MAX_CACHED + 200):
            response = await client.get(url, headers={"authorization": f"Bearer flood-{i}"})
            assert response.status_code == 401
        assert len(auth.users) == MAX_CACHED
        assert (await client.get(url, headers=reader)).status_code == 200
