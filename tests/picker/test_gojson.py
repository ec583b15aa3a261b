"""The Go ``encoding/json`` rules the request parsers share (``parsers/gojson.py``)."""

from __future__ import annotations

import pytest

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers import gojson


@pytest.mark.parametrize("body", [b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e400}', b'{"a": [' + b"9" * 400 + b"]}",
                                  b"\xef\xbb\xbf{}", b'{"a":1} x', b"[]"])
def test_load_refuses_what_a_go_map_decode_refuses(body: bytes) -> None:
    with pytest.raises(RequestError) as caught:
        gojson.load(body)
    assert caught.value.status == 400


def test_load_keeps_repeated_members_and_replaces_bad_utf8() -> None:
    doc, text, span = gojson.load(b'{"model":"a","x":{"k":1,"k":2},"model":"b\xff"}')
    assert doc == {"model": "b\ufffd", "x": {"k": 2}} and text[span[0]:span[1]] == '"b\ufffd"'  # type: ignore[index]
    assert list(gojson.members(doc["x"])) == [("k", 1), ("k", 2)]
    assert gojson.load(b'{"a": 1e400}', float64=False)[0] == {"a": float("inf")}  # no map decode: it passes


def test_struct_fields_fold_case_every_member_counts_and_null_is_zero() -> None:
    spec = gojson.struct("T", stream=gojson.boolean, name=gojson.string, ids=gojson.slice_of(gojson.UINT32))
    doc = gojson.load('{"STREAM": true, "\u017ftream": false, "Name": null, "ids": [1, null], "other": 5}'.encode())[0]
    assert spec(doc, "t") == {"stream": False, "name": None, "ids": [1, None]}
    with pytest.raises(gojson.Mismatch, match=r"t\.stream of type bool"):
        spec(gojson.load(b'{"stream": "yes", "stream": true}')[0], "t")  # a repeated key is decoded each time
    for bad in (b'{"ids": [1.0]}', b'{"ids": [-1]}', b'{"ids": [4294967296]}', b'{"ids": {}}', b'{"ids": [true]}'):
        with pytest.raises(gojson.Mismatch):
            spec(gojson.load(bad)[0], "t")


def test_text_replaces_lone_surrogates_only() -> None:
    assert gojson.text("a\ud800b\U0001f600") == "a\ufffdb\U0001f600"
    assert gojson.max_output_tokens({"a": -1, "b": 2.5, "c": True, "d": 7.0}, "a", "b", "c", "d") == 7
