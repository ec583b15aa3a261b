"""``/debug/plugins/state`` over real sockets: the metrics port's pages behind its checks (in
process), then a started ``evergreen-trio picker``: the shape, 405 for other methods, and a flood
of dumps of a large state that stays bounded while the picker serves on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from kube_fakes import metrics_reader, write_kubeconfig
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health

from evergreen_trio._http import HttpResponse
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.k8s import ClusterAccess
from evergreen_trio.picker.k8s.metrics_auth import DENIED_TTL_S, MetricsAuth
from evergreen_trio.picker.plugin_state import MAX_LISTED, PATH, UNSUPPORTED
from evergreen_trio.picker.runtime import run_picker
from evergreen_trio.serving.metrics import SessionMetrics, serve_metrics
from evergreen_trio.testing.kube_api import KubeApiServer

ENDPOINTS = 300  # past the file discovery's cap


@pytest.fixture
async def metrics_page() -> AsyncIterator[tuple[int, list[str]]]:
    """A metrics port with one page (its body counts its calls) and a check that refuses requests
    without the reader's token; the list of paths the check was asked about."""
    asked: list[str] = []
    calls = []

    async def refuse_strangers(method: str, path: str, headers: Mapping[str, str]) -> tuple[int, str] | None:
        asked.append(path)
        return None if headers.get("authorization") == "Bearer reader" else (401, "Unauthorized")

    def page() -> HttpResponse:
        calls.append(1)
        return HttpResponse(200, [("content-type", "application/json")], b'{"n":%d}' % len(calls))

    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(
            lambda task_status: serve_metrics(SessionMetrics().registry, "127.0.0.1", 0, authorize=refuse_strangers,
                                              pages={PATH: page}, task_status=task_status))
        yield bound, asked
        nursery.cancel_scope.cancel()


async def test_a_page_is_served_behind_the_metrics_check_for_get_only(metrics_page: tuple[int, list[str]]) -> None:
    port, asked = metrics_page
    reader = {"authorization": "Bearer reader"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        refused = await client.get(PATH)
        assert refused.status_code == 401 and asked == [PATH]  # the check sees the page's path
        page = await client.get(PATH + "?x=1", headers=reader)
        assert (page.status_code, page.headers["content-type"], page.json()) == (200, "application/json", {"n": 1})
        for method in ("POST", "PUT", "DELETE", "HEAD"):
            other = await client.request(method, PATH, headers=reader)
            assert other.status_code == 405 and other.headers["allow"] == "GET"
        metrics = await client.get("/metrics", headers=reader)
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


async def test_the_picker_checks_the_dump_as_it_checks_metrics(nursery: trio.Nursery, tmp_path: Path) -> None:
    # --metrics-endpoint-auth: a reader allowed `get` of /metrics only is refused the dump, as a
    # SubjectAccessReview of the path decides in the reference's filter.
    api = KubeApiServer()
    await nursery.start(api.serve)
    now = [0.0]
    auth = MetricsAuth(ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port))), clock=lambda: now[0])
    config = parse_config("pool: {name: p, endpoints: ['127.0.0.1:9']}\n---\napiVersion: llm-d.ai/v1alpha1\n"
                          "kind: EndpointPickerConfig\nplugins:\n- {type: no-hit-lru-scorer}\n"
                          "schedulingProfiles:\n- {name: default, plugins: [{pluginRef: no-hit-lru-scorer}]}\n")
    ports = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0,
                                        metrics_auth=auth.serving))
    reader = metrics_reader(api)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.metrics}", timeout=30) as client:
        assert (await client.get("/metrics", headers=reader)).status_code == 200
        assert (await client.get(PATH)).status_code == 401
        assert (await client.get(PATH, headers=reader)).status_code == 403
        metrics_reader(api, PATH)
        now[0] += DENIED_TTL_S  # the denial's cache ends
        allowed = await client.get(PATH, headers=reader)
        assert allowed.status_code == 200
        assert allowed.json()["plugins"]["no-hit-lru-scorer"]["state"]["maxEndpoints"] == MAX_LISTED
    nursery.cancel_scope.cancel()


def _config(tmp_path: Path) -> Path:
    endpoints = tmp_path / "endpoints.yaml"
    # Closed ports on loopback: every scrape fails at once, the endpoints stay listed.
    endpoints.write_text("endpoints:\n" + "".join(
        f'  - {{name: pod-{i:03d}, address: "127.0.{1 + i // 250}.{1 + i % 250}", port: "9"}}\n'
        for i in range(ENDPOINTS)))
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool: {{name: pool}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: file-discovery, name: files, parameters: {{path: {endpoints}}}}}
- {{type: approx-prefix-cache-producer}}
- {{type: prefix-cache-scorer}}
- {{type: no-hit-lru-scorer}}
- {{type: inflight-load-producer}}
- {{type: queue-scorer}}
- {{type: max-score-picker}}
dataLayer:
  discovery: {{pluginRef: files}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: prefix-cache-scorer}}, {{pluginRef: no-hit-lru-scorer}}, {{pluginRef: queue-scorer}},
            {{pluginRef: max-score-picker}}]
""")
    return config


async def test_the_picker_command_serves_the_dump_on_its_metrics_port(tmp_path: Path) -> None:
    args = ["--config", str(_config(tmp_path)), *EPHEMERAL_PORTS, "--refresh-metrics-interval", "1s"]
    async with picker_process(args) as picker, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{picker.metrics}", timeout=30) as client:
        with trio.fail_after(30):
            while True:  # the file is loaded once the dump lists it
                plugins = (await client.get(PATH)).json()["plugins"]
                if plugins["files"]["state"]["totalEndpoints"] == ENDPOINTS:
                    break
                await trio.sleep(0.1)
        response = await client.get(PATH)
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        body = response.json()
        assert set(body) == {"timestamp", "plugins"} and body["timestamp"].endswith("Z")
        plugins = body["plugins"]
        assert set(plugins) == {"files", "approx-prefix-cache-producer", "prefix-cache-scorer", "no-hit-lru-scorer",
                                "inflight-load-producer", "queue-scorer", "max-score-picker"}
        files = plugins["files"]
        assert (files["name"], files["type"]) == ("files", "file-discovery")
        assert files["state"]["endpoints"] == [f"default/pod-{i:03d}" for i in range(MAX_LISTED)]
        assert files["state"]["maxEndpoints"] == MAX_LISTED
        assert plugins["queue-scorer"] == {"name": "queue-scorer", "type": "queue-scorer", "message": UNSUPPORTED}
        assert plugins["no-hit-lru-scorer"]["state"] == {"endpoints": [], "totalEndpoints": 0,
                                                         "maxEndpoints": MAX_LISTED}
        assert plugins["inflight-load-producer"]["state"]["truncated"] is False
        assert len(response.content) < 16 * 1024  # 300 endpoints, listed up to the cap
        for method in ("POST", "PUT"):
            refused = await client.request(method, PATH, content=b"{}")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET"

        sizes: set[int] = set()

        async def dump_repeatedly(count: int) -> None:
            for _ in range(count):
                reply = await client.get(PATH)
                assert reply.status_code == 200
                sizes.add(len(json.loads(reply.content)["plugins"]["files"]["state"]["endpoints"]))

        async with trio.open_nursery() as nursery:  # a flood: eight connections of dumps
            for _ in range(8):
                nursery.start_soon(dump_repeatedly, 50)
            async with httpx.AsyncClient(timeout=30) as other:  # the port and the picker serve on meanwhile
                assert (await other.get(f"http://127.0.0.1:{picker.metrics}/metrics")).status_code == 200
            await wait_health("127.0.0.1", picker.health, "liveness")
        assert sizes == {MAX_LISTED}
        assert picker.process.returncode is None
