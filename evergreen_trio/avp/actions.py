"""AVP in Evergreen sessions: read an input as an AVP message, write an output as one, and ``AVP_HANDSHAKE``.

An AVP message travels as one chunk with mimetype ``application/avp+binary``; its fragments feed the
incremental decoder as they arrive, and an encoded message goes out in fragments of a chosen size
without being joined first.
"""

from __future__ import annotations

import logging
from typing import Any

from evergreen_trio._logsafe import peer_text
from evergreen_trio.avp.errors import AVPError, AVPHandshakeError
from evergreen_trio.avp.handshake import MAX_HELLO_BYTES, HelloMessage, hello_from_json, hello_to_json, resolve_mode
from evergreen_trio.avp.message import DEFAULT_LIMITS, AVPLimits, AVPMessage
from evergreen_trio.avp.stream import AVP_MIMETYPE, avp_fragments, read_avp
from evergreen_trio.dag import ProtocolViolationError
from evergreen_trio.nursery_session import ActionContext, InputStream, OutputNode
from evergreen_trio.serving.server import Server

log = logging.getLogger(__name__)

AVP_HANDSHAKE = "AVP_HANDSHAKE"
JSON_MIMETYPE = "application/json"
DEFAULT_FRAGMENT_BYTES = 256 * 1024


async def read_avp_input(
    stream: InputStream, *, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True
) -> AVPMessage:
    """Decode the input's single ``application/avp+binary`` chunk incrementally, as its bytes arrive.

    An input that is not one valid AVP message is the peer's error: :class:`ProtocolViolationError`
    (INVALID_ARGUMENT, its text sent to the peer) naming the input; a decoding failure's
    :class:`AVPError` is its cause.
    """
    message: AVPMessage | None = None
    async for chunk in stream:
        if chunk.mimetype != AVP_MIMETYPE or message is not None:
            got = "a second chunk" if message is not None else repr(chunk.mimetype)
            raise ProtocolViolationError(f"input {stream.node_id}: expected one chunk of {AVP_MIMETYPE}, got {got}")
        try:
            message = await read_avp(chunk, limits=limits, strict=strict)
        except AVPError as error:
            raise ProtocolViolationError(f"input {stream.node_id}: {error}") from error
    if message is None:
        raise ProtocolViolationError(f"input {stream.node_id}: expected one chunk of {AVP_MIMETYPE}, got none")
    return message


async def write_avp_output(
    node: OutputNode, message_buffers: Any, *, fragment_bytes: int = DEFAULT_FRAGMENT_BYTES
) -> None:
    """Write an encoded message (bytes or `encode_buffers` parts) as one AVP chunk, in fragments."""
    fragments = list(avp_fragments(message_buffers, fragment_bytes))
    for index, fragment in enumerate(fragments):
        await node.write(
            bytes(fragment),  # protobuf bytes fields take bytes: one copy per fragment
            mimetype=AVP_MIMETYPE if index == 0 else None,
            last=index == len(fragments) - 1,
        )
    if not fragments:
        await node.write(b"", mimetype=AVP_MIMETYPE, last=True)


async def _read_hello(stream: InputStream) -> HelloMessage:
    data = bytearray()
    async for chunk in stream:
        async for piece in chunk:
            data += piece
            if len(data) > MAX_HELLO_BYTES:
                raise ProtocolViolationError(f"AVP_HANDSHAKE hello: expected at most {MAX_HELLO_BYTES} bytes, got more")
    try:
        return hello_from_json(bytes(data))
    except AVPHandshakeError as exc:
        raise ProtocolViolationError(f"AVP_HANDSHAKE hello: {exc}") from None


def register_avp_actions(server: Server, hello: HelloMessage) -> None:
    """Add ``AVP_HANDSHAKE`` (input ``hello``, output ``hello``): answer the peer's HelloMessage with ``hello``.

    The resolved mode is logged; each side resolves it from the two HelloMessages with `resolve_mode`.
    """

    async def handshake(ctx: ActionContext) -> None:
        remote = await _read_hello(ctx.input("hello"))
        if hello.identity is not None and remote.identity is not None:
            resolution = resolve_mode(hello.identity, remote.identity)
            log.info("avp.handshake remote_agent=%s mode=%s", peer_text(remote.agent_id), resolution.mode.name)
        await ctx.output("hello").write(hello_to_json(hello), mimetype=JSON_MIMETYPE, last=True)

    server.add_action(AVP_HANDSHAKE, handshake, inputs=["hello"], outputs=["hello"])
