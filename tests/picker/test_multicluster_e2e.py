"""The multicluster family over real sockets: peer clusters are started pickers whose metrics port
(https, a test CA) publishes their pool averages; a cluster-scoped ``evergreen-trio picker``
discovers them from a file, polls them and routes to the least-loaded one (grpcio as Envoy).
The poll's hostile cases run against a stand-in https server."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
import trio
import trustme
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from test_token_producer import first_route

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker import PickerPorts, parse_config, run_picker
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.errors import MetricsError
from evergreen_trio.picker.http_poll import HttpPoll, poll_http
from evergreen_trio.picker.multicluster import (
    CLUSTER_EXTRACTOR,
    CLUSTER_SOURCE,
    KV_ATTRIBUTE,
    MAX_PAGE_BYTES,
    QUEUE_ATTRIBUTE,
    ClusterPoll,
    ClusterSource,
    PoolMetrics,
)
from evergreen_trio.picker.multicluster_poll import poll_cluster
from evergreen_trio.picker.processor import DESTINATION
from evergreen_trio.picker.runtime import Scrapers
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.tls import client_context, metrics_context

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Engine:
    """A model server whose vLLM metrics say what ``metrics`` holds now."""

    metrics: EndpointMetrics

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async def handle(request: HttpRequest) -> HttpResponse:
            return HttpResponse(200, [("content-type", "text/plain")], render_metrics("vllm", self.metrics).encode())

        await serve_http(handle, "127.0.0.1", 0, task_status=task_status)


def issue(ca: trustme.CA, directory: Path) -> Path:
    """A ``tls.crt``/``tls.key`` pair for localhost and 127.0.0.1, signed by ``ca``, in ``directory``."""
    directory.mkdir()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    leaf.private_key_pem.write_to_path(str(directory / "tls.key"))
    (directory / "tls.crt").write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    return directory


async def start_peer(nursery: trio.Nursery, engine: Engine, certs: Path) -> PickerPorts:
    port = await nursery.start(engine.serve)
    config = parse_config(f"pool: {{name: peer, endpoints: ['127.0.0.1:{port}']}}")
    ports: PickerPorts = await nursery.start(partial(
        run_picker, config, grpc_port=0, health_port=0, metrics_port=0,
        metrics_ssl_context=metrics_context(str(certs), None)))
    return ports


def cluster_config(clusters: Path, ca_file: Path) -> str:
    return f"""pool: {{name: clusters}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: multicluster-file-discovery, name: discovery, parameters: {{path: "{clusters}"}}}}
- {{type: multicluster-metrics-data-source, name: metrics-source, parameters: {{caCertPath: "{ca_file}",
   interval: 50ms}}}}
- {{type: multicluster-metrics-extractor, name: metrics-extractor}}
- {{type: multicluster-queue-scorer, name: queue}}
- {{type: multicluster-kv-cache-utilization-scorer, name: kv-cache}}
- {{type: local-syncer, name: sync}}
- {{type: max-score-picker}}
- {{type: single-profile-handler}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue, weight: 2}}, {{pluginRef: kv-cache}}, {{pluginRef: max-score-picker}}]
dataLayer:
  discovery: {{pluginRef: discovery}}
  sources: [{{pluginRef: metrics-source, extractors: [{{pluginRef: metrics-extractor}}]}}]
  crossReplicaSyncerPluginRef: sync
"""


async def route_until(port: int, want: str) -> None:
    """Route through the picker until it sends the request to ``want`` (20 s at most), then check
    it keeps doing so (not a tie broken at random)."""
    with trio.fail_after(20):
        while (await first_route(port, CHAT))[DESTINATION] != want:  # noqa: ASYNC110 (the peers' loads)
            await trio.sleep(0.05)
        assert [(await first_route(port, CHAT))[DESTINATION] for _ in range(8)] == [want] * 8


async def test_a_cluster_scoped_picker_routes_to_the_least_loaded_cluster_and_follows_the_loads(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    certs = issue(ca, tmp_path / "peer-tls")
    engines = [Engine(EndpointMetrics(waiting=5, kv_usage=0.5)), Engine(EndpointMetrics(waiting=1, kv_usage=0.2)),
               Engine(EndpointMetrics(waiting=9, kv_usage=0.9))]
    peers = [await start_peer(nursery, engine, certs) for engine in engines]
    # Each peer's gateway stands at its ext_proc port (never dialled here), its metrics apart by label.
    gateways = [f"localhost:{peer.grpc}" for peer in peers]
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text("endpoints:\n" + "".join(
        f'  - {{name: cluster-{i}, address: localhost, port: "{peer.grpc}", '
        f'labels: {{metricsAddress: "127.0.0.1", metricsPort: "{peer.metrics}"}}}}\n' for i, peer in enumerate(peers)))
    config = tmp_path / "picker.yaml"
    config.write_text(cluster_config(clusters, tmp_path / "ca.crt"))
    async with picker_process(["--config", str(config), "--allow-experimental-plugins", *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await route_until(picker.grpc, gateways[1])
        engines[1].metrics = EndpointMetrics(waiting=12, kv_usage=0.95)
        engines[0].metrics = EndpointMetrics(waiting=0, kv_usage=0.1)
        await route_until(picker.grpc, gateways[0])


# -- the poll against a stand-in peer --------------------------------------------------------------


@dataclass
class Counted:
    """The data-layer error counters, as the picker's telemetry counts them."""

    polls: Counter[str] = field(default_factory=Counter)
    extracts: Counter[tuple[str, str]] = field(default_factory=Counter)

    def poll_error(self, source_type: str) -> None:
        self.polls[source_type] += 1

    def extract_error(self, source_type: str, extractor_type: str) -> None:
        self.extracts[(source_type, extractor_type)] += 1


@dataclass
class StandIn:
    """An https peer answering ``body`` (a real page of our picker's pool gauges by default)."""

    ca: trustme.CA
    body: bytes = (b"# TYPE llm_d_epp_average_kv_cache_utilization gauge\n"
                   b'llm_d_epp_average_kv_cache_utilization{name="peer"} 0.25\n'
                   b"# TYPE llm_d_epp_average_queue_size gauge\n"
                   b'llm_d_epp_average_queue_size{name="peer"} 3.0\n')
    polls: int = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)

        async def handle(request: HttpRequest) -> HttpResponse:
            self.polls += 1
            return HttpResponse(200, [("content-type", "text/plain")], self.body)

        await serve_http(handle, "127.0.0.1", 0, max_body=1024, ssl_context=context, task_status=task_status)


async def poll_stand_in(nursery: trio.Nursery, peer: StandIn, source: ClusterSource,
                        ) -> tuple[PoolSnapshot, Endpoint, Counted]:
    port = await nursery.start(peer.serve)
    endpoint = Endpoint("localhost", port)
    snapshot = PoolSnapshot([endpoint], 2.0, time.monotonic)
    errors = Counted()
    pool = PoolConfig("clusters", (endpoint,), refresh_interval_s=0.01)
    nursery.start_soon(poll_cluster, endpoint, ClusterPoll(source, PoolMetrics()), pool, snapshot, lambda: None,
                       errors)
    return snapshot, endpoint, errors


async def polled(peer: StandIn, count: int) -> None:
    target = peer.polls + count
    with trio.fail_after(10):
        while peer.polls < target:  # noqa: ASYNC110 (a peer's counter)
            await trio.sleep(0.01)


async def test_a_self_signed_peer_fails_verification_until_its_ca_is_given(nursery: trio.Nursery, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    peer_ca = trustme.CA()
    snapshot, endpoint, errors = await poll_stand_in(nursery, StandIn(peer_ca), ClusterSource())
    with trio.fail_after(10):
        while errors.polls[CLUSTER_SOURCE] < 3:  # noqa: ASYNC110
            await trio.sleep(0.01)
    state = snapshot.states[endpoint.address]
    assert state.ready and state.attributes == {}  # still a candidate, unscored
    warnings = [r.getMessage() for r in caplog.records if "cluster_poll_failed" in r.getMessage()
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CERTIFICATE_VERIFY_FAILED" in warnings[0]
    unverified = StandIn(peer_ca)  # insecureSkipVerify opts out
    snapshot, endpoint, errors = await poll_stand_in(nursery, unverified, ClusterSource(skip_verify=True))
    await polled(unverified, 2)
    assert snapshot.states[endpoint.address].attributes == {KV_ATTRIBUTE: 0.25, QUEUE_ATTRIBUTE: 3.0}
    peer_ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    trusted = StandIn(peer_ca)
    snapshot, endpoint, errors = await poll_stand_in(
        nursery, trusted, ClusterSource(ca_file=str(tmp_path / "ca.crt")))
    await polled(trusted, 2)
    assert snapshot.states[endpoint.address].attributes == {KV_ATTRIBUTE: 0.25, QUEUE_ATTRIBUTE: 3.0}
    assert not errors.polls and not errors.extracts


@pytest.mark.parametrize(("body", "poll_errors", "extract_errors", "kept"), [
    (b"\x00\xff{{{ not a metrics page", True, False, {KV_ATTRIBUTE: 0.25, QUEUE_ATTRIBUTE: 3.0}),
    (b"# TYPE llm_d_epp_average_queue_size gauge\nllm_d_epp_average_queue_size 7\n", False, True,
     {KV_ATTRIBUTE: 0.25, QUEUE_ATTRIBUTE: 7.0}),
    (b"x" * (MAX_PAGE_BYTES + 1), True, False, {KV_ATTRIBUTE: 0.25, QUEUE_ATTRIBUTE: 3.0}),
])
async def test_a_hostile_page_is_counted_as_the_reference_counts_it_and_routing_goes_on(
        nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes, poll_errors: bool,
        extract_errors: bool, kept: dict[tuple[str, str], float]) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    peer = StandIn(ca)
    snapshot, endpoint, errors = await poll_stand_in(
        nursery, peer, ClusterSource(ca_file=str(tmp_path / "ca.crt")))
    await polled(peer, 2)
    peer.body = body
    await polled(peer, 5)
    state = snapshot.states[endpoint.address]
    assert state.ready and state.attributes == kept
    assert bool(errors.polls[CLUSTER_SOURCE]) is poll_errors
    assert bool(errors.extracts[(CLUSTER_SOURCE, CLUSTER_EXTRACTOR)]) is extract_errors
    warnings = [r for r in caplog.records if "cluster_poll_failed" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one per run of failures


async def test_a_cluster_whose_metrics_labels_change_is_polled_at_the_new_place(nursery: trio.Nursery,
                                                                               tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    old, new = StandIn(ca), StandIn(ca, body=StandIn(ca).body.replace(b"3.0", b"8.0"))
    ports = [await nursery.start(peer.serve) for peer in (old, new)]
    config = parse_config(f"""pool: {{name: clusters, refreshMetricsInterval: 10ms, endpoints: ['127.0.0.1:9']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: multicluster-metrics-data-source, name: source, parameters: {{caCertPath: "{tmp_path / 'ca.crt'}"}}}}
- {{type: multicluster-metrics-extractor, name: extractor}}
- {{type: multicluster-queue-scorer}}
dataLayer: {{sources: [{{pluginRef: source, extractors: [{{pluginRef: extractor}}]}}]}}
""")

    def cluster(port: int) -> Endpoint:
        return Endpoint("localhost", 443, labels=(("metricsAddress", "localhost"), ("metricsPort", str(port))))

    snapshot = PoolSnapshot([], 2.0, time.monotonic)
    scrapers = Scrapers(nursery, config, snapshot, lambda: None)
    scrapers.sync([cluster(ports[0])])
    await polled(old, 1)
    scrapers.sync([cluster(ports[1])])
    await polled(new, 2)
    polls = old.polls
    await polled(new, 3)
    assert old.polls == polls and snapshot.states["localhost:443"].attributes[QUEUE_ATTRIBUTE] == 8.0


async def test_a_big_page_is_parsed_off_the_event_loop_and_a_small_one_on_it(nursery: trio.Nursery,
                                                                            tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    peer = StandIn(ca)
    port = await nursery.start(peer.serve)
    threads: list[bool] = []

    def parse(body: bytes) -> bytes:
        threads.append(threading.current_thread() is threading.main_thread())
        return body

    endpoint = Endpoint("localhost", port)
    poll = HttpPoll(endpoint, endpoint, "/metrics", MAX_PAGE_BYTES, 5.0, 0.01, logging.getLogger("test"), "poll",
                    CLUSTER_SOURCE, CLUSTER_EXTRACTOR, client_context(False, str(tmp_path / "ca.crt")),
                    offload_bytes=len(peer.body))
    nursery.start_soon(poll_http, poll, parse, lambda page: None, MetricsError)
    await polled(peer, 2)
    peer.body += b"# one byte over the threshold and more\n"
    await polled(peer, 2)
    assert threads[0] is True and threads[-1] is False
