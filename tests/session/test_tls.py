"""TLS both ways, with certificates made here (trustme): our client and server, a grpcio client
(ssl_channel_credentials) against our server, our client against a grpcio TLS server, and mTLS."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trio
import trustme
from test_interop import grpcio_echo

from evergreen_trio import Server, SessionAbortedError, connect, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import StatusCode
from evergreen_trio.serving.auth import Peer
from evergreen_trio.serving.tls import client_context, server_context
from evergreen_trio.testing.subprocess_server import serve_command


class Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA()
        self.ca_file = str(directory / "ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.server_cert, self.server_key = str(directory / "server.pem"), str(directory / "server.key")
        server.cert_chain_pems[0].write_to_path(self.server_cert)
        server.private_key_pem.write_to_path(self.server_key)
        client = self.ca.issue_cert("agent-7.clients.example")
        self.client_cert, self.client_key = str(directory / "client.pem"), str(directory / "client.key")
        client.cert_chain_pems[0].write_to_path(self.client_cert)
        client.private_key_pem.write_to_path(self.client_key)

    def read(self, path: str) -> bytes:
        return Path(path).read_bytes()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def serve(nursery: trio.Nursery, tls: ssl.SSLContext, **options: object) -> int:
    server = Server(tls=tls, **options)  # type: ignore[arg-type]
    register_builtin_actions(server)
    port: int = await nursery.start(server.serve, "127.0.0.1", 0)
    return port


async def echo(port: int, tls: bool | ssl.SSLContext) -> str:
    async with connect(f"127.0.0.1:{port}", tls=tls, timeout=30) as session:
        call = await session.run("ECHO", {"input": text("over TLS")}, ["output"])
        return await call["output"].read_text()


def test_contexts_offer_h2_and_at_least_tls_1_2(pki: Pki) -> None:
    for context in (server_context(pki.server_cert, pki.server_key), client_context(ca_file=pki.ca_file)):
        assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert server_context(pki.server_cert, pki.server_key, client_ca_file=pki.ca_file).verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ssl.SSLError):
        server_context(pki.server_cert, pki.client_key)  # a key that is not the certificate's
    with pytest.raises(ValueError, match="key_file needs cert_file"):
        client_context(key_file=pki.client_key)


async def test_our_client_and_server_over_tls(pki: Pki, nursery: trio.Nursery) -> None:
    port = await serve(nursery, server_context(pki.server_cert, pki.server_key))
    assert await echo(port, client_context(ca_file=pki.ca_file)) == "over TLS"


async def test_a_client_that_does_not_trust_the_server_cannot_connect(pki: Pki, nursery: trio.Nursery) -> None:
    port = await serve(nursery, server_context(pki.server_cert, pki.server_key))
    with pytest.raises(SessionAbortedError) as aborted:
        await echo(port, client_context(ca_file=None))  # the system CAs do not know the test CA
    assert aborted.value.code is StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in aborted.value.message


async def test_a_plaintext_client_gets_no_session_from_a_tls_server(pki: Pki, nursery: trio.Nursery) -> None:
    port = await serve(nursery, server_context(pki.server_cert, pki.server_key))
    with pytest.raises(SessionAbortedError) as aborted:
        await echo(port, False)
    assert aborted.value.code is StatusCode.UNAVAILABLE


def grpcio_tls_echo(address: str, root: bytes, key: bytes | None = None, chain: bytes | None = None) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    replies = grpcio_echo(address, credentials)
    assert any(f.chunk_fragment.data == b"Write a heroic novel." for m in replies for f in m.node_fragments)


async def test_grpcio_client_with_ssl_channel_credentials_against_our_server(pki: Pki, nursery: trio.Nursery) -> None:
    port = await serve(nursery, server_context(pki.server_cert, pki.server_key))
    await trio.to_thread.run_sync(grpcio_tls_echo, f"127.0.0.1:{port}", pki.read(pki.ca_file))


async def test_mtls_client_certificate_required_and_seen_by_authorize(pki: Pki, nursery: trio.Nursery) -> None:
    peers: list[Peer] = []

    def authorize(metadata: object, peer: Peer) -> str:
        peers.append(peer)
        assert peer.certificate is not None
        return dict(name for rdn in peer.certificate["subject"] for name in rdn).get("commonName", "?")

    tls = server_context(pki.server_cert, pki.server_key, client_ca_file=pki.ca_file)
    port = await serve(nursery, tls, authorize=authorize)
    with_cert = client_context(ca_file=pki.ca_file, cert_file=pki.client_cert, key_file=pki.client_key)
    assert await echo(port, with_cert) == "over TLS"
    assert peers and peers[0].address.startswith("127.0.0.1:")
    with pytest.raises(SessionAbortedError) as aborted:
        await echo(port, client_context(ca_file=pki.ca_file))  # no client certificate
    assert aborted.value.code is StatusCode.UNAVAILABLE
    await trio.to_thread.run_sync(
        grpcio_tls_echo, f"127.0.0.1:{port}", pki.read(pki.ca_file), pki.read(pki.client_key),
        pki.read(pki.client_cert),
    )


def start_grpcio_tls_server(pki: Pki, seen: list[dict[str, str]]) -> tuple[grpc.Server, int]:
    """A grpcio StartSession over TLS that records the call's metadata and reads the session to its end."""

    def start_session(requests: Iterator[SessionMessage], context: grpc.ServicerContext) -> Iterator[SessionMessage]:
        seen.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        for _ in requests:
            pass
        return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.stream_stream_rpc_method_handler(
        start_session, request_deserializer=SessionMessage.FromString,
        response_serializer=SessionMessage.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("evergreen.v2.EvergreenService", {"StartSession": handler}),)
    )
    credentials = grpc.ssl_server_credentials([(pki.read(pki.server_key), pki.read(pki.server_cert))])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


async def test_our_client_against_a_grpcio_tls_server(pki: Pki) -> None:
    seen: list[dict[str, str]] = []
    server, port = start_grpcio_tls_server(pki, seen)
    try:
        metadata = {"authorization": "Bearer s3cret"}
        async with connect(f"127.0.0.1:{port}", tls=client_context(ca_file=pki.ca_file), metadata=metadata,
                           timeout=30) as session:
            await session.send(text("hello over TLS"))
        assert seen and seen[0]["authorization"] == "Bearer s3cret"
    finally:
        server.stop(None)


async def test_serve_with_tls_flags_as_a_user_types_it(pki: Pki) -> None:
    args = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca_file]
    async with serve_command(*args) as line:
        assert line.startswith("evergreen-trio serving TLS on ")
        port = int(line.split()[-1].rsplit(":", 1)[1])
        with_cert = client_context(ca_file=pki.ca_file, cert_file=pki.client_cert, key_file=pki.client_key)
        assert await echo(port, with_cert) == "over TLS"
