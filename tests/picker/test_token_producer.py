"""``token-producer`` (``tokenizer``), ``always-disagg-multimodal-decider`` and the disagg handler's
encode stage: parameters as llm-d-router checks them (and the command's one line), the reference's
decider and E/PD tables through the scheduler, the vllm backend's render client against the
simulator's render endpoints, the ext_proc stream parking for a render, and a started picker
routing a chat with an image through encode -> prefill -> decode, driven by grpcio as Envoy."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_disagg_headers import serve_fake_engine
from test_processor import request_body, request_headers, set_headers

from evergreen_trio._asgi import serve_asgi
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.json_text import go_float, go_marshal
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, MultimodalDecider
from evergreen_trio.picker.processor import DESTINATION, Picker, StreamReport
from evergreen_trio.picker.render_client import post_render, render
from evergreen_trio.picker.routing_headers import ENCODERS_HEADER, PREFILL_HEADER
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot
from evergreen_trio.picker.token_estimate import TokenizedPrompt
from evergreen_trio.picker.token_producer import TokenProducer
from evergreen_trio.picker.vllm_render import (
    MAX_RENDER_REPLY_BYTES,
    RenderCall,
    RenderError,
    VllmRender,
    messages_payload,
    python_arguments,
    render_call,
)
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim

FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def _producer(parameters: str, kind: str = "token-producer") -> object:
    config = parse_config(HEAD + f"plugins:\n- {{type: {kind}, parameters: {parameters}}}\n- {{type: queue-scorer}}\n",
                          cluster_pool="p")
    assert config.epp is not None
    return next(iter(config.epp.plugins.values())).params


# -- llm-d-router's factory tests (tokenizer_test.go, vllm_http_test.go) -----------------------------


@pytest.mark.parametrize("parameters", ["{}", "null", "{estimate: {image: {mode: static, static: {staticToken: 8}}}}"])
def test_the_estimate_backend_is_the_default(parameters: str) -> None:
    produced = _producer(parameters)
    assert isinstance(produced, TokenProducer) and not isinstance(produced.backend, VllmRender)


@pytest.mark.parametrize(("parameters", "field", "says"), [
    ("{vllm: {}}", "modelName", "'modelName' must be specified"),
    ("{estimate: {image: {mode: bogus}}}", "estimate.image.mode", "estimate.image.mode must be"),
    ("{estimate: {video: {tokensPerFrame: {mode: x}}}}", "estimate.video.tokensPerFrame.mode", "must be"),
    ("{estimate: {video: {frames: {mode: x}}}}", "estimate.video.frames.mode", "must be"),
    ("{modelName: m, estimate: {}}", "", "only one of 'estimate', 'vllm', or 'udsTokenizerConfig'"),
    ("{modelName: m, vllm: {timeout: nope}}", "vllm.timeout", "a duration"),
    ("{modelName: m, vllm: {mmTimeout: 0s}}", "vllm.mmTimeout", "a duration > 0"),
    ("{modelName: m, vllm: {url: 'https://render:8000'}}", "vllm.url", "TLS is not supported"),
    ("{modelName: m, vllm: {url: 'http://render:99999'}}", "vllm.url", "an http://"),
    ("{modelName: m, udsTokenizerConfig: {socketFile: /tmp/t.sock}}", "udsTokenizerConfig", "vllm.url"),
    ("{estimate: {image: {dynamic: {factor: 1.5}}}}", "estimate.image.dynamic.factor", "an integer"),
    ("{estimate: {image: {extra: 1}}}", "estimate.image.extra", "a image parameter"),
    ("{tokenizersPoolConfig: {}}", "tokenizersPoolConfig", "a token-producer parameter"),
])
def test_bad_parameters_name_their_field(parameters: str, field: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _producer(parameters)
    assert caught.value.field == (f"{P}.{field}" if field else P) and says in str(caught.value), caught.value


def test_the_vllm_backend_reads_its_block() -> None:
    produced = _producer("{modelName: m, vllm: {url: 'http://render.ns.svc:8001/base/', timeout: 2s, mmTimeout: 1m}}")
    assert isinstance(produced, TokenProducer)
    assert produced.backend == VllmRender("m", "render.ns.svc", 8001, "/base", 2.0, 60.0)
    default = _producer("{modelName: m}")
    assert isinstance(default, TokenProducer) and default.backend == VllmRender("m")


def test_the_legacy_type_is_the_same_plugin_with_a_deprecation_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert _producer("{}", "tokenizer") == _producer("{}")
    assert any("'tokenizer'" in r.getMessage() and "'token-producer'" in r.getMessage() for r in caplog.records)


def test_registered_beta_and_no_longer_refused() -> None:
    for name in ("token-producer", "tokenizer", "always-disagg-multimodal-decider"):
        assert name in PLUGIN_TYPES and name not in ALPHA_TYPES


@pytest.mark.parametrize(("parameters", "field"), [
    ("{vllm: {}}", "modelName"),
    ("{estimate: {image: {mode: bogus}}}", "estimate.image.mode"),
    ("{modelName: m, vllm: {timeout: nope}}", "vllm.timeout"),
    ("{modelName: m, udsTokenizerConfig: {socketFile: /s}}", "udsTokenizerConfig"),
])
def test_each_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: token-producer, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line


# -- JSON text (pythonjson.go's tables; Go's float64 text) -----------------------------------------


@pytest.mark.parametrize(("wire", "expected"), [
    ('{"city":"Zürich","n":5}', '{"city": "Z\\u00fcrich", "n": 5}'),
    ('{"z":1,"a":[{"y":1,"b":2},true,null,"x"]}', '{"z": 1, "a": [{"y": 1, "b": 2}, true, null, "x"]}'),
    ("{}", "{}"),
    ("null", "{}"),
    ('{"s":"a\\"b\\\\c\\nd e","f":"/"}', '{"s": "a\\"b\\\\c\\nd e", "f": "/"}'),
    ('{"e":"Zürich 😀"}', '{"e": "Z\\u00fcrich \\ud83d\\ude00"}'),
    ('{"a":1}', '{"a": 1}'),
])
def test_tool_call_arguments_are_cpython_json_dumps(wire: str, expected: str) -> None:
    assert python_arguments(json.loads(wire)) == expected


@pytest.mark.parametrize(("value", "text"), [
    (1, "1"), (1.0, "1"), (100000.0, "100000"), (1e20, "100000000000000000000"), (1e21, "1e+21"),
    (1e-6, "0.000001"), (1e-7, "1e-7"), (-0.0, "-0"), (0.1, "0.1"),
    (2**60, "1152921504606847000"), (2**70, "1.1805916207174113e+21"),  # shortest digits, as strconv
])
def test_go_floats(value: float, text: str) -> None:
    assert go_float(float(value)) == text


@given(st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=20))
def test_go_marshal_is_json_of_the_same_value(value: Any) -> None:
    text = go_marshal(value)  # every number a float64, as Go's decoder holds it
    assert json.loads(text, parse_int=float) == json.loads(json.dumps(value), parse_int=float)
    assert not {"<", ">", "&", "\u2028"} & set(text)


# -- Anthropic messages as the chat vLLM renders (tokenizer_test.go's MessagesToRenderChatRequest) ---


def test_an_agentic_turn_becomes_the_chat_vllm_builds() -> None:
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: 9"}, {"type": "text", "text": "be kind"}],
        "tools": [{"name": "get", "input_schema": {"type": "object", "properties": {"b": {}, "a": {}}}},
                  {"name": "put", "description": "d", "strict": True}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                              {"type": "tool_use", "id": "t1", "name": "get", "input": {"c": "Zü"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "sunny"}, {"type": "image", "source": {"type": "base64", "data": "AA"}}]}]},
        ]}
    assert messages_payload(body) == {
        "messages": [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "reasoning": "hmm", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get", "arguments": '{"c": "Z\\u00fc"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AA"}}]},
        ],
        "tools": [
            {"type": "function", "function": {"name": "get", "parameters": {
                "type": "object", "properties": {"b": {}, "a": {}}}}},
            {"type": "function", "function": {"name": "put", "parameters": {"type": "object"}, "description": "d",
                                              "strict": True}},
        ]}


# -- the render request (vllm_http.go) --------------------------------------------------------------

BACKEND = VllmRender("test-model", "127.0.0.1", 1, timeout_s=5.0, mm_timeout_s=30.0)


def test_the_render_carries_the_clients_body_with_the_model_and_picks_its_timeout() -> None:
    call = render_call(BACKEND, "completions", {"prompt": "hello", "dummy_field": "kept", "model": "x"})
    assert isinstance(call, RenderCall) and call.path == "/v1/completions/render" and call.timeout_s == 5.0
    assert json.loads(call.body) == {"prompt": "hello", "dummy_field": "kept", "model": "test-model"}
    chat = render_call(BACKEND, "chat", {"messages": [{"role": "user", "content": [IMAGE]}]})
    assert isinstance(chat, RenderCall) and chat.path == "/v1/chat/completions/render" and chat.timeout_s == 30.0
    text = render_call(BACKEND, "chat", {"messages": [{"role": "user", "content": "hi"}]})
    assert isinstance(text, RenderCall) and text.timeout_s == 5.0
    ids = render_call(BACKEND, "completions", {"prompt": [7, 8, 9]})  # pre-tokenized: no render
    assert isinstance(ids, TokenizedPrompt) and ids.prompts[0].token_ids() == [7, 8, 9]
    assert render_call(BACKEND, "embeddings", {"input": "x"}) is None


async def _sim(nursery: trio.Nursery, model: str = "test-model") -> VllmRender:
    port = await nursery.start(run_sim, SimConfig(model=model))
    return VllmRender(model, "127.0.0.1", port)


async def test_the_render_client_reads_the_simulators_replies(nursery: trio.Nursery) -> None:
    backend = await _sim(nursery)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}, IMAGE]}]}
    call = render_call(backend, "chat", body)
    assert isinstance(call, RenderCall)
    tokens = await render(backend, call, body)
    assert tokens is not None and tokens.multimodal
    (feature,) = tokens.prompts[0].features
    assert (feature.modality, feature.length) == ("image", 16)
    assert tokens.prompts[0].token_ids()[feature.offset : feature.offset + 16] == [151655] * 16
    multi = render_call(backend, "completions", {"prompt": ["alpha", "beta"]})
    assert isinstance(multi, RenderCall)
    rendered = await render(backend, multi, {"prompt": ["alpha", "beta"]})
    assert rendered is not None and [p.token_count for p in rendered.prompts] == [2, 1]


async def test_a_failed_render_is_a_render_error(nursery: trio.Nursery) -> None:
    backend = await _sim(nursery)
    wrong = RenderCall("/v1/completions/render", b'{"prompt": "x", "model": "other"}', 5.0)
    with pytest.raises(RenderError, match="status 404"):
        await render(backend, wrong, {})
    with pytest.raises(RenderError, match=r"POST http://127\.0\.0\.1:1/v1/completions/render: OSError"):
        await post_render(VllmRender("m", "127.0.0.1", 1), wrong)  # nothing listens on port 1

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await trio.sleep_forever()

    port = await nursery.start(serve_asgi, silent, "127.0.0.1", 0)
    with pytest.raises(RenderError, match="no reply within"):
        await post_render(VllmRender("m", "127.0.0.1", port), RenderCall(wrong.path, wrong.body, 0.2))

    async def huge(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range((MAX_RENDER_REPLY_BYTES >> 20) + 1):
                await send({"type": "http.response.body", "body": b"1," * (1 << 19), "more_body": True})

    port = await nursery.start(serve_asgi, huge, "127.0.0.1", 0)
    with pytest.raises(RenderError, match="larger than"):
        await post_render(VllmRender("m", "127.0.0.1", port), wrong)


def replying(reply: bytes) -> Any:
    """An ASGI app answering every request 200 with ``reply``: a vLLM render of our choosing."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": reply})

    return app


async def test_a_render_whose_multimodal_items_overlap_is_a_render_error(nursery: trio.Nursery) -> None:
    # Every item over every token: each block's extras would name all 4096 items, 33 million
    # entries (gigabytes) for one request, from a 2 MB reply.
    tokens = 1 << 17
    features = {"mm_hashes": {"image": [f"h{i}" for i in range(4096)]},
                "mm_placeholders": {"image": [{"offset": i, "length": tokens} for i in range(4096)]}}
    reply = json.dumps({"token_ids": [1] * tokens, "features": features}).encode()

    port = await nursery.start(serve_asgi, replying(reply), "127.0.0.1", 0)
    backend = VllmRender("m", "127.0.0.1", port)
    body = {"messages": [{"role": "user", "content": [IMAGE]}]}
    call = render_call(backend, "chat", body)
    assert isinstance(call, RenderCall)
    with pytest.raises(RenderError, match="multimodal items overlap"):
        await render(backend, call, body)


async def test_a_render_of_more_prompts_than_the_request_has_is_a_render_error(nursery: trio.Nursery) -> None:
    # Each render costs Python work on the event loop: 16 MiB of empty ones held it 5 s.
    reply = json.dumps([{"token_ids": [1]}] * 100_000).encode()

    port = await nursery.start(serve_asgi, replying(reply), "127.0.0.1", 0)
    backend = VllmRender("m", "127.0.0.1", port)
    body = {"prompt": ["alpha", "beta"]}
    call = render_call(backend, "completions", body)
    assert isinstance(call, RenderCall)
    with pytest.raises(RenderError, match="100000 renders for a request of 2 prompts"):
        await render(backend, call, body)


@pytest.mark.parametrize("reply", [b"[]", b"{}", b"[{\"token_ids\": [-1]}]", b"not json", b"[[" * 100_000])
def test_replies_not_in_vllms_shape_are_render_errors(reply: bytes) -> None:
    from evergreen_trio.picker.vllm_render import render_reply
    with pytest.raises(RenderError):
        render_reply(RenderCall("/v1/completions/render", b"", 1.0), 200, reply, {})


# -- E/PD through the scheduler (disagg_profile_handler_test.go) --------------------------------------

ENCODE, ENCODE_2, PREFILL, DECODE = "10.0.2.1:8000", "10.0.2.2:8000", "10.0.2.3:8000", "10.0.2.4:8000"
POOL = f"""pool:
  endpoints:
  - {{address: '{ENCODE}', labels: {{llm-d.ai/role: encode}}}}
  - {{address: '{ENCODE_2}', labels: {{llm-d.ai/role: encode}}}}
  - {{address: '{PREFILL}', labels: {{llm-d.ai/role: prefill}}}}
  - {{address: '{DECODE}', labels: {{llm-d.ai/role: decode}}}}
---
"""


def _picker(text: str) -> Picker:
    config = parse_config(POOL + (text if "kind: EndpointPickerConfig" in text else HEAD.removeprefix("---\n") + text))
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    return Picker(config, snapshot, rng=random.Random(3))


def _route(picker: Picker, body: Mapping[str, Any], path: str = "/v1/chat/completions",
           after: Callable[[], None] | None = None) -> dict[str, str]:
    stream = picker.new_stream()
    assert stream.on_message(request_headers(path, extra=[(ENCODERS_HEADER, "6.6.6.6:1")])) == []
    replies = stream.on_message(request_body(json.dumps({"model": "m", **body}).encode()))
    if after is not None:
        assert replies == [] and stream.parked
        after()
        replies = list(stream.resume())
    return set_headers(replies[0].request_headers.response.header_mutation)


def _chat(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def test_the_references_e_p_d_config_encodes_then_prefills_a_chat_with_an_image() -> None:
    picker = _picker((FIXTURES / "sim-e-p-d-epp-config.yaml").read_text())
    assert picker.tokens is not None  # the framework's default estimate producer: a decider reads features
    headers = _route(picker, _chat({"type": "text", "text": "describe"}, IMAGE))
    assert headers[ENCODERS_HEADER] in (ENCODE, ENCODE_2) and headers[PREFILL_HEADER] == PREFILL
    assert headers[DESTINATION] == DECODE
    text = _route(picker, _chat({"type": "text", "text": "hi"}))  # 2 tokens: no encode, no prefill
    assert ENCODERS_HEADER not in text and PREFILL_HEADER not in text and text[DESTINATION] == DECODE


@pytest.mark.parametrize("order", ["decode-first", "prefill-first"])
def test_encode_runs_only_when_its_decider_says_so_and_picks_maxnumofendpoints(order: str) -> None:
    prefill = "prefill: always-disagg-pd-decider" if order == "decode-first" else ""
    picker = _picker(f"""plugins:
- {{type: encode-filter}}
- {{type: prefill-filter}}
- {{type: decode-filter}}
- {{type: always-disagg-pd-decider}}
- {{type: always-disagg-multimodal-decider}}
- {{type: max-score-picker, name: two, parameters: {{maxNumOfEndpoints: 2}}}}
- {{type: disagg-profile-handler, parameters: {{stageOrder: {order},
   deciders: {{encode: always-disagg-multimodal-decider, {prefill}}}}}}}
schedulingProfiles:
- {{name: encode, plugins: [{{pluginRef: encode-filter}}, {{pluginRef: two}}]}}
- {{name: prefill, plugins: [{{pluginRef: prefill-filter}}]}}
- {{name: decode, plugins: [{{pluginRef: decode-filter}}]}}
""")
    headers = _route(picker, _chat(IMAGE))
    assert sorted(headers[ENCODERS_HEADER].split(",")) == [ENCODE, ENCODE_2]
    assert headers[PREFILL_HEADER] == PREFILL and headers[DESTINATION] == DECODE
    text = _route(picker, {"prompt": "no images here"}, "/v1/completions")
    assert ENCODERS_HEADER not in text and text[PREFILL_HEADER] == PREFILL


def test_without_the_encode_profile_or_decider_there_is_no_encode_stage() -> None:
    plugins = """plugins:
- {type: encode-filter}
- {type: decode-filter}
- {type: always-disagg-multimodal-decider}
"""
    no_profile = _picker(plugins + "- {type: disagg-profile-handler, parameters: {deciders: "
                         "{encode: always-disagg-multimodal-decider}}}\nschedulingProfiles:\n"
                         "- {name: decode, plugins: [{pluginRef: decode-filter}]}\n")
    assert ENCODERS_HEADER not in _route(no_profile, _chat(IMAGE))
    no_decider = _picker(plugins + "- {type: disagg-profile-handler}\nschedulingProfiles:\n"
                         "- {name: encode, plugins: [{pluginRef: encode-filter}]}\n"
                         "- {name: decode, plugins: [{pluginRef: decode-filter}]}\n")
    assert no_decider.tokens is None and ENCODERS_HEADER not in _route(no_decider, _chat(IMAGE))


def test_the_multimodal_decider_reads_the_features_only() -> None:
    decider = MultimodalDecider()
    assert decider.disaggregate(0, 0, True) and not decider.disaggregate(10**6, 0, False)


def test_a_declared_token_producer_counts_the_prefill_deciders_tokens() -> None:
    config_text = """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: token-producer, parameters: {estimate: {image: {mode: static, static: {staticToken: 40}}}}}
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 32}}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: prefix-based-pd-decider}}}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
- {name: decode, plugins: [{pluginRef: decode-filter}]}
"""
    picker = _picker(config_text)
    assert PREFILL_HEADER in _route(picker, _chat(IMAGE))  # 1 role token + 40 image tokens
    assert PREFILL_HEADER not in _route(picker, _chat({"type": "text", "text": "short"}))


# -- the stream parks for a render -----------------------------------------------------------------


def test_the_stream_parks_for_the_render_then_routes_with_its_tokens() -> None:
    picker = _picker("""plugins:
- {type: encode-filter}
- {type: decode-filter}
- {type: token-producer, parameters: {modelName: m, vllm: {url: 'http://127.0.0.1:1'}}}
- {type: always-disagg-multimodal-decider}
- {type: disagg-profile-handler, parameters: {deciders: {encode: always-disagg-multimodal-decider}}}
schedulingProfiles:
- {name: encode, plugins: [{pluginRef: encode-filter}]}
- {name: decode, plugins: [{pluginRef: decode-filter}]}
""")
    started: list[tuple[RenderCall, Callable[[TokenizedPrompt | None], None]]] = []
    picker.start_render = lambda call, body, done: started.append((call, done))
    image_tokens = TokenizedPrompt((render_reply_prompt(),))
    headers = _route(picker, _chat(IMAGE), after=lambda: started[-1][1](image_tokens))
    assert started[-1][0].path == "/v1/chat/completions/render"
    assert headers[ENCODERS_HEADER] in (ENCODE, ENCODE_2) and headers[DESTINATION] == DECODE
    failed = _route(picker, _chat(IMAGE), after=lambda: started[-1][1](None))  # the reference: log, go on
    assert ENCODERS_HEADER not in failed and failed[DESTINATION] == DECODE
    stream = picker.new_stream()  # the client left while the render ran: its reply routes nothing
    stream.on_message(request_headers("/v1/chat/completions"))
    stream.on_message(request_body(json.dumps({"model": "m", **_chat(IMAGE)}).encode()))
    stream.on_abort()
    started[-1][1](image_tokens)
    assert stream.route is None and not list(stream.resume())


def render_reply_prompt() -> Any:
    from evergreen_trio.picker.vllm_render import render_reply
    reply = {"token_ids": [1, 2, 3, 4], "features": {"mm_hashes": {"image": ["h"]},
                                                      "mm_placeholders": {"image": [{"offset": 1, "length": 2}]}}}
    tokens = render_reply(RenderCall("/v1/chat/completions/render", b"", 1.0), 200, json.dumps(reply).encode(), {})
    assert tokens is not None
    return tokens.prompts[0]


# -- a started picker, grpcio as Envoy ---------------------------------------------------------------


def upstream(port: int, body: bytes, path: str = "/v1/chat/completions") -> dict[str, str]:
    """One buffered request through the ext_proc port, grpcio as Envoy: the headers set on it
    upstream (blocking; ValueError when none are, as before the picker's first scrapes)."""
    pairs = [(":path", path), (":method", "POST"), ("content-type", "application/json")]
    head = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])))
    message = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                     request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        replies = list(call(iter([head, message]), timeout=30))
    (mutation,) = [r.request_body.response.header_mutation for r in replies
                   if r.request_body.response.header_mutation.set_headers]
    return set_headers(mutation)


def upstream_chat(port: int, body: Mapping[str, Any]) -> dict[str, str]:
    """:func:`upstream` of a chat body."""
    return upstream(port, json.dumps(body).encode())


async def first_route(port: int, body: bytes, path: str = "/v1/chat/completions") -> dict[str, str]:
    """:func:`upstream` in a thread, again until the picker's first scrapes are in (it answers 503 before)."""
    while True:
        try:
            return await trio.to_thread.run_sync(upstream, port, body, path)
        except ValueError:
            await trio.sleep(0.05)


async def test_a_started_picker_routes_an_image_chat_through_encode_prefill_decode(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    encode, prefill, decode = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(3)]
    renderer = await _sim(nursery, "m")
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool:
  name: epd
  endpoints:
  - {{address: '{encode}', labels: {{llm-d.ai/role: encode}}}}
  - {{address: '{prefill}', labels: {{llm-d.ai/role: prefill}}}}
  - {{address: '{decode}', labels: {{llm-d.ai/role: decode}}}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: token-producer, parameters: {{modelName: m, vllm: {{url: 'http://127.0.0.1:{renderer.port}'}}}}}}
""" + (FIXTURES / "sim-e-p-d-epp-config.yaml").read_text().split("plugins:\n", 1)[1])
    image_chat = {"model": "m", **_chat({"type": "text", "text": "what is this?"}, IMAGE)}
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(10):
            routed = await first_route(picker.grpc, json.dumps(image_chat).encode())
        assert (routed[ENCODERS_HEADER], routed[PREFILL_HEADER], routed[DESTINATION]) == (encode, prefill, decode)
        plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        text = await trio.to_thread.run_sync(upstream_chat, picker.grpc, plain)
        assert ENCODERS_HEADER not in text and PREFILL_HEADER not in text and text[DESTINATION] == decode



def test_context_length_and_in_flight_load_count_the_producers_tokens() -> None:
    picker = _picker("""plugins:
- {type: token-producer, parameters: {estimate: {image: {mode: static, static: {staticToken: 1000}}}}}
- {type: context-length-aware, parameters: {label: llm-d.ai/role, enableFiltering: true}}
- {type: decode-filter}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: decode-filter}]}
""")
    tokens = picker.admit("/v1/chat/completions", {}, json.dumps({"model": "m", **_chat(IMAGE)}).encode(), None,
                         StreamReport()).tokens
    assert tokens is not None and tokens.token_count == 1 + 1000  # "user", then the image's placeholders
    request = PickRequest("m", 0, prompt_bytes=4, tokens=tokens)
    assert picker.scheduler.prompt_tokens(request) == 1001
    assert picker.scheduler.prompt_tokens(PickRequest("m", 0, prompt_bytes=4)) == 1


def test_a_token_counting_plugin_gets_the_default_estimate_producer_as_in_the_reference() -> None:
    """llm-d-router's framework adds an ``estimate`` token-producer for plugins consuming its tokens:
    the prefix-based decider then counts an image's placeholders (228 tokens here, not 3)."""
    picker = _picker((FIXTURES / "e2e-deprecated-pd-config.yaml").read_text())  # nonCachedTokens: 16
    assert picker.tokens is not None
    headers = _route(picker, _chat({"type": "text", "text": "describe"}, IMAGE))
    assert headers[PREFILL_HEADER] == PREFILL
    context = _picker("plugins:\n- {type: context-length-aware}\n")
    assert context.tokens is not None
    assert _picker("plugins:\n- {type: queue-scorer}\n").tokens is None


@pytest.mark.parametrize("tools", ["[1e400]", "[" + "1" + "0" * 400 + "]"])
def test_a_body_whose_tools_go_cannot_hold_goes_on_without_tokens(tools: str) -> None:
    picker = _picker((FIXTURES / "sim-e-pd-epp-config.yaml").read_text())
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/chat/completions"))
    messages = json.dumps([{"role": "user", "content": [IMAGE]}])
    body = '{"model": "m", "tools": ' + tools + ', "messages": ' + messages + "}"
    (reply, *_) = stream.on_message(request_body(body.encode()))
    headers = set_headers(reply.request_headers.response.header_mutation)
    assert headers[DESTINATION] == DECODE and ENCODERS_HEADER not in headers


def test_a_render_that_calls_back_at_once_routes_at_once() -> None:
    picker = _picker("""plugins:
- {type: decode-filter}
- {type: token-producer, parameters: {modelName: m}}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}]}
""")
    picker.start_render = lambda call, body, done: done(None)
    assert _route(picker, {"prompt": "hello"}, "/v1/completions")[DESTINATION] == DECODE
