"""llm-d-router's ``vllm`` token backend, sans-IO: the render request it posts and the reply it reads.

As vllm_http.go: a completions prompt goes to ``/v1/completions/render`` (the reply is a list,
one ``{"token_ids": [...]}`` per prompt), a chat to ``/v1/chat/completions/render`` (one
object, with ``features``: ``mm_hashes`` and ``mm_placeholders`` by modality). The request body
is the client's, with ``model`` set to the configured model name. A chat whose messages carry
content parts gets the multimodal timeout. A pre-tokenized completions prompt is not posted:
its ids are the tokens. The Trio client is :mod:`evergreen_trio.picker.render_client`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from evergreen_trio.picker.token_estimate import (
    MultiModalFeature,
    PromptTokens,
    TokenizedPrompt,
    cache_salt,
    pack_ids,
)
from evergreen_trio.picker.token_ids import uint32_ids

COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_RENDER = "/v1/chat/completions/render"
MAX_RENDER_REPLY_BYTES = 16 << 20
"""A render reply's body at most: about 2.4 million token ids of six digits, past any served
context. The reply is parsed on the event loop, so this bounds the stall a broken vLLM can cause
(64 MiB took 15 s before the ids were checked in C, and still takes about 2 s to parse)."""
MAX_ERROR_SNIPPET = 1024  # bytes of a failed render's body quoted in its error, as the reference's
MAX_FEATURES = 4096  # multimodal items read from one reply at most


class RenderError(Exception):
    """A render that failed: refused, a non-2xx status, or a reply not in vLLM's shape."""


@dataclass(frozen=True)
class VllmRender:
    """``vllm``: where the render endpoints are, the model named in each render, the timeouts."""

    model: str
    host: str = "localhost"
    port: int = 8000
    base_path: str = ""
    timeout_s: float = 5.0
    mm_timeout_s: float = 30.0


@dataclass(frozen=True)
class RenderCall:
    """One render to post: its path, JSON body and timeout."""

    path: str
    body: bytes
    timeout_s: float


def render_call(backend: VllmRender, protocol: str, body: Mapping[str, Any]) -> RenderCall | TokenizedPrompt | None:
    """The render to post for a request of ``protocol`` (``chat`` or ``completions``); the tokens
    at once for a pre-tokenized prompt; None for a protocol the backend does not render."""
    if protocol == "completions":
        prompt = body.get("prompt")
        ids = uint32_ids(prompt)
        if ids is not None:
            return TokenizedPrompt((pack_ids(ids),), cache_salt(body))
        path, timeout = COMPLETIONS_RENDER, backend.timeout_s
    elif protocol == "chat":
        path, timeout = CHAT_RENDER, _chat_timeout(backend, body)
    elif protocol == "messages":  # rebuilt as the OpenAI chat vLLM makes of it: /render takes no other shape
        rebuilt = messages_payload(body)
        path, timeout = CHAT_RENDER, _chat_timeout(backend, rebuilt)
        body = {**rebuilt, **({"cache_salt": body["cache_salt"]} if "cache_salt" in body else {})}
    else:
        return None
    payload = json.dumps({**body, "model": backend.model}, ensure_ascii=False, separators=(",", ":"))
    return RenderCall(backend.base_path + path, payload.encode("utf-8", "surrogatepass"), timeout)


def python_arguments(value: object) -> str:
    """Tool-call arguments as vLLM renders them: ``json.dumps(input or {})`` (CPython's default
    separators, non-ASCII escaped, the wire's key order; what pythonjson.go re-implements in Go)."""
    return "{}" if value is None or value == {} else json.dumps(value)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _blocks(value: object) -> list[Mapping[str, Any]]:
    return [b for b in value if isinstance(b, Mapping)] if isinstance(value, list) else []


def _system_text(value: object) -> str:
    if isinstance(value, str):
        return value
    return "".join(t for b in _blocks(value) if b.get("type") == "text" and (t := _text(b.get("text")))
                   and not t.startswith("x-anthropic-billing-header"))


def _image_url(source: object) -> str:
    """An Anthropic image source as an OpenAI image URL ("" drops it): its URL, or a data URL."""
    source = source if isinstance(source, Mapping) else {}
    url = _text(source.get("url"))
    if source.get("type") == "url" or url:
        return url
    data = _text(source.get("data"))
    return f"data:{_text(source.get('media_type')) or 'image/jpeg'};base64,{data}" if data else ""


def _tool_result(block: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    content = block.get("content")
    if isinstance(content, str) and content:
        return content, []
    texts, images = [], []
    for item in _blocks(content):
        if item.get("type") == "text":
            texts.append(_text(item.get("text")))
        elif item.get("type") == "image" and (url := _image_url(item.get("source"))):
            images.append({"type": "image_url", "image_url": {"url": url}})
    return "\n".join(texts), images


def _message(conversation: list[dict[str, Any]], message: Mapping[str, Any]) -> None:
    """One Anthropic message as vLLM converts it (tokenizer.go's appendAnthropicMessage)."""
    role, content = _text(message.get("role")), message.get("content")
    if isinstance(content, str) and content:
        conversation.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning = ""
    for block in _blocks(content):
        kind = block.get("type")
        if kind == "text" and _text(block.get("text")):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and (url := _image_url(block.get("source"))):
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "thinking":
            reasoning += _text(block.get("thinking"))
        elif kind == "tool_use":
            calls.append({"id": _text(block.get("id")) or "call_0000000000", "type": "function", "function": {
                "name": _text(block.get("name")), "arguments": python_arguments(block.get("input"))}})
        elif kind == "tool_result" and role == "user":
            text, images = _tool_result(block)
            conversation.append({"role": "tool", "content": text, "tool_call_id": _text(block.get("tool_use_id"))})
            if images:
                conversation.append({"role": "user", "content": images})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": "Tool result: " + _tool_result(block)[0]})
    rebuilt: dict[str, Any] = {"role": role}
    if len(parts) == 1 and parts[0]["type"] == "text":
        rebuilt["content"] = parts[0]["text"]
    elif parts:
        rebuilt["content"] = parts
    elif role == "user":
        return  # reduced to bare tool results: their tool messages are in already
    if calls:
        rebuilt["tool_calls"] = calls
    if reasoning:
        rebuilt["reasoning"] = reasoning
    conversation.append(rebuilt)


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = tool.get("input_schema")
    function: dict[str, Any] = {"name": _text(tool.get("name")),
                                "parameters": schema if schema is not None else {"type": "object"}}
    if _text(tool.get("description")):
        function["description"] = tool["description"]
    function.update({key: tool[key] for key in ("strict", "defer_loading") if isinstance(tool.get(key), bool)})
    return {"type": "function", "function": function}


def messages_payload(body: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic ``/v1/messages`` body as the OpenAI chat vLLM builds of it (tokenizer.go's
    MessagesToRenderChatRequest): the system prompt first, tool results as tool messages, tool
    uses as tool calls with CPython-formatted arguments, thinking as reasoning."""
    conversation: list[dict[str, Any]] = []
    if system := _system_text(body.get("system")):
        conversation.append({"role": "system", "content": system})
    for message in _blocks(body.get("messages")):
        if message.get("role") == "system":  # not Anthropic input; tolerated as vLLM does
            if text := _system_text(message.get("content")):
                conversation.append({"role": "system", "content": text})
            continue
        _message(conversation, message)
    payload: dict[str, Any] = {"messages": conversation}
    if tools := _blocks(body.get("tools")):
        payload["tools"] = [_tool(t) for t in tools]
    return payload


def _chat_timeout(backend: VllmRender, body: Mapping[str, Any]) -> float:
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, Mapping) and isinstance(message.get("content"), list) and message["content"]:
            return backend.mm_timeout_s  # content parts may be images: vLLM fetches and processes them
    return backend.timeout_s


def render_reply(call: RenderCall, status: int, data: bytes, body: Mapping[str, Any]) -> TokenizedPrompt | None:
    """The tokens in a render's reply (None when they are none); RenderError for a failed render."""
    if not 200 <= status < 300:
        snippet = data[:MAX_ERROR_SNIPPET].decode("utf-8", "replace")
        raise RenderError(f"vLLM render returned status {status}: {snippet}")
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise RenderError(f"unmarshal response: {type(exc).__name__}") from None
    if call.path.endswith(COMPLETIONS_RENDER):
        if not isinstance(reply, list):
            raise RenderError("unmarshal response: expected a list of renders")
        if not reply:
            raise RenderError("vLLM render returned empty response")
        # One render per prompt: more would each cost Python work on the event loop (a 16 MiB reply
        # of empty renders held it 5 s for a one-prompt request).
        prompt = body.get("prompt")
        asked = len(prompt) if isinstance(prompt, list) else 1
        if len(reply) > asked:
            raise RenderError(f"unmarshal response: {len(reply)} renders for a request of {asked} prompts")
        prompts = tuple(pack_ids(_token_ids(item)) for item in reply)
    else:
        if not isinstance(reply, dict):
            raise RenderError("unmarshal response: expected a render object")
        prompts = (PromptTokens(pack_ids(_token_ids(reply)).segments, _features(reply.get("features"))),)
    tokenized = TokenizedPrompt(prompts, cache_salt(body))
    return tokenized if tokenized.token_count else None


def _token_ids(item: object) -> Sequence[int]:
    ids = item.get("token_ids") if isinstance(item, dict) else None
    if ids is None or ids == []:
        return ()
    checked = uint32_ids(ids)
    if checked is None:
        raise RenderError("unmarshal response: token_ids must be a list of uint32")
    return checked


def _features(raw: object) -> tuple[MultiModalFeature, ...]:
    """vLLM's ``features`` flattened as the reference does: per modality, hashes paired with
    placeholders (the shorter list wins), all sorted by offset; placeholders that overlap are refused."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise RenderError("unmarshal response: features must be an object")
    hashes, placeholders = raw.get("mm_hashes") or {}, raw.get("mm_placeholders") or {}
    if not isinstance(hashes, dict) or not isinstance(placeholders, dict):
        raise RenderError("unmarshal response: mm_hashes and mm_placeholders must be objects")
    items: list[MultiModalFeature] = []
    for modality, listed in hashes.items():
        ranges = placeholders.get(modality)
        if not isinstance(listed, list) or not isinstance(ranges, list):
            continue
        for digest, span in zip(listed, ranges, strict=False):
            if len(items) >= MAX_FEATURES:
                raise RenderError(f"unmarshal response: more than {MAX_FEATURES} multimodal items")
            offset, length = (span.get("offset"), span.get("length")) if isinstance(span, dict) else (None, None)
            if not isinstance(digest, str) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in (offset, length)):
                raise RenderError("unmarshal response: a multimodal item is not a hash and an offset and length")
            items.append(MultiModalFeature(modality, digest, offset, length))  # type: ignore[arg-type]
    items.sort(key=lambda f: f.offset)
    # vLLM's placeholders are disjoint: overlapping ones would put every item in every block's extras
    # (4096 items over a long prompt: gigabytes for one request).
    for before, after in pairwise(items):
        if after.offset < before.offset + before.length:
            raise RenderError(f"unmarshal response: multimodal items overlap (one at {before.offset}, "
                              f"{before.length} long, another at {after.offset})")
    return tuple(items)
