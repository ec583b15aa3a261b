"""Test peers for the picker: fake model servers on loopback and a real Envoy launched per module."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import ENVOY_ARGS, find_envoy
from evergreen_trio.testing.wire import health_status

USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class FakeModelServer:
    """A model server whose ``/metrics`` the test sets; it echoes what it received."""

    port: int
    engine: str = "vllm"
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    host: str = "127.0.0.1"
    requests: list[HttpRequest] = field(default_factory=list)
    metrics_delay_s: float = 0.0
    response_delay_s: float = 0.0
    cancel: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def handle(self, request: HttpRequest) -> HttpResponse:
        if request.target == "/metrics":
            await trio.sleep(self.metrics_delay_s)
            text = render_metrics(self.engine, self.metrics)
            return HttpResponse(200, [("content-type", "text/plain")], text.encode())
        self.requests.append(request)
        await trio.sleep(self.response_delay_s)
        try:
            doc = json.loads(request.body) if request.body else {}
        except ValueError:
            doc = {}
        model = doc.get("model") if isinstance(doc, dict) else None
        headers = [("x-served-by", self.address)]
        if isinstance(doc, dict) and doc.get("stream"):
            first = json.dumps({"model": model, "choices": [{"text": "hi"}]})
            last = json.dumps({"model": model, "choices": [], "usage": USAGE})
            # The usage event is split across two writes, the way a network would split it.
            chunks = [f"data: {first}\n\n".encode(), f"data: {last[:20]}".encode(),
                      f"{last[20:]}\n\n".encode(), b"data: [DONE]\n\n"]
            return HttpResponse(200, [*headers, ("content-type", "text/event-stream")], chunks=chunks)
        body = json.dumps({
            "model": model, "served_by": self.address, "received_bytes": len(request.body),
            "received_headers": request.headers, "usage": USAGE,
        }).encode()
        return HttpResponse(200, [*headers, ("content-type", "application/json")], body)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel:
            await serve_http(self.handle, self.host, self.port, task_status=task_status)


Body = str | bytes


@dataclass
class PolledServer:
    """A model server with an idle vLLM ``/metrics`` and, at ``path``, a data source's page (a models
    list, a dcgm-exporter page) answering what ``answer`` says: a body, an HTTP status and a body, or
    None to never answer. ``polls`` counts the GETs of ``path``."""

    path: str
    answer: Body | tuple[int, Body] | None
    content_type: str = "text/plain"
    polls: int = 0
    polled: trio.Event = field(default_factory=trio.Event)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        metrics = render_metrics("vllm", EndpointMetrics()).encode()

        async def handle(request: HttpRequest) -> HttpResponse:
            if request.target != self.path:
                return HttpResponse(200, [("content-type", "text/plain")], metrics)
            self.polls += 1
            self.polled.set()
            if self.answer is None:
                await trio.sleep_forever()
            status, body = self.answer if isinstance(self.answer, tuple) else (200, self.answer)
            return HttpResponse(status, [("content-type", self.content_type)],
                                body.encode() if isinstance(body, str) else body)

        await serve_http(handle, "127.0.0.1", 0, task_status=task_status)

    async def next_polls(self, count: int) -> None:
        """Wait (10 s at most) until ``path`` has been polled ``count`` more times."""
        target = self.polls + count
        with trio.fail_after(10):
            while self.polls < target:
                self.polled = trio.Event()
                await self.polled.wait()


@dataclass
class Gateway:
    """A running Envoy (one per test module) routing through the picker port."""

    port: int
    admin_port: int
    picker_port: int
    process: subprocess.Popen[bytes]

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def start_envoy(directory: Path, picker_port: int, pool: list[str], **options: object) -> Gateway:
    """Launch Envoy from the test process (it dies with it) and wait for admin /ready."""
    port, admin_port = free_port(), free_port()
    config = gateway_config(f"127.0.0.1:{picker_port}", port, admin_port=admin_port, pool_endpoints=pool,
                            subset_hint_header="x-test-subset-hint", message_timeout_s=10.0, **options)  # type: ignore[arg-type]
    path = write_gateway_config(directory / f"envoy-{port}.json", config)
    process = subprocess.Popen([find_envoy(), "-c", str(path), *ENVOY_ARGS], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1).status_code == 200:
                return Gateway(port, admin_port, picker_port, process)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("envoy did not become ready")


def stop_envoy(gateway: Gateway) -> None:
    gateway.process.terminate()
    try:
        gateway.process.wait(10)
    except subprocess.TimeoutExpired:
        gateway.process.kill()
        gateway.process.wait()




async def wait_serving(health_port: int, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while True:
            if await trio.to_thread.run_sync(health_status, f"127.0.0.1:{health_port}", "readiness") == "SERVING":
                return
            await trio.sleep(0.05)
