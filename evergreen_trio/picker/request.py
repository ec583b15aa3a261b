"""OpenAI-style request bodies: the API by path suffix, ``model``, ``stream`` and the prompt text."""

from __future__ import annotations

import enum
import json
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
        doc = json.loads(body)
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
    utf8(prompt, "prompt")
    return InferenceRequest(api, model, doc.get("stream") is True, prompt, doc)


def rewrite_model(body: Mapping[str, Any], model: str) -> bytes:
    """The body re-serialized with ``model`` replaced; RequestError(400) for a lone surrogate in it."""
    return utf8(json.dumps({**body, "model": model}, separators=(",", ":"), ensure_ascii=False), "body")
