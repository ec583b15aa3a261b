"""llm-d-router's ``estimate`` token backend: a prompt's pseudo-tokens without a tokenizer.

As estimate.go and mm_estimate.go: the request's text is packed four bytes to a little-endian
uint32 token (the tail zero-padded); each image, video or audio part is aligned to a token and
stands for N placeholder tokens (its xxhash64's low 32 bits, repeated), reported as a
:class:`MultiModalFeature` at that offset. Images count width x height / factor tokens (the size
decoded from a base64 data URL's header, else a default), videos frames x tokens per frame
(from the ``x-llm-d-video-*`` headers, the config, then defaults). Token ids are kept as
segments (text bytes, placeholder runs), so a placeholder count costs no memory.

Pure functions over the JSON body (no I/O).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import xxhash

from evergreen_trio.picker.image_size import ReadBudget, base64_image_size, data_url_image_size
from evergreen_trio.picker.json_text import go_compact, go_marshal
from evergreen_trio.picker.parsers.gojson import text as go_text
from evergreen_trio.picker.token_ids import BYTES_PER_TOKEN, little_endian_uint32, uint32_ids

MAX_PLACEHOLDERS = 2**31 - 1
"""An asset's placeholder count at most (Go's int arithmetic would wrap for absurd sizes)."""
MAX_PROMPTS = 2048
"""A completions request's prompts packed (and so hashed, or keyed) one by one at most (OpenAI's own
cap on a prompt list); the rest are packed as one. Each costs the routing thread microseconds of
packing and hashing: 250,000 prompts (near the body's JSON item cap) held it for about a second."""
IMAGE, VIDEO, AUDIO = "image", "video", "audio"
VIDEO_FPS_HEADER = "x-llm-d-video-fps"
VIDEO_DURATION_HEADER = "x-llm-d-video-duration-seconds"
VIDEO_RESOLUTION_HEADER = "x-llm-d-video-resolution"


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal item of a prompt: its modality, content hash (hex), first placeholder
    token and placeholder count."""

    modality: str
    hash: str
    offset: int
    length: int


@dataclass(frozen=True)
class Placeholders:
    """``count`` copies of ``token`` in a prompt's token stream."""

    token: int
    count: int


class PromptTokens(NamedTuple):
    """One prompt's tokens (as segments: aligned text bytes and placeholder runs) and its
    multimodal features sorted by offset. (A named tuple: one is built per hashed request, and a
    frozen dataclass costs several times as much to build.)"""

    segments: tuple[bytes | Placeholders, ...] = ()
    features: tuple[MultiModalFeature, ...] = ()

    @property
    def token_count(self) -> int:
        segments = self.segments
        if len(segments) == 1 and type(segments[0]) is bytes:  # a text prompt (in-flight load reads it per request)
            return len(segments[0]) // BYTES_PER_TOKEN
        return sum(len(s) // BYTES_PER_TOKEN if isinstance(s, bytes) else s.count for s in segments)

    def token_ids(self, limit: int | None = None) -> list[int]:
        """The token ids, at most the first ``limit``."""
        out: list[int] = []
        left = self.token_count if limit is None else limit
        for segment in self.segments:
            if left <= 0:
                break
            if isinstance(segment, Placeholders):
                take = min(segment.count, left)
                out += [segment.token] * take
            else:
                take = min(len(segment) // BYTES_PER_TOKEN, left)
                data = segment[: take * BYTES_PER_TOKEN]
                out += [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
            left -= take
        return out


class TokenizedPrompt(NamedTuple):
    """A request's prompts' tokens (several for a multi-string completions prompt) and its cache
    salt (a named tuple, as :class:`PromptTokens`)."""

    prompts: tuple[PromptTokens, ...]
    cache_salt: str = ""

    @property
    def token_count(self) -> int:
        prompts = self.prompts
        return prompts[0].token_count if len(prompts) == 1 else sum(p.token_count for p in prompts)

    @property
    def multimodal(self) -> bool:
        """Whether any prompt carries a multimodal feature (what the E/PD decider asks)."""
        return any(p.features for p in self.prompts)


def pack_ids(ids: Sequence[int]) -> PromptTokens:
    """Token ids as given (a pre-tokenized prompt passes through); OverflowError for an id outside uint32."""
    if not len(ids):
        return PromptTokens()
    return PromptTokens((little_endian_uint32(ids),))  # uint32_ids' array read as it is


@dataclass(frozen=True)
class ImageEstimate:
    """``estimate.image``: ``dynamic`` (width x height / factor) or ``static`` mode; zeros mean defaults."""

    mode: str = "dynamic"
    default_width: int = 0
    default_height: int = 0
    factor: int = 0
    static_tokens: int = 0

    def count(self, size: tuple[int, int] | None) -> int:
        if self.mode == "static":
            return self.static_tokens if self.static_tokens > 0 else 1
        width, height = size or (self.default_width if self.default_width > 0 else 640,
                                 self.default_height if self.default_height > 0 else 360)
        return _clamp((width * height) // (self.factor if self.factor > 0 else 1024))


@dataclass(frozen=True)
class VideoMeta:
    """A request's ``x-llm-d-video-*`` headers (zero: not given)."""

    width: int = 0
    height: int = 0
    duration: float = 0.0
    fps: float = 0.0


@dataclass(frozen=True)
class VideoEstimate:
    """``estimate.video``: min(frames x tokens per frame, maxVideoTokens); zeros mean defaults."""

    tokens_mode: str = "dynamic"
    factor: int = 0
    static_tokens: int = 0
    frames_mode: str = "sampled"
    sample_fps: float = 0.0
    source_fps: float = 0.0
    frame_stride: int = 0
    min_frames: int = 0
    max_frames: int = 0
    temporal_patch_size: int = 0
    default_width: int = 0
    default_height: int = 0
    default_duration: float = 0.0
    max_video_tokens: int = 0

    def count(self, meta: VideoMeta) -> int:
        tokens = self.frames(meta) * self.tokens_per_frame(meta)
        if 0 < self.max_video_tokens < tokens:
            tokens = self.max_video_tokens
        return _clamp(tokens)

    def frames(self, meta: VideoMeta) -> int:
        duration = meta.duration or self.default_duration or 10.0
        if self.frames_mode == "strided":
            fps = meta.fps or self.source_fps or 24.0
            n = _int(duration * fps) // max(self.frame_stride, 1)
        else:
            n = _int(duration * (self.sample_fps or 2.0))
        if self.min_frames > 0 and n < self.min_frames:
            n = self.min_frames
        if self.max_frames > 0 and n > self.max_frames:
            n = self.max_frames
        if self.frames_mode != "strided" and self.temporal_patch_size > 1:
            n //= self.temporal_patch_size
        return n

    def tokens_per_frame(self, meta: VideoMeta) -> int:
        if self.tokens_mode == "static":
            return self.static_tokens if self.static_tokens > 0 else 1
        width, height = self.default_width, self.default_height
        if meta.width > 0 and meta.height > 0:
            width, height = meta.width, meta.height
        width, height = width if width > 0 else 640, height if height > 0 else 360
        return max((width * height) // (self.factor if self.factor > 0 else 1024), 1)


def _int(value: float) -> int:
    return int(value) if math.isfinite(value) else MAX_PLACEHOLDERS


def _clamp(count: int) -> int:
    return min(max(count, 1), MAX_PLACEHOLDERS)


@dataclass(frozen=True)
class Estimator:
    """The estimate backend as configured."""

    image: ImageEstimate = field(default_factory=ImageEstimate)
    video: VideoEstimate = field(default_factory=VideoEstimate)


_FLOAT = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)
_INT = re.compile(r"[+-]?\d+")
_INT64 = 2**63 - 1


def _positive_float(text: str | None) -> float:
    # strconv.ParseFloat's syntax (hex floats aside); non-finite values are refused here.
    if text is None or not _FLOAT.fullmatch(text):
        return 0.0
    value = float(text)
    return value if value > 0 and math.isfinite(value) else 0.0


def _positive_int(text: str) -> int:
    text = text.strip(" \t\n\v\f\r")
    if not _INT.fullmatch(text) or abs(value := int(text)) > _INT64:
        return 0
    return value if value > 0 else 0


def video_meta(headers: Mapping[str, str]) -> VideoMeta:
    """The ``x-llm-d-video-*`` headers (lower-case names); a missing or malformed value is 0."""
    width = height = 0
    resolution = headers.get(VIDEO_RESOLUTION_HEADER, "")
    cut = min((i for i in (resolution.find("x"), resolution.find("X")) if i >= 0), default=-1)
    if cut > 0:
        width, height = _positive_int(resolution[:cut]), _positive_int(resolution[cut + 1 :])
        if not (width and height):
            width = height = 0
    return VideoMeta(width, height, _positive_float(headers.get(VIDEO_DURATION_HEADER)),
                     _positive_float(headers.get(VIDEO_FPS_HEADER)))


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _block(value: object) -> Mapping[str, Any]:
    return value if type(value) is dict or isinstance(value, Mapping) else {}  # a parsed body's are dicts


class _Stream:
    """A prompt being built: text since the last asset (joined and encoded once, at the next asset
    or the end), then aligned text bytes and placeholder runs, and the features."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.text: Callable[[str], None] = self.parts.append  # a C call per piece of text
        self.segments: list[bytes | Placeholders] = []
        self.features: list[MultiModalFeature] = []
        self.tokens = 0
        self.image_reads = ReadBudget()  # the request's images share it

    def _take(self) -> bytes:
        """The text since the last asset as bytes (Go's: lone surrogates as U+FFFD), zero-padded
        to whole tokens."""
        joined = "".join(self.parts)
        self.parts.clear()
        data = (joined if joined.isascii() else go_text(joined)).encode()
        pad = -len(data) % BYTES_PER_TOKEN
        return data + bytes(pad) if pad else data

    def asset(self, modality: str, content: str, count: int) -> None:
        data = self._take()
        self.tokens += len(data) // BYTES_PER_TOKEN
        self.segments.append(data)
        digest = xxhash.xxh64_intdigest(go_text(content).encode())
        self.features.append(MultiModalFeature(modality, format(digest, "x"), self.tokens, count))
        self.segments.append(Placeholders(digest & 0xFFFFFFFF, count))
        self.tokens += count

    def done(self) -> PromptTokens:
        data = self._take()
        if not self.segments:  # text only
            return PromptTokens((data,) if data else ())
        self.segments.append(data)
        return PromptTokens(tuple(s for s in self.segments if isinstance(s, Placeholders) or s), tuple(self.features))


def _conversation(stream: _Stream, messages: object, add_block: Callable[[Mapping[str, Any]], None]) -> None:
    """Each message's role and content into ``stream``: a string content as text, a list's blocks
    through ``add_block`` (the API's own kinds)."""
    for message in messages if isinstance(messages, list) else ():
        message = _block(message)
        role = _text(message.get("role"))
        content = message.get("content")
        if isinstance(content, str):
            stream.text(role + content)  # one call for the common message (the same bytes)
            continue
        stream.text(role)
        for block in content if isinstance(content, list) else ():
            add_block(_block(block))


def _chat(estimator: Estimator, body: Mapping[str, Any], headers: Mapping[str, str]) -> PromptTokens:
    stream = _Stream()
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        stream.text(go_marshal(tools))

    def add_block(part: Mapping[str, Any]) -> None:
        kind = part.get("type")
        if kind == "text":
            stream.text(_text(part.get("text")))
        elif kind == "image_url":
            url = _text(_block(part.get("image_url")).get("url"))
            stream.asset(IMAGE, url, estimator.image.count(data_url_image_size(url, stream.image_reads)))
        elif kind == "video_url":
            stream.asset(VIDEO, _text(_block(part.get("video_url")).get("url")),
                         estimator.video.count(video_meta(headers)))
        elif kind in ("input_audio", "audio_url"):
            audio = _block(part.get("input_audio"))
            data = _text(audio.get("data")) + _text(audio.get("format"))
            stream.asset(AUDIO, data, _clamp(-(-len(data.encode()) // BYTES_PER_TOKEN)))

    _conversation(stream, body.get("messages"), add_block)
    return stream.done()


def _anthropic_system(value: object) -> str:
    if isinstance(value, str):
        return value
    return "".join(t for b in (value if isinstance(value, list) else ()) if _block(b).get("type") == "text"
                   and (t := _text(_block(b).get("text"))) and not t.startswith("x-anthropic-billing-header"))


def _messages(estimator: Estimator, body: Mapping[str, Any]) -> PromptTokens:
    """An Anthropic ``/v1/messages`` body (estimate.go's messagesBytes)."""
    stream = _Stream()
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        stream.text(f"[{','.join(_anthropic_tool(_block(t)) for t in tools)}]")
    stream.text(_anthropic_system(body.get("system")))

    def add_block(block: Mapping[str, Any]) -> None:
        kind = block.get("type")
        if kind == "text":
            stream.text(_text(block.get("text")))
        elif kind == "image":
            _anthropic_image(stream, estimator, _block(block.get("source")))
        elif kind == "thinking":
            stream.text(_text(block.get("thinking")))
        elif kind == "tool_use":
            stream.text(_text(block.get("id")) + _text(block.get("name")))
            if block.get("input") is not None:  # the wire's bytes there (compact here)
                stream.text(go_compact(block["input"]))
        elif kind == "tool_result":
            _tool_result(stream, estimator, block.get("content"))

    _conversation(stream, body.get("messages"), add_block)
    return stream.done()


def _anthropic_tool(tool: Mapping[str, Any]) -> str:
    # AnthropicTool marshalled: its fields in struct order, empty ones omitted (omitempty).
    fields = [f'"name":{go_marshal(_text(tool.get("name")))}']
    if _text(tool.get("description")):
        fields.append(f'"description":{go_marshal(tool["description"])}')
    if tool.get("input_schema") is not None:
        fields.append(f'"input_schema":{go_compact(tool["input_schema"])}')
    fields += [f'"{key}":{go_marshal(tool[key])}' for key in ("strict", "defer_loading")
               if isinstance(tool.get(key), bool)]
    return "{" + ",".join(fields) + "}"


def _anthropic_image(stream: _Stream, estimator: Estimator, source: Mapping[str, Any]) -> None:
    url, data = _text(source.get("url")), _text(source.get("data"))
    if url:
        stream.asset(IMAGE, url, estimator.image.count(data_url_image_size(url, stream.image_reads)))
    elif data:
        stream.asset(IMAGE, data, estimator.image.count(base64_image_size(data, stream.image_reads)))


def _tool_result(stream: _Stream, estimator: Estimator, content: object) -> None:
    if isinstance(content, str):
        stream.text(content)
        return
    texts: list[str] = []
    urls: list[str] = []
    for item in content if isinstance(content, list) else ():
        item = _block(item)
        if item.get("type") == "text":
            texts.append(_text(item.get("text")))
        elif item.get("type") == "image":
            source = _block(item.get("source"))
            url = _text(source.get("url"))
            if source.get("type") != "url" and not url and _text(source.get("data")):
                url = f"data:{_text(source.get('media_type')) or 'image/jpeg'};base64,{_text(source.get('data'))}"
            if url:
                urls.append(url)
    stream.text("\n".join(texts))
    for url in urls:
        stream.asset(IMAGE, url, estimator.image.count(data_url_image_size(url, stream.image_reads)))


def _strings(value: object) -> list[str] | None:
    # map and repeat: the check is one C loop, not a Python step per string
    return value if isinstance(value, list) and all(map(isinstance, value, repeat(str))) else None


def pack_text(text: str) -> PromptTokens:
    """A text prompt packed 4 bytes a token (the tail zero-padded)."""
    stream = _Stream()
    stream.text(text)
    return stream.done()


def estimate(estimator: Estimator, protocol: str, body: Mapping[str, Any],
             headers: Mapping[str, str]) -> TokenizedPrompt | None:
    """The estimate backend's tokens for a request of ``protocol`` (``chat``, ``messages``,
    ``completions``, ``embeddings``, ``responses``, ``conversations``); None when it has none
    (an unknown protocol, an empty prompt), as the reference then publishes nothing."""
    prompts: tuple[PromptTokens, ...]
    if protocol == "chat":
        prompts = (_chat(estimator, body, headers),)
    elif protocol == "messages":
        prompts = (_messages(estimator, body),)
    elif protocol == "completions":
        prompt = body.get("prompt")
        ids, strings = uint32_ids(prompt, integral_floats=True), _strings(prompt)
        if ids is not None:
            prompts = (pack_ids(ids),)
        elif strings is not None and len(strings) > 1:
            prompts = tuple(map(pack_text, strings[:MAX_PROMPTS]))
            if len(strings) > MAX_PROMPTS:  # joined in C: past the cap a string costs no Python work
                prompts += (pack_text("".join(strings[MAX_PROMPTS:])),)
        else:
            prompts = (pack_text(prompt if isinstance(prompt, str) else " ".join(strings or ())),)
    elif protocol == "embeddings":
        value = body.get("input")
        ids, strings = uint32_ids(value, integral_floats=True), _strings(value)
        if ids is not None:
            prompts = (pack_ids(ids),)
        else:  # Go marshals the EmbeddingsInput struct as it is (it has no MarshalJSON)
            raw = value if isinstance(value, str) else ""
            prompts = (pack_text(go_marshal({"Raw": raw, "Strings": strings or None, "TokenIDs": None})),)
    elif protocol == "responses":
        combined: list[dict[str, Any]] = []
        if body.get("instructions") is not None:
            combined.append({"instructions": body["instructions"]})
        if body.get("tools") is not None:
            combined.append({"tools": body["tools"]})
        combined.append({"input": body.get("input")})
        prompts = (pack_text(go_marshal(combined)),)
    elif protocol == "conversations":
        items = body.get("items")
        listed = f"[{','.join(_conversation_item(i) for i in items)}]" if isinstance(items, list) else "null"
        prompts = (pack_text(listed),)
    else:
        return None
    # A prompt has tokens when it has a segment (estimate leaves out empty ones).
    tokens = prompts[0].segments if len(prompts) == 1 else any(p.segments for p in prompts)
    return TokenizedPrompt(prompts, cache_salt(body)) if tokens else None


def _conversation_item(item: object) -> str:
    # ConversationItem marshalled: its fields in struct order, each omitted when empty (omitempty).
    item = _block(item)
    fields: list[tuple[str, object]] = [(k, v) for k, v in (("type", _text(item.get("type"))),
                                                            ("role", _text(item.get("role")))) if v]
    if item.get("content") is not None:
        fields.append(("content", item["content"]))
    return "{" + ",".join(f'"{k}":{go_marshal(v)}' for k, v in fields) + "}"


def cache_salt(body: Mapping[str, Any]) -> str:
    """The request's ``cache_salt`` (what isolates its prefix cache)."""
    return _text(body.get("cache_salt"))

