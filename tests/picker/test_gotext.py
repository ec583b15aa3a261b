"""Go's text rules for header values (``evergreen_trio.picker.gotext``): ``strings.TrimSpace`` of a
value's raw bytes against a model that strips whole UTF-8 encoded space runes, and the value's text."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.gotext import GO_SPACE, header_text, trim_space

SPACE_RUNES = [space.encode() for space in GO_SPACE]  # unicode.IsSpace's runes, UTF-8 encoded
# Bytes near the edges of the rule: runes Go trims, bytes str.strip would trim and Go does not
# (C0 separators, a lone NEL or NBSP byte, a truncated rune), and plain ones.
PIECES = st.sampled_from([*SPACE_RUNES, b"\x1c", b"\x1f", b"\x85", b"\xa0", b"\xc2", b"\xe2\x80", b"\x00",
                          b"a", b"\xc3\xa9", b"\xff"])
RAW = st.one_of(st.binary(max_size=12), st.lists(PIECES, max_size=8).map(b"".join))


def go_trim_space(raw: bytes) -> bytes:
    """A model of ``strings.TrimSpace`` on bytes: whole encoded space runes off each end."""
    while (rune := next((r for r in SPACE_RUNES if raw.startswith(r)), None)) is not None:
        raw = raw[len(rune):]
    while (rune := next((r for r in SPACE_RUNES if raw.endswith(r)), None)) is not None:
        raw = raw[: -len(rune)]
    return raw


@given(RAW)
def test_trim_space_trims_the_raw_bytes_as_go(raw: bytes) -> None:
    assert trim_space(raw.decode("latin-1")).encode("latin-1") == go_trim_space(raw)


@given(st.text(alphabet=st.sampled_from([*GO_SPACE, "\x1f", "a", "é", "Ā", "€"]), max_size=8))
def test_a_value_beyond_latin_1_is_text_and_trimmed_as_text(text: str) -> None:
    if not text.isascii() and any(ord(c) > 0xFF for c in text):
        assert trim_space(text) == text.strip(GO_SPACE)


@given(RAW)
def test_header_text_is_the_utf_8_the_bytes_encode_or_none(raw: bytes) -> None:
    try:
        want: str | None = raw.decode("utf-8")
    except UnicodeDecodeError:
        want = None
    assert header_text(raw.decode("latin-1")) == want


def test_the_cases_where_go_and_str_strip_differ() -> None:
    assert trim_space(" \t a \r\n") == "a"
    assert trim_space("\x1fa\x1f") == "\x1fa\x1f"  # str.strip would take the separators
    assert trim_space("\x85a\xa0") == "\x85a\xa0"  # lone bytes: no rune
    assert trim_space("\xc2\xa0a\xe3\x80\x80") == "a"  # NBSP and IDEOGRAPHIC SPACE, UTF-8 encoded
