"""llm-d-router's EPP flags the picker took last (pkg/epp/server/options.go), on the command as a
user types it: endpoint scores in the routing metadata, the ext_proc stream metrics, gRPC message
size caps, the ext_proc port's TLS floor and cipher suites, and TLS with client certificates on the
metrics port. Each is checked against a real peer: grpcio on ext_proc, Python's ssl on the ports."""

from __future__ import annotations

import http.client
import socket
import ssl
import sys
from functools import partial
from pathlib import Path

import grpc
import pytest
import trio
import trustme
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import LEGIT_BODY, PROCESS, serve_fake_engine

SCORES = "x-gateway-destination-endpoint-scores"


async def two_engines(nursery: trio.Nursery, tmp_path: Path) -> tuple[Path, str, str]:
    """A config over an idle and a busy engine, and their addresses."""
    idle = f"127.0.0.1:{await nursery.start(serve_fake_engine, 0)}"
    busy = f"127.0.0.1:{await nursery.start(serve_fake_engine, 8)}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool:\n  name: flags\n  endpoints: ['{idle}', '{busy}']\n")
    return config, idle, busy


def route(port: int, body: bytes) -> ep.ProcessingResponse:
    """One buffered request: the picker's reply to its body (blocking: run it in a thread)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        pairs = ((":path", b"/v1/completions"), (":method", b"POST"))
        headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])))
        body_message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
        replies = list(call(iter([headers, body_message]), timeout=10))
    return replies[-1]


def scrape(port: int, context: ssl.SSLContext | None = None) -> str:
    connection = (http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10) if context
                  else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


async def test_scores_stream_metrics_and_the_receive_cap(nursery: trio.Nursery, tmp_path: Path) -> None:
    config, idle, busy = await two_engines(nursery, tmp_path)
    args = ["--config", str(config), *EPHEMERAL_PORTS, "--emit-endpoint-scores", "--enable-grpc-stream-metrics",
            "--grpc-max-recv-msg-size=4KiB"]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        reply = await trio.to_thread.run_sync(route, picker.grpc, LEGIT_BODY)
        lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        scores = {address: value.number_value for address, value in lb[SCORES].struct_value.fields.items()}
        assert set(scores) == {idle, busy} and scores[idle] > scores[busy]
        assert lb["x-gateway-destination-endpoint"].string_value == idle
        with pytest.raises(grpc.RpcError) as refused:  # an 8 KiB body in one message: over the 4 KiB cap
            await trio.to_thread.run_sync(route, picker.grpc, b"x" * 8192)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        page = await trio.to_thread.run_sync(scrape, picker.metrics)
    assert 'llm_d_epp_extproc_streams_total{code="OK"} 1.0' in page
    assert 'llm_d_epp_extproc_streams_total{code="ResourceExhausted"} 1.0' in page
    assert "llm_d_epp_extproc_streams_inflight 0.0" in page
    assert "llm_d_epp_extproc_stream_duration_seconds_count 2.0" in page


async def test_without_the_flags_neither_scores_nor_stream_metrics(nursery: trio.Nursery, tmp_path: Path) -> None:
    config, _, _ = await two_engines(nursery, tmp_path)
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        reply = await trio.to_thread.run_sync(route, picker.grpc, LEGIT_BODY)
        assert SCORES not in reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        assert "extproc_stream" not in await trio.to_thread.run_sync(scrape, picker.metrics)


async def test_the_send_cap_fails_a_reply_over_it(nursery: trio.Nursery, tmp_path: Path) -> None:
    config, _, _ = await two_engines(nursery, tmp_path)
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS, "--grpc-max-send-msg-size", "64B"]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with pytest.raises(grpc.RpcError) as refused:
            await trio.to_thread.run_sync(route, picker.grpc, LEGIT_BODY)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in str(refused.value.details())


def handshake(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(raw, server_hostname="picker")


def tls_client(maximum: ssl.TLSVersion, ciphers: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.maximum_version = maximum
    context.set_alpn_protocols(["h2"])
    if ciphers:
        context.set_ciphers(ciphers)
    return context


async def test_the_tls_floor_and_cipher_suites_of_the_ext_proc_port(nursery: trio.Nursery, tmp_path: Path) -> None:
    config, _, _ = await two_engines(nursery, tmp_path)
    tls12 = tls_client(ssl.TLSVersion.TLSv1_2)
    args = ["--config", str(config), *EPHEMERAL_PORTS, "--secure-serving", "--tls-min-version", "VersionTLS13"]
    async with picker_process(args) as picker:
        with pytest.raises(ssl.SSLError):
            await trio.to_thread.run_sync(handshake, picker.grpc, tls12)
        tls13 = await trio.to_thread.run_sync(handshake, picker.grpc, tls_client(ssl.TLSVersion.TLSv1_3))
        assert tls13.version() == "TLSv1.3"
        tls13.close()
    # The self-signed certificate is ECDSA: of the two suites asked for, an ECDSA one is negotiated.
    suites = "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,TLS_AES_128_GCM_SHA256"
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS, "--secure-serving",
                               f"--tls-cipher-suites={suites}"]) as picker:
        chosen = await trio.to_thread.run_sync(handshake, picker.grpc, tls12)
        assert chosen.cipher()[0] == "ECDHE-ECDSA-AES256-GCM-SHA384"
        chosen.close()
        with pytest.raises(ssl.SSLError):  # a client offering only a suite left out
            await trio.to_thread.run_sync(handshake, picker.grpc,
                                          tls_client(ssl.TLSVersion.TLSv1_2, "ECDHE-ECDSA-AES128-GCM-SHA256"))


async def test_metrics_over_tls_with_client_certificates(nursery: trio.Nursery, tmp_path: Path) -> None:
    config, _, _ = await two_engines(nursery, tmp_path)
    ca, scrapers = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    certs = tmp_path / "metrics-certs"
    certs.mkdir()
    server.cert_chain_pems[0].write_to_path(certs / "tls.crt")
    server.private_key_pem.write_to_path(certs / "tls.key")
    scrapers.cert_pem.write_to_path(tmp_path / "scrapers-ca.crt")
    args = ["--config", str(config), *EPHEMERAL_PORTS, "--metrics-cert-dir", str(certs),
            "--metrics-client-ca-file", str(tmp_path / "scrapers-ca.crt")]
    async with picker_process(args) as picker:
        context = ssl.create_default_context()
        ca.configure_trust(context)
        scrapers.issue_cert("prometheus").configure_cert(context)
        page = await trio.to_thread.run_sync(scrape, picker.metrics, context)
        assert "inference_pool_ready_pods" in page
        anonymous = ssl.create_default_context()
        ca.configure_trust(anonymous)
        with pytest.raises((ssl.SSLError, ConnectionError)):  # no client certificate
            await trio.to_thread.run_sync(scrape, picker.metrics, anonymous)
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain HTTP on the TLS port
            await trio.to_thread.run_sync(scrape, picker.metrics)
        await wait_health("127.0.0.1", picker.health, "readiness")  # still serving after both
        assert "inference_pool_ready_pods" in await trio.to_thread.run_sync(scrape, picker.metrics, context)


async def test_hostile_clients_of_a_tls_metrics_port_are_closed_and_it_serves_on(nursery: trio.Nursery,
                                                                                   tmp_path: Path) -> None:
    """A silent connection is closed at the read timeout (its handshake is bounded by it), garbage is
    closed at once; a scraper with a certificate is served after both (over real sockets)."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [], b"ok")

    port = await nursery.start(partial(serve_http, handle, "127.0.0.1", 0, read_timeout=0.5,
                                       ssl_context=server_context))

    async def closed_after(data: bytes) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(data)
        with trio.fail_after(10):
            while await stream.receive_some(65536):
                pass
        await stream.aclose()

    await closed_after(b"")
    await closed_after(bytes(range(256)) * 256)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    assert await trio.to_thread.run_sync(scrape, port, client) == "ok"
