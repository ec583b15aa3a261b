"""``openai-parser``: OpenAI-style bodies (:func:`~evergreen_trio.picker.request.parse_body`) on
the paths llm-d-router's openai parser claims."""

from __future__ import annotations

from collections.abc import Mapping

from evergreen_trio.picker.parsers.registry import RequestParser, register_parser
from evergreen_trio.picker.request import InferenceRequest, parse_body


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    return parse_body(path, body)


OPENAI = register_parser(RequestParser("openai-parser", (
    "chat/completions", "completions", "embeddings", "responses", "conversations", "chat/completions/render",
    "completions/render", "images/generations"), _parse))
