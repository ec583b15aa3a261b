"""``openai-parser``: OpenAI-style bodies (:func:`~evergreen_trio.picker.request.parse_body`) on
the paths llm-d-router's openai parser claims.

Each body is first read as the reference reads it into the request type its path names
(:func:`~evergreen_trio.picker.request.request_type`; its ``extractRequestBody``): every field the
type declares must be of its Go type (:mod:`~evergreen_trio.picker.parsers.gojson`), and the body
must hold what the type requires (a chat's messages, a completion's prompt, ...). A body that
fails is a 400 with the reference's message, and what failed after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.gojson import (
    Mismatch,
    Spec,
    boolean,
    integer,
    map_of,
    raw,
    slice_of,
    string,
    string_or_blocks,
    struct,
)
from evergreen_trio.picker.parsers.registry import RequestParser, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest, parse_body, request_type
from evergreen_trio.picker.token_ids import uint32_ids


def prompt_input(go_type: str) -> Spec:
    """The reference's ``Prompt`` / ``EmbeddingsInput``: a string, or an array of strings or of token
    ids (numbers equal to a uint32), typed by its first element; null is refused (its UnmarshalJSON
    sees it). Decoded as a string or a list (empty: no prompt)."""

    def decode(value: object, path: str) -> str | list[Any]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if not value:
                return value
            first = type(value[0])
            if first is str and set(map(type, value)) == {str}:
                return value
            if first in (int, float) and uint32_ids(value, integral_floats=True) is not None:
                return value
        raise Mismatch(path, f"{go_type} (a string, or an array of strings or of token ids)", value)

    return decode


_content = string_or_blocks("Content", lambda: _BLOCKS)
_BLOCKS: Spec = slice_of(struct(
    "ContentBlock", type=string, text=string, image_url=struct("ImageBlock", url=string),
    input_audio=struct("AudioBlock", data=string, format=string), video_url=struct("VideoBlock", url=string)))
CHAT_COMPLETIONS = struct(
    "ChatCompletionsRequest",
    messages=slice_of(struct("Message", role=string, content=_content, tool_calls=slice_of(raw))),
    tools=slice_of(raw), documents=slice_of(raw), chat_template=string, return_assistant_tokens_mask=boolean,
    continue_final_message=boolean, add_generation_prompt=boolean, chat_template_kwargs=map_of(raw),
    cache_salt=string)
RESPONSES = struct("ResponsesRequest", input=raw, instructions=raw, tools=raw, cache_salt=string)
_INT64 = integer(-(2**63), 2**63 - 1, "int64")


class _RequestType(NamedTuple):
    spec: Spec
    name: str
    field: str
    """What the body must hold: a non-empty value (for ``responses``, any value but null)."""
    message: str


_REQUEST_TYPES = {
    "conversations": _RequestType(struct(
        "ConversationsRequest", items=slice_of(struct("ConversationItem", type=string, role=string, content=raw)),
        metadata=map_of(raw), cache_salt=string), "conversations request", "items",
        "invalid conversations request: must have items field"),
    "responses": _RequestType(RESPONSES, "responses request", "input",
                              "invalid responses request: must have input field"),
    "chat/completions": _RequestType(CHAT_COMPLETIONS, "chat completions request", "messages",
                                     "invalid chat completions request: must have valid messages field"),
    "completions": _RequestType(struct("CompletionsRequest", prompt=prompt_input("Prompt"), cache_salt=string),
                                "completions request", "prompt", "invalid completions request: must have prompt field"),
    "embeddings": _RequestType(struct("EmbeddingsRequest", input=prompt_input("EmbeddingsInput"), cache_salt=string),
                               "embeddings request", "input", "invalid embeddings request: must have input field"),
    "images/generations": _RequestType(struct(
        "ImagesGenerationsRequest", prompt=string, n=_INT64, size=string, num_inference_steps=_INT64),
        "images generations request", "prompt", "invalid images generations request: must have prompt field"),
}


def read_request(request_type: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` decoded as the reference's openai parser decodes a body of ``request_type`` (a key
    of :data:`~evergreen_trio.picker.request.REQUEST_TYPES`' types); RequestError(400) with its
    message for one it refuses."""
    kind = _REQUEST_TYPES[request_type]
    try:
        decoded: dict[str, Any] = kind.spec(doc, kind.name)  # a dict decodes to a dict
    except Mismatch as exc:
        raise RequestError(400, f"{kind.message} ({exc})") from None
    except RecursionError:
        raise RequestError(400, f"{kind.message} (nested too deeply)") from None
    value = decoded.get(kind.field)
    if value is None or (not value and kind.spec is not RESPONSES):
        raise RequestError(400, kind.message)
    return decoded


def check_request_type(path: str, doc: Mapping[str, Any]) -> Api:
    """RequestError(400) for a body the reference's openai parser refuses at ``path``; else the
    API the request is scheduled as."""
    kind, api = request_type(path)
    read_request(kind, doc)
    return api


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    return parse_body(path, body, check_request_type)


OPENAI = register_parser(RequestParser("openai-parser", (
    "chat/completions", "completions", "embeddings", "responses", "conversations", "chat/completions/render",
    "completions/render", "images/generations"), _parse))
