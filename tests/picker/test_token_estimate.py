"""The ``estimate`` token backend (llm-d-router's estimate.go, mm_estimate.go): the reference's own
test tables, then properties (token counts monotone in the prompt, features in order and inside
the stream, hostile bodies bounded)."""

from __future__ import annotations

import base64
import struct
import sys
import zlib
from types import FrameType
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from evergreen_trio.picker import image_size
from evergreen_trio.picker.image_size import base64_image_size, data_url_image_size
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.request import Api, api_prompt, content_text
from evergreen_trio.picker.token_estimate import (
    MAX_PLACEHOLDERS,
    MAX_PROMPTS,
    Estimator,
    ImageEstimate,
    VideoEstimate,
    VideoMeta,
    estimate,
    video_meta,
)

# A 64x32 RGBA PNG (estimate_test.go's pngBase64Raw): 64*32/1024 = 2 placeholder tokens.
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAEAAAAAgCAIAAAAt/+nTAAAARUlEQVR4nOzP0QnAUAzDwBSy/8zlTSECdxj/a2fmu7x9d5mAmoCagJqAmoCagJ"
       "qAmoCagJqAmoCagJqAmoCagJqAmoCagNofAAD//57WAN8yR4QZAAAAAElFTkSuQmCC")
PNG_URL = "data:image/png;base64," + PNG
DEFAULT = Estimator()


def chat(*parts: dict[str, Any], tools: list[Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": list(parts)}]}
    if tools is not None:
        body["tools"] = tools
    return body


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def video(url: str = "https://example.com/clip.mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def produce(body: dict[str, Any], protocol: str = "chat", estimator: Estimator = DEFAULT,
            headers: dict[str, str] | None = None) -> Any:
    result = estimate(estimator, protocol, body, headers or {})
    assert result is not None
    return result


def first_length(body: dict[str, Any], estimator: Estimator = DEFAULT, headers: dict[str, str] | None = None) -> int:
    (feature,) = produce(body, estimator=estimator, headers=headers).prompts[0].features
    return int(feature.length)


# -- llm-d-router's tests (dataproducer/tokenizer/estimate_test.go) -------------------------------


def test_packed_tokens_hash_as_the_raw_bytes() -> None:
    raw = "the quick brown fox jumps over!!"
    ids = produce({"prompt": raw}, "completions").prompts[0].token_ids()
    assert len(ids) == len(raw) // 4
    packed = b"".join(i.to_bytes(4, "little") for i in ids)
    assert xxhash.xxh64_intdigest(packed) == xxhash.xxh64_intdigest(raw.encode())


@pytest.mark.parametrize(("protocol", "body", "ids"), [
    ("completions", {"prompt": [11, 22, 33]}, [11, 22, 33]),
    ("embeddings", {"input": [4, 5]}, [4, 5]),
])
def test_token_id_prompts_pass_through(protocol: str, body: dict[str, Any], ids: list[int]) -> None:
    assert produce(body, protocol).prompts[0].token_ids() == ids


def test_completions_are_deterministic_and_distinct() -> None:
    def ids(text: str) -> list[int]:
        return list(produce({"prompt": text}, "completions").prompts[0].token_ids())
    assert ids("hello world") == ids("hello world") != ids("hello there")


def test_a_chat_image_is_a_feature_of_weighted_placeholders_inside_the_stream() -> None:
    tokens = produce(chat({"type": "text", "text": "describe this"}, image(PNG_URL)))
    (feature,) = tokens.prompts[0].features
    digest = xxhash.xxh64_intdigest(PNG_URL.encode())
    assert (feature.modality, feature.hash, feature.length) == ("image", format(digest, "x"), 2)
    ids = tokens.prompts[0].token_ids()
    assert feature.offset + feature.length <= len(ids)
    assert ids[feature.offset : feature.offset + feature.length] == [digest & 0xFFFFFFFF] * 2


@pytest.mark.parametrize(("part", "modality"), [
    (image("https://example.com/a.png"), "image"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    (video(), "video"),
])
def test_modality_labels(part: dict[str, Any], modality: str) -> None:
    (feature,) = produce(chat(part)).prompts[0].features
    assert feature.modality == modality


def test_image_weighting_follows_the_decoded_size() -> None:
    assert first_length(chat(image("https://example.com/a.png"))) == 640 * 360 // 1024
    assert first_length(chat(image(PNG_URL))) == 2


@pytest.mark.parametrize(("estimator", "url", "length"), [
    (Estimator(ImageEstimate(mode="static", static_tokens=7)), PNG_URL, 7),
    (Estimator(ImageEstimate(factor=2048)), "https://example.com/a.png", 640 * 360 // 2048),
    (Estimator(ImageEstimate(default_width=1024, default_height=1024)), "https://example.com/a.png", 1024),
])
def test_image_estimator_knobs(estimator: Estimator, url: str, length: int) -> None:
    assert first_length(chat(image(url)), estimator) == length


@pytest.mark.parametrize(("knobs", "length"), [
    ({}, 20 * 225),  # 10 s at 2 fps, 640x360 / 1024 a frame
    ({"tokens_mode": "static", "static_tokens": 100}, 20 * 100),
    ({"factor": 2048}, 20 * (640 * 360 // 2048)),
    ({"default_duration": 8, "sample_fps": 2, "tokens_mode": "static", "static_tokens": 10}, 8 * 2 * 10),
    ({"default_duration": 10, "frames_mode": "strided", "max_frames": 16, "source_fps": 24, "frame_stride": 4,
      "tokens_mode": "static", "static_tokens": 100}, 16 * 100),
    ({"default_duration": 1, "frames_mode": "strided", "min_frames": 8, "source_fps": 24, "frame_stride": 4,
      "tokens_mode": "static", "static_tokens": 100}, 8 * 100),
    ({"max_video_tokens": 500}, 500),
    ({"default_width": 640, "default_height": 480, "default_duration": 10, "factor": 1024, "sample_fps": 2,
      "max_video_tokens": 100000}, 20 * (640 * 480 // 1024)),  # qwen3-shaped
    ({"default_duration": 10, "tokens_mode": "static", "static_tokens": 256, "frames_mode": "strided",
      "max_frames": 16, "source_fps": 24, "frame_stride": 4}, 16 * 256),  # gemma4-shaped
])
def test_video_estimator_table(knobs: dict[str, Any], length: int) -> None:
    assert first_length(chat(video()), Estimator(video=VideoEstimate(**knobs))) == length


@pytest.mark.parametrize(("headers", "meta"), [
    ({"x-llm-d-video-fps": "30", "x-llm-d-video-duration-seconds": "12.5", "x-llm-d-video-resolution": "1920x1080"},
     VideoMeta(1920, 1080, 12.5, 30)),
    ({"x-llm-d-video-resolution": "640x360"}, VideoMeta(640, 360)),
    ({"x-llm-d-video-resolution": "1280X720"}, VideoMeta(1280, 720)),
    ({"x-llm-d-video-resolution": " 800 x 600 "}, VideoMeta(800, 600)),
    ({}, VideoMeta()),
    ({"x-llm-d-video-fps": "abc", "x-llm-d-video-duration-seconds": "", "x-llm-d-video-resolution": "not-a-res"},
     VideoMeta()),
    ({"x-llm-d-video-fps": "-1", "x-llm-d-video-duration-seconds": "0", "x-llm-d-video-resolution": "0x0"},
     VideoMeta()),
    ({"x-llm-d-video-resolution": "1920x"}, VideoMeta()),
])
def test_video_metadata_headers(headers: dict[str, str], meta: VideoMeta) -> None:
    assert video_meta(headers) == meta


def test_video_headers_override_the_config_and_respect_the_caps() -> None:
    headers = {"x-llm-d-video-duration-seconds": "4", "x-llm-d-video-resolution": "1024x1024"}
    assert first_length(chat(video()), headers=headers) == 4 * 2 * 1024  # 8 frames, 1024 tokens a frame
    strided = Estimator(video=VideoEstimate(frames_mode="strided", tokens_mode="static", static_tokens=1))
    assert first_length(chat(video()), strided, {"x-llm-d-video-fps": "5"}) == 10 * 5
    sampled = Estimator(video=VideoEstimate(tokens_mode="static", static_tokens=1))
    assert first_length(chat(video()), sampled, {"x-llm-d-video-fps": "5"}) == 20  # sampleFPS is the model's
    merged = Estimator(video=VideoEstimate(tokens_mode="static", static_tokens=1, min_frames=30, temporal_patch_size=2))
    assert first_length(chat(video()), merged) == 15
    capped = Estimator(video=VideoEstimate(max_video_tokens=100))
    assert first_length(chat(video()), capped, headers) == 100


def messages(*blocks: dict[str, Any], system: Any = None, tools: list[Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": list(blocks)}]}
    if system is not None:
        body["system"] = system
    if tools is not None:
        body["tools"] = tools
    return body


def test_anthropic_images_key_on_their_content() -> None:
    base64_image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    (feature,) = produce(messages(base64_image), "messages").prompts[0].features
    assert (feature.hash, feature.length) == (format(xxhash.xxh64_intdigest(PNG.encode()), "x"), 2)
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    (feature,) = produce(messages(url_image), "messages").prompts[0].features
    assert feature.hash == format(xxhash.xxh64_intdigest(b"https://example.com/a.png"), "x")


@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_tools_come_first_and_change_the_prefix(protocol: str) -> None:
    tool = {"type": "function", "function": {"name": "get_weather"}} if protocol == "chat" else {"name": "w"}
    build = chat if protocol == "chat" else messages
    text = {"type": "text", "text": "hi"}
    plain = produce(build(text), protocol).prompts[0].token_ids()
    with_tools = produce(build(text, tools=[tool]), protocol).prompts[0].token_ids()
    assert with_tools[: 2] != plain[: 2] and len(with_tools) > len(plain)
    raw = b"".join(i.to_bytes(4, "little") for i in with_tools)
    assert raw.startswith(b'[{"function":{"name":"get_weather"},"type":"function"}]' if protocol == "chat"
                          else b'[{"name":"w"}]')


def test_anthropic_system_drops_the_billing_header_and_tool_blocks_count() -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: 123"}, {"type": "text", "text": "sys"}]
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}
    raw = b"".join(i.to_bytes(4, "little") for i in produce(messages(use, system=system), "messages")
                   .prompts[0].token_ids())
    assert raw.rstrip(b"\0") == b'sysusert1f{"b":1,"a":2}'


@pytest.mark.parametrize(("protocol", "body"), [
    ("completions", {"prompt": "hello"}),
    ("embeddings", {"input": "hello"}),
    ("responses", {"input": "hello", "instructions": "be brief"}),
    ("conversations", {"items": [{"type": "message", "role": "user", "content": "hi"}]}),
])
def test_non_chat_bodies_have_no_features(protocol: str, body: dict[str, Any]) -> None:
    tokens = produce(body, protocol)
    assert tokens.token_count > 0 and not tokens.multimodal


def test_go_marshalled_bodies_match_the_reference_bytes() -> None:
    def text(protocol: str, body: dict[str, Any]) -> bytes:
        ids = produce(body, protocol).prompts[0].token_ids()
        return b"".join(i.to_bytes(4, "little") for i in ids).rstrip(b"\0")
    assert text("embeddings", {"input": "hi"}) == b'{"Raw":"hi","Strings":null,"TokenIDs":null}'
    assert text("responses", {"input": "a<b", "instructions": 1.0}) == b'[{"instructions":1},{"input":"a\\u003cb"}]'
    assert text("conversations", {"items": [{"content": "c", "role": "user"}]}) == b'[{"role":"user","content":"c"}]'


def test_multi_string_completions_are_one_prompt_each() -> None:
    tokens = produce({"prompt": ["alpha", "beta"]}, "completions")
    assert [p.token_count for p in tokens.prompts] == [2, 1]
    single = produce({"prompt": ["alpha"]}, "completions")
    assert len(single.prompts) == 1 and single.prompts[0].token_count == 2


def _python_steps(run: Any) -> int:
    """Python lines ``run()`` executes (a C loop's items count none)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        count += event == "line"
        return trace

    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
    return count


def test_prompts_past_the_cap_cost_no_python_work_and_are_packed_as_one() -> None:
    """A body of 250k tiny prompts held the routing thread ~1 s (a packing and a hash chain each):
    past MAX_PROMPTS they are one prompt, and the Python lines run to read, pack and hash a request
    stop growing with its prompts."""
    def route(count: int) -> None:
        body = {"prompt": ["ab"] * count}
        block_hashes("m", estimate(DEFAULT, "completions", body, {}), 16, 256)
        api_prompt(Api.COMPLETIONS, body)

    route(10 * MAX_PROMPTS)  # first-use work (caches, lazy imports) out of the count
    # 10x and 100x (both rests fill the 256 blocks hashed a prompt): per-prompt work would cost the
    # second ten times the lines; a few lines either way are the collector's callbacks and the like.
    small, large = _python_steps(lambda: route(10 * MAX_PROMPTS)), _python_steps(lambda: route(100 * MAX_PROMPTS))
    assert large <= small + small // 100
    tokens = produce({"prompt": [f"{i:04d}" for i in range(MAX_PROMPTS + 100)]}, "completions")
    assert len(tokens.prompts) == MAX_PROMPTS + 1
    assert [p.token_count for p in tokens.prompts[-2:]] == [1, 100]  # the rest: 400 bytes, packed as one
    assert tokens.prompts[-1].token_ids()[0] == int.from_bytes(f"{MAX_PROMPTS:04d}".encode(), "little")
    assert len(block_hashes("m", tokens, 16, 256)) == MAX_PROMPTS + 7  # 100 tokens: 7 blocks of 16
    prompts = ["ab", "c\u00e9"] * 1000
    assert api_prompt(Api.COMPLETIONS, {"prompt": prompts}) == content_text(prompts)


def test_an_empty_prompt_or_unknown_protocol_has_no_tokens() -> None:
    assert estimate(DEFAULT, "completions", {"prompt": ""}, {}) is None
    assert estimate(DEFAULT, "", {"prompt": "x"}, {}) is None


def test_the_cache_salt_is_kept() -> None:
    assert produce({"prompt": "x", "cache_salt": "tenant"}, "completions").cache_salt == "tenant"


# -- image headers (Go's image.DecodeConfig) ------------------------------------------------------


def _png(width: int, height: int, depth: int = 8, color: int = 6) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    palette = struct.pack(">I", 3) + b"PLTE\0\0\0" + struct.pack(">I", zlib.crc32(b"PLTE\0\0\0")) if color == 3 else b""
    return b"\x89PNG\r\n\x1a\n" + chunk + palette


def _gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\0" * 6


def _jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\0" * 9
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


@given(st.sampled_from([_png, _gif, _jpeg]), st.integers(1, 65535), st.integers(1, 65535))
def test_image_headers_give_their_size(make: Any, width: int, height: int) -> None:
    assert base64_image_size(base64.b64encode(make(width, height)).decode()) == (width, height)


@pytest.mark.parametrize("data", [
    b"", b"not an image", _png(0, 5), _png(5, 5, depth=3), _png(5, 5, color=3)[:-1], _gif(0, 0),
    _jpeg(5, 5).replace(b"\xff\xc0", b"\xff\xc3"), _png(5, 5)[:20],
])
def test_bad_or_cut_headers_have_no_size(data: bytes) -> None:
    assert base64_image_size(base64.b64encode(data).decode()) is None


def test_a_paletted_png_is_read_through_its_palette() -> None:
    assert base64_image_size(base64.b64encode(_png(3, 4, color=3)).decode()) == (3, 4)


def test_only_base64_data_urls_are_decoded() -> None:
    assert data_url_image_size(PNG_URL) == (64, 32)
    assert data_url_image_size("https://example.com/" + PNG) is None
    assert data_url_image_size("data:image/png," + PNG) is None
    assert data_url_image_size("data:image/png;base64,***") is None


def test_a_requests_images_share_a_bounded_number_of_header_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stray bytes before a JPEG marker are read one at a time: 1 MiB of them was a million
    # Python reads, and a 16 MiB body of such images held the routing thread for seconds.
    reads = 0
    read = image_size._Reader.read

    def counted(reader: Any, size: int) -> bytes:
        nonlocal reads
        reads += 1
        return read(reader, size)

    monkeypatch.setattr(image_size._Reader, "read", counted)
    stray = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8" + bytes(1 << 20)).decode()
    result = estimate(DEFAULT, "chat", chat(*[{"type": "image_url", "image_url": {"url": stray}}] * 4,
                                            {"type": "image_url", "image_url": {"url": PNG_URL}}), {})
    assert result is not None and len(result.prompts[0].features) == 5
    assert reads <= image_size.MAX_HEADER_READS + 5 < 4_000_000  # 4 million reads before the budget
    assert data_url_image_size(PNG_URL) == (64, 32)  # another request's images have their own budget


# -- properties -----------------------------------------------------------------------------------

_texts = st.text(max_size=200)


@given(_texts, _texts)
def test_the_token_count_is_monotone_in_the_prompt(prefix: str, more: str) -> None:
    def count(text: str) -> int:
        result = estimate(DEFAULT, "completions", {"prompt": text}, {})
        return result.token_count if result is not None else 0
    assert count(prefix) <= count(prefix + more)


_parts = st.lists(st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _texts),
    st.builds(image, st.sampled_from([PNG_URL, "https://example.com/x.png", "data:image/png;base64,AAAA"])),
    st.just(video()),
    st.builds(lambda d: {"type": "input_audio", "input_audio": {"data": d, "format": "wav"}}, _texts)), max_size=8)


@given(_parts)
def test_features_are_sorted_and_inside_the_stream(parts: list[dict[str, Any]]) -> None:
    tokens = estimate(DEFAULT, "chat", chat(*parts), {})
    assert tokens is not None  # the role alone is a token
    (prompt,) = tokens.prompts
    offsets = [f.offset for f in prompt.features]
    assert offsets == sorted(offsets)
    assert all(f.offset + f.length <= prompt.token_count and f.length >= 1 for f in prompt.features)
    assert tokens.multimodal == bool(prompt.features)


@settings(max_examples=20)
@given(st.integers(0, 2**70), st.integers(0, 2**70))
def test_absurd_video_headers_are_bounded(width: int, height: int) -> None:
    tokens = produce(chat(video()), headers={"x-llm-d-video-resolution": f"{width}x{height}",
                                            "x-llm-d-video-duration-seconds": "1e300"})
    (feature,) = tokens.prompts[0].features
    assert 1 <= feature.length <= MAX_PLACEHOLDERS
    assert len(tokens.prompts[0].token_ids(limit=10)) <= 10  # placeholders are counted, not stored


def test_hostile_bodies_are_bounded() -> None:
    huge = "data:image/png;base64," + base64.b64encode(_png(7, 9) + b"\0" * (8 << 20)).decode()
    assert first_length(chat(image(huge))) == 1  # 7x9 read from the header alone
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    assert produce(chat({"type": "text", "text": "x"}, tools=[deep])).token_count > 5000 // 4
    many = produce(chat(*[image("https://example.com/a.png")] * 2000))
    assert len(many.prompts[0].features) == 2000
