"""A picker stopped with SIGTERM drains as the reference EPP does, through a real Envoy: NOT_SERVING at
once, ext_proc served through the window, then a graceful GOAWAY, and the request in flight (its
ext_proc stream open while its response is observed) ends 200 instead of being cut."""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from conftest import Ports
from picker_cli import health, picker_process
from picker_fakes import FakeModelServer, Gateway, wait_serving

from evergreen_trio.picker import PickerDrain, PickerPorts, parse_config, run_picker

pytestmark = pytest.mark.envoy

BODY = json.dumps({"model": "food-review", "prompt": "hello"}).encode()


def config_text(pool: list[str]) -> str:
    endpoints = "\n".join(f"    - address: {a}" for a in pool)
    return f"pool:\n  name: test\n  endpoints:\n{endpoints}\nmodels:\n  - name: food-review\n"


async def post(gateway: Gateway) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(gateway.url("/v1/completions"), content=BODY)


async def wait_received(backends: list[FakeModelServer], count: int) -> None:
    with trio.fail_after(20):
        while sum(len(b.requests) for b in backends) < count:  # noqa: ASYNC110 (a peer's state)
            await trio.sleep(0.02)


async def test_a_drain_serves_the_window_then_lets_the_request_in_flight_end(
        nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway) -> None:
    for backend in backends:
        backend.response_delay_s = 1.5
    drain = PickerDrain(window_s=1.0, grace_s=20)
    bound: PickerPorts = await nursery.start(partial(
        run_picker, parse_config(config_text(ports.pool)), grpc_port=ports.picker, health_port=0, metrics_port=0,
        drain=drain))
    await wait_serving(bound.health)
    responses: list[httpx.Response] = []

    async def send() -> None:
        responses.append(await post(duplex_gateway))

    nursery.start_soon(send)
    await wait_received(backends, 1)  # routed; its ext_proc stream stays open for the response
    drained = trio.Event()

    async def run_drain() -> None:
        await drain.drain()
        drained.set()

    nursery.start_soon(run_drain)
    await trio.sleep(0.1)
    check = partial(trio.to_thread.run_sync, health, "127.0.0.1", bound.health)
    assert await check("readiness") == "NOT_SERVING"
    assert await check("inference-extension") == "NOT_SERVING"
    assert await check("liveness") == "SERVING"
    second = await post(duplex_gateway)  # inside the window: still routed
    assert second.status_code == 200, second.text
    with trio.fail_after(20):
        await drained.wait()
    assert [r.status_code for r in responses] == [200], [r.text for r in responses]
    with pytest.raises(OSError):  # the port closed after the window
        await trio.open_tcp_stream("127.0.0.1", ports.picker)


async def test_sigterm_drains_the_command_and_the_request_in_flight_ends(
        nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway,
        tmp_path: Path) -> None:
    for backend in backends:
        backend.response_delay_s = 2.0
    config = tmp_path / "picker.yaml"
    config.write_text(config_text(ports.pool))
    args = ["--config", str(config), "--grpc-port", str(ports.picker), "--grpc-health-port", "0",
            "--metrics-port", "0", "--drain-timeout", "500ms", "--stop-grace=30s"]
    async with picker_process(args) as picker:
        await wait_serving(picker.health)
        responses: list[httpx.Response] = []

        async def send() -> None:
            responses.append(await post(duplex_gateway))

        async with trio.open_nursery() as requests:
            requests.start_soon(send)
            await wait_received(backends, 1)
            picker.process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await picker.process.wait() == 0
    assert [r.status_code for r in responses] == [200], [r.text for r in responses]
