"""``anthropic-parser`` (llm-d-router's parsers/anthropic): the Anthropic Messages API.

It claims ``messages`` and ``messages/count_tokens``. A path ending in ``/messages/count_tokens``
is forwarded as received and its response is not processed. A path ending in ``/messages`` must
carry a JSON object whose ``messages`` hold at least one message, every field the reference reads
of the right type (``messages``, ``system``, ``tools``, ``cache_salt``, their content blocks);
``model``, ``stream`` and the output cap (``max_tokens``) come from it, the prompt is the system
text then the messages' text, and the target model is written into ``model``. Any other path it is
chosen for is a 400.

Usage: a JSON response's ``usage`` (``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``);
a streamed one's ``message_start`` (``message.usage``: input and cached tokens) and
``message_delta`` (``usage.output_tokens``) events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers import gojson
from evergreen_trio.picker.parsers.gojson import Spec, boolean, raw, slice_of, string, string_or_blocks, struct
from evergreen_trio.picker.parsers.registry import RequestParser, forwarded, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest, content_text
from evergreen_trio.picker.usage import ResponseFormat, Usage

_content = string_or_blocks("AnthropicContent", lambda: _BLOCKS)
_BLOCKS: Spec = slice_of(struct(
    "AnthropicContentBlock", type=string, text=string,
    source=struct("AnthropicImageSource", type=string, media_type=string, data=string, url=string),
    id=string, name=string, input=raw, tool_use_id=string, content=_content, thinking=string))
_MESSAGES_REQUEST = struct(
    "MessagesRequest",
    messages=slice_of(struct("AnthropicMessage", role=string, content=_content)),
    system=_content,
    tools=slice_of(struct("AnthropicTool", name=string, description=string, input_schema=raw, strict=boolean,
                          defer_loading=boolean)),
    cache_salt=string)


def _tokens(value: object) -> int | None:
    """A token count as the reference reads it (a JSON number, truncated); negative counts none."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def anthropic_usage(doc: object, streamed: bool) -> Usage | None:
    """Usage of a Messages API response body, or of one of its stream events."""
    if not isinstance(doc, dict):
        return None
    if not streamed:
        usage = doc.get("usage")
        if not isinstance(usage, dict):
            return None
        return Usage(_tokens(usage.get("input_tokens")), _tokens(usage.get("output_tokens")),
                     _tokens(usage.get("cache_read_input_tokens")))
    kind = doc.get("type")
    if kind == "message_start":
        message = doc.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if isinstance(usage, dict):
            return Usage(_tokens(usage.get("input_tokens")), None, _tokens(usage.get("cache_read_input_tokens")))
    elif kind == "message_delta":
        usage = doc.get("usage")
        if isinstance(usage, dict):
            return Usage(None, _tokens(usage.get("output_tokens")), None)
    return None


ANTHROPIC_RESPONSES = ResponseFormat(usage=anthropic_usage)


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    if path.endswith("/messages/count_tokens"):
        return forwarded(skip_response=True)  # a token count gains nothing from parsing or its response
    if not path.endswith("/messages"):
        raise RequestError(400, f"unsupported API endpoint: {path[:256]}")
    doc, text, model_span = gojson.load(body)
    request = gojson.checked(_MESSAGES_REQUEST, doc, "messages request")
    messages = request.get("messages")
    if not messages:
        raise RequestError(400, "invalid messages request: must have at least one message")
    model = doc.get("model")
    prompt = gojson.text(content_text(request.get("system")) + content_text(messages))
    return InferenceRequest(
        Api.OTHER, gojson.text(model) if isinstance(model, str) else "", doc.get("stream") is True, prompt, doc,
        len(prompt) if prompt.isascii() else len(prompt.encode()), text, model_span,
        gojson.max_output_tokens(doc, "max_tokens"), response=ANTHROPIC_RESPONSES)


ANTHROPIC = register_parser(RequestParser("anthropic-parser", ("messages", "messages/count_tokens"), _parse))
