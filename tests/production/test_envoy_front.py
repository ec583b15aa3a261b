"""A real Envoy (``gateway-config --evergreen``) in front of two `serve` processes: sessions land on
both, survive one server's drain, and TLS terminates at Envoy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import grpc  # type: ignore[import-untyped]
import httpx
import pytest
import trio
import trustme
from ops_helpers import free_port, held_echo, scrape, serve, value, wait_health

from evergreen_trio import SessionAbortedError, connect, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.picker.envoy_config import write_gateway_config
from evergreen_trio.picker.envoy_process import find_envoy, run_envoy
from evergreen_trio.serving.evergreen_front import front_config
from evergreen_trio.serving.server import SERVICE, START_SESSION
from evergreen_trio.testing.model import Act, Frag, Meta, echo, to_messages

pytestmark = pytest.mark.envoy
HANG_GUARD = 120


@asynccontextmanager
async def envoy_front(tmp_path: Path, servers: list[str], **options: object) -> AsyncIterator[tuple[str, int]]:
    """Envoy in front of ``servers``; yields (its address, its admin port)."""
    listener, admin = free_port(), free_port()
    config = front_config(servers, listener, admin_port=admin, health_interval_s=0.3, unhealthy_threshold=1,
                          **options)  # type: ignore[arg-type]
    path = write_gateway_config(tmp_path / f"front-{listener}.json", config)
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_envoy, path, admin_port=admin))
        yield f"127.0.0.1:{listener}", admin
        nursery.cancel_scope.cancel()


async def _unhealthy_in_envoy(admin: int, address: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as client:
        text_ = (await client.get(f"http://127.0.0.1:{admin}/clusters")).text
    return f"evergreen::{address}::health_flags::/failed_active_hc" in text_


async def _echo(address: str, words: str) -> str:
    try:
        async with connect(address) as session:
            call = await session.run("ECHO", {"input": text(words)}, ["output"])
            assert await call["output"].read_text() == words
        return "OK"
    except SessionAbortedError as aborted:
        return aborted.code.name


async def test_sessions_land_on_both_servers_and_survive_a_drain(tmp_path: Path) -> None:
    held: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with (serve("--metrics-port", "0", "--drain-grace", "60", lines=2) as first,
                    serve("--metrics-port", "0", "--drain-grace", "60", lines=2) as second,
                    envoy_front(tmp_path, [first.address, second.address]) as (front, admin)):
            async with trio.open_nursery() as clients:
                for _ in range(8):
                    clients.start_soon(held_echo, front, opened, release, held)
                for _ in range(8):
                    await opened.acquire()
                active = [value(await scrape(s.metrics_url), "evergreen_sessions_active") for s in (first, second)]
                assert active == [4, 4]  # round robin per stream

                first.signal(signal.SIGTERM)  # drain: NOT_SERVING, open sessions go on
                with trio.fail_after(30):
                    while not await _unhealthy_in_envoy(admin, first.address):  # noqa: ASYNC110 - polling Envoy
                        await trio.sleep(0.1)
                before = value(await scrape(second.metrics_url), "evergreen_sessions_started_total")
                assert [await _echo(front, f"new {i}") for i in range(4)] == ["OK"] * 4
                after = value(await scrape(second.metrics_url), "evergreen_sessions_started_total")
                assert after - before == 4  # every new session went to the server still serving
                assert first.process.returncode is None  # still draining its 4 sessions
                release.set()
            assert held == ["OK"] * 8
            assert await first.process.wait() == 0


def _grpcio_echo(address: str, credentials: grpc.ChannelCredentials | None) -> tuple[str, bytes]:
    """One ECHO session with grpcio (TLS when ``credentials``): (final status, echoed bytes)."""
    items: list[Frag | Act] = [echo("in", "out"), Frag("in", 0, True, chunk=(Meta("text/plain"), b"over ")),
             Frag("in", 1, False, chunk=(None, b"TLS"))]
    requests: Iterator[SessionMessage] = iter(to_messages(items, groups=[2]))
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        start = channel.stream_stream(START_SESSION, request_serializer=SessionMessage.SerializeToString,
                                      response_deserializer=SessionMessage.FromString)
        data = b""
        try:
            for reply in start(requests, timeout=30):
                data += b"".join(f.chunk_fragment.data for f in reply.node_fragments)
        except grpc.RpcError as error:
            return error.code().name, data
    return "OK", data


async def test_tls_terminates_at_envoy(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    with trio.fail_after(HANG_GUARD):
        async with (serve() as server,
                    envoy_front(tmp_path, [server.address], tls_cert=str(tmp_path / "cert.pem"),
                                tls_key=str(tmp_path / "key.pem")) as (front, _)):
            status, data = await trio.to_thread.run_sync(_grpcio_echo, front, credentials)
            assert (status, data) == ("OK", b"over TLS")
            status, _ = await trio.to_thread.run_sync(_grpcio_echo, front, None)  # plaintext to a TLS port
            assert status == "UNAVAILABLE"


async def test_limits_are_in_envoys_runtime_and_health_reaches_the_servers(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serve() as server, envoy_front(tmp_path, [server.address]) as (_, admin):
            async with httpx.AsyncClient(timeout=5) as client:
                runtime = (await client.get(f"http://127.0.0.1:{admin}/runtime")).json()["entries"]
                stats = (await client.get(f"http://127.0.0.1:{admin}/stats?filter=health_check")).text
            assert runtime["overload.premature_reset_total_stream_count"]["final_value"] == "500"
            assert runtime["overload.premature_reset_min_stream_lifetime_seconds"]["final_value"] == "1"
            assert runtime["http.max_requests_per_io_cycle"]["final_value"] == "1"
            assert "cluster.evergreen.health_check.success" in stats
            await wait_health(server.address, "SERVING", SERVICE)


def test_gateway_config_command_writes_a_front_envoy_accepts(tmp_path: Path) -> None:
    out = tmp_path / "front.yaml"
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", "--evergreen",
                           "127.0.0.1:50051", "evergreen-0.evergreen.default.svc.cluster.local:50051",
                           "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    checked = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", "--evergreen",
                           "127.0.0.1:50051"], capture_output=True, text=True, timeout=60)
    cluster = json.loads(done.stdout)["static_resources"]["clusters"][0]
    assert cluster["type"] == "STATIC" and cluster["lb_policy"] == "ROUND_ROBIN"


def test_the_largest_limits_and_an_ipv6_listener_are_ones_envoy_accepts(tmp_path: Path) -> None:
    """The bounds gateway-config checks are Envoy's own: at them, Envoy takes the config."""
    out = tmp_path / "front.json"
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", "--evergreen",
                           "127.0.0.1:50051", "--listen-host", "::", "--max-concurrent-streams", "2147483647",
                           "--max-connections", "4294967295", "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    checked = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
