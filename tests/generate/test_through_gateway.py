"""GENERATE through the real gateway: simulated servers, the picker and Envoy (``run_gateway``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from generate_helpers import BUSY, aborted, fill, generate, wait_until

from evergreen_trio import StatusCode
from evergreen_trio.generate import BackendSettings, served_by
from evergreen_trio.sim import SimConfig
from evergreen_trio.stack.gateway import GatewayInfo, GatewaySettings, run_gateway

pytestmark = pytest.mark.envoy

FAST = SimConfig(decode_ms_per_token=1.0, prefill_us_per_token=1.0)
SHEDDABLE = """\
pool: {name: shed, endpoints: [127.0.0.1:1]}
models: [{name: sim-model, criticality: Sheddable}]
scheduler: {queueThreshold: 1}
"""


async def test_two_turns_stream_through_the_gateway(nursery: trio.Nursery) -> None:
    info: GatewayInfo = await nursery.start(run_gateway, GatewaySettings(simulate=3, listen="127.0.0.1:0", sim=FAST))
    first, second = await generate(BackendSettings(info.url, "sim-model", max_tokens=5), second_turn="Who's winning?")
    for answer in (first, second):
        assert len(answer.pieces) == 5
        assert answer.metadata is not None and served_by(answer.metadata) in info.endpoints
    nursery.cancel_scope.cancel()


async def test_a_shed_request_is_resource_exhausted(nursery: trio.Nursery, tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(SHEDDABLE)
    settings = GatewaySettings(config_path=tmp_path / "pool.yaml", simulate=1, listen="127.0.0.1:0", sim=BUSY)
    info: GatewayInfo = await nursery.start(run_gateway, settings)
    async with httpx.AsyncClient(timeout=300) as client:
        await fill(nursery, client, info.endpoints[0])
        probe = {"model": "sim-model", "prompt": "x", "max_tokens": 1}

        async def shed() -> bool:  # once the picker has scraped the saturated server
            return (await client.post(f"{info.url}/v1/completions", json=probe)).status_code == 429

        await wait_until(shed)
        error = await aborted(BackendSettings(info.url, "sim-model"))
        nursery.cancel_scope.cancel()
    assert error.code == StatusCode.RESOURCE_EXHAUSTED
    assert "HTTP 429" in error.message


async def test_a_full_server_behind_the_gateway_is_unavailable(nursery: trio.Nursery) -> None:
    info: GatewayInfo = await nursery.start(run_gateway, GatewaySettings(simulate=1, listen="127.0.0.1:0", sim=BUSY))
    async with httpx.AsyncClient(timeout=300) as client:
        await fill(nursery, client, info.endpoints[0])
        error = await aborted(BackendSettings(info.url, "sim-model"))
        nursery.cancel_scope.cancel()
    assert error.code == StatusCode.UNAVAILABLE
    assert "HTTP 503: waiting queue is full" in error.message
