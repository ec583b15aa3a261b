"""``sglanghttp-parser`` (llm-d-router's parsers/sglanghttp): SGLang's native ``/generate``.

It claims ``generate``, but reads only a path that is ``/generate`` itself (a trailing ``/``
aside); any other is a 400. The body is a JSON object with ``input_ids``: one pre-tokenized
prompt, a non-empty array of integers in 0..2**32-1 (a batch of prompts is refused, as text
and embeddings inputs are); ``extra_key`` must be a string when set and ``stream`` a boolean.
The output cap is ``sampling_params.max_new_tokens`` (a whole number >= 0; anything else caps
nothing). The body is forwarded as received: the request has no model (an
``x-gateway-model-name-rewrite`` header still names a target). Usage comes from the response's
``meta_info``; streamed, from the event whose ``meta_info.finish_reason`` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.gotext import GO_SPACE
from evergreen_trio.picker.parsers import gojson
from evergreen_trio.picker.parsers.gojson import INT, Mismatch, boolean, raw, struct
from evergreen_trio.picker.parsers.registry import RequestParser, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest
from evergreen_trio.picker.usage import ResponseFormat, Usage

_WIRE = struct("sgLangGenerateWire", input_ids=raw, extra_key=raw, sampling_params=raw, stream=boolean)
_SAMPLING_PARAMS = struct("sgLangSamplingParams", max_new_tokens=INT)
_MAX_TOKEN = 2**32 - 1


def _input_ids(value: object) -> list[int]:
    """``input_ids`` decoded as Go's ``[]uint32`` (null elements are 0)."""
    if isinstance(value, list):
        ids = [0 if item is None else item for item in value]
        if all(type(item) is int and 0 <= item <= _MAX_TOKEN for item in ids):
            if not ids:
                raise RequestError(400, "invalid generate request: input_ids cannot be empty")
            return ids
    raise RequestError(400, "invalid generate request: input_ids must be an array of uint32 integers")


def _max_new_tokens(value: object) -> int | None:
    try:
        params = _SAMPLING_PARAMS(value, "sampling_params")
    except Mismatch:
        return None
    cap = params.get("max_new_tokens") if params is not None else None
    return cap if cap is not None and cap >= 0 else None


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    if path.strip(GO_SPACE).removesuffix("/") not in ("generate", "/generate"):
        raise RequestError(400, f"unsupported path: {path[:256]}")
    doc, _, _ = gojson.load(body, float64=False)  # no map decode: numbers beyond float64 pass
    wire = gojson.checked(_WIRE, doc, "generate request")
    if wire.get("input_ids") is None:
        raise RequestError(400, "invalid generate request: input_ids must be provided")
    if wire.get("extra_key") is not None and not isinstance(wire["extra_key"], str):
        raise RequestError(400, "unsupported generate request: extra_key must be a string")
    return InferenceRequest(Api.OTHER, "", wire.get("stream") is True, "", {}, output_cap=_max_new_tokens(
        wire.get("sampling_params")), rewritable=False, token_ids=_input_ids(wire["input_ids"]),
        response=SGLANG_RESPONSES, cache_salt=wire.get("extra_key") or "")


_RESPONSE = struct("sgLangResponse", meta_info=struct(
    "meta_info", finish_reason=raw, prompt_tokens=INT, completion_tokens=INT, cached_tokens=INT))


def _count(value: Any) -> int | None:
    return value if value is not None and value >= 0 else None


def sglang_usage(doc: object, streamed: bool) -> Usage | None:
    """Usage of a ``/generate`` response (``meta_info``), or of its final stream event."""
    try:
        response = _RESPONSE(doc, "response")
    except Mismatch:
        return None
    meta = (response or {}).get("meta_info") or {}
    if streamed and meta.get("finish_reason") is None:
        return None  # only the final event (finish_reason set) has the request's counts
    if meta.get("prompt_tokens") is None and meta.get("completion_tokens") is None:
        return None
    return Usage(_count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens")),
                 _count(meta.get("cached_tokens")))


SGLANG_RESPONSES = ResponseFormat(usage=sglang_usage)
SGLANG_HTTP = register_parser(RequestParser("sglanghttp-parser", ("generate",), _parse))
