"""Request bodies, response usage (JSON and SSE), engine metrics: examples and fuzzing."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.engine_metrics import (
    ENGINE_METRICS,
    EndpointMetrics,
    parse_engine_metrics,
    parse_spec,
    render_metrics,
)
from evergreen_trio.picker.errors import MetricsError, RequestError
from evergreen_trio.picker.request import (
    _DECODER,
    MAX_SPLICED_MEMBERS,
    Api,
    _detect_and_decode,
    _object_and_model_span,
    api_for_path,
    load_object,
    model_span_of,
    parse_body,
    rewrite_model,
)
from evergreen_trio.picker.usage import ResponseBody, Usage, usage_of


@pytest.mark.parametrize(("path", "api"), [
    ("/v1/completions", Api.COMPLETIONS),
    ("/v1/chat/completions?x=1", Api.CHAT),
    ("/override/v1/embeddings", Api.EMBEDDINGS),
    ("/v1/responses/", Api.RESPONSES),
    ("/v1/models", Api.COMPLETIONS),  # the openai parser's default type (it claims no such path)
])
def test_api_by_path_suffix(path: str, api: Api) -> None:
    assert api_for_path(path) is api


def test_prompt_per_api() -> None:
    chat = parse_body("/v1/chat/completions", json.dumps({
        "model": "m", "stream": True,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode())
    assert (chat.model, chat.stream, chat.prompt) == ("m", True, "systembe briefuserhi")
    assert parse_body("/v1/completions", b'{"model":"m","prompt":["a","b"]}').prompt == "ab"
    assert parse_body("/v1/embeddings", b'{"model":"m","input":"e"}').prompt == "e"
    assert parse_body("/v1/responses", b'{"model":"m","instructions":"i","input":"x"}').prompt == "ix"


@pytest.mark.parametrize("body", [b"{not json", b"[1]", b"", b"\xff"])
def test_bad_bodies_are_400(body: bytes) -> None:
    with pytest.raises(RequestError) as info:
        parse_body("/v1/completions", body)
    assert info.value.status == 400


@pytest.mark.parametrize("body", [b'{"prompt":"x"}', b'{"model":3,"prompt":"x"}', b'{"model":null,"prompt":"x"}'])
def test_a_body_without_a_string_model_reads_as_none(body: bytes) -> None:
    """As the reference's parser (``bodyMap["model"].(string)``): the picker decides what follows."""
    assert parse_body("/v1/completions", body).model == ""


@pytest.mark.parametrize("depth", [10, 600, 900, 5000])
def test_a_deeply_nested_prompt_is_read_or_refused_never_raised(depth: int) -> None:
    """The prompt is walked without recursion: nesting the JSON parser takes is read, deeper is 400."""
    body = ('{"model":"m","prompt":' + "[" * depth + '"x"' + "]" * depth + "}").encode()
    try:
        assert parse_body("/v1/completions", body).prompt == "x"
    except RequestError as exc:
        assert exc.status == 400 and depth > 900


def test_rewrite_model_keeps_other_fields() -> None:
    request = parse_body("/v1/completions", b'{"model": "a",\n "prompt": "p\\u00e9"}')
    assert rewrite_model(request, "b\u00e9") == '{"model": "b\u00e9",\n "prompt": "p\\u00e9"}'.encode()


def test_rewrite_of_a_body_of_many_members_reserializes() -> None:
    doc = {"model": "a", **{f"k{i}": i for i in range(MAX_SPLICED_MEMBERS)}}
    request = parse_body("/v1/completions", json.dumps(doc).encode())
    assert model_span_of(request) is None
    assert json.loads(rewrite_model(request, "b")) == {**doc, "model": "b"}


def _walked(body: bytes) -> tuple[str, object, object]:
    """What load_object made of ``body`` when it always walked the top-level members: the error
    class, or the document and the model's span."""
    try:
        doc, span = _object_and_model_span(_detect_and_decode(body), _DECODER)
    except (ValueError, RecursionError) as exc:
        return "error", type(exc).__name__, None
    return "ok", doc, span


_bodies = st.one_of(
    st.binary(max_size=80),
    st.lists(st.tuples(st.sampled_from(['"model"', '"prompt"', '"x"', '"model" ', '1', '"m\u00e9"']),
                       st.sampled_from(['"a"', " 1", "[1, {}]", '{"model": "in"}', "null", '"\\ud800"', "", "tru"]),
                       st.sampled_from(["", " ", "\n\t"])), max_size=6).map(
        lambda members: ("{" + ",".join(f"{s}{k}{s}:{s}{v}{s}" for k, v, s in members) + "}").encode()),
    st.integers(60, 70).map(lambda n: json.dumps({"model": "a", **{f"k{i}": i for i in range(n)}}).encode()),
    st.integers(8000, 8300).map(lambda n: json.dumps({"prompt": "p" * n, "model": "a"}).encode()),  # LAZY_SPAN_CHARS
    st.sampled_from([b"[1]", b" {} ", b'{"model":"a"} x', b'{"model":"a",}', b"\xef\xbb\xbf{}", b'{"a":1}{']),
)


@given(_bodies)
def test_the_body_is_read_as_walking_its_members_read_it(body: bytes) -> None:
    """The default decoder parses a body whole and locates the model only for a rewrite: the same
    document, the same span, the same error as walking the members at once."""
    kind, doc, span = _walked(body)
    try:
        read, _, _ = load_object(body)
    except RequestError as exc:
        assert exc.status == 400
        if kind == "error":
            assert exc.message == f"request body is not valid JSON ({doc})"
        else:
            assert not isinstance(doc, dict)
        return
    assert kind == "ok" and read == doc
    try:
        request = parse_body("/v1/completions", body)
    except RequestError:  # no string model, or a lone surrogate in it: nothing to rewrite
        return
    assert model_span_of(request) == span


_members = st.dictionaries(st.sampled_from(["model", "prompt", "stream", "x", "\u00e9"]),
                           st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                           | st.lists(st.text(max_size=4), max_size=3), max_size=5)


@given(st.text(min_size=1, max_size=8), _members, st.text(min_size=1, max_size=8), st.sampled_from(["", " ", "\n\t"]),
       st.booleans())
def test_rewrite_equals_reserializing(model: str, members: dict[str, object], new: str, space: str,
                                      duplicate: bool) -> None:
    """The spliced rewrite reads back as the re-serialized one, whatever the formatting."""
    pairs = [*([("model", 1)] if duplicate else []), *members.items(), ("model", model)]
    text = "{" + space + ("," + space).join(f"{json.dumps(k)}{space}:{space}{json.dumps(v)}" for k, v in pairs) + "}"
    try:
        request = parse_body("/v1/completions", text.encode("utf-8", "surrogatepass"))
    except RequestError as exc:  # a lone surrogate in the model or prompt
        assert exc.status == 400
        return
    assert request.body == json.loads(text)
    try:
        rewritten = rewrite_model(request, new)
    except RequestError as exc:
        assert exc.status == 400
        return
    assert json.loads(rewritten) == {**json.loads(text), "model": new}


def test_usage_from_json_and_rewrite_back() -> None:
    reader = ResponseBody(sse=False, rewrite=("t", "c"), max_bytes=1000)
    body = json.dumps({"model": "t", "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                "prompt_tokens_details": {"cached_tokens": 1}}}).encode()
    assert reader.feed(body[:10]) == b""
    assert reader.feed(body[10:]) == b""
    out = reader.finish()
    assert json.loads(out)["model"] == "c"
    assert reader.usage == Usage(5, 2, 1)


def test_usage_from_sse_split_across_chunks_and_events() -> None:
    stream = (b'data: {"model":"t","usage":{"prompt_tokens":4}}\n\n'
              b'data: {"model":"t","choices":[],"usage":{"completion_tokens":9}}\n\ndata: [DONE]\n\n')
    reader = ResponseBody(sse=True, rewrite=("t", "c"), max_bytes=1000)
    out = b"".join(reader.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + reader.finish()
    assert reader.usage == Usage(4, 9, None)
    lines = [line for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [json.loads(line[6:])["model"] for line in lines] == ["c", "c"]
    assert out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("sse", [False, True])
def test_a_rewritten_response_holding_a_lone_surrogate_is_passed_on_escaped(sse: bool) -> None:
    """A model server's ``\\ud800`` escape cannot be UTF-8: the rewritten document keeps it escaped
    (before, encoding it raised and the ext_proc stream ended with UNKNOWN)."""
    doc = b'{"model":"t","choices":[{"text":"a\\ud800 \xc3\xa9"}]}'
    reader = ResponseBody(sse=sse, rewrite=("t", "c"), max_bytes=1000)
    body = b"data: " + doc + b"\n\n" if sse else doc
    out = reader.feed(body) + reader.finish()
    passed = out.removeprefix(b"data: ").rstrip(b"\n")
    out.decode("utf-8")  # valid UTF-8 throughout
    assert json.loads(passed) == {**json.loads(doc), "model": "c"} and reader.rewritten


def test_responses_api_usage_names() -> None:
    reader = ResponseBody(sse=True, rewrite=None, max_bytes=1000)
    reader.feed(b'data: {"type":"response.completed","response":{"usage":{"input_tokens":3,"output_tokens":4,'
                b'"input_tokens_details":{"cached_tokens":2}}}}\n')
    assert reader.usage == Usage(3, 4, 2)


def test_the_total_is_kept_as_the_references_merge_keeps_it() -> None:
    full = usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 9}})
    assert full == Usage(3, 4, None, 9) and full.total == 9
    assert usage_of({"usage": {"prompt_tokens": 3, "total_tokens": 9}}) == Usage(3)  # a partial block's: no
    assert usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 9}}) == Usage(3, 0)
    later = full.merged(Usage(None, 6))  # a later block without a total: prompt + completion again
    assert later == Usage(3, 6) and later.total == 9
    assert full.merged(Usage(5, 6, None, 20)).total == 20 and Usage().total == 0


def test_response_body_limits() -> None:
    with pytest.raises(RequestError):
        ResponseBody(sse=False, rewrite=None, max_bytes=4).feed(b"12345")
    with pytest.raises(RequestError):
        ResponseBody(sse=True, rewrite=None, max_bytes=4).feed(b"data: long line without end")


@pytest.mark.parametrize("engine", sorted(ENGINE_METRICS))
def test_engine_metrics_round_trip(engine: str) -> None:
    spec = ENGINE_METRICS[engine]
    geometry = {"block_size": 32, "num_blocks": 900} if spec.cache_info or spec.block_size else {}
    metrics = EndpointMetrics(waiting=3, running=2, kv_usage=0.25 if spec.kv else 0.0, **geometry)
    assert parse_engine_metrics(engine, render_metrics(engine, metrics)) == metrics


def test_each_engine_reads_its_real_metric_names() -> None:
    triton = """# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="m",request_type="waiting",version="1"} 4
nv_trt_llm_request_metrics{model="m",request_type="scheduled",version="1"} 2
nv_trt_llm_request_metrics{model="m",request_type="context",version="1"} 99
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="m",version="1"} 0.5
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="m",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="m",version="1"} 1000
"""
    m = parse_engine_metrics("triton-tensorrt-llm", triton)
    assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_blocks) == (4, 2, 0.5, 64, 1000)
    sglang = "sglang:num_queue_reqs 1\nsglang:num_running_reqs 2\nsglang:token_usage 0.3\n"
    assert parse_engine_metrics("sglang", sglang) == EndpointMetrics(1, 2, 0.3)
    trt = "trtllm_num_requests_waiting 5\ntrtllm_num_requests_running 6\ntrtllm_kv_cache_utilization 0.7\n"
    assert parse_engine_metrics("trtllm-serve", trt) == EndpointMetrics(5, 6, 0.7)
    assert parse_engine_metrics("trtllm", trt) == EndpointMetrics(5, 6, 0.7)
    with pytest.raises(MetricsError, match="vllm:num_requests_waiting"):
        parse_engine_metrics("vllm", sglang)  # an SGLang pod read with vLLM's names is not ready
    with pytest.raises(MetricsError, match="expected engine"):
        parse_engine_metrics("tgi", trt)


@pytest.mark.parametrize("text", ["", "1abc", "m{a}", "m{a=b", "m{=b}"])
def test_bad_metric_specs(text: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_spec(text)


def test_vllm_metrics_as_served() -> None:
    text = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 2.0
vllm:num_requests_waiting{engine="0",model_name="b"} 1.0
vllm:num_requests_running{engine="0",model_name="a"} 4.0
vllm:gpu_cache_usage_perc{engine="0",model_name="a"} 0.5
vllm:lora_requests_info{max_lora="2",running_lora_adapters="x",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="x,y",waiting_lora_adapters="z"} 1.8e9
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"} 1.0
"""
    m = parse_engine_metrics("vllm", text)
    assert (m.waiting, m.running, m.kv_usage) == (3.0, 4.0, 0.5)
    assert m.running_adapters == {"x", "y"} and m.waiting_adapters == {"z"} and m.max_lora == 2
    assert (m.block_size, m.num_blocks) == (16, 2048)


def test_missing_core_metric_is_an_error() -> None:
    with pytest.raises(MetricsError, match="vllm:kv_cache_usage_perc"):
        parse_engine_metrics("vllm", "vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n")


@pytest.mark.fuzz
@given(st.binary(max_size=300), st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]))
def test_fuzz_request_body(body: bytes, path: str) -> None:
    try:
        request = parse_body(path, body)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert isinstance(request.model, str) and isinstance(request.prompt, str)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["model", "usage", "prompt_tokens", "completion_tokens", "response", "x"]), inner, max_size=3),
    max_leaves=12,
)


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=60) | _json.map(lambda d: b"data: " + json.dumps(d).encode() + b"\n"),
                max_size=6), st.booleans())
def test_fuzz_response_body(chunks: list[bytes], sse: bool) -> None:
    reader = ResponseBody(sse=sse, rewrite=("t", "c"), max_bytes=200)
    try:
        for chunk in chunks:
            reader.feed(chunk)
        reader.finish()
    except RequestError as exc:
        assert exc.status == 502
    assert isinstance(reader.usage, Usage)


@pytest.mark.fuzz
@given(st.text(max_size=300), st.sampled_from(sorted(ENGINE_METRICS)))
def test_fuzz_engine_metrics(text: str, engine: str) -> None:
    with contextlib.suppress(MetricsError):
        parse_engine_metrics(engine, text)
