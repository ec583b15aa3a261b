"""Request bodies as the picker schedules them: :class:`InferenceRequest`, what every request
parser returns, and the OpenAI-style body (the API by path suffix, ``model``, ``stream`` and the
prompt text) that ``openai-parser`` reads.

JSON bodies are read by :func:`load_object`, with bounded work (:func:`check_json_cost`) and the
top-level ``model`` value located, so a model rewrite splices the body instead of re-serializing it.
"""

from __future__ import annotations

import enum
import json
import re
from _json import scanstring
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NoReturn

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.fast_json import json_object
from evergreen_trio.picker.gotext import GO_SPACE
from evergreen_trio.picker.guards import check_json_cost, utf8
from evergreen_trio.picker.inflight import output_cap
from evergreen_trio.picker.usage import OPENAI_RESPONSES, ResponseFormat


class Api(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    OTHER = ""


REQUEST_TYPES = (
    ("conversations", Api.OTHER), ("responses", Api.RESPONSES), ("chat/completions", Api.CHAT),
    ("chat/completions/render", Api.CHAT), ("completions", Api.COMPLETIONS), ("completions/render", Api.COMPLETIONS),
    ("embeddings", Api.EMBEDDINGS), ("images/generations", Api.OTHER),
)
"""llm-d-router's openai parser's request types by path suffix, in the order it tries them (its
``determineAPITypeFromPath``), and the API each is scheduled as."""
MAX_CACHED_APIS = 1024
"""Request paths whose type is kept at hand (they are the client's: the map is cleared when full)."""
_TYPES: dict[str, tuple[str, Api]] = {}


def bare_path(path: str) -> str:
    """``path`` without its query string and trailing slashes."""
    return path.split("?", 1)[0].rstrip("/")


def trimmed_path(path: str) -> str:
    """``path`` as the reference's MatchPathSuffix matches it: Go spaces trimmed, one trailing ``/`` off."""
    return path.strip(GO_SPACE).removesuffix("/")


def request_type(path: str) -> tuple[str, Api]:
    """The openai parser's request type for a (query-less) request path, as the reference picks it:
    the first of :data:`REQUEST_TYPES` whose suffix the path ends with, else ``completions``; and
    the API it is scheduled as."""
    found = _TYPES.get(path)
    if found is None:
        trimmed = trimmed_path(path)
        found = next(((suffix.removesuffix("/render"), api) for suffix, api in REQUEST_TYPES
                      if trimmed.endswith(suffix)), ("completions", Api.COMPLETIONS))
        if len(_TYPES) >= MAX_CACHED_APIS:
            _TYPES.clear()
        _TYPES[path] = found
    return found


def api_for_path(path: str) -> Api:
    """The API a request path is scheduled as (query string ignored)."""
    return request_type(path.split("?", 1)[0])[1]


@dataclass(frozen=True)
class InferenceRequest:
    """What scheduling needs from a body: the model (empty when the parser reads none), whether it
    streams, the prompt (text, or token ids), the client's output cap, and how the request is
    forwarded and its response read."""

    api: Api
    model: str
    stream: bool
    prompt: str
    body: Mapping[str, Any]
    prompt_bytes: int = 0
    """The prompt's length in UTF-8."""
    text: str = ""
    """The body as decoded text (what ``rewrite_model`` splices into)."""
    model_span: tuple[int, int] | None = None
    """Where the top-level ``model`` value lies in ``text``; None when the body is re-serialized instead;
    ``UNLOCATED`` when not looked for yet (``model_span_of`` looks: the default decoder's bodies)."""
    output_cap: int | None = None
    """The client's own cap on output tokens, when it set one."""
    rewritable: bool = True
    """Whether a target model is written into the forwarded body (``body`` is the JSON object sent);
    otherwise the body goes as received, and only ``x-gateway-model-name-rewrite`` names a target."""
    skip_response: bool = False
    """Route the request, then end its ext_proc stream: its response is not processed."""
    token_ids: Sequence[int] | None = None
    """A pre-tokenized prompt (``prompt`` is empty then)."""
    response: ResponseFormat = OPENAI_RESPONSES
    """How the parser reads the response's usage."""
    cache_salt: str = ""
    """A cache salt the parser read outside ``body`` (SGLang's ``extra_key``)."""

    def prompt_size(self, chars_per_token: int) -> int:
        """The prompt's size in bytes, a token prompt's at ``chars_per_token`` bytes a token (the
        token estimate divides by it)."""
        return self.prompt_bytes if self.token_ids is None else len(self.token_ids) * chars_per_token


def content_text(value: object) -> str:
    """Concatenated text of a prompt-ish value: a string, a list of strings or content parts.

    Walked with a stack, not recursion: a client's nesting depth must not reach Python's limit.
    """
    texts: list[str] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, list):
            pending.extend(reversed(item))
        elif type(item) is dict or isinstance(item, Mapping):  # a parsed body's are dicts: no ABC check
            for key in _PART_KEYS:
                part = item.get(key)
                if part is not None:
                    pending.append(part)
    return "".join(texts)


_PART_KEYS = ("input_text", "content", "text", "role")
"""A content part's members read as prompt text, pushed in this order (so read in the reverse)."""


def api_prompt(api: Api, body: Mapping[str, Any]) -> str:
    if api is Api.CHAT:
        return content_text(body.get("messages"))
    if api is Api.EMBEDDINGS:
        return content_text(body.get("input"))
    if api is Api.RESPONSES:
        return content_text(body.get("instructions")) + content_text(body.get("input"))
    prompt = body.get("prompt")
    if type(prompt) is list and all(map(isinstance, prompt, repeat(str))):
        return "".join(prompt)  # a batch of strings: C loops, as content_text's is a Python step a string
    return content_text(prompt)


def _detect_and_decode(body: bytes) -> str:
    if body[:1] == b"{" and body[1:2] != b"\x00":  # UTF-8 by json.detect_encoding's rules, without its checks
        return body.decode("utf-8", "surrogatepass")
    return body.decode(json.detect_encoding(body), "surrogatepass")


def no_constant(name: str) -> NoReturn:
    """``parse_constant`` refusing NaN, Infinity and -Infinity, which are not JSON: Go's decoder
    (the reference parsers') refuses them, where Python's would read them."""
    raise ValueError(f"{name} is not a JSON value")


_DECODER = json.JSONDecoder(parse_constant=no_constant)  # called only for those literals: free otherwise
# What _DECODER.decode runs, called here without its two Python frames.
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
UNLOCATED: tuple[int, int] = (-1, -1)
"""A ``model_span`` not looked for yet: the default decoder's bodies of at most
:data:`LAZY_SPAN_CHARS` are parsed whole by its C scanner, and the model's place is found only for
a rewrite (most requests have none)."""
LAZY_SPAN_CHARS = 8 * 1024
"""Longer bodies are walked member by member at once: a rewrite then parses them once, not twice."""


def load_object(body: bytes, decoder: json.JSONDecoder = _DECODER, decode: Callable[[bytes], str] = _detect_and_decode,
                ) -> tuple[dict[str, Any], str, tuple[int, int] | None]:
    """``body`` as a JSON object (parsed by ``decoder`` from the text ``decode`` makes of it), the
    text, and where its ``model`` value lies (see :func:`rewrite_model`); RequestError(413) for a
    body too costly to parse, RequestError(400) for one that is not a JSON object."""
    check_json_cost(body)
    model_span: tuple[int, int] | None
    try:
        text = decode(body)
        if decoder is _DECODER and len(text) <= LAZY_SPAN_CHARS:
            model_span = UNLOCATED
            doc = json_object(body)  # msgspec's, where it reads as json does
            if doc is None:
                try:  # _DECODER.decode(text), inline
                    doc, end = _SCAN(text, 0 if text[:1] == "{" else _skip(text, 0))
                    if end != len(text) and _skip(text, end) != len(text):
                        raise ValueError("extra data")
                except (ValueError, RecursionError, StopIteration):  # the walk's own error, as it always said,
                    doc, model_span = _object_and_model_span(text, decoder)  # or, a level short of the limit, its parse
        else:
            doc, model_span = _object_and_model_span(text, decoder)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, f"request body is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(doc).__name__}")
    return doc, text, model_span


def parse_body(path: str, body: bytes,
               check: Callable[[str, Mapping[str, Any]], Api] | None = None) -> InferenceRequest:
    """Parse a request body; one that is not a JSON object is a 400. A ``model`` that is not a
    string reads as none (""), as the reference's parser reads it: the picker then needs a rewrite
    header to name the target (else 400 ``model not found in request body``).

    ``check`` (the parser's checks of the object: RequestError for one it refuses, else the API
    the request is scheduled as) runs first."""
    doc, text, model_span = load_object(body)
    api = check(path, doc) if check is not None else api_for_path(path)
    model = doc.get("model")
    if not isinstance(model, str):
        model = ""
    prompt = api_prompt(api, doc)
    if not model.isascii():  # ASCII always encodes
        utf8(model, "model")
    prompt_bytes = len(prompt) if prompt.isascii() else len(utf8(prompt, "prompt"))
    return InferenceRequest(api, model, doc.get("stream") is True, prompt, doc, prompt_bytes, text, model_span,
                            output_cap(doc))


def model_span_of(request: InferenceRequest) -> tuple[int, int] | None:
    """Where ``request``'s top-level ``model`` value lies in its text (None: nowhere to splice), found
    now when the parse left it :data:`UNLOCATED`."""
    if request.model_span is UNLOCATED:
        return _object_and_model_span(request.text, _DECODER)[1]
    return request.model_span


def rewrite_model(request: InferenceRequest, model: str) -> bytes:
    """The body with its ``model`` value replaced; RequestError(400) for a lone surrogate in it.

    Where the parse found the value, only that span is replaced (the client's bytes are kept, and a
    16 MiB body costs a copy rather than a 50 ms re-serialization); otherwise the body is re-serialized.
    """
    span = model_span_of(request)
    if span is None:
        text = json.dumps({**request.body, "model": model}, separators=(",", ":"), ensure_ascii=False)
    else:
        start, end = span
        text = request.text[:start] + json.dumps(model, ensure_ascii=False) + request.text[end:]
    return utf8(text, "body")


_SPACE = re.compile(r"[ \t\n\r]*")
_WHITESPACE = " \t\n\r"
MAX_SPLICED_MEMBERS = 64
"""A body with more top-level members is parsed by ``json.loads`` and re-serialized to rewrite its
model: walking members costs Python work per member, a whole value costs C work."""


def _skip(text: str, index: int) -> int:
    """``index`` past the JSON whitespace there (most bodies have none between tokens: no match then)."""
    return _SPACE.match(text, index).end() if text[index : index + 1] in _WHITESPACE else index  # type: ignore[union-attr]


def _object_and_model_span(text: str, decoder: json.JSONDecoder) -> tuple[Any, tuple[int, int] | None]:
    """``text`` parsed by ``decoder`` (ValueError if it is not JSON), and where a top-level object's
    last ``model`` value lies (None for anything else, or an object of many members).

    Values are read by the decoder's C scanner (``scan_once``: the value at an index, and where it
    ends); the top-level object is built from its members by the decoder's ``object_pairs_hook``.
    """
    start = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text[start : start + 1] != "{":
        return decoder.decode(text), None
    pairs: list[tuple[str, Any]] = []
    span = None
    index = _skip(text, start + 1)
    if text[index : index + 1] == "}":
        index = _skip(text, index + 1)
    else:
        for _ in range(MAX_SPLICED_MEMBERS):
            if text[index : index + 1] != '"':
                raise ValueError(f"expected a member name at {index}")
            key, index = scanstring(text, index + 1)
            index = _skip(text, index)
            if text[index : index + 1] != ":":
                raise ValueError(f"expected ':' at {index}")
            index = _skip(text, index + 1)
            try:
                value, end = decoder.scan_once(text, index)  # type: ignore[attr-defined]
            except StopIteration:
                raise ValueError(f"expected a value at {index}") from None
            pairs.append((key, value))
            if key == "model":
                span = (index, end)
            index = _skip(text, end)
            separator = text[index : index + 1]
            index = _skip(text, index + 1)
            if separator == "}":
                break
            if separator != ",":
                raise ValueError(f"expected ',' or '}}' at {index}")
        else:
            return decoder.decode(text), None
    if index != len(text):
        raise ValueError(f"extra data at {index}")
    hook = decoder.object_pairs_hook
    return (hook(pairs) if hook is not None else dict(pairs)), span
