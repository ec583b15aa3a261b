"""gRPC server reflection on the serving port, asked by grpcio as grpcurl asks: list the services,
fetch the file that declares each (and the files it imports) and build the service from them."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import trio
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from google.protobuf.descriptor_pool import DescriptorPool
from grpclib.reflection.v1 import reflection_pb2 as v1
from grpclib.reflection.v1alpha import reflection_pb2 as v1alpha

from evergreen_trio import Server

WANTED = {"evergreen.v2.EvergreenService", "grpc.health.v1.Health"}


def ask(address: str, version: Any, requests: list[Any]) -> list[Any]:
    """One ServerReflectionInfo stream carrying ``requests``; the replies in order."""
    package = "grpc.reflection.v1" if version is v1 else "grpc.reflection.v1alpha"
    with grpc.insecure_channel(address) as channel:
        info = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=version.ServerReflectionRequest.SerializeToString,
            response_deserializer=version.ServerReflectionResponse.FromString,
        )
        return list(info(iter(requests), timeout=30))


def describe_like_grpcurl(address: str, version: Any) -> tuple[set[str], DescriptorPool]:
    """The service names, and a pool holding every file they need, fetched by symbol then by file name."""
    [listed] = ask(address, version, [version.ServerReflectionRequest(list_services="")])
    names = {service.name for service in listed.list_services_response.service}
    files: dict[str, FileDescriptorProto] = {}
    pending = [version.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(names & WANTED)]
    while pending:
        for reply in ask(address, version, pending):
            for raw in reply.file_descriptor_response.file_descriptor_proto:
                file = FileDescriptorProto.FromString(raw)
                files[file.name] = file
        pending = [version.ServerReflectionRequest(file_by_filename=dep)
                   for file in files.values() for dep in file.dependency if dep not in files]
    pool = DescriptorPool()

    def add(name: str) -> None:
        try:
            pool.FindFileByName(name)
        except KeyError:
            for dep in files[name].dependency:
                add(dep)
            pool.Add(files[name])

    for name in files:
        add(name)
    return names, pool


@pytest.mark.parametrize("version", [v1, v1alpha], ids=["v1", "v1alpha"])
async def test_grpcio_lists_and_describes_the_services(version: Any, nursery: trio.Nursery) -> None:
    port = await nursery.start(Server().serve, "127.0.0.1", 0)
    names, pool = await trio.to_thread.run_sync(describe_like_grpcurl, f"127.0.0.1:{port}", version)
    assert names >= WANTED
    method = pool.FindServiceByName("evergreen.v2.EvergreenService").methods_by_name["StartSession"]
    assert method.input_type.full_name == "evergreen.v2.SessionMessage"
    assert method.client_streaming and method.server_streaming
    assert "Check" in pool.FindServiceByName("grpc.health.v1.Health").methods_by_name
    [missing] = await trio.to_thread.run_sync(
        ask, f"127.0.0.1:{port}", version, [version.ServerReflectionRequest(file_containing_symbol="no.Such")])
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


async def test_reflection_can_be_turned_off(nursery: trio.Nursery) -> None:
    port = await nursery.start(Server(reflection=False).serve, "127.0.0.1", 0)
    with pytest.raises(grpc.RpcError) as refused:
        await trio.to_thread.run_sync(ask, f"127.0.0.1:{port}", v1, [v1.ServerReflectionRequest(list_services="")])
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
