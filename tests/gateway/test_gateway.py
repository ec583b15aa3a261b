"""The gateway: simulated servers, the picker and a real Envoy under one nursery."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from evergreen_trio.picker.errors import ConfigError, EnvoyError
from evergreen_trio.sim import SERVED_BY_HEADER, SimConfig
from evergreen_trio.stack import gateway
from evergreen_trio.stack.gateway import GatewayError, GatewayInfo, GatewaySettings, run_gateway, settings_from_args

pytestmark = pytest.mark.envoy

FAST = SimConfig(decode_ms_per_token=1.0, prefill_us_per_token=1.0)
POOL_YAML = """\
pool:
  name: food
  endpoints: [127.0.0.1:1]
models:
  - name: food-review
    criticality: Standard
    targetModels: [{name: food-review-v1, weight: 1}, {name: food-review-v2, weight: 1}]
  - name: base-model
"""


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[GatewayInfo]:
    (tmp_path / "pool.yaml").write_text(POOL_YAML)
    settings = GatewaySettings(config_path=tmp_path / "pool.yaml", listen="127.0.0.1:0", simulate=2, sim=FAST)
    info: GatewayInfo = await nursery.start(run_gateway, settings)
    yield info
    nursery.cancel_scope.cancel()


async def test_a_completion_goes_through_envoy_to_a_simulated_server(stack: GatewayInfo) -> None:
    assert len(stack.endpoints) == 2 and stack.round_robin_url is None
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        response = await client.post("/v1/completions", json={"model": "base-model", "prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.headers[SERVED_BY_HEADER] in stack.endpoints
        assert response.json()["usage"]["completion_tokens"] == 3
        body = {"model": "food-review", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        # The picker rewrote food-review to a target, and rewrites the target back in the response.
        assert {json.loads(event)["model"] for event in events[:-1]} == {"food-review"}


async def test_unknown_models_get_the_pickers_404(stack: GatewayInfo) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        response = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert response.status_code == 404


async def test_the_round_robin_listener_spreads_requests() -> None:
    settings = GatewaySettings(listen="127.0.0.1:0", simulate=2, sim=FAST, round_robin_port=0)
    async with trio.open_nursery() as nursery:
        info: GatewayInfo = await nursery.start(run_gateway, settings)
        assert info.round_robin_url is not None
        served = set()
        async with httpx.AsyncClient(base_url=info.round_robin_url, timeout=30) as client:
            for _ in range(4):
                response = await client.post("/v1/completions", json={"model": "sim-model", "prompt": "same"})
                served.add(response.headers[SERVED_BY_HEADER])
        assert served == set(info.endpoints)
        nursery.cancel_scope.cancel()


async def test_the_gateway_stops_when_envoy_dies() -> None:
    with pytest.RaisesGroup(pytest.RaisesExc(EnvoyError, match="expected envoy to run until cancelled"),
                            flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            info: GatewayInfo = await nursery.start(run_gateway, GatewaySettings(listen="127.0.0.1:0", simulate=1))
            async with httpx.AsyncClient() as client:
                await client.post(f"{info.admin_url}/quitquitquit")
            await trio.sleep_forever()


def test_ctrl_c_stops_everything_and_leaves_no_envoy() -> None:
    script = ("import argparse, sys; from evergreen_trio.stack import gateway; p = argparse.ArgumentParser(); "
              "gateway.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.run(a))")
    command = [sys.executable, "-c", script, "gateway", "--simulate", "1", "--listen", "127.0.0.1:0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        admin = next(line.split()[2] for line in lines if line.startswith("envoy admin"))
        assert httpx.get(f"{admin}/ready").status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{admin}/ready")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "expected a config file, or simulate >= 1"),
        ({"simulate": 65}, "simulate must be in 0..64"),
        ({"simulate": 1, "listen": "localhost:80"}, "listen must be ip:port"),
        ({"simulate": 1, "listen": "127.0.0.1:99999"}, "listen port must be in 0..65535"),
        ({"simulate": 1, "listen": "127.0.0.1:\u00b2"}, "listen port must be in 0..65535"),
        ({"simulate": 1, "round_robin_port": -1}, "round_robin_port must be in 0..65535"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(GatewayError, match=message):
        GatewaySettings(**settings)  # type: ignore[arg-type]


async def test_a_bad_config_fails_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text("pool: {name: x, endpoints: []}\n")
    with pytest.raises(ConfigError, match=r"pool\.endpoints"):
        await run_gateway(GatewaySettings(config_path=tmp_path / "pool.yaml"))


def test_simulated_servers_serve_the_configured_names(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(POOL_YAML)
    config = gateway.pool_config(gateway._read_documents(tmp_path / "pool.yaml"), ["127.0.0.1:5", "127.0.0.1:6"])
    assert [e.address for e in config.pool.endpoints] == ["127.0.0.1:5", "127.0.0.1:6"]
    assert gateway.served_names(config) == ("food-review-v1", "food-review-v2", "base-model")


def test_cli_options_build_the_settings() -> None:
    parser = argparse.ArgumentParser()
    gateway.register(parser.add_subparsers())
    args = parser.parse_args(["gateway", "--simulate", "3", "--listen", "127.0.0.1:0", "--sim-max-batch", "4",
                              "--sim-time-scale", "2", "--round-robin-port", "8081"])
    settings = settings_from_args(args)
    assert (settings.simulate, settings.listen, settings.round_robin_port) == (3, "127.0.0.1:0", 8081)
    assert (settings.sim.max_batch, settings.sim.time_scale) == (4, 2.0)
