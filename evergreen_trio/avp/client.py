"""An async AVP HTTP client (httpx on Trio through anyio), speaking to our server or the reference's app.

``http2=True`` speaks cleartext HTTP/2 with prior knowledge (needs ``h2``); the default is HTTP/1.1,
which is also what the reference's ``AVPClient`` ends up using over ``http://``. Each answer is read
up to ``max_answer_bytes``; every request has a timeout.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from evergreen_trio._extras import require_extra
from evergreen_trio._http import content_coding

require_extra("avp", __name__, ("httpx",))

import httpx

from evergreen_trio.avp import binding
from evergreen_trio.avp.codec import Compression, encode_buffers
from evergreen_trio.avp.errors import AVPError, AVPTransportError
from evergreen_trio.avp.fallback import JSONMessage, text_to_json
from evergreen_trio.avp.handshake import (
    HelloMessage,
    ModelIdentity,
    Resolution,
    hello_to_json,
    identity_from_dict,
    resolve_mode,
)
from evergreen_trio.avp.message import AVPMetadata

MAX_ANSWER_BYTES = 1 << 20


class AVPHttpClient:
    """One agent's connection to a remote AVP agent; get one from `open_avp_client`."""

    def __init__(self, client: httpx.AsyncClient, hello: HelloMessage, token: str | None) -> None:
        self._client = client
        self.hello = hello
        self._token = token
        self.session: Resolution | None = None

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {
            "content-type": content_type,
            "avp-version": binding.AVP_VERSION_HEADER,
            "avp-agent-id": self.hello.agent_id,
            "accept-encoding": "identity",
        }
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    async def _request(self, method: str, path: str, content: Any = None, content_type: str = "") -> dict[str, Any]:
        try:
            async with self._client.stream(
                method, path, content=content, headers=self._headers(content_type or binding.JSON_CONTENT_TYPE)
            ) as response:
                # Raw bytes, never inflated: 10 kB of zstd would be GBs before the cap below is checked.
                if (coding := content_coding(response.headers)) is not None:
                    raise AVPTransportError(f"{path}: expected no content-encoding (identity), got '{coding}'",
                                            status_code=response.status_code)
                body = bytearray()
                async for data in response.aiter_raw():
                    body += data
                    if len(body) > MAX_ANSWER_BYTES:
                        raise AVPTransportError(f"{path}: expected an answer of at most {MAX_ANSWER_BYTES} bytes")
        except httpx.HTTPError as error:
            raise AVPTransportError(f"{path}: {type(error).__name__}: {error}") from None
        try:
            document = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deep
            document = None
        if not isinstance(document, dict):
            raise AVPTransportError(
                f"{path}: expected a JSON object, got HTTP {response.status_code} {bytes(body[:200])!r}",
                status_code=response.status_code,
            )
        if response.status_code >= 400:
            message = document.get("message", document.get("detail", ""))
            raise AVPTransportError(f"{path}: HTTP {response.status_code}: {message}", status_code=response.status_code)
        return document

    async def handshake(self) -> Resolution:
        """Send our HelloMessage, resolve the mode from the answer's identity (the five rules), keep the
        server's ``session_id`` and ``ttl`` when it names them. Raises `AVPTransportError` (also for a ``ttl`` that
        is not a finite number > 0)."""
        if self.hello.identity is None:
            raise AVPTransportError("handshake: expected this agent's model identity, got none")
        answer = await self._request("POST", binding.HANDSHAKE_PATH, hello_to_json(self.hello))
        raw = answer.get("identity", {})
        if not isinstance(raw, dict):
            raise AVPTransportError(f"handshake: answer.identity: expected a JSON object, got {type(raw).__name__}")
        try:
            remote = identity_from_dict(raw, "answer.identity")
        except AVPError as error:
            raise AVPTransportError(f"handshake: {error}") from None
        resolution = resolve_mode(self.hello.identity, remote)
        session_id, ttl = answer.get("session_id"), answer.get("ttl")
        if isinstance(session_id, str) and session_id:
            resolution = replace(resolution, session_id=session_id)
        if ttl is not None:
            resolution = replace(resolution, ttl_s=_ttl_seconds(ttl))
        self.session = resolution
        return resolution

    async def transmit(
        self, payload: Any, metadata: AVPMetadata, *, compression: Compression | None = None
    ) -> dict[str, Any]:
        """Encode and POST one binary message (one copy of the tensor, into the request body)."""
        parts = encode_buffers(payload, metadata, compression=compression)
        return await self._request("POST", binding.TRANSMIT_PATH, b"".join(parts), binding.BINARY_CONTENT_TYPE)

    async def send_raw(self, data: bytes) -> dict[str, Any]:
        """POST bytes to the transmit endpoint as they are (already encoded elsewhere)."""
        return await self._request("POST", binding.TRANSMIT_PATH, data, binding.BINARY_CONTENT_TYPE)

    async def send_text(self, message: JSONMessage) -> dict[str, Any]:
        """POST a JSON fallback message."""
        return await self._request("POST", binding.TEXT_PATH, text_to_json(message))

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", binding.HEALTH_PATH)


def _ttl_seconds(ttl: object) -> float:
    """A handshake answer's ``ttl`` as seconds; AVPTransportError unless it is a finite number > 0."""
    seconds = math.nan
    if isinstance(ttl, int | float) and not isinstance(ttl, bool):
        try:
            seconds = float(ttl)
        except OverflowError:  # an integer past a float's range
            seconds = math.inf
    # json.loads reads Infinity and NaN: a session that never expires, or never compares, is refused.
    if not 0 < seconds < math.inf:
        raise AVPTransportError(
            f"handshake: answer.ttl: expected a finite number of seconds > 0, got {type(ttl).__name__} {ttl!r:.40}")
    return seconds


@asynccontextmanager
async def open_avp_client(
    base_url: str,
    *,
    agent_id: str = "default",
    identity: ModelIdentity | None = None,
    token: str | None = None,
    timeout_s: float = 30.0,
    http2: bool = False,
) -> AsyncIterator[AVPHttpClient]:
    """An `AVPHttpClient` for ``base_url`` (``http://host:port``) whose connections live as long as the block."""
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), timeout=timeout_s, http1=not http2, http2=http2
    ) as client:
        yield AVPHttpClient(client, HelloMessage(agent_id=agent_id, identity=identity), token)
