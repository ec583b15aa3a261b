"""The request parser registry (llm-d-router's ParserRegistry, its handlers/parsers_test.go ported),
``requestHandler.parsers`` in an EndpointPickerConfig, and ``passthrough-parser``, each through a
stream where it matters."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.parsers import DEFAULT_REGISTRY, PARSERS
from evergreen_trio.picker.parsers.passthrough import PASSTHROUGH
from evergreen_trio.picker.parsers.registry import (
    MAX_RESOLVED_PATHS,
    ParserRegistry,
    RequestParser,
    forwarded,
    match_path_suffix,
    request_path,
)
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category, Plugin
from evergreen_trio.picker.processor import DESTINATION, MODEL_REWRITE, ExtProcStream, Picker
from evergreen_trio.picker.request import InferenceRequest
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage
from tests.picker.test_processor import (
    A,
    B,
    C,
    lb_metadata,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    status,
)

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
POOL = f"""pool: {{endpoints: ['{A}', '{B}', '{C}']}}
models:
- {{name: food-review, targetModels: [{{name: food-review-v1}}]}}
- {{name: plain}}
"""
FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"


def picker_with(epp: str | None = None, extra: str = "") -> Picker:
    """A picker over A, B, C (queues 0, 4, 8) with the models above, and ``epp`` as its
    EndpointPickerConfig (None: a plain config, so the default parsers)."""
    config = parse_config(POOL + extra + (HEAD + epp if epp is not None else ""))
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, queue in zip(config.pool.endpoints, (0, 4, 8), strict=True):
        snapshot.update(endpoint.address, EndpointMetrics(waiting=queue))
    return Picker(config, snapshot, rng=random.Random(5))


def parsers_config(*types: str) -> str:
    """An EndpointPickerConfig of the queue and prefix scorers declaring ``types`` and listing them
    as the parsers, in order."""
    plugins = "".join(f"- {{type: {kind}}}\n" for kind in types)
    refs = "".join(f"  - pluginRef: {kind}\n" for kind in types)
    scorers = "- {type: queue-scorer}\n- {type: prefix-cache-scorer}\n"
    return f"plugins:\n{scorers}{plugins}requestHandler:\n  parsers:\n{refs}"


def send(picker: Picker, path: str, body: bytes,
         headers: Sequence[tuple[str, str]] = ()) -> tuple[ExtProcStream, list[ep.ProcessingResponse]]:
    """One request through a new stream (duplex): the stream and the replies to its body."""
    stream = picker.new_stream()
    stream.on_message(request_headers(path, extra=headers))
    return stream, list(stream.on_message(request_body(body)))


def forwarded_body(replies: Sequence[ep.ProcessingResponse]) -> bytes:
    """The request body a routing decision (duplex) sends on."""
    return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in replies[1:])


# -- the registry (handlers/parsers_test.go) -----------------------------------------------------


def _fake(kind: str, *paths: str) -> RequestParser:
    return RequestParser(kind, paths, lambda path, headers, body: forwarded(skip_response=False))


def _registry(*parsers: RequestParser) -> ParserRegistry:
    return ParserRegistry([Plugin(p.type, p.type, p) for p in parsers])


@pytest.mark.parametrize(("path", "chosen"), [
    ("/v1/chat/completions", "openai"),
    ("/v1/messages", "anthropic"),
    ("/google.cloud.aiplatform.v1beta1.PredictionService/ChatCompletions", "vertex"),
    ("/google.cloud.aiplatform.v1.PredictionService/ChatCompletions", "vertex"),
    ("/v1/messages/", "anthropic"),
    ("/unknown/path", None),
])
def test_resolve_by_suffix(path: str, chosen: str | None) -> None:
    registry = _registry(_fake("openai", "v1/chat/completions", "v1/completions"), _fake("anthropic", "v1/messages"),
                         _fake("vertex", "PredictionService/ChatCompletions"))
    if chosen is None:
        with pytest.raises(RequestError) as caught:
            registry.resolve(path)
        assert caught.value.status == 400 and path in caught.value.message
    else:
        assert registry.resolve(path).type == chosen


def test_the_first_listed_wins_a_tie() -> None:
    openai, custom = _fake("openai", "v1/chat/completions"), _fake("custom", "v1/chat/completions")
    assert _registry(openai, custom).resolve("/v1/chat/completions") is openai
    assert _registry(custom, openai).resolve("/v1/chat/completions") is custom


def test_a_claim_wins_over_the_fallback() -> None:
    registry = _registry(_fake("openai", "v1/chat/completions", "v1/completions"), _fake("passthrough"))
    assert registry.resolve("/v1/completions").type == "openai"
    assert registry.resolve("/unknown/path").type == "passthrough"


def test_the_longest_suffix_wins_whatever_the_order() -> None:
    registry = _registry(_fake("sglang", "generate"), _fake("vllm", "inference/v1/generate"))
    assert registry.resolve("/inference/v1/generate").type == "vllm"
    assert registry.resolve("/generate").type == "sglang"


def test_a_type_listed_twice_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    first, second = _fake("openai", "v1/chat/completions"), _fake("openai", "v1/completions")
    with caplog.at_level(logging.WARNING):
        registry = _registry(first, second)
    assert registry.parsers == [first] and "parser_skipped" in caplog.text
    with pytest.raises(RequestError):
        registry.resolve("/v1/completions")


def test_the_list_ends_at_the_first_fallback(caplog: pytest.LogCaptureFixture) -> None:
    fallback, late = _fake("passthrough"), _fake("anthropic", "v1/messages")
    with caplog.at_level(logging.WARNING):
        registry = _registry(_fake("openai", "v1/completions"), fallback, late)
    assert [p.type for p in registry.parsers] == ["openai", "passthrough"] and registry.fallback is fallback
    assert registry.resolve("/v1/messages") is fallback
    assert "listed after the fallback parser passthrough" in caplog.text
    # A second fallback of a type already listed is still the fallback (the reference sets it first).
    again = _registry(_fake("passthrough"), _fake("openai", "v1/completions"))
    assert again.resolve("/x").type == "passthrough"


@pytest.mark.parametrize(("headers", "path"), [
    ({":path": "/v1/messages?beta=true"}, "/v1/messages"),
    ({":path": "", "x-original-path": "/inference/v1/generate"}, "/inference/v1/generate"),
    ({"x-forwarded-path": "/generate?x"}, "/generate"),
    ({}, "/v1/completions"),
])
def test_request_path(headers: Mapping[str, str], path: str) -> None:
    assert request_path(headers) == path


@pytest.mark.parametrize(("path", "suffix", "matches"), [
    ("/v1/messages/", "messages", True), ("/v1/messages//", "messages", False), (" /v1/messages ", "/messages/", True),
    ("/v1/foomessages", "messages", True), ("/v1/messages/count_tokens", "messages", False),
])
def test_match_path_suffix(path: str, suffix: str, matches: bool) -> None:
    assert match_path_suffix(path, suffix) is matches


@given(st.lists(st.text(max_size=40).map(lambda tail: "/v1/" + tail), min_size=1, max_size=50))
def test_resolved_paths_match_the_claims_and_stay_bounded(paths: list[str]) -> None:
    """A client's paths are resolved as the claims say, remembered in a map that never outgrows its cap
    (a flood of distinct paths included)."""
    registry = ParserRegistry([Plugin(p.type, p.type, p) for p in DEFAULT_REGISTRY.parsers])
    for path in [*paths, *(f"/v1/{i}" for i in range(MAX_RESOLVED_PATHS + 10)), *paths]:
        claimed = [(len(s), parser) for parser in registry.parsers for s in parser.paths
                   if match_path_suffix(path, s)]
        expected = max(claimed, key=lambda c: c[0])[1] if claimed else registry.fallback
        assert registry.resolve(path) is expected
        assert len(registry._resolved) <= MAX_RESOLVED_PATHS


@pytest.mark.parametrize(("path", "kind"), [
    ("/v1/chat/completions", "openai-parser"), ("/v1/embeddings", "openai-parser"),
    ("/v1/images/generations", "openai-parser"), ("/v1/messages", "anthropic-parser"),
    ("/v1/messages/count_tokens", "anthropic-parser"), ("/inference/v1/generate", "vllmhttp-parser"),
    ("/generate", "passthrough-parser"), ("/v1/models", "passthrough-parser"), ("/", "passthrough-parser"),
])
def test_the_default_parsers(path: str, kind: str) -> None:
    assert DEFAULT_REGISTRY.resolve(path).type == kind


def test_every_parser_type_is_registered_and_implemented() -> None:
    for parser in PARSERS:
        assert PLUGIN_TYPES[parser.type].category is Category.PARSER
        assert PLUGIN_TYPES[parser.type].parse(None) is parser  # type: ignore[arg-type]


# -- requestHandler.parsers in an EndpointPickerConfig -------------------------------------------


def test_the_payload_agnostic_chart_config_routes_every_path_through_passthrough() -> None:
    registry = load_config(FIXTURES / "chart-payload-agnostic.yaml", cluster_pool="pool").epp.parsers  # type: ignore[union-attr]
    assert registry.parsers == [PASSTHROUGH] and registry.resolve("/v1/chat/completions") is PASSTHROUGH


def test_a_plain_config_and_an_empty_list_take_the_default_parsers() -> None:
    assert picker_with().parsers is DEFAULT_REGISTRY
    assert picker_with("plugins: [{type: queue-scorer}]\nrequestHandler: {parsers: []}\n").parsers is DEFAULT_REGISTRY


def test_a_listed_type_need_not_be_declared() -> None:
    """As the reference: a pluginRef naming a parser type, not a declared plugin, is one of that type."""
    picker = picker_with("plugins: [{type: queue-scorer}, {type: openai-parser, name: mine}]\n"
                         "requestHandler: {parsers: [{pluginRef: anthropic-parser}, {pluginRef: mine}]}\n")
    assert [p.type for p in picker.parsers.parsers] == ["anthropic-parser", "openai-parser"]
    assert picker.parsers.fallback is None


def test_the_deprecated_top_level_parser(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        alone = picker_with("plugins: [{type: queue-scorer}]\nparser: {pluginRef: passthrough-parser}\n")
    assert alone.parsers.parsers == [PASSTHROUGH] and "EndpointPickerConfig.parser" in caplog.text
    both = picker_with("plugins: [{type: queue-scorer}]\nparser: {pluginRef: nonsense}\n"
                       "requestHandler: {parsers: [{pluginRef: anthropic-parser}]}\n")
    assert [p.type for p in both.parsers.parsers] == ["anthropic-parser"]  # the new field wins; the old is unread


P = "EndpointPickerConfig"


@pytest.mark.parametrize(("text", "field"), [
    ("plugins: [{type: passthrough-parser, parameters: {mode: raw}}]", f"{P}.plugins[0].parameters.mode"),
    ("plugins: [{type: anthropic-parser, parameters: {x: 1}}]", f"{P}.plugins[0].parameters.x"),
    ("plugins: [{type: queue-scorer}]\nrequestHandler: {parsers: [{pluginRef: queue-scorer}]}",
     f"{P}.requestHandler.parsers[0].pluginRef"),
    ("plugins: [{type: queue-scorer}]\nrequestHandler: {parsers: [{pluginRef: kv-cache-utilization-scorer}]}",
     f"{P}.requestHandler.parsers[0].pluginRef"),
    ("requestHandler: {parsers: [{pluginRef: nonsense}]}", f"{P}.requestHandler.parsers[0].pluginRef"),
    ("requestHandler: {parsers: [{pluginRef: tokenizer}]}", f"{P}.requestHandler.parsers[0].pluginRef"),
    ("requestHandler: {parsers: [{pluginRef: openai-parser, weight: 1}]}", f"{P}.requestHandler.parsers[0].weight"),
    ("requestHandler: {parsers: [openai-parser]}", f"{P}.requestHandler.parsers[0]"),
    ("requestHandler: {parser: {pluginRef: openai-parser}}", f"{P}.requestHandler.parser"),
    ("parser: {pluginRef: queue-scorer}\nplugins: [{type: queue-scorer}]", f"{P}.parser.pluginRef"),
])
def test_bad_parser_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(POOL + HEAD + text)
    assert caught.value.field == field, caught.value


# -- passthrough-parser (parsers/passthrough/passthrough_test.go) ---------------------------------


@pytest.mark.parametrize("body", [b"", b"hello world", b'{"model": "m"}'])
def test_passthrough_forwards_any_body(body: bytes) -> None:
    request = PASSTHROUGH.parse("/anything", {}, body)
    assert (request.model, request.prompt, request.token_ids, request.rewritable) == ("", "", None, False)
    assert not request.skip_response and request.response.usage is None
    assert PASSTHROUGH.paths == ()


def test_passthrough_routes_by_endpoint_state_and_forwards_the_body_untouched() -> None:
    """A JSON body naming a configured model with target models is not rewritten, nor refused
    for an unknown model: the parser reads no model. The response's usage is not read."""
    picker = picker_with(parsers_config("passthrough-parser"))
    for body in (b'{"model":"food-review","prompt":"p"}', b'{"model":"unknown"}', b"\x00binary"):
        stream, replies = send(picker, "/v1/completions", body)
        assert lb_metadata(replies[0])[DESTINATION] == A and forwarded_body(replies) == body
        assert stream.report.client_model == stream.report.target_model == ""
    stream.on_message(response_headers())
    stream.on_message(response_body(b'{"usage":{"prompt_tokens":3,"completion_tokens":4}}'))
    assert stream.report.usage == Usage()


def test_passthrough_takes_the_target_from_the_rewrite_header_only() -> None:
    body = b'{"model":"food-review"}'
    _, replies = send(picker_with(parsers_config("passthrough-parser")), "/v1/completions", body,
                      [(MODEL_REWRITE, "food-review-v1")])
    assert status(replies) == 404  # with models configured, a rewrite needs a model it is a target of
    config = parse_config(f"pool: {{endpoints: ['{A}']}}\n" + HEAD + parsers_config("passthrough-parser"))
    picker = Picker(config, PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0))
    picker.snapshot.update(A, EndpointMetrics())
    stream, replies = send(picker, "/v1/completions", body, [(MODEL_REWRITE, "other")])
    assert forwarded_body(replies) == body and stream.report.target_model == "other"


def test_default_parsers_send_unclaimed_paths_through_passthrough() -> None:
    stream, replies = send(picker_with(), "/custom/predict", b"not json at all")
    assert lb_metadata(replies[0])[DESTINATION] == A and forwarded_body(replies) == b"not json at all"
    assert not stream.finished


def test_a_list_without_fallback_refuses_an_unclaimed_path() -> None:
    picker = picker_with(parsers_config("openai-parser"))
    stream, replies = send(picker, "/v1/messages", b'{"model":"plain","messages":[]}')
    assert status(replies) == 400
    assert "no parser registered matching path suffix for: /v1/messages" in json.loads(
        replies[0].immediate_response.body)["error"]["message"]
    assert stream.report.error == 400
    _, replies = send(picker, "/v1/completions", b'{"model":"plain","prompt":"p"}')
    assert set_headers(replies[0].request_headers.response.header_mutation)[DESTINATION] == A


@pytest.mark.fuzz
@given(st.binary(max_size=200), st.sampled_from(["/v1/x", "/generate", "/v1/messages"]))
def test_fuzz_passthrough_and_the_default_registry(body: bytes, path: str) -> None:
    try:
        request = DEFAULT_REGISTRY.parse(path, {":path": path}, body)
    except RequestError as exc:
        assert exc.status in (400, 413)
    else:
        assert isinstance(request, InferenceRequest)
