"""GENERATE backed by an OpenAI-compatible endpoint: the Trio shell around ``openai.py``.

One ``httpx.AsyncClient`` (httpx runs on Trio through anyio) per :class:`OpenAIBackend`, opened
and closed by :func:`open_backend`. Each GENERATE reads its prompt's text chunks, sends one
streaming request, writes every token delta to the output as a fragment as soon as it arrives
and ends the output at ``data: [DONE]``. Failures abort the session with the status
``openai.py`` documents.
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("generate", __name__)

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import trio
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.struct_pb2 import Struct

from evergreen_trio._http import content_coding
from evergreen_trio._logsafe import peer_text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import ChunkMetadata
from evergreen_trio.generate.config import BackendSettings
from evergreen_trio.generate.errors import (
    BackendError,
    PromptTooLargeError,
    StreamFormatError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from evergreen_trio.generate.openai import MESSAGE_CHARS, PromptPart, StreamParser, request_body, upstream_error
from evergreen_trio.generate.params import parse_configs
from evergreen_trio.nodes import SERVER_ROLE
from evergreen_trio.nursery_session import ActionContext, InputStream, OutputNode, describe

log = logging.getLogger(__name__)

RESPONSE_ROLE = SERVER_ROLE
"""The ``role`` of GENERATE's output chunk: a later chat prompt that reuses it sends it as such."""


def response_metadata(served_by: str | None, model: str) -> ChunkMetadata:
    """The output's metadata: text/plain, role assistant, and in ``experimental`` a Struct with
    ``model`` and, when the upstream named it, ``served_by`` (the model server that answered)."""
    info = Struct()
    info.update({"model": model} | ({"served_by": served_by} if served_by else {}))
    packed = AnyProto()
    packed.Pack(info)
    return ChunkMetadata(mimetype="text/plain", role=RESPONSE_ROLE, experimental=[packed])


def served_by(metadata: ChunkMetadata) -> str | None:
    """The model server recorded in an output's metadata by :func:`response_metadata`, if any."""
    for packed in metadata.experimental:
        if packed.Is(Struct.DESCRIPTOR):
            info = Struct()
            packed.Unpack(info)
            value = info.fields.get("served_by")
            if value is not None and value.HasField("string_value"):
                return value.string_value
    return None


async def read_prompt(stream: InputStream, max_bytes: int, *, where: str) -> tuple[list[PromptPart], int]:
    """The text chunks (mimetype ``text/*``) of a flattened input with their roles, and how many
    other chunks were skipped (a text model cannot take a video)."""
    parts: list[PromptPart] = []
    size = skipped = 0
    async for chunk in stream:
        if not chunk.mimetype.startswith("text/"):
            skipped += 1
            continue
        data = bytearray()
        async for piece in chunk:
            size += len(piece)
            if size > max_bytes:
                raise PromptTooLargeError(f"{where}: expected at most {max_bytes} bytes of prompt text, got more")
            data += piece
        parts.append(PromptPart(chunk.metadata.role, data.decode("utf-8", errors="replace")))
    return parts, skipped


def _transport_error(error: httpx.HTTPError, settings: BackendSettings, where: str) -> BackendError:
    upstream = settings.endpoint
    # h11 quotes what it could not parse (a 100 kB chunk header), so the peer's text is cut and escaped.
    reason = f"{type(error).__name__}: {peer_text(str(error), MESSAGE_CHARS)}"
    if isinstance(error, httpx.ConnectTimeout | httpx.PoolTimeout):
        return UpstreamUnavailableError(
            f"{where}: could not get a connection to {upstream} within {settings.connect_timeout_s}s"
        )
    if isinstance(error, httpx.TimeoutException):
        return UpstreamTimeoutError(f"{where}: {upstream} sent nothing for {settings.read_timeout_s}s")
    if isinstance(error, httpx.TransportError):
        return UpstreamUnavailableError(f"{where}: {upstream} failed: {reason}")
    return StreamFormatError(f"{where}: {upstream} sent an unreadable response: {reason}")


async def _read_some(response: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    async for data in response.aiter_raw():  # raw: a compressed body must not inflate past the limit
        body += data
        if len(body) >= limit:
            break
    return bytes(body[:limit])


def _logged(value: object) -> str:
    """A token count the upstream reported, for the log line: an int as is, a string escaped and cut
    (it could hold a newline to forge a log line), anything else (or nothing) ``-``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return peer_text(value) if isinstance(value, str) else "-"


@dataclass
class _Attempt:
    """What one upstream request learned, for its log line."""

    started: float
    served_by: str | None = None


class OpenAIBackend:
    """The GENERATE handler (:meth:`generate`) for one endpoint; get one from :func:`open_backend`."""

    def __init__(self, settings: BackendSettings, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self._client = client

    async def generate(self, ctx: ActionContext) -> None:
        """Input ``prompt`` (or ``text``), output ``response`` (or ``text``), streamed token by token."""
        where = describe(ctx.action)
        params = parse_configs(ctx.action.configs, where=where)
        parts, skipped = await read_prompt(ctx.input("prompt", "text"), self.settings.max_prompt_bytes, where=where)
        body = request_body(self.settings, parts, params)
        log.debug("generate.request endpoint=%s model=%s parts=%d skipped_chunks=%d",
                  self.settings.endpoint, self.settings.model, len(parts), skipped)
        attempt = _Attempt(trio.current_time())
        try:
            with trio.move_on_after(self.settings.total_timeout_s) as deadline:
                await self._stream(body, ctx.output("response", "text"), attempt, where)
            if deadline.cancelled_caught:
                raise UpstreamTimeoutError(
                    f"{where}: {self.settings.endpoint} did not finish within {self.settings.total_timeout_s}s"
                )
        except httpx.HTTPError as error:
            failure = _transport_error(error, self.settings, where)
            log.warning("generate.failed served_by=%s code=%s reason=%s",
                        peer_text(attempt.served_by or "-"), failure.code.name, failure.message)
            raise failure from None
        except BackendError as error:
            log.warning("generate.failed served_by=%s code=%s reason=%s",
                        peer_text(attempt.served_by or "-"), error.code.name, error.message)
            raise

    async def _stream(self, body: dict[str, Any], output: OutputNode, attempt: _Attempt, where: str) -> None:
        settings = self.settings
        async with self._client.stream("POST", settings.endpoint, json=body) as response:
            served = attempt.served_by = response.headers.get(settings.served_by_header)
            if not response.is_success:
                raise upstream_error(
                    response.status_code, await _read_some(response, settings.max_error_bytes), where=where
                )
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                raise StreamFormatError(
                    f"{where}: expected content-type text/event-stream, got '{peer_text(content_type, MESSAGE_CHARS)}'"
                )
            if (coding := content_coding(response.headers)) is not None:
                raise StreamFormatError(f"{where}: expected no content-encoding (identity), got '{coding}'")
            parser = StreamParser(settings, where=where)
            metadata: ChunkMetadata | None = response_metadata(served, settings.model)
            fragments = chars = 0
            first_token: float | None = None
            async for data in response.aiter_raw():
                for delta in parser.feed(data):
                    await output.write(delta, metadata=metadata)
                    metadata = None
                    first_token = first_token or trio.current_time()
                    fragments += 1
                    chars += len(delta)
                if parser.done:
                    break
            if not parser.done:
                raise UpstreamUnavailableError(f"{where}: {settings.endpoint} closed the stream before data: [DONE]")
        if metadata is not None:
            await output.write(b"", metadata=metadata, last=True)
        else:
            await output.close()
        usage = parser.usage or {}
        details = usage.get("prompt_tokens_details")
        now = trio.current_time()
        log.info(
            "generate.done served_by=%s model=%s fragments=%d chars=%d prompt_tokens=%s cached_tokens=%s "
            "completion_tokens=%s finish_reason=%s ttft_ms=%.1f total_ms=%.1f",
            peer_text(served or "-"), settings.model, fragments, chars, _logged(usage.get("prompt_tokens")),
            _logged(details.get("cached_tokens")) if isinstance(details, dict) else "-",
            _logged(usage.get("completion_tokens")), peer_text(parser.finish_reason or "-"),
            ((first_token or now) - attempt.started) * 1000, (now - attempt.started) * 1000,
        )


@asynccontextmanager
async def open_backend(settings: BackendSettings) -> AsyncIterator[OpenAIBackend]:
    """An :class:`OpenAIBackend` whose HTTP client lives as long as the block.

    >>> async with open_backend(BackendSettings("http://127.0.0.1:8080", "sim-model")) as backend:
    ...     register_builtin_actions(server, generate_handler=backend.generate)
    """
    headers = {"accept": "text/event-stream", "accept-encoding": "identity"}
    if settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s, read=settings.read_timeout_s,
        write=settings.read_timeout_s, pool=settings.connect_timeout_s,
    )
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        yield OpenAIBackend(settings, client)
