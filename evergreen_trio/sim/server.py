"""The Trio shell of the simulator: an ASGI app under our HTTP/1.1 server (`evergreen_trio._asgi`) and
the engine's step loop.

One scheduler task drives the sans-IO engine: it starts a step, sleeps for the step's
simulated duration, then hands each request's new token to that request's memory channel.
HTTP handlers put requests into the engine and read their channel.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from evergreen_trio._asgi import (
    BodyTooLargeError,
    ClientGoneError,
    HttpServerLimits,
    Receive,
    Scope,
    Send,
    lifespan,
    read_body,
    serve_asgi,
)
from evergreen_trio._logsafe import peer_text
from evergreen_trio.sim import api, render
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimRequestError
from evergreen_trio.sim.metrics import SimMetrics
from evergreen_trio.sim.model import Emission, Engine, SimRequest

logger = logging.getLogger(__name__)


_Handler = Callable[[str, Receive, Send], Awaitable[None]]


BODY_TIMEOUT_S = 30.0
"""A request body must be in this soon after its headers (else 408)."""

SIM_HTTP_LIMITS = HttpServerLimits(max_connections_per_peer=HttpServerLimits().max_connections)
"""The simulator's HTTP limits: the defaults, but no per-address share, as its one client is often Envoy."""

SERVED_BY_HEADER = "x-served-by"
"""Response header naming the simulated server (``host:port``) that answered."""
PREFILLER_HEADER = "x-prefiller-host-port"
PREFILLED_BY_HEADER = "x-prefilled-by"
"""Response header repeating the request's ``x-prefiller-host-port`` (the prefill pod an llm-d
routing sidecar beside this decode server would have prefilled on), so P/D is visible end to end."""


def _echo_prefiller(send: Send, prefiller: bytes) -> Send:
    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], (PREFILLED_BY_HEADER.encode(), prefiller)]}
        await send(message)

    return wrapped


class SimServer:
    """One simulated vLLM server: the engine, its metrics, the ASGI app and the step loop."""

    def __init__(self, config: SimConfig, *, name: str = "sim") -> None:
        self.config = config
        self.name = name
        self.engine = Engine(config)
        self.metrics = SimMetrics(self.engine)
        self._streams: dict[str, trio.MemorySendChannel[Emission]] = {}
        self._wake = trio.Event()
        self._ids = itertools.count()
        self._routes: dict[str, tuple[str, _Handler]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/metrics": ("GET", self._metrics),
            api.COMPLETIONS: ("POST", self._completion),
            api.CHAT_COMPLETIONS: ("POST", self._completion),
            render.COMPLETIONS_RENDER: ("POST", self._render),
            render.CHAT_RENDER: ("POST", self._render),
        }

    async def run_scheduler(self) -> None:
        """The step loop; runs until cancelled."""
        engine = self.engine
        while True:
            start = trio.current_time()
            duration = engine.start_step(start)
            if duration is None:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            end = start + duration
            await trio.sleep_until(end)
            for emission in engine.finish_step(end):
                if emission.timings is not None and emission.usage is not None:
                    self.metrics.observe_finished(emission.timings, emission.usage)
                channel = self._streams.get(emission.request_id)
                if channel is not None:
                    channel.send_nowait(emission)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point."""
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        route = self._routes.get(path)
        prefiller = dict(scope.get("headers") or ()).get(PREFILLER_HEADER.encode())
        if prefiller is not None:
            send = _echo_prefiller(send, prefiller)
        try:
            if route is None:
                raise SimRequestError(404, f"no route for {path}; expected one of {sorted(self._routes)}",
                                      error_type="NotFoundError")
            if method != route[0]:
                raise SimRequestError(405, f"{path} takes {route[0]}, got {method}", error_type="MethodNotAllowed")
            await route[1](path, receive, send)
        except SimRequestError as error:
            logger.info("sim.reject path=%s status=%d reason=%s", peer_text(path, 100), error.status,
                        peer_text(error.message))
            await self._respond(send, error.status, api.error_body(error.status, error.message, error.error_type))
        except ClientGoneError:
            logger.info("sim.abort path=%s reason=client-gone-before-body", peer_text(path, 100))

    async def _respond(
        self, send: Send, status: int, body: bytes, content_type: str = "application/json"
    ) -> None:
        await send({"type": "http.response.start", "status": status, "headers": self._headers(content_type)})
        await send({"type": "http.response.body", "body": body})

    def _headers(self, content_type: str) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type.encode()), (SERVED_BY_HEADER.encode(), self.name.encode())]

    async def _health(self, path: str, receive: Receive, send: Send) -> None:
        await self._respond(send, 200, b"", "text/plain")

    async def _models(self, path: str, receive: Receive, send: Send) -> None:
        await self._respond(send, 200, api.models_body(self.config, int(time.time())))

    async def _metrics(self, path: str, receive: Receive, send: Send) -> None:
        await self._respond(send, 200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def _read_body(self, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        with trio.move_on_after(BODY_TIMEOUT_S):
            try:
                return await read_body(receive, limit)
            except BodyTooLargeError:
                raise SimRequestError(413, f"request body is larger than the limit of {limit} bytes",
                                      error_type="PayloadTooLarge") from None
        raise SimRequestError(408, f"request body: expected it within {BODY_TIMEOUT_S}s", error_type="RequestTimeout")

    async def _render(self, path: str, receive: Receive, send: Send) -> None:
        body = await self._read_body(receive)
        reply = render.render_chat if path == render.CHAT_RENDER else render.render_completions
        await self._respond(send, 200, reply(body, self.config))

    async def _completion(self, path: str, receive: Receive, send: Send) -> None:
        request = api.parse_request(path, await self._read_body(receive), self.config)
        request_id = f"{'chatcmpl' if request.chat else 'cmpl'}-{self.name}-{next(self._ids)}"
        sender, receiver = trio.open_memory_channel[Emission](request.max_tokens)
        self.engine.add(SimRequest(request_id, request.prompt, request.max_tokens, request.lora), trio.current_time())
        self._streams[request_id] = sender
        self._wake.set()
        logger.debug("sim.accept id=%s model=%s max_tokens=%d stream=%s", request_id, peer_text(request.model),
                     request.max_tokens, request.stream)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                if request.stream:
                    await self._stream(request, request_id, receiver, send)
                else:
                    await self._collect(request, request_id, receiver, send)
                nursery.cancel_scope.cancel()
        finally:
            del self._streams[request_id]
            if self.engine.abort(request_id):
                logger.info("sim.abort id=%s reason=client-gone", request_id)

    async def _collect(
        self, request: api.ParsedRequest, request_id: str, receiver: trio.MemoryReceiveChannel[Emission], send: Send
    ) -> None:
        words = []
        async for emission in receiver:
            words.append(emission.text)
            if emission.usage is not None:
                body = api.full_response(request, request_id, int(time.time()), "".join(words), emission.usage)
                await self._respond(send, 200, json.dumps(body).encode())
                return

    async def _stream(
        self, request: api.ParsedRequest, request_id: str, receiver: trio.MemoryReceiveChannel[Emission], send: Send
    ) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self._headers("text/event-stream"), (b"cache-control", b"no-cache")]})
        created = int(time.time())
        async for emission in receiver:
            last = emission.usage is not None
            frames = api.sse(api.stream_chunk(request, request_id, created, emission.text, first=emission.first,
                                              last=last))
            if last:
                if request.include_usage and emission.usage is not None:
                    frames += api.sse(api.usage_chunk(request, request_id, created, emission.usage))
                frames += api.SSE_DONE
            await send({"type": "http.response.body", "body": frames, "more_body": not last})
            if last:
                return


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()



async def run_sim(
    config: SimConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one simulated server until cancelled; ``started`` reports the bound port (useful with port 0)."""
    server = SimServer(config)
    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(partial(serve_asgi, server, host, port, SIM_HTTP_LIMITS, name="sim.http"))
        server.name = f"{host}:{bound}"
        nursery.start_soon(server.run_scheduler)
        logger.info("sim.ready address=%s model=%s adapters=%s", server.name, config.model,
                    ",".join(config.lora_adapters))
        task_status.started(bound)
