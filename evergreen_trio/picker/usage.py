"""Response bodies: token usage from JSON, SSE and gRPC messages, and the target -> client model
name rewrite.

SSE bodies are handled line by line with a bounded carry-over, so an event split across chunks
is read whole, and usage fields spread over several events are merged (later values win). Each
request parser says how its responses carry usage (:class:`ResponseFormat`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.fast_json import loads


@dataclass(frozen=True)
class Usage:
    """Token counts of one response (None: not reported).

    ``total_tokens`` is a total reported beside non-zero prompt and completion counts in the same
    usage block, and only while no later block reports usage without one: llm-d-router's
    ``mergeUsage`` keeps such a total and otherwise derives prompt + completion (``total``).
    """

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    total_tokens: int | None = None

    def merged(self, other: Usage) -> Usage:
        return Usage(
            other.prompt_tokens if other.prompt_tokens is not None else self.prompt_tokens,
            other.completion_tokens if other.completion_tokens is not None else self.completion_tokens,
            other.cached_tokens if other.cached_tokens is not None else self.cached_tokens,
            other.total_tokens,
        )

    @property
    def total(self) -> int:
        """The reported total, else prompt + completion (0 for a count not reported)."""
        if self.total_tokens is not None:
            return self.total_tokens
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


NO_USAGE = Usage()
"""Nothing reported yet (usage is immutable: one instance serves every reader)."""


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(doc: object, streamed: bool = False) -> Usage | None:
    """Usage of one decoded JSON document (chat/completions, or the Responses API's names), a whole
    body or an SSE event alike."""
    if not isinstance(doc, Mapping):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, Mapping) and isinstance(doc.get("response"), Mapping):
        usage = doc["response"].get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    prompt = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = _count(usage.get("completion_tokens", usage.get("output_tokens")))
    total = _count(usage.get("total_tokens")) if prompt and completion else None
    return Usage(prompt, completion, _count(cached), total or None)


def _swap_model(doc: Any, target: str, client: str) -> bool:
    """Replace ``model == target`` by ``client`` in the document and a nested ``response`` (the
    Responses API's events) or ``message`` (the Anthropic ``message_start`` event)."""
    changed = False
    nested = (doc.get("response"), doc.get("message")) if isinstance(doc, dict) else ()
    for obj in (doc, *nested):
        if isinstance(obj, dict) and obj.get("model") == target:
            obj["model"] = client
            changed = True
    return changed


UsageOf = Callable[[object, bool], "Usage | None"]
"""Usage of one decoded JSON document: a whole response body (False) or one SSE event's data (True)."""


class ResponseBody:
    """Incremental reader of one response body: usage (read by ``usage``; None reads none), plus
    the optional model name rewrite.

    ``feed`` returns the bytes to pass on (SSE: the complete lines so far; JSON: nothing until
    ``finish``, which returns the whole body), so a rewrite never splits an event.
    """

    def __init__(self, *, sse: bool, rewrite: tuple[str, str] | None, max_bytes: int,
                 usage: UsageOf | None = usage_of) -> None:
        self.sse = sse
        self.usage = NO_USAGE
        self.rewritten = False
        self._rewrite = rewrite
        self._max = max_bytes
        self._buffer = bytearray()
        self._usage_of = usage

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        if not self.sse:
            if len(self._buffer) > self._max:
                raise RequestError(502, f"response body larger than {self._max} bytes")
            return b""
        end = self._buffer.rfind(b"\n") + 1
        if not end:
            if len(self._buffer) > self._max:
                raise RequestError(502, f"SSE line longer than {self._max} bytes")
            return b""
        lines = bytes(self._buffer[:end])
        del self._buffer[:end]
        return self._lines(lines)

    def finish(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        if self.sse:
            return self._lines(rest)
        try:
            doc = loads(rest)
        except (ValueError, RecursionError):
            return rest
        self._merge(doc, False)
        if self._rewrite and _swap_model(doc, *self._rewrite):
            self.rewritten = True
            return _json_bytes(doc)
        return rest

    def _merge(self, doc: object, streamed: bool) -> None:
        found = self._usage_of(doc, streamed) if self._usage_of is not None else None
        if found is not None:  # merged into nothing, ``found`` is itself the result
            self.usage = found if self.usage is NO_USAGE else self.usage.merged(found)

    def _lines(self, data: bytes) -> bytes:
        out = []
        for line in data.splitlines(keepends=True):
            stripped = line.rstrip(b"\r\n")
            if not stripped.startswith(b"data:"):
                out.append(line)
                continue
            payload = stripped[5:].strip()
            if payload == b"[DONE]":
                out.append(line)
                continue
            try:
                doc = loads(payload)
            except (ValueError, RecursionError):
                out.append(line)
                continue
            self._merge(doc, True)
            if self._rewrite and _swap_model(doc, *self._rewrite):
                self.rewritten = True
                ending = line[len(stripped) :]
                out.append(b"data: " + _json_bytes(doc) + ending)
            else:
                out.append(line)
        return b"".join(out)


def _json_bytes(doc: object) -> bytes:
    """``doc`` as compact JSON in UTF-8; with ``\\u`` escapes for all but ASCII when a string in it
    holds a lone surrogate (a model server may escape one, and UTF-8 cannot carry it), so the
    document passed on is the one received, not a stream ended with an encoding error."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(doc, separators=(",", ":")).encode()


_FRAME_HEADER = 5  # gRPC's message prefix: a compression flag, then a 4-byte big-endian length


class GrpcResponseBody(ResponseBody):
    """A gRPC response body: the usage each length-prefixed message carries (``message_usage``).

    Messages split across chunks are read whole; the body is passed on untouched (no rewrite). A
    compressed message, or one longer than ``max_bytes``, ends the reading (as the reference's
    parsers fail on it).
    """

    def __init__(self, message_usage: Callable[[bytes], Usage | None], max_bytes: int) -> None:
        super().__init__(sse=False, rewrite=None, max_bytes=max_bytes, usage=None)
        self._message_usage = message_usage
        self._stopped = False

    def feed(self, chunk: bytes) -> bytes:
        if self._stopped:
            return b""
        buffer = self._buffer
        buffer += chunk
        while len(buffer) >= _FRAME_HEADER:
            length = int.from_bytes(buffer[1:_FRAME_HEADER], "big")
            if buffer[0] == 1 or length > self._max:
                self._stopped = True
                buffer.clear()
                break
            if len(buffer) < _FRAME_HEADER + length:
                break
            found = self._message_usage(bytes(buffer[_FRAME_HEADER : _FRAME_HEADER + length]))
            if found is not None:
                self.usage = self.usage.merged(found)
            del buffer[: _FRAME_HEADER + length]
        return b""

    def finish(self) -> bytes:
        self._buffer.clear()
        return b""


@dataclass(frozen=True)
class ResponseFormat:
    """How a request parser reads its responses: ``usage`` over JSON bodies and SSE events (None:
    no usage), or ``grpc_usage`` over gRPC messages (no model rewrite then)."""

    usage: UsageOf | None = usage_of
    grpc_usage: Callable[[bytes], Usage | None] | None = None

    @property
    def rewrites(self) -> bool:
        """Whether the target model name is rewritten back to the client's in the response."""
        return self.grpc_usage is None

    def reader(self, *, sse: bool, rewrite: tuple[str, str] | None, max_bytes: int) -> ResponseBody:
        if self.grpc_usage is not None:
            return GrpcResponseBody(self.grpc_usage, max_bytes)
        return ResponseBody(sse=sse, rewrite=rewrite, max_bytes=max_bytes, usage=self.usage)


OPENAI_RESPONSES = ResponseFormat()
"""OpenAI usage shapes (chat/completions, the Responses API), read from JSON and SSE bodies."""
