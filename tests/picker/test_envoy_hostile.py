"""Issue 22, items 8-10 end to end: the status the picker decides reaches the client through Envoy."""

from __future__ import annotations

import httpx
import pytest
import trio
from conftest import Ports
from picker_fakes import FakeModelServer, Gateway
from test_envoy_e2e import config_text, start_picker

pytestmark = pytest.mark.envoy
REWRITE = "x-gateway-model-name-rewrite"


async def send(gateway: Gateway, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(gateway.url("/v1/completions"), content=body, headers=headers)


@pytest.mark.parametrize("mode", ["duplex", "buffered"])
async def test_smuggled_rewrites_surrogates_and_costly_bodies_get_their_status(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], request: pytest.FixtureRequest, mode: str
) -> None:
    gateway: Gateway = request.getfixturevalue(f"{mode}_gateway")
    await start_picker(nursery, ports, config_text(ports.pool))
    plain = b'{"model":"food-review","prompt":"hi"}'
    smuggled = await send(gateway, plain, {REWRITE: "plain"})  # listed, but not a target of food-review
    assert smuggled.status_code == 404, smuggled.text
    assert not any(s.requests for s in backends)
    allowed = await send(gateway, plain, {REWRITE: "food-review-v1"})
    assert allowed.status_code == 200, allowed.text
    surrogate = await send(gateway, b'{"model":"food-review","prompt":"a\\ud800"}', {REWRITE: "food-review-v1"})
    assert surrogate.status_code == 400
    assert "lone surrogate" in surrogate.json()["error"]["message"]
    costly = await send(gateway, b'{"model":"food-review","prompt":[' + b",".join([b"{}"] * 40_000) + b"]}")
    assert costly.status_code == 413
    assert "MAX_BODY_JSON_CONTAINERS" in costly.json()["error"]["message"]
