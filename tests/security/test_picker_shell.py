"""The picker wire's Trio shell: TLS with ALPN h2 (grpcio over TLS), and descriptor exhaustion (EMFILE)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import grpc
import trio
import trustme
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from frames import ECHO, grpcio_echo

from evergreen_trio._grpc.server import WireTimeouts, serve_grpc
from evergreen_trio.picker import parse_config, run_picker

HERE = Path(__file__).parent


async def test_tls_with_a_context_made_per_connection(nursery: trio.Nursery) -> None:
    ca = trustme.CA()
    made: list[ssl.SSLContext] = []

    def context() -> ssl.SSLContext:  # called per connection: a reloaded certificate applies to new ones
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("picker.test").configure_cert(server)
        made.append(server)
        return server

    port = await nursery.start(partial(serve_grpc, [ECHO], "127.0.0.1", 0, ssl_context=context,
                                       timeouts=WireTimeouts(handshake_s=0.5)))

    def call() -> bytes:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                                 options=[("grpc.ssl_target_name_override", "picker.test")]) as channel:
            return grpcio_echo(channel)

    assert await trio.to_thread.run_sync(call) == b"legit"
    assert await trio.to_thread.run_sync(call) == b"legit"
    assert len(made) == 2

    # A TLS client that never says hello is closed at the handshake deadline.
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(5.0):
        assert await silent.receive_some(100) == b""
    await silent.aclose()


SERVER = """
import logging, resource, sys, trio
sys.path.insert(0, {here!r})
from frames import ECHO
from evergreen_trio._grpc.server import serve_grpc
logging.basicConfig(level=logging.INFO, stream=sys.stderr)

async def main():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_grpc, [ECHO], "127.0.0.1", 0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
        print(port, flush=True)

trio.run(main)
"""


def test_descriptor_exhaustion_backs_off_with_one_line_and_recovers() -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(here=str(HERE))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]
        time.sleep(1.5)  # the server is out of descriptors, accepting in back-off
        for sock in silent:
            sock.close()
        start = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert grpcio_echo(channel) == b"legit"
        assert time.monotonic() - start < 5.0
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=10)
    assert stderr.count("grpc_wire.accept_failed") == 1, stderr[-2000:]
    assert "Traceback" not in stderr.split("KeyboardInterrupt")[0]


async def test_the_pickers_message_limit_follows_its_body_caps(nursery: trio.Nursery) -> None:
    """``maxRequestBodyBytes: 1024`` makes the ext_proc port refuse a 200 KiB message with
    RESOURCE_EXHAUSTED (not buffer up to the 16 MiB default), and answer a small one."""
    config = parse_config("pool:\n  endpoints: ['127.0.0.1:1']\n"
                          "extProc:\n  maxRequestBodyBytes: 1024\n  maxResponseBodyBytes: 1024\n")
    ports = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0))

    def call(body: bytes) -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            process = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                            request_serializer=ep.ProcessingRequest.SerializeToString,
                                            response_deserializer=ep.ProcessingResponse.FromString)
            request = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
            try:
                for _ in process(iter([request]), timeout=10):
                    pass
            except grpc.RpcError as error:
                return error.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

    assert await trio.to_thread.run_sync(call, b"x" * 200 * 1024) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await trio.to_thread.run_sync(call, b"x" * 100) != grpc.StatusCode.RESOURCE_EXHAUSTED
