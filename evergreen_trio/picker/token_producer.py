"""``token-producer`` (and ``tokenizer``, its deprecated alias): which token backend a config runs.

As llm-d-router's tokenizer.go: ``estimate`` (the default, tokenizer-free byte packing,
:mod:`~evergreen_trio.picker.token_estimate`) or ``vllm`` (selected by a ``vllm`` block or a
``modelName``: vLLM's render endpoints, :mod:`~evergreen_trio.picker.vllm_render`), one of them.
``udsTokenizerConfig`` (the deprecated gRPC-over-UDS sidecar) is refused with a line naming
``vllm.url``. The parameters are checked as the reference's factory checks them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import (
    Category,
    MultimodalDecider,
    Params,
    Plugin,
    PluginType,
    PrefixDecider,
    register,
)
from evergreen_trio.picker.request import Api, InferenceRequest, bare_path
from evergreen_trio.picker.token_estimate import (
    Estimator,
    ImageEstimate,
    TokenizedPrompt,
    VideoEstimate,
    cache_salt,
    estimate,
    pack_ids,
)
from evergreen_trio.picker.vllm_render import RenderCall, VllmRender, render_call

log = logging.getLogger(__name__)

TOKEN_PRODUCER = "token-producer"
LEGACY_TOKENIZER = "tokenizer"
_GO_INT = (-(2**63), 2**63 - 1)  # what a Go int field decodes


@dataclass(frozen=True)
class TokenProducer:
    """A token producer: its backend."""

    backend: Estimator | VllmRender


def _int(params: Params, key: str) -> int:
    return params.integer(key, 0, minimum=_GO_INT[0], maximum=_GO_INT[1])


def _float(params: Params, key: str) -> float:
    return params.number(key, 0.0, minimum=-1.8e308)


def _mode(params: Params, key: str, choices: tuple[str, str], what: str) -> str:
    mode = params.text(key, "")
    if mode not in ("", *choices):
        raise ConfigError(params.where(key), f"{what} must be {choices[0]!r} or {choices[1]!r}", mode)
    return mode or choices[0]


def _resolution(params: Params, key: str) -> tuple[int, int]:
    if not params.has(key) or params.raw[key] is None:
        return 0, 0
    section = params.section(key, ("width", "height"))
    return _int(section, "width"), _int(section, "height")


def _section(params: Params, key: str, known: tuple[str, ...]) -> Params:
    """A nested block; JSON null reads as an absent one (Go leaves the pointer nil)."""
    return params.section(key, known) if params.raw.get(key) is not None else params.section("", ())


def _image(params: Params) -> ImageEstimate:
    image = _section(params, "image", ("mode", "defaultResolution", "static", "dynamic"))
    width, height = _resolution(image, "defaultResolution")
    return ImageEstimate(
        _mode(image, "mode", ("dynamic", "static"), "estimate.image.mode"), width, height,
        _int(_section(image, "dynamic", ("factor",)), "factor"),
        _int(_section(image, "static", ("staticToken",)), "staticToken"))


def _video(params: Params) -> VideoEstimate:
    video = _section(params, "video", ("defaultResolution", "defaultDuration", "tokensPerFrame", "frames",
                                       "maxVideoTokens"))
    tokens = _section(video, "tokensPerFrame", ("mode", "static", "dynamic"))
    frames = _section(video, "frames", ("mode", "minFrames", "maxFrames", "sampled", "strided"))
    sampled = _section(frames, "sampled", ("sampleFPS", "temporalPatchSize"))
    strided = _section(frames, "strided", ("defaultSourceFPS", "frameStride"))
    width, height = _resolution(video, "defaultResolution")
    return VideoEstimate(
        tokens_mode=_mode(tokens, "mode", ("dynamic", "static"), "estimate.video.tokensPerFrame.mode"),
        factor=_int(_section(tokens, "dynamic", ("factor",)), "factor"),
        static_tokens=_int(_section(tokens, "static", ("numTokensPerFrame",)), "numTokensPerFrame"),
        frames_mode=_mode(frames, "mode", ("sampled", "strided"), "estimate.video.frames.mode"),
        sample_fps=_float(sampled, "sampleFPS"), source_fps=_float(strided, "defaultSourceFPS"),
        frame_stride=_int(strided, "frameStride"), min_frames=_int(frames, "minFrames"),
        max_frames=_int(frames, "maxFrames"), temporal_patch_size=_int(sampled, "temporalPatchSize"),
        default_width=width, default_height=height, default_duration=_float(video, "defaultDuration"),
        max_video_tokens=_int(video, "maxVideoTokens"))


def _estimator(params: Params) -> Estimator:
    estimate = _section(params, "estimate", ("image", "video"))
    return Estimator(_image(estimate), _video(estimate))


def _timeout(params: Params, key: str, default: float) -> float:
    from evergreen_trio.picker.flow_control.config import go_duration  # it imports config, which imports this

    text = params.text(key, "")
    if not text:
        return default
    seconds = go_duration(text, params.where(key))
    if seconds <= 0:
        raise ConfigError(params.where(key), "a duration > 0 (a render with no time left fails at once)", text)
    return seconds


def _vllm(params: Params, model: str) -> VllmRender:
    block = _section(params, "vllm", ("url", "timeout", "mmTimeout"))
    url = block.text("url", "").rstrip("/") or "http://localhost:8000"
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError:
        parts, port = None, 0
    if parts is None or parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(block.where("url"), "an http://host[:port][/path] URL (TLS is not supported)", url)
    return VllmRender(model, parts.hostname, port, parts.path, _timeout(block, "timeout", 5.0),
                      _timeout(block, "mmTimeout", 30.0))


def _token_producer(params: Params) -> TokenProducer:
    if params.raw.get("udsTokenizerConfig") is not None:
        raise ConfigError(params.where("udsTokenizerConfig"),
                          "vllm.url (the deprecated gRPC-over-UDS tokenizer sidecar is not supported)", "set")
    model = params.text("modelName", "")
    estimate = params.raw.get("estimate") is not None
    vllm = params.raw.get("vllm") is not None or bool(model)
    if estimate and vllm:
        raise ConfigError(params.path, "only one of 'estimate', 'vllm', or 'udsTokenizerConfig' set", "both")
    if vllm:
        if not model:
            raise ConfigError(params.where("modelName"), "'modelName' must be specified (the vllm backend)", model)
        return TokenProducer(_vllm(params, model))
    return TokenProducer(_estimator(params))


_PARAMETERS = ("modelName", "vllm", "estimate", "udsTokenizerConfig")
register(TOKEN_PRODUCER, PluginType(Category.PRODUCER, _PARAMETERS, _token_producer))
register(LEGACY_TOKENIZER, PluginType(Category.PRODUCER, _PARAMETERS, _token_producer, replaced_by=TOKEN_PRODUCER))

DEFAULT_PRODUCER = TokenProducer(Estimator())
"""What the reference's framework adds to a config that consumes tokens and declares no producer."""


def request_producer(plugins: Mapping[str, Plugin], handler: object) -> TokenProducer | None:
    """The token producer requests run through: the first declared, else (as the reference's
    framework adds one for plugins consuming its tokens) the default estimate when a P/D or E/PD
    decider or ``context-length-aware`` counts them. The prefix producers run the default
    estimate when none runs here, and its tokens are then the request's."""
    declared = next((p.params for p in plugins.values() if isinstance(p.params, TokenProducer)), None)
    if declared is not None:
        return declared
    deciders = (getattr(handler, "prefill_decider", None), getattr(handler, "encode_decider", None))
    counted = any(isinstance(d, MultimodalDecider | PrefixDecider) for d in deciders) or any(
        p.type == "context-length-aware" for p in plugins.values())
    return DEFAULT_PRODUCER if counted else None


def tokenize(producer: TokenProducer, path: str, request: InferenceRequest,
             headers: Mapping[str, str]) -> tuple[TokenizedPrompt | None, RenderCall | None]:
    """A request's tokens by ``producer`` now (None when it has none), or the render to post for
    them (the ``vllm`` backend's, when the prompt is not pre-tokenized). A prompt the parser read
    as token ids with no JSON prompt around them (vLLM and SGLang ``generate``, vLLM gRPC) passes
    through with its salt, as the reference's parsers and estimate backend hand them on."""
    protocol = protocol_of(path, request.api)
    body = request.body
    if request.token_ids is not None and (not protocol or not body):
        salt = request.cache_salt or cache_salt(body)
        return (TokenizedPrompt((pack_ids(request.token_ids),), salt) if request.token_ids else None), None
    if not body and request.prompt:  # vLLM gRPC's text prompt: a completions prompt without a JSON body
        body = {"prompt": request.prompt}
    try:
        if isinstance(producer.backend, Estimator):
            return estimate(producer.backend, protocol, body, headers), None
        call = render_call(producer.backend, protocol, body)
    except (ValueError, OverflowError, RecursionError) as exc:
        # A body Go's decoder would have refused (a number beyond float64), or too deep to write
        # back: as the reference's director on a producer's error, the request goes on without tokens.
        log.info("picker.tokens_skipped protocol=%s reason=%s", protocol, type(exc).__name__)
        return None, None
    return (None, call) if isinstance(call, RenderCall) else (call, None)


_PROTOCOLS = {Api.CHAT: "chat", Api.COMPLETIONS: "completions", Api.EMBEDDINGS: "embeddings",
              Api.RESPONSES: "responses"}


def protocol_of(path: str, api: Api) -> str:
    """A request's protocol as the producer reads its body: ``chat``, ``completions``,
    ``embeddings``, ``responses``, ``conversations``, ``messages`` (Anthropic) or ``""``."""
    protocol = _PROTOCOLS.get(api)
    if protocol is not None:
        return protocol
    bare = bare_path(path)
    return next((name for name in ("messages", "conversations") if bare.endswith(f"/v1/{name}")), "")
