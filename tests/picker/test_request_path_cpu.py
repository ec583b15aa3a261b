"""The request path's shortcuts (docs/picker.md, "CPU per request") answer as the longer ways they replace."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections.abc import Callable
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker import processor as processor_module
from evergreen_trio.picker import request as request_module
from evergreen_trio.picker import usage as usage_module
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.fast_json import MAX_DEPTH, json_object, loads
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.pickers import max_score
from evergreen_trio.picker.processor import MAX_PLAIN_DECISIONS, Picker, Route
from evergreen_trio.picker.request import _detect_and_decode, load_object
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import ResponseBody

ADDRESSES = st.sampled_from(["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "[fd00::1]:8000", "h:1"])


@given(st.dictionaries(ADDRESSES, st.sampled_from([0.0, 0.5, 1.0, 2.5])), st.integers(1, 4), st.integers(0, 99))
def test_max_score_draws_and_orders_as_sorting_by_a_drawing_key(scores: dict[str, float], count: int,
                                                                  seed: int) -> None:
    ours, theirs = random.Random(seed), random.Random(seed)
    expected = sorted(scores, key=lambda a: (scores[a], theirs.random()), reverse=True)[:count]
    assert max_score(ours, scores, count) == expected
    assert ours.random() == theirs.random()  # as many draws, in the same order


@given(st.lists(st.tuples(ADDRESSES, st.booleans())), st.lists(ADDRESSES))
def test_request_counts_are_each_endpoints_requests(dispatches: list[tuple[str, bool]], asked: list[str]) -> None:
    load = InflightLoad()
    for address, released in dispatches:
        ticket = load.dispatch(address, 10)
        if released:
            ticket.release()
    assert load.request_counts(asked) == {a: load.requests(a) for a in asked}


@given(st.binary(max_size=8) | st.binary(max_size=6).map(lambda b: b"{" + b))
def test_a_brace_body_decodes_as_json_detect_encoding_says(body: bytes) -> None:
    def detected() -> str:
        return body.decode(json.detect_encoding(body), "surrogatepass")

    try:
        expected: str | type[Exception] = detected()
    except UnicodeDecodeError:
        expected = UnicodeDecodeError
    if expected is UnicodeDecodeError:
        with pytest.raises(UnicodeDecodeError):
            _detect_and_decode(body)
    else:
        assert _detect_and_decode(body) == expected


JSON_TEXT = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3),
                         max_leaves=6).map(json.dumps)


@given(JSON_TEXT | st.text(alphabet='{}[]":, \t\nmodel01a', max_size=30), st.sampled_from(["", " ", "\n\t"]))
def test_the_inline_scan_reads_and_refuses_as_the_member_walk(text: str, space: str) -> None:
    """The default decoder's small bodies are scanned whole; a decoder of one's own is walked member
    by member (as every body was once): the same object, or the same 400."""
    body = (space + text + space).encode()

    def read(decoder: json.JSONDecoder | None) -> tuple[object, ...]:
        try:
            doc, decoded, _ = load_object(body, decoder) if decoder is not None else load_object(body)
        except RequestError as exc:
            return ("refused", exc.status, exc.message)
        return ("read", doc, decoded)

    assert read(None) == read(json.JSONDecoder())


def _exact(value: object) -> object:
    """``value`` with its types spelled out: 1, 1.0 and True differ, so do 0.0 and -0.0, and member order."""
    if isinstance(value, dict):
        return ("object", [(key, _exact(item)) for key, item in value.items()])
    if isinstance(value, list):
        return ("array", [_exact(item) for item in value])
    if isinstance(value, float):
        return ("float", value.hex() if value == value else "nan")
    return (type(value).__name__, value)


_HOSTILE_SCALARS = (st.none() | st.booleans() | st.floats() | st.integers()
                    | st.integers(10**18, 10**19).map(lambda n: n * 10**300)  # past int64, past float range
                    | st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, int("9" * 4300),
                                      float("nan"), float("inf"), -0.0, 1e308, 5e-324])
                    | st.text(st.characters(codec=None), max_size=6)  # lone surrogates among them
                    | st.just("model"))  # the target model a response's rewrite replaces
_NAMES = st.sampled_from(["model", "a", "", "\ud800", "prompt_tokens", "completion_tokens"])
_HOSTILE_VALUES = st.recursive(
    _HOSTILE_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.lists(st.tuples(_NAMES, inner), max_size=3),
    max_leaves=8)


def _json_text(value: object, ascii_only: bool) -> str:
    """``value`` as JSON text; a list of pairs is an object, duplicate names kept."""
    if isinstance(value, list) and value and all(isinstance(p, tuple) for p in value):
        return "{" + ",".join(json.dumps(k, ensure_ascii=ascii_only) + ":" + _json_text(v, ascii_only)
                              for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_json_text(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def _object_text(pairs: list[tuple[str, object]], ascii_only: bool) -> bytes:
    return _json_text([("_", 0), *pairs], ascii_only).encode("utf-8", "surrogatepass")


_MEMBERS = st.lists(st.tuples(st.sampled_from(["model", "messages", "x", "usage"]), _HOSTILE_VALUES), max_size=4)
_USAGE = st.lists(st.tuples(st.sampled_from(["prompt_tokens", "completion_tokens", "total_tokens"]), _HOSTILE_SCALARS),
                  max_size=3).map(lambda counts: [("model", "model"), ("usage", [("_", 0), *counts])])
_HOSTILE_BODIES = st.one_of(
    st.builds(_object_text, _MEMBERS, st.booleans()),
    st.builds(_object_text, _USAGE, st.booleans()),  # a response's usage
    st.text(alphabet='{}[]":,. \t\n\x00\x0c-+eE019aNInf\\u\u00e9', max_size=40).map(lambda t: ("{" + t).encode()),
    st.binary(max_size=40).map(lambda b: b"{" + b),
)


@given(_HOSTILE_BODIES)
def test_msgspec_reads_a_body_as_json_does_or_leaves_it_to_json(body: bytes) -> None:
    """What msgspec reads of a body starting with ``{`` is exactly what json reads (duplicate names,
    big numbers, surrogates, NaN, control bytes among the inputs); load_object's document, text or
    400 are the same with it as without it, and so is what a response body's reader makes of it."""
    fast = json_object(body)
    if fast is not None:
        assert _exact(fast) == _exact(json.loads(body))
    assert _read(body, fast_path=True, exact=_exact) == _read(body, fast_path=False, exact=_exact)
    for sse in (False, True):
        assert _response_read(body, sse, fast_path=True) == _response_read(body, sse, fast_path=False)


def _response_read(body: bytes, sse: bool, *, fast_path: bool) -> tuple[object, ...]:
    """What a response body's reader passes on, and the usage it read, with or without msgspec."""
    if sse:
        body = b"data: " + body + b"\n\ndata: [DONE]\n\n"
    with mock.patch.object(usage_module, "loads", loads if fast_path else json.loads):
        reader = ResponseBody(sse=sse, rewrite=("model", "client"), max_bytes=1 << 20)
        out = reader.feed(body) + reader.finish()
    return out, reader.usage, reader.rewritten


def _read(body: bytes, *, fast_path: bool, exact: Callable[[object], object]) -> tuple[object, ...]:
    """load_object's answer, with or without msgspec: ``exact`` of the document, the text and span, or the 400."""
    with mock.patch.object(request_module, "json_object", json_object if fast_path else lambda body: None):
        try:
            doc, text, span = load_object(body)
        except RequestError as exc:
            return ("refused", exc.status, exc.message)
    return ("read", exact(doc), text, span)


@pytest.mark.parametrize("opening", ["[", '{"k":'])
def test_msgspec_gives_up_on_nesting_no_later_than_json(opening: str) -> None:
    """Near Python's recursion limit each depth is read, or refused, as json alone reads it."""
    closing = "]" if opening == "[" else "}"
    limit = sys.getrecursionlimit()
    for depth in range(limit - 150, limit + 10):
        body = ('{"m":' + opening * depth + "1" + closing * depth + "}").encode()
        assert _read(body, fast_path=True, exact=type) == _read(body, fast_path=False, exact=type), depth


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1])
def test_msgspec_reads_nesting_within_its_bound(depth: int) -> None:
    """A body as deep as the bound is msgspec's to read; one that could be deeper is json's."""
    nested = ('{"m":' + "[" * depth + "1" + "]" * depth + "}").encode()
    assert (json_object(nested) is not None) == (depth < MAX_DEPTH)
    assert json_object(nested) in (None, json.loads(nested))


_ROUTES = st.builds(
    Route,
    endpoints=st.lists(ADDRESSES, min_size=1, max_size=3, unique=True),
    body=st.none() | st.just(b'{"model":"b"}'),
    scores=st.none().map(lambda _: {}) | st.dictionaries(ADDRESSES, st.sampled_from([0.0, 0.5]), max_size=2),
    request_headers=st.none().map(lambda _: {}) | st.just({"x-prefiller-host-port": "10.0.0.9:8000"}),
)
_REQUEST_HEADERS = st.dictionaries(st.sampled_from(["content-length", "x-gateway-destination-endpoint-fallback",
                                                    "x-gateway-model-name-rewrite", "accept"]), st.just("1"))


@given(st.sampled_from(["single", "fallback", "list"]),
       st.lists(st.tuples(_ROUTES, st.sampled_from(["headers", "body"]), _REQUEST_HEADERS), min_size=1, max_size=8),
       st.sampled_from([1, 2, MAX_PLAIN_DECISIONS]))
def test_a_routing_reply_parsed_back_from_its_bytes_is_the_one_built(
        mode: str, decisions: list[tuple[Route, str, dict[str, str]]], kept: int) -> None:
    """A plain routing reply made from the bytes kept for its destination equals, message and bytes,
    the one built field by field for this route (the first time, again, and after the map is cleared)."""
    picker = Picker(parse_config(f"pool: {{endpoints: ['10.0.0.1:8000']}}\nextProc: {{destinationMode: {mode}}}"),
                    PoolSnapshot([], 2.0, lambda: 0.0))
    # each route beside its plain self (no body, scores or headers to set) and each without the
    # request's headers: the same destinations, some plain, some not
    cases = [(r, phase, h) for route, phase, headers in decisions
             for r in (route, dataclasses.replace(route, body=None, scores={}, request_headers={}))
             for h in (headers, {})]
    with mock.patch.object(processor_module, "MAX_PLAIN_DECISIONS", kept):
        for route, phase, headers in cases * 2:
            stream = picker.new_stream()
            stream.headers = headers
            endpoints = route.endpoints
            value = ",".join(endpoints) if mode == "list" else endpoints[0]
            fallback = endpoints[1] if mode == "fallback" and len(endpoints) > 1 else None
            built = stream._routing_reply(route, phase, value, fallback)
            reply = stream._decision(route, phase)
            assert reply == built
            assert reply.SerializeToString(deterministic=True) == built.SerializeToString(deterministic=True)
    assert len(picker.plain_decisions) <= kept
