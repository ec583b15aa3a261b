"""The SSE decoder: the WHATWG parsing rules, any split of the bytes, limits, and fuzzing."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.generate import ResponseTooLargeError, SSEDecoder, SSEError, SSEEvent
from evergreen_trio.generate.errors import BackendError


def decode(data: bytes, cuts: list[int] | None = None, **limits: int) -> list[SSEEvent]:
    decoder = SSEDecoder(**limits)
    points = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts or []]})
    events: list[SSEEvent] = []
    for start, end in itertools.pairwise(points):
        events += decoder.feed(data[start:end])
    return events


def test_an_openai_stream() -> None:
    stream = b'data: {"choices":[{"text":"hi"}]}\n\ndata: [DONE]\n\n'
    assert decode(stream) == [SSEEvent('{"choices":[{"text":"hi"}]}'), SSEEvent("[DONE]")]


def test_the_whatwg_rules() -> None:
    stream = (
        b"\xef\xbb\xbf: a comment first, after a BOM\r\n"
        b"data: line one\r\n"
        b"data:line two\r"  # no space after the colon; CR alone ends a line
        b"data\n"  # a field without a colon has an empty value
        b"event: update\n"
        b"id: 7\n"
        b"retry: 100\n"
        b"unknown: ignored\n"
        b"\n"
        b"event: no data, not dispatched\n\n"
        b"data:  two spaces keep one\n\n"
        b"data: unterminated at the end"
    )
    assert decode(stream) == [
        SSEEvent("line one\nline two\n", "update", "7"),
        SSEEvent(" two spaces keep one", "message", "7"),
    ]


def test_a_crlf_split_between_feeds_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"\r") == [SSEEvent("a")]
    assert decoder.feed(b"\ndata: b\n\n") == [SSEEvent("b")]


def test_a_line_over_the_limit_is_refused_before_it_ends() -> None:
    decoder = SSEDecoder(max_line_bytes=16)
    decoder.feed(b"data: 0123456789")
    with pytest.raises(ResponseTooLargeError, match="at most 16 bytes"):
        decoder.feed(b"x")


def test_an_event_over_the_limit_is_refused() -> None:
    with pytest.raises(ResponseTooLargeError, match="at most 20"):
        decode(b"data: 0123456789\ndata: 0123456789\n\n", max_event_bytes=20)
    assert decode(b"data: 0123456789\n\ndata: 0123456789\n\n", max_event_bytes=20) == [SSEEvent("0123456789")] * 2


def test_bytes_that_are_not_utf8_are_an_sse_error() -> None:
    with pytest.raises(SSEError, match="expected UTF-8"):
        decode(b"data: \xc3\x28\n\n")


@st.composite
def events(draw: st.DrawFn) -> SSEEvent:
    line = st.text(st.characters(exclude_characters="\r\n\0", exclude_categories=["Cs"]), max_size=20)
    data = "\n".join(draw(st.lists(line, min_size=1, max_size=3)))
    return SSEEvent(data, draw(line.filter(bool)) if draw(st.booleans()) else "message", draw(line))


@given(st.lists(events(), max_size=5), st.sampled_from(["\n", "\r\n", "\r"]), st.lists(st.integers(0, 10_000)))
def test_encoded_events_decode_the_same_in_any_split(
    expected: list[SSEEvent], eol: str, cuts: list[int]
) -> None:
    """Round trip: events written with any line end, a comment each, read back in any split."""
    text = ""
    for event in expected:
        text += f": comment{eol}event: {event.event}{eol}id: {event.id}{eol}"
        text += "".join(f"data: {line}{eol}" for line in event.data.split("\n")) + eol
    assert decode(text.encode(), cuts) == expected


@pytest.mark.fuzz
@given(st.binary(max_size=2000), st.lists(st.integers(0, 2000), max_size=8))
def test_arbitrary_bytes_give_events_or_a_typed_error_whatever_the_split(data: bytes, cuts: list[int]) -> None:
    def outcome(cuts: list[int]) -> list[SSEEvent] | type[BackendError]:
        try:
            return decode(data, cuts, max_line_bytes=64, max_event_bytes=128)
        except BackendError as error:
            return type(error)

    assert outcome([]) == outcome(cuts)
