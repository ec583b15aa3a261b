"""The OpenAI-compatible wire, sans-IO: request bodies, streamed deltas, HTTP statuses as session statuses.

Status mapping (the session aborts with the code on the right):

==========================================  =====================  ====================================
upstream                                    session status         why
==========================================  =====================  ====================================
429                                         RESOURCE_EXHAUSTED     the gateway sheds load: retry later
503, 502, 504                               UNAVAILABLE            no model server could take it now
408                                         DEADLINE_EXCEEDED      the upstream gave up waiting
400, 413, 422                               INVALID_ARGUMENT       the prompt the client sent was refused
other 4xx (401, 403, 404, 409, ...)         FAILED_PRECONDITION    the server's backend settings are
                                                                   wrong (key, model name): the client
                                                                   cannot fix it by changing its input
500 and other 5xx                           INTERNAL               the upstream failed
==========================================  =====================  ====================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from evergreen_trio.dag.errors import StatusCode
from evergreen_trio.generate.config import BackendSettings
from evergreen_trio.generate.errors import ResponseTooLargeError, SSEError, StreamFormatError, UpstreamStatusError
from evergreen_trio.generate.params import GenerateParams
from evergreen_trio.generate.sse import SSEDecoder

DONE = "[DONE]"
MESSAGE_CHARS = 300
"""An upstream error message is cut to this many characters in the abort message."""


@dataclass(frozen=True, slots=True)
class PromptPart:
    """A run of prompt text with one role (``""``: the chunk metadata named none)."""

    role: str
    text: str


def chat_messages(parts: list[PromptPart]) -> list[dict[str, str]]:
    """One message per run of parts with the same role; no role means ``user``."""
    messages: list[dict[str, str]] = []
    for part in parts:
        role = part.role or "user"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += part.text
        else:
            messages.append({"role": role, "content": part.text})
    return messages or [{"role": "user", "content": ""}]


def request_body(
    settings: BackendSettings, parts: list[PromptPart], params: GenerateParams | None = None
) -> dict[str, Any]:
    """The streaming request for ``settings.endpoint``: the prompt's parts as one string (completions,
    concatenated as they are) or as chat messages, and the call's ``params`` (its ``max_tokens`` wins)."""
    body: dict[str, Any] = {"model": settings.model, "stream": True}
    if settings.api == "chat":
        body["messages"] = chat_messages(parts)
    else:
        body["prompt"] = "".join(part.text for part in parts)
    if settings.max_tokens is not None:
        body["max_tokens"] = settings.max_tokens
    if params is not None:
        body.update(params.openai_fields())
    if settings.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def status_code(http_status: int) -> StatusCode:
    """The session status for an upstream HTTP error status (the table above)."""
    if http_status == 429:
        return StatusCode.RESOURCE_EXHAUSTED
    if http_status in (502, 503, 504):
        return StatusCode.UNAVAILABLE
    if http_status == 408:
        return StatusCode.DEADLINE_EXCEEDED
    if http_status in (400, 413, 422):
        return StatusCode.INVALID_ARGUMENT
    if 400 <= http_status < 500:
        return StatusCode.FAILED_PRECONDITION
    return StatusCode.INTERNAL


def _printable(text: str) -> str:
    cleaned = "".join(c if c.isprintable() else " " for c in text).strip()
    return cleaned[:MESSAGE_CHARS] + ("..." if len(cleaned) > MESSAGE_CHARS else "")


def error_message(body: bytes) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``,
    or the body as text; cut and stripped of control characters."""
    text = body.decode("utf-8", errors="replace")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deep
        return _printable(text) or "(empty body)"
    if isinstance(document, dict):
        error = document.get("error", document)
        if isinstance(error, dict):
            error = error.get("message", error.get("detail", error))
        if isinstance(error, str):
            return _printable(error)
    return _printable(text)


def upstream_error(http_status: int, body: bytes, *, where: str) -> UpstreamStatusError:
    """The abort for an upstream error response."""
    return UpstreamStatusError(
        f"{where}: upstream answered HTTP {http_status}: {error_message(body)}",
        status=http_status,
        code=status_code(http_status),
    )


class StreamParser:
    """An OpenAI streaming response body -> text deltas, until ``data: [DONE]``.

    ``feed`` returns the deltas the bytes completed (empty deltas dropped); ``done`` is set by
    ``[DONE]``, after which nothing more is read. ``usage`` and ``finish_reason`` keep the last
    seen. Anything else than the OpenAI shapes raises :class:`StreamFormatError`; an error
    object in the stream raises :class:`UpstreamStatusError`; crossing ``max_response_bytes``
    raises :class:`ResponseTooLargeError`.
    """

    def __init__(self, settings: BackendSettings, *, where: str) -> None:
        self._chat = settings.api == "chat"
        self._max_bytes = settings.max_response_bytes
        self._where = where
        self._sse = SSEDecoder(max_line_bytes=settings.max_line_bytes, max_event_bytes=settings.max_line_bytes)
        self.received = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def feed(self, data: bytes) -> list[str]:
        """The text deltas completed by ``data`` (nothing after ``[DONE]``); raises as the class says."""
        if self.done:
            return []
        self.received += len(data)
        if self.received > self._max_bytes:
            raise ResponseTooLargeError(
                f"{self._where}: expected a response of at most {self._max_bytes} bytes, got more"
            )
        try:
            events = self._sse.feed(data)
        except (SSEError, ResponseTooLargeError) as error:
            raise type(error)(f"{self._where}: {error.message}") from None
        deltas: list[str] = []
        for event in events:
            if event.data == DONE:
                self.done = True
                break
            try:
                delta = self._delta(event.data)
            except RecursionError:  # json.loads (or repr, json.dumps of what it made) of a deep nesting
                raise self._bad("a data event of JSON nested less deeply", event.data) from None
            if delta:
                deltas.append(delta)
        return deltas

    def _bad(self, expected: str, got: object) -> StreamFormatError:
        return StreamFormatError(f"{self._where}: expected {expected} in the stream, got {_printable(repr(got))}")

    def _delta(self, data: str) -> str:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise self._bad("a JSON object or [DONE] in each data event", data) from None
        if not isinstance(chunk, dict):
            raise self._bad("a JSON object in each data event", chunk)
        if "error" in chunk:
            raise self._stream_error(chunk["error"])
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise self._bad("'choices' to be a list", choices)
        texts = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._bad("each choice to be an object", choice)
            if choice.get("index", 0) != 0:
                continue
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason
            if self._chat:
                delta = choice.get("delta", {})
                if not isinstance(delta, dict):
                    raise self._bad("'delta' to be an object", delta)
                text = delta.get("content")
            else:
                text = choice.get("text")
            if text is not None and not isinstance(text, str):
                raise self._bad("the token text to be a string", text)
            texts.append(text or "")
        delta = "".join(texts)
        try:
            delta.encode()  # JSON can spell a lone surrogate ("\\ud800"), which UTF-8 cannot carry
        except UnicodeEncodeError as error:
            raise self._bad("token text without lone surrogates", delta[error.start : error.end]) from None
        return delta

    def _stream_error(self, error: object) -> UpstreamStatusError:
        """vLLM reports a failure after the headers as ``data: {"error": {"message", "code"}}``."""
        code = error.get("code") if isinstance(error, dict) else None
        http_status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 500
        message = error_message(json.dumps({"error": error}).encode())
        return UpstreamStatusError(
            f"{self._where}: upstream failed in the stream (HTTP {http_status}): {message}",
            status=http_status,
            code=status_code(http_status),
        )
