"""The simulator over real HTTP (hypercorn's Trio worker), driven by httpx on Trio."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio.sim import SERVED_BY_HEADER, SimConfig, SimConfigError, run_sim
from evergreen_trio.sim.cli import config_from_args, register
from evergreen_trio.sim.server import PREFILLED_BY_HEADER, PREFILLER_HEADER

FAST = SimConfig(lora_adapters=("food-review",), decode_ms_per_token=1.0, prefill_us_per_token=1.0,
                 max_body_bytes=64 * 1024)


@pytest.fixture
async def client(nursery: trio.Nursery) -> AsyncIterator[httpx.AsyncClient]:
    port = await nursery.start(partial(run_sim, FAST, port=0))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client


def sse_events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(event.startswith("data: ") for event in events)
    return [event.removeprefix("data: ") for event in events]


async def metrics(client: httpx.AsyncClient) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(response.text)
    }


async def test_completion(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "sim-model", "prompt": "x" * 40, "max_tokens": 5})
    assert response.status_code == 200
    assert response.headers[SERVED_BY_HEADER] == client.base_url.netloc.decode()
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "sim-model"
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_same_seed_same_text(client: httpx.AsyncClient) -> None:
    texts = set()
    for _ in range(2):
        response = await client.post("/v1/completions", json={"model": "sim-model", "prompt": "same"})
        texts.add(response.json()["choices"][0]["text"])
    assert len(texts) == 1


async def test_chat_stream_with_usage(client: httpx.AsyncClient) -> None:
    body = {"model": "food-review", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) == 5
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "food-review" for c in chunks)


async def test_completion_stream_without_usage(client: httpx.AsyncClient) -> None:
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        raw = "".join([chunk async for chunk in response.aiter_text()])
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all("usage" not in json.loads(event) for event in events[:-1])


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert [(m["id"], m["parent"]) for m in models["data"]] == [("sim-model", None), ("food-review", "sim-model")]


async def test_metrics_carry_vllm_names_and_follow_the_model(client: httpx.AsyncClient) -> None:
    prompt = "shared system prompt " * 20
    for _ in range(2):
        await client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 2})
    await client.post("/v1/completions", json={"model": "food-review", "prompt": "x", "max_tokens": 2})
    families = await metrics(client)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:cache_config_info", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert name in families, name
    assert families["vllm:num_requests_running"][0][2] == 0
    assert families["vllm:kv_cache_usage_perc"][0][2] == 0
    (_, cache_labels, _), = families["vllm:cache_config_info"]
    assert (cache_labels["block_size"], cache_labels["num_gpu_blocks"]) == ("16", str(FAST.kv_blocks))
    (_, lora_labels, _), = families["vllm:lora_requests_info"]
    assert lora_labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    hits = families["vllm:prefix_cache_hits"][0][2]
    assert hits == (len(prompt) // 64) * 16
    ttft_count = [v for n, _, v in families["vllm:time_to_first_token_seconds"] if n.endswith("_count")]
    assert ttft_count == [3]


async def test_running_adapters_show_in_lora_info(client: httpx.AsyncClient) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, "/v1/completions",
                                   json={"model": "food-review", "prompt": "x", "max_tokens": 2000}))
        while True:
            families = await metrics(client)
            (_, labels, _), = families["vllm:lora_requests_info"]
            if labels["running_lora_adapters"]:
                break
            await trio.sleep(0.01)
        assert labels["running_lora_adapters"] == "food-review"
        assert families["vllm:num_requests_running"][0][2] == 1
        nursery.cancel_scope.cancel()


async def test_a_client_that_hangs_up_frees_its_slot(client: httpx.AsyncClient) -> None:
    body = {"model": "sim-model", "prompt": "x", "max_tokens": 5000, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_bytes():
            break
    while True:  # the abort lands when hypercorn reports the disconnect; no deadline, no timing assertion
        if (await metrics(client))["vllm:num_requests_running"][0][2] == 0:
            break
        await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("method", "path", "content", "status", "message"),
    [
        ("POST", "/v1/completions", b"{not json", 400, "request body must be a JSON object"),
        ("POST", "/v1/completions", b'{"model": "m", "prompt": "x"}', 404, "`m` does not exist"),
        ("POST", "/v1/completions", b"x" * (64 * 1024 + 1), 413, "larger than the limit of 65536 bytes"),
        ("POST", "/v1/completions", b'{"model": "sim-model", "prompt": "x", "max_tokens": 9000}', 400,
         "maximum context length"),
        ("POST", "/v1/completions", b'{"model": "sim-model", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
         400, "request body must be a JSON object: Exceeds the limit (4300 digits)"),
        ("POST", "/v1/chat/completions/render", b'{"model": "sim-model", "n": 1' + b"0" * 5000 + b"}", 400,
         "request body must be a JSON object"),
        ("GET", "/v1/completions", b"", 405, "takes POST"),
        ("GET", "/nope", b"", 404, "no route for /nope"),
    ],
)
async def test_errors_are_json_with_a_clear_message(
    client: httpx.AsyncClient, method: str, path: str, content: bytes, status: int, message: str
) -> None:
    response = await client.request(method, path, content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == status


async def test_server_keeps_serving_after_bad_requests(client: httpx.AsyncClient) -> None:
    for content in (b"", b"\x00\xff", b"[]", b'{"model": 1}', b"{" * 5000):
        assert (await client.post("/v1/chat/completions", content=content)).status_code == 400
    assert (await client.post("/v1/completions", json={"model": "sim-model", "prompt": "ok"})).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_prompt_with_a_lone_surrogate_is_answered(client: httpx.AsyncClient, path: str) -> None:
    """It used to end the whole simulator: its step loop could not encode the prompt to UTF-8."""
    for text in ("\ud800", "x" * 200 + "\udfff" * 100):  # short, and over full KV blocks
        body: dict[str, object] = {"model": "sim-model", "max_tokens": 2}
        body |= {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
        assert (await client.post(path, content=json.dumps(body).encode())).status_code == 200
    assert (await client.get("/health")).status_code == 200


def test_cli_options_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sim", "--port", "0", "--max-batch", "4", "--kv-blocks", "100", "--lora", "a",
                              "--lora", "b", "--decode-ms-per-token", "2.5", "--seed", "7", "--time-scale", "3"])
    config = config_from_args(args)
    assert (config.max_batch, config.kv_blocks, config.lora_adapters) == (4, 100, ("a", "b"))
    assert (config.decode_ms_per_token, config.seed, config.time_scale) == (2.5, 7, 3.0)
    with pytest.raises(SimConfigError, match="max_batch"):
        config_from_args(parser.parse_args(["sim", "--max-batch", "0"]))


def test_the_sim_command_serves_until_ctrl_c() -> None:
    command = [sys.executable, "-m", "evergreen_trio.cli", "sim", "--port", "0", "--max-batch", "2",
               "--metrics-engine", "sglang"]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        assert process.stderr is not None
        address = ""
        for line in process.stderr:
            if "sim.ready address=" in line:
                address = line.split("sim.ready address=")[1].split()[0]
                break
        assert httpx.get(f"http://{address}/health").status_code == 200
        metrics = httpx.get(f"http://{address}/metrics").text
        assert "sglang:num_queue_reqs" in metrics and "vllm:num_requests_waiting" not in metrics
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"])
async def test_metrics_in_each_engines_names_and_the_prefiller_echo(nursery: trio.Nursery, engine: str) -> None:
    port = await nursery.start(partial(run_sim, SimConfig(metrics_engine=engine), port=0))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        families = {f.name for f in text_string_to_metric_families((await client.get("/metrics")).text)}
        plain = await client.get("/health")
        told = await client.get("/health", headers={PREFILLER_HEADER: "10.0.0.9:8000"})
    names = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs",
             "trtllm-serve": "trtllm_num_requests_waiting", "triton-tensorrt-llm": "nv_trt_llm_request_metrics"}
    assert names[engine] in families and all(n not in families for e, n in names.items() if e != engine)
    assert PREFILLED_BY_HEADER not in plain.headers and told.headers[PREFILLED_BY_HEADER] == "10.0.0.9:8000"
