"""Helpers for the GENERATE backend tests: a real Evergreen server backed by a real HTTP upstream.

``scripted_upstream`` is a tiny OpenAI-shaped server (hypercorn's Trio worker, a real HTTP stack)
whose behaviour is chosen by the request's ``model``: error statuses, broken streams, slow answers.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from evergreen_trio import NodeRef, Server, SessionAbortedError, connect, inner, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import ChunkMetadata
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.generate import BackendSettings, open_backend
from evergreen_trio.nodes import Inner, Leaf
from evergreen_trio.sim import SimConfig

SERVED_BY = "scripted-upstream"


@dataclass
class Answer:
    """One GENERATE output as the client saw it."""

    pieces: list[bytes] = field(default_factory=list)
    metadata: ChunkMetadata | None = None

    @property
    def text(self) -> str:
        return b"".join(self.pieces).decode()


async def generate(
    settings: BackendSettings, prompt: Leaf | Inner | None = None, *, second_turn: str | None = None
) -> list[Answer]:
    """Run GENERATE on ``prompt`` through a fresh server backed by ``settings``; with ``second_turn``,
    run it again on [prompt, response, second_turn] (the spec's second turn). A session abort
    raises SessionAbortedError."""
    prompt = prompt or inner(text("Write a summary of this video: "), id="prompt_1")
    answers: list[Answer] = []
    aborted: SessionAbortedError | None = None
    server = Server()
    async with open_backend(settings) as backend, trio.open_nursery() as nursery:
        register_builtin_actions(server, generate_handler=backend.generate)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        try:
            await _turns(port, prompt, second_turn, answers)
        except SessionAbortedError as error:  # raised plainly, not in the server nursery's group
            aborted = error
        nursery.cancel_scope.cancel()
    if aborted is not None:
        raise aborted
    return answers


async def aborted(settings: BackendSettings) -> SessionAbortedError:
    """The abort of one GENERATE that must fail."""
    with pytest.raises(SessionAbortedError) as caught:
        await generate(settings)
    return caught.value


async def _turns(port: int, prompt: Leaf | Inner, second_turn: str | None, answers: list[Answer]) -> None:
    async with connect(f"127.0.0.1:{port}") as session:
        turns = [(prompt, "response_1")]
        if second_turn is not None:
            turns.append((inner(NodeRef(prompt.id or "prompt_1"), NodeRef("response_1"), text(second_turn)),
                          "response_2"))
        for node, output in turns:
            call = await session.run("GENERATE", {"prompt": node}, {"response": output})
            answer = Answer()
            async for chunk in call["response"]:
                answer.metadata = chunk.metadata
                answer.pieces += [piece async for piece in chunk]
            answers.append(answer)


async def wait_until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll a condition outside this process (HTTP state has no event to wait on)."""
    while True:
        if await check():
            return
        await trio.sleep(0.02)


def gauge(metrics: str, name: str) -> float:
    """A gauge out of a simulator's /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


BUSY = SimConfig(max_batch=1, max_waiting=1, decode_ms_per_token=1000.0)
"""With :func:`fill`: one request runs and one waits for minutes, so the next is refused (503)."""


async def fill(nursery: trio.Nursery, client: httpx.AsyncClient, endpoint: str) -> None:
    """Make ``endpoint`` (a BUSY simulator, reached directly) run one request and queue one."""
    body = {"model": "sim-model", "prompt": "x", "max_tokens": 100}
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        nursery.start_soon(partial(client.post, f"http://{endpoint}/v1/completions", json=body))

        async def counted(metric: str = metric) -> bool:
            return gauge((await client.get(f"http://{endpoint}/metrics")).text, metric) >= 1

        await wait_until(counted)


def _sse(payload: object) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def _token(text: str) -> bytes:
    return _sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


async def scripted_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app; the request's ``model`` picks the answer:

    ``status-NNN`` an OpenAI error body with that status; ``plain-NNN`` a text/plain body;
    ``json`` a 200 that ignores ``stream``; ``empty`` no tokens, just ``[DONE]``; ``garbage`` SSE
    data that is not JSON; ``bad-utf8`` bytes that are not UTF-8; ``truncated`` two tokens and no
    ``[DONE]``; ``stream-error`` a token then vLLM's in-stream error object; ``hang`` a token then
    silence; ``echo-request`` one token, the request's JSON without ``prompt``/``messages``; ``deep`` SSE
    data and ``deep-503`` a 503 body, each JSON nested 100,000 levels deep; ``gzip`` two tokens and
    ``[DONE]`` gzipped, ``gzip-503`` a 503 of 1 MB of ``x`` gzipped to 1 kB (the request asked for
    ``identity``); ``forged-log`` a token whose finish_reason and usage hold newlines; ``surrogate`` a
    token holding a lone surrogate; ``long-content-type`` a 200 whose content-type is 50 kB long; anything else
    two tokens and ``[DONE]`` in an odd split (CRLF line ends, a comment,
    a chunk boundary mid-line).
    """
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = json.loads(body)
    model = request["model"]

    async def start(status: int, content_type: str = "text/event-stream") -> None:
        headers = [(b"content-type", content_type.encode()), (b"x-served-by", SERVED_BY.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    if model.startswith("status-"):
        status = int(model.removeprefix("status-"))
        await start(status, "application/json")
        await chunk(json.dumps({"error": {"message": f"scripted {status}", "code": status}}).encode(), False)
    elif model.startswith("plain-"):
        await start(int(model.removeprefix("plain-")), "text/plain")
        await chunk(b"upstream says no\x07", False)
    elif model == "json":
        await start(200, "application/json")
        await chunk(b'{"choices": [{"text": "whole"}]}', False)
    elif model == "garbage":
        await start(200)
        await chunk(_token("ok") + b"data: {not json\n\n", False)
    elif model == "deep":
        await start(200)
        await chunk(b"data: " + b"[" * 100_000 + b"\n\n", False)
    elif model == "deep-503":
        await start(503, "application/json")
        await chunk(b'{"error": ' + b"[" * 60_000, False)
    elif model == "gzip":
        headers = [(b"content-type", b"text/event-stream"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await chunk(gzip.compress(_token("one") + _token(" two") + _sse("[DONE]")), False)
    elif model == "long-content-type":
        await start(200, "application/" + "x" * 50_000)
        await chunk(b"{}", False)
    elif model == "surrogate":
        await start(200)
        await chunk(_token("ok") + b'data: {"choices": [{"text": "a\\ud800b"}]}\n\n' + _sse("[DONE]"), False)
    elif model == "forged-log":
        await start(200)
        choice = {"index": 0, "text": "ok", "finish_reason": "stop\nFORGED line"}
        usage = {"prompt_tokens": "1\nFORGED", "completion_tokens": [1], "prompt_tokens_details": {"cached_tokens": 2}}
        await chunk(_sse({"choices": [choice], "usage": usage}) + _sse("[DONE]"), False)
    elif model == "gzip-503":
        headers = [(b"content-type", b"text/plain"), (b"content-encoding", b"gzip")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await chunk(gzip.compress(b"x" * 1_000_000), False)
    elif model == "bad-utf8":
        await start(200)
        await chunk(b"data: \xff\xfe\n\n", False)
    elif model == "empty":
        await start(200)
        await chunk(_sse("[DONE]"), False)
    elif model == "truncated":
        await start(200)
        await chunk(_token("one") + _token(" two"), False)
    elif model == "stream-error":
        await start(200)
        await chunk(_token("one") + _sse({"error": {"message": "scripted overload", "code": 503}}), False)
    elif model == "echo-request":
        await start(200)
        fields = {key: value for key, value in request.items() if key not in ("prompt", "messages")}
        await chunk(_token(json.dumps(fields, sort_keys=True)) + _sse("[DONE]"), False)
    elif model == "hang":
        await start(200)
        await chunk(_token("one"))
        await trio.sleep_forever()
    else:
        await start(200)
        first = b": keep-alive comment\r\n" + _token("Ayrton").replace(b"\n", b"\r\n")
        await chunk(first[:20])
        await chunk(first[20:] + _token(" Senna.")[:9])
        await chunk(_token(" Senna.")[9:] + _sse("[DONE]"), False)


async def run_scripted_upstream(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``scripted_upstream`` on a free loopback port until cancelled; ``started`` gets the port."""
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = logging.getLogger("tests.generate.upstream")
    config.graceful_timeout = 0.2
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, scripted_upstream, config))  # type: ignore[arg-type]
        task_status.started(int(binds[0].rsplit(":", 1)[1]))
