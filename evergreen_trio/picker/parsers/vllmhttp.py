"""``vllmhttp-parser`` (llm-d-router's parsers/vllmhttp): vLLM's ``/inference/v1/generate``.

It claims ``inference/v1/generate``; a path not ending so is a 400. The body is a JSON object
with a non-empty ``token_ids`` (whole numbers in 0..2**32-1; null counts as 0), and of the right
type ``cache_salt`` (a string) and ``features`` (``mm_hashes``: lists of strings by modality,
``mm_placeholders``: ``{offset, length}`` lists by modality). The prompt is the token ids;
``model`` and ``stream`` come from the body, the output cap from ``sampling_params.max_tokens``;
the target model is written into ``model``. Responses carry OpenAI-style usage.
"""

from __future__ import annotations

from collections.abc import Mapping

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers import gojson
from evergreen_trio.picker.parsers.gojson import INT, float64, map_of, slice_of, string, struct
from evergreen_trio.picker.parsers.registry import RequestParser, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest

_GENERATE_REQUEST = struct(
    "GenerateRequest", token_ids=slice_of(float64), cache_salt=string,
    features=struct("features", mm_hashes=map_of(slice_of(string)),
                    mm_placeholders=map_of(slice_of(struct("placeholder", offset=INT, length=INT)))))
_MAX_TOKEN = 2**32 - 1


def _token_ids(values: list[int | float | None]) -> list[int]:
    """GenerateRequest's token ids: each a whole number in uint32's range (null is 0)."""
    ids = []
    for i, value in enumerate(values):
        if value is None:
            value = 0
        if not 0 <= value <= _MAX_TOKEN or (isinstance(value, float) and not value.is_integer()):
            raise RequestError(400, f"invalid generate request: token_ids[{i}]: invalid value {value}")
        ids.append(int(value))
    return ids


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    if not path.endswith("inference/v1/generate"):
        raise RequestError(400, f"unsupported path: {path[:256]}")
    doc, text, model_span = gojson.load(body)
    request = gojson.checked(_GENERATE_REQUEST, doc, "generate request")
    ids = _token_ids(request.get("token_ids") or [])
    if not ids:
        raise RequestError(400, "invalid generate request: must have non-empty token_ids field")
    model = doc.get("model")
    sampling = doc.get("sampling_params")
    cap = gojson.max_output_tokens(sampling, "max_tokens") if isinstance(sampling, dict) else None
    return InferenceRequest(Api.OTHER, gojson.text(model) if isinstance(model, str) else "",
                            doc.get("stream") is True, "", doc, 0, text, model_span, cap, token_ids=ids)


VLLM_HTTP = register_parser(RequestParser("vllmhttp-parser", ("inference/v1/generate",), _parse))
