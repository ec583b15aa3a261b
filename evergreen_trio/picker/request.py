"""OpenAI-style request bodies: the API by path suffix, ``model``, ``stream`` and the prompt text."""

from __future__ import annotations

import enum
import json
import re
from _json import make_scanner, scanstring
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.guards import check_json_cost, utf8


class Api(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    OTHER = ""


_SUFFIXES = (Api.CHAT, Api.COMPLETIONS, Api.EMBEDDINGS, Api.RESPONSES)


def api_for_path(path: str) -> Api:
    """The API a request path names by its suffix (query string ignored)."""
    bare = path.split("?", 1)[0].rstrip("/")
    for api in _SUFFIXES:
        if bare.endswith(api.value):
            return api
    return Api.OTHER


@dataclass(frozen=True)
class InferenceRequest:
    """What scheduling needs from a body: the model, whether it streams, the prompt text."""

    api: Api
    model: str
    stream: bool
    prompt: str
    body: Mapping[str, Any]
    prompt_bytes: int = 0
    """The prompt's length in UTF-8."""
    text: str = ""
    """The body as decoded text (what :func:`rewrite_model` splices into)."""
    model_span: tuple[int, int] | None = None
    """Where the top-level ``model`` value lies in ``text``; None when the body is re-serialized instead."""


def _text(value: object) -> str:
    """Concatenated text of a prompt-ish value: a string, a list of strings or content parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(item) for item in value)
    if isinstance(value, Mapping):
        parts = [value.get("role"), value.get("text"), value.get("content"), value.get("input_text")]
        return "".join(_text(part) for part in parts if part is not None)
    return ""


def _prompt(api: Api, body: Mapping[str, Any]) -> str:
    if api is Api.CHAT:
        return _text(body.get("messages"))
    if api is Api.EMBEDDINGS:
        return _text(body.get("input"))
    if api is Api.RESPONSES:
        return _text(body.get("instructions")) + _text(body.get("input"))
    return _text(body.get("prompt"))


def parse_body(path: str, body: bytes) -> InferenceRequest:
    """Parse a request body; a body that is not a JSON object with a string ``model`` is a 400."""
    check_json_cost(body)
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        doc, model_span = _object_and_model_span(text)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, f"request body is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(doc).__name__}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "request body lacks a string 'model' field")
    api = api_for_path(path)
    prompt = _prompt(api, doc)
    utf8(model, "model")
    prompt_bytes = len(prompt) if prompt.isascii() else len(utf8(prompt, "prompt"))
    return InferenceRequest(api, model, doc.get("stream") is True, prompt, doc, prompt_bytes, text, model_span)


def rewrite_model(request: InferenceRequest, model: str) -> bytes:
    """The body with its ``model`` value replaced; RequestError(400) for a lone surrogate in it.

    Where the parse found the value, only that span is replaced (the client's bytes are kept, and a
    16 MiB body costs a copy rather than a 50 ms re-serialization); otherwise the body is re-serialized.
    """
    if request.model_span is None:
        text = json.dumps({**request.body, "model": model}, separators=(",", ":"), ensure_ascii=False)
    else:
        start, end = request.model_span
        text = request.text[:start] + json.dumps(model, ensure_ascii=False) + request.text[end:]
    return utf8(text, "body")


_SCAN = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # a decoder is the context (typeshed TODO)
"""The C scanner json.loads uses: the value starting at an index, and where it ends."""
_SPACE = re.compile(r"[ \t\n\r]*")
MAX_SPLICED_MEMBERS = 64
"""A body with more top-level members is parsed by ``json.loads`` and re-serialized to rewrite its
model: walking members costs Python work per member, a whole value costs C work."""


def _object_and_model_span(text: str) -> tuple[Any, tuple[int, int] | None]:
    """``text`` parsed as JSON (ValueError if it is not), and where a top-level object's last
    ``model`` value lies (None for anything else, or an object of many members)."""
    start = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text[start : start + 1] != "{":
        return json.loads(text), None
    doc: dict[str, Any] = {}
    span = None
    index = _SPACE.match(text, start + 1).end()  # type: ignore[union-attr]
    if text[index : index + 1] == "}":
        index = _SPACE.match(text, index + 1).end()  # type: ignore[union-attr]
    else:
        for _ in range(MAX_SPLICED_MEMBERS):
            if text[index : index + 1] != '"':
                raise ValueError(f"expected a member name at {index}")
            key, index = scanstring(text, index + 1)
            index = _SPACE.match(text, index).end()  # type: ignore[union-attr]
            if text[index : index + 1] != ":":
                raise ValueError(f"expected ':' at {index}")
            index = _SPACE.match(text, index + 1).end()  # type: ignore[union-attr]
            try:
                doc[key], end = _SCAN(text, index)
            except StopIteration:
                raise ValueError(f"expected a value at {index}") from None
            if key == "model":
                span = (index, end)
            index = _SPACE.match(text, end).end()  # type: ignore[union-attr]
            separator = text[index : index + 1]
            index = _SPACE.match(text, index + 1).end()  # type: ignore[union-attr]
            if separator == "}":
                break
            if separator != ",":
                raise ValueError(f"expected ',' or '}}' at {index}")
        else:
            return json.loads(text), None
    if index != len(text):
        raise ValueError(f"extra data at {index}")
    return doc, span
