"""vLLM's render endpoints, simulated and sans-IO: a request body in, vLLM's reply shape out.

``POST /v1/completions/render`` answers a list with one ``{"token_ids": [...]}`` per prompt (a
string, a list of strings, or token ids, which pass through); ``POST
/v1/chat/completions/render`` one object, whose ``features`` (when the chat holds images)
carry ``mm_hashes`` and ``mm_placeholders`` by modality, as vLLM's ``GenerateRequest``. The
simulated tokenizer cuts text into :attr:`SimConfig.chars_per_token` character tokens (each id
a hash of its characters); an image stands for :data:`IMAGE_TOKENS` placeholder tokens, hashed
by its URL. What the picker's ``vllm`` token backend reads (llm-d-router's vllm_http.go).
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimRequestError

COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_RENDER = "/v1/chat/completions/render"
IMAGE_TOKENS = 16
IMAGE_TOKEN_ID = 151655  # one id for every image placeholder, as a VLM's image token
VOCAB = 150_000


def _token_ids(text: str, config: SimConfig) -> list[int]:
    size = config.chars_per_token
    return [xxhash.xxh32_intdigest(text[i : i + size].encode("utf-8", "surrogatepass")) % VOCAB
            for i in range(0, len(text), size)]


def _document(body: bytes, config: SimConfig) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # ValueError: not UTF-8, not JSON, an integer of over 4300 digits
        raise SimRequestError(400, "request body must be a JSON object") from None
    if not isinstance(document, dict):
        raise SimRequestError(400, f"request body must be a JSON object, got {type(document).__name__}")
    model = document.get("model")
    if model != config.model and model not in config.lora_adapters:
        raise SimRequestError(404, f"The model `{model!s:.80}` does not exist.", error_type="NotFoundError")
    return document


def render_completions(body: bytes, config: SimConfig) -> bytes:
    """The reply of ``/v1/completions/render``: one render per prompt."""
    prompt = _document(body, config).get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        renders = [prompt]
    elif isinstance(prompt, str):
        renders = [_token_ids(prompt, config)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        renders = [_token_ids(p, config) for p in prompt]
    else:
        raise SimRequestError(400, "'prompt' must be a string, a list of strings or a list of token ids")
    return json.dumps([{"request_id": f"render-{i}", "token_ids": ids, "features": None}
                       for i, ids in enumerate(renders)]).encode()


def render_chat(body: bytes, config: SimConfig) -> bytes:
    """The reply of ``/v1/chat/completions/render``: the chat's tokens and its images' features."""
    messages = _document(body, config).get("messages")
    if not isinstance(messages, list) or not messages:
        raise SimRequestError(400, "'messages' must be a non-empty list")
    ids: list[int] = []
    hashes: list[str] = []
    spans: list[dict[str, int]] = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role:
            raise SimRequestError(400, f"messages[{index}].role must be a non-empty string")
        ids += _token_ids(f"{role}: ", config)
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                ids += _token_ids(part["text"], config)
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                url = str(part["image_url"].get("url", ""))
                hashes.append(format(xxhash.xxh64_intdigest(url.encode("utf-8", "surrogatepass")), "016x"))
                spans.append({"offset": len(ids), "length": IMAGE_TOKENS})
                ids += [IMAGE_TOKEN_ID] * IMAGE_TOKENS
            else:
                raise SimRequestError(400, f"messages[{index}].content: only text and image_url parts are rendered")
        ids += _token_ids("\n", config)
    ids += _token_ids("assistant: ", config)
    features = {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": spans}} if hashes else None
    return json.dumps({"request_id": "render-0", "token_ids": ids, "features": features}).encode()
