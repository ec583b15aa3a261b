"""AVP through real Evergreen sessions over gRPC: AVP_HANDSHAKE and AVP chunks both ways."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
from avp_strategies import kv_layers

from evergreen_trio import ActionContext, Server, SessionAbortedError, StatusCode, blob, connect, inner, text
from evergreen_trio.avp import AVPMetadata, DataType, PayloadType, encode_buffers, pack_kv, unpack_kv
from evergreen_trio.avp.actions import AVP_HANDSHAKE, read_avp_input, register_avp_actions, write_avp_output
from evergreen_trio.avp.handshake import HelloMessage, ModelIdentity, hello_from_json, hello_to_json, resolve_mode
from evergreen_trio.avp.message import CommunicationMode
from evergreen_trio.avp.stream import AVP_MIMETYPE, avp_fragments

LLAMA = ModelIdentity(model_family="llama", model_id="llama-8b", model_hash="h-llama", hidden_dim=4096, num_layers=32)
SERVER_HELLO = HelloMessage(agent_id="server-agent", identity=LLAMA)
KV_META = AVPMetadata(payload_type=PayloadType.KV_CACHE, dtype=DataType.FLOAT16, model_id="llama-8b")


async def _kv_double(ctx: ActionContext) -> None:
    """Reads an AVP KV cache, answers with the same cache doubled, in 1000-byte fragments."""
    message = await read_avp_input(ctx.input("input"))
    _, layers = unpack_kv(message.payload)
    doubled = [(key * 2, value * 2) for key, value in layers]
    parts = encode_buffers(pack_kv(doubled), message.metadata)
    await write_avp_output(ctx.output("output"), parts, fragment_bytes=1000)


async def _start(nursery: trio.Nursery) -> str:
    server = Server()
    register_avp_actions(server, SERVER_HELLO)
    server.add_action("KV_DOUBLE", _kv_double, inputs=["input"], outputs=["output"])
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def test_handshake_resolves_latent_for_the_same_model(nursery: trio.Nursery) -> None:
    address = await _start(nursery)
    mine = HelloMessage(agent_id="client-agent", identity=LLAMA)
    async with connect(address) as session:
        call = await session.run(AVP_HANDSHAKE, {"hello": blob(hello_to_json(mine), mimetype="application/json")},
                                 ["hello"])
        chunks = await call["hello"].read_chunks()
    assert [metadata.mimetype for metadata, _ in chunks] == ["application/json"]
    theirs = hello_from_json(chunks[0][1])
    assert theirs == SERVER_HELLO
    assert resolve_mode(LLAMA, theirs.identity).mode is CommunicationMode.LATENT  # type: ignore[arg-type]


async def test_handshake_rejects_a_bad_hello(nursery: trio.Nursery) -> None:
    address = await _start(nursery)
    with pytest.raises(SessionAbortedError) as info:
        async with connect(address) as session:
            call = await session.run(AVP_HANDSHAKE, {"hello": text(json.dumps({"agent_id": 7}))}, ["hello"])
            await call["hello"].read_bytes()
    assert info.value.code is StatusCode.INVALID_ARGUMENT
    assert "hello.agent_id: expected a JSON str" in info.value.message


async def test_kv_cache_round_trip_in_fragments(nursery: trio.Nursery) -> None:
    address = await _start(nursery)
    layers = kv_layers(2, 2, 16, 8, DataType.FLOAT16)
    parts = encode_buffers(pack_kv(layers), KV_META)
    fragments = [bytes(fragment) for fragment in avp_fragments(parts, 700)]
    async with connect(address) as session:
        call = await session.run("KV_DOUBLE", {"input": inner(blob(fragments, mimetype=AVP_MIMETYPE))}, ["output"])
        message = await read_avp_input(call["output"])
    assert message.metadata.model_id == "llama-8b"
    _, doubled = unpack_kv(message.payload)
    for (key, value), (got_key, got_value) in zip(layers, doubled, strict=True):
        np.testing.assert_array_equal(got_key, key * 2)
        np.testing.assert_array_equal(got_value, value * 2)


async def test_a_non_avp_input_is_an_error(nursery: trio.Nursery) -> None:
    address = await _start(nursery)
    with pytest.raises(SessionAbortedError) as info:
        async with connect(address) as session:
            call = await session.run("KV_DOUBLE", {"input": text("not avp")}, ["output"])
            await call["output"].read_bytes()
    assert "expected one chunk of application/avp+binary, got 'text/plain'" in info.value.message
