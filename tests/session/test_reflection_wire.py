"""Server reflection (v1 and v1alpha) on the sans-IO server wire, asked by an ``h2`` client in memory
as grpcurl asks: list, describe by symbol then by file name, not found; hostile names and fuzzed
requests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any, TypeVar

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import trio
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.message import DecodeError, Message
from grpclib.const import Status
from grpclib.reflection.v1 import reflection_pb2 as v1
from grpclib.reflection.v1alpha import reflection_pb2 as v1alpha
from hypothesis import given
from hypothesis import strategies as st
from test_reflection import WANTED, describe_like_grpcurl
from test_reflection import ask as grpcio_ask

from evergreen_trio._grpc.client_wire import frame
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.reflection import SERVICE_FILE, reflection_methods
from evergreen_trio._grpc.server import serve_grpc
from evergreen_trio._grpc.server_wire import GrpcWireConnection, SyncBidiMethod
from evergreen_trio._wire import SERVICE

M = TypeVar("M", bound=Message)
SERVICES = [SERVICE, "grpc.health.v1.Health"]
METHODS = reflection_methods(SERVICES)
VERSIONS = pytest.mark.parametrize("version", [v1, v1alpha], ids=["v1", "v1alpha"])


def exchange(methods: Sequence[SyncBidiMethod[Any, Any]], path: str, requests: Sequence[Message],
             reply_type: type[M], *, end: bool = True) -> tuple[list[M], dict[str, str]]:
    """One stream on a :class:`GrpcWireConnection` carrying ``requests`` (then the client's end, with
    ``end``): the replies, and the trailers (``{}`` while the stream is open)."""
    server = GrpcWireConnection({method.path: method for method in methods})
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                    (":authority", "test"), ("content-type", "application/grpc"), ("te", "trailers")])
    body = b"".join(frame(request.SerializeToString()) for request in requests)
    data, trailers = bytearray(), {}
    while True:
        size = min(len(body), client.local_flow_control_window(stream_id), client.max_outbound_frame_size)
        if size:
            client.send_data(stream_id, body[:size])
            body = body[size:]
        if end and not body:
            client.end_stream(stream_id)
            end = False
        out = client.data_to_send()
        if not out:
            assert not body, "the server stopped taking the requests"
            break
        server.receive_data(out)
        back = server.data_to_send()
        while server.paused:
            server.resume()
            back += server.data_to_send()
        for event in client.receive_data(back):
            if isinstance(event, h2.events.DataReceived):
                data += event.data
                client.acknowledge_received_data(event.flow_controlled_length, stream_id)
            elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                headers = {str(key): str(value) for key, value in event.headers}
                if "grpc-status" in headers:
                    trailers = headers
    replies = []
    while data:
        size = int.from_bytes(data[1:5], "big")
        replies.append(reply_type.FromString(bytes(data[5 : 5 + size])))
        del data[: 5 + size]
    return replies, trailers


def ask(version: Any, requests: Sequence[Message], *, end: bool = True) -> tuple[list[Any], dict[str, str]]:
    path = f"/{version.DESCRIPTOR.package}.ServerReflection/ServerReflectionInfo"
    return exchange(METHODS, path, requests, version.ServerReflectionResponse, end=end)


@VERSIONS
def test_lists_the_services_and_itself(version: Any) -> None:
    [listed], trailers = ask(version, [version.ServerReflectionRequest(list_services="")])
    assert [service.name for service in listed.list_services_response.service] == [
        *SERVICES, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
    assert trailers["grpc-status"] == "0"


@VERSIONS
async def test_grpcio_over_tcp_lists_and_describes_like_grpcurl(version: Any, nursery: trio.Nursery) -> None:
    port = await nursery.start(partial(serve_grpc, METHODS, "127.0.0.1", 0))
    names, pool = await trio.to_thread.run_sync(describe_like_grpcurl, f"127.0.0.1:{port}", version)
    assert names >= WANTED
    assert {"StartSession"} <= set(pool.FindServiceByName(SERVICE).methods_by_name)
    assert {"Check", "Watch"} <= set(pool.FindServiceByName("grpc.health.v1.Health").methods_by_name)


@VERSIONS
def test_a_method_symbol_finds_its_service_file(version: Any) -> None:
    [reply], _ = ask(version, [version.ServerReflectionRequest(file_containing_symbol=f"{SERVICE}.StartSession")])
    [raw] = reply.file_descriptor_response.file_descriptor_proto
    assert FileDescriptorProto.FromString(raw).name == SERVICE_FILE


@VERSIONS
def test_extensions_are_answered_from_the_pool(version: Any) -> None:
    [numbers, unknown_extension], _ = ask(version, [
        version.ServerReflectionRequest(all_extension_numbers_of_type="google.protobuf.FieldOptions"),
        version.ServerReflectionRequest(file_containing_extension=version.ExtensionRequest(
            containing_type="google.protobuf.FieldOptions", extension_number=99999))])
    assert numbers.all_extension_numbers_response.base_type_name == "google.protobuf.FieldOptions"
    assert unknown_extension.error_response.error_code == Status.NOT_FOUND.value


@VERSIONS
def test_unknown_names_are_not_found_and_the_stream_goes_on(version: Any) -> None:
    requests = [
        version.ServerReflectionRequest(file_containing_symbol="no.Such"),
        version.ServerReflectionRequest(file_by_filename="no/such.proto"),
        version.ServerReflectionRequest(all_extension_numbers_of_type="no.Such"),
        version.ServerReflectionRequest(file_containing_extension=version.ExtensionRequest(containing_type="no.Such")),
        version.ServerReflectionRequest(),  # no request at all
        version.ServerReflectionRequest(list_services=""),
    ]
    replies, trailers = ask(version, requests, end=False)
    assert [reply.error_response.error_code for reply in replies] == [Status.NOT_FOUND.value] * 4 + [
        Status.INVALID_ARGUMENT.value, 0]
    assert replies[0].error_response.error_message == "file_containing_symbol no.Such not found"
    assert trailers == {}  # open until the client ends it


@VERSIONS
def test_a_huge_name_is_not_found_fast_and_not_echoed(version: Any) -> None:
    for name in ("x" * (4 << 20), "a." * (2 << 20), "é\n" * (1 << 20)):
        started = time.perf_counter()
        [reply], _ = ask(version, [version.ServerReflectionRequest(file_containing_symbol=name)])
        assert time.perf_counter() - started < 5  # one hash of the name (upb), never quadratic
        message = reply.error_response.error_message
        assert reply.error_response.error_code == Status.NOT_FOUND.value
        assert len(message) < 120 and "\n" not in message and message.endswith("... not found")


async def test_grpcio_over_tcp_a_huge_name_then_the_list(nursery: trio.Nursery) -> None:
    port = await nursery.start(partial(serve_grpc, METHODS, "127.0.0.1", 0))
    asked = [v1.ServerReflectionRequest(file_containing_symbol="\x7f" * (3 << 20)),
             v1.ServerReflectionRequest(list_services="")]
    huge, listed = await trio.to_thread.run_sync(grpcio_ask, f"127.0.0.1:{port}", v1, asked)
    assert huge.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert huge.error_response.error_message == f"file_containing_symbol {'?' * 64}... not found"
    assert [service.name for service in listed.list_services_response.service][:2] == SERVICES


REQUEST_FIELDS = st.one_of(
    st.builds(dict, list_services=st.text(max_size=20)),
    st.builds(dict, file_by_filename=st.text(max_size=40)
              | st.sampled_from([SERVICE_FILE, "google/protobuf/any.proto"])),
    st.builds(dict, file_containing_symbol=st.text(max_size=40) | st.sampled_from([SERVICE, f"{SERVICE}.X", ".", ""])),
    st.builds(dict, all_extension_numbers_of_type=st.text(max_size=40) | st.just("google.protobuf.FieldOptions")),
    st.builds(dict, file_containing_extension=st.builds(
        dict, containing_type=st.text(max_size=40) | st.just("google.protobuf.FieldOptions"),
        extension_number=st.integers(-(2**31), 2**31 - 1))),
    st.builds(dict),
)


@given(st.sampled_from([v1, v1alpha]), st.lists(REQUEST_FIELDS | st.binary(max_size=64), max_size=8),
       st.text(max_size=20))
def test_fuzzed_requests_get_one_response_each(version: Any, asked: list[Any], host: str) -> None:
    [method] = [m for m in METHODS if m.request_type is version.ServerReflectionRequest]
    processor = method.new_processor()
    for fields in asked:
        if isinstance(fields, bytes):
            try:
                request = version.ServerReflectionRequest.FromString(fields)
            except DecodeError:  # the wire answers INTERNAL before a processor sees it
                continue
        else:
            extension = fields.pop("file_containing_extension", None)
            request = version.ServerReflectionRequest(host=host, **fields)
            if extension is not None:
                request.file_containing_extension.CopyFrom(version.ExtensionRequest(**extension))
        reply: Any
        try:
            [reply] = processor.on_message(request)
        except RpcAbortError:
            continue
        assert reply.WhichOneof("message_response") is not None
        assert len(reply.error_response.error_message) < 200
    assert processor.on_end() == () and processor.finished
