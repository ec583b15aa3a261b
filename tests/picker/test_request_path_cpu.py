"""The request path's shortcuts (docs/picker.md, "CPU per request") answer as the longer ways they replace."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.pickers import max_score
from evergreen_trio.picker.request import _detect_and_decode, load_object

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
