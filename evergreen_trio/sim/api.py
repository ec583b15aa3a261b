"""The OpenAI-compatible surface, sans-IO: request bodies in, response bodies and SSE frames out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimRequestError
from evergreen_trio.sim.model import Usage

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat completion request."""

    chat: bool
    model: str
    prompt: str
    max_tokens: int
    stream: bool
    include_usage: bool
    lora: str | None
    """The adapter named, or None for the base model."""


def _bad(message: str) -> SimRequestError:
    return SimRequestError(400, message)


def _flatten_content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{index}] must be an object {{'type': 'text', 'text': str}}, got {part!r:.80}")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise _bad(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def chat_prompt(messages: object) -> str:
    """The prompt text a chat request stands for: one ``role: content`` line per message."""
    if not isinstance(messages, list) or not messages:
        raise _bad(f"'messages' must be a non-empty list, got {type(messages).__name__}")
    lines = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{index}].role must be a non-empty string, got {role!r:.40}")
        lines.append(f"{role}: {_flatten_content(message.get('content'), f'messages[{index}].content')}\n")
    return "".join(lines) + "assistant: "


def _completion_prompt(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad(f"'prompt' must be a string (or a list of one string), got {type(prompt).__name__}")
    return prompt


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"'{name}' must be an integer >= 1, got {value!r:.40}")
    return value


def parse_request(path: str, body: bytes, config: SimConfig) -> ParsedRequest:
    """Validate a POST body for ``path``; raises SimRequestError (400, or 404 for an unknown model)."""
    chat = path == CHAT_COMPLETIONS
    try:
        document = json.loads(body)
    except ValueError as exc:  # not UTF-8, not JSON, or an integer of over 4300 digits
        raise _bad(f"request body must be a JSON object: {exc}") from None
    except RecursionError:
        raise _bad("request body must be a JSON object: nesting too deep") from None
    if not isinstance(document, dict):
        raise _bad(f"request body must be a JSON object, got {type(document).__name__}")
    model = document.get("model")
    if not isinstance(model, str):
        raise _bad(f"'model' must be a string, got {type(model).__name__}")
    if model != config.model and model not in config.lora_adapters:
        raise SimRequestError(404, f"The model `{model}` does not exist.", error_type="NotFoundError")
    prompt = chat_prompt(document.get("messages")) if chat else _completion_prompt(document.get("prompt"))
    if chat and document.get("max_completion_tokens") is not None:
        max_tokens = _int_field(document, "max_completion_tokens", config.default_max_tokens)
    else:
        max_tokens = _int_field(document, "max_tokens", config.default_max_tokens)
    if _int_field(document, "n", 1) != 1:
        raise _bad(f"only 'n': 1 is supported, got {document.get('n')!r:.40}")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad(f"'stream' must be a boolean, got {stream!r:.40}")
    options = document.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise _bad(f"'stream_options' must be an object, got {type(options).__name__}")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad(f"'stream_options.include_usage' must be a boolean, got {include_usage!r:.40}")
    lora = None if model == config.model else model
    return ParsedRequest(chat, model, prompt, max_tokens, stream, include_usage, lora)


def usage_json(usage: Usage) -> dict[str, Any]:
    """The OpenAI ``usage`` object, with vLLM's ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def full_response(request: ParsedRequest, request_id: str, created: int, text: str, usage: Usage) -> dict[str, Any]:
    """A non-streaming completion or chat completion."""
    if request.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        kind = "text_completion"
    choice.update(finish_reason="length", stop_reason=None)
    return {
        "id": request_id, "object": kind, "created": created, "model": request.model,
        "choices": [choice], "usage": usage_json(usage),
    }


def stream_chunk(
    request: ParsedRequest, request_id: str, created: int, text: str, *, first: bool, last: bool
) -> dict[str, Any]:
    """One SSE chunk carrying one token (a chat stream's first chunk also names the role)."""
    finish = "length" if last else None
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        kind = "text_completion"
    chunk = {"id": request_id, "object": kind, "created": created, "model": request.model, "choices": [choice]}
    if request.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request: ParsedRequest, request_id: str, created: int, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    return {
        "id": request_id, "object": kind, "created": created, "model": request.model,
        "choices": [], "usage": usage_json(usage),
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal like ``[DONE]``) and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def error_body(status: int, message: str, error_type: str) -> bytes:
    """vLLM's error envelope."""
    return json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": status}}).encode()


def models_body(config: SimConfig, created: int) -> bytes:
    """``GET /v1/models``: the base model and its adapters (with ``parent``)."""
    entries = [{"id": config.model, "object": "model", "created": created, "owned_by": "vllm", "root": config.model,
                "parent": None, "max_model_len": config.max_model_len}]
    entries += [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
                 "parent": config.model, "max_model_len": config.max_model_len} for name in config.lora_adapters]
    return json.dumps({"object": "list", "data": entries}).encode()
