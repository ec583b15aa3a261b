"""A model server that dies under load, behind the real gateway (three simulated servers, the
picker, Envoy): the picker stops routing to it once a scrape fails, the requests it had in
flight fail cleanly (an HTTP error status from Envoy, or a reset when the response had already
begun; never a hang or a timeout), and nothing else fails.

The moment the picker notices is read from the picker itself (``inference_pool_ready_pods``
drops to 2), not assumed from the clock; the test prints how long that took in scrape
intervals (the issue asks for at most two), but asserts only what follows from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import SERVED_BY_HEADER, run_sim
from evergreen_trio.stack.gateway import GatewayInfo, GatewaySettings, run_gateway

pytestmark = pytest.mark.envoy

SCRAPE_INTERVAL_S = 0.05
WORKERS = 12
HANG_GUARD_S = 60


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    status: int
    served_by: str


POOL = """
pool:
  name: faults
  refreshMetricsInterval: {interval}ms
  endpoints:
{endpoints}
"""


async def _ready_pods(client: httpx.AsyncClient, info: GatewayInfo) -> float:
    text = (await client.get(f"http://127.0.0.1:{info.picker.metrics}/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith("inference_pool_ready_pods{"))
    return float(line.rsplit(" ", 1)[1])


async def _load(url: str, outcomes: list[Outcome], stop: trio.Event) -> None:
    """One closed-loop client: requests of a few dozen decode steps until ``stop``."""
    body = {"model": "sim-model", "prompt": "Tell me about structured concurrency.", "max_tokens": 12}
    async with httpx.AsyncClient(timeout=20) as client:
        while not stop.is_set():
            started = trio.current_time()
            try:
                response = await client.post(f"{url}/v1/completions", json=body)
                status, served_by = response.status_code, response.headers.get(SERVED_BY_HEADER, "")
            except (httpx.RemoteProtocolError, httpx.ReadError):
                # The server died after Envoy had passed its response headers on: Envoy can only reset.
                status, served_by = 0, ""
            outcomes.append(Outcome(started, trio.current_time(), status, served_by))


async def test_a_model_server_that_dies_under_load_is_routed_around(tmp_path: Path) -> None:
    config = SimConfig(decode_ms_per_token=4.0)
    outcomes: list[Outcome] = []
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            victim = trio.CancelScope()
            addresses = []
            for index in range(3):
                scope = victim if index == 0 else trio.CancelScope()
                port = await nursery.start(_run_in_scope, scope, config)
                addresses.append(f"127.0.0.1:{port}")
            pool = tmp_path / "pool.yaml"
            pool.write_text(POOL.format(interval=int(SCRAPE_INTERVAL_S * 1000),
                                        endpoints="\n".join(f"    - address: {a}" for a in addresses)))
            settings = GatewaySettings(config_path=pool, listen="127.0.0.1:0")
            info: GatewayInfo = await nursery.start(run_gateway, settings)
            stop = trio.Event()
            for _ in range(WORKERS):
                nursery.start_soon(_load, info.url, outcomes, stop)
            async with httpx.AsyncClient() as metrics:
                while len({o.served_by for o in outcomes}) < 3:  # noqa: ASYNC110 - until every server has served
                    await trio.sleep(0.05)
                killed_at = trio.current_time()
                victim.cancel()
                while await _ready_pods(metrics, info) != 2:  # noqa: ASYNC110 - the picker's view, polled
                    await trio.sleep(0.005)
                noticed_at = trio.current_time()
            served_before = len(outcomes)
            while len(outcomes) < served_before + 100:  # noqa: ASYNC110 - a hundred requests after
                await trio.sleep(0.05)
            stop.set()
            nursery.cancel_scope.cancel()

    dead = addresses[0]
    print(f"picker noticed the dead server after {(noticed_at - killed_at) * 1000:.0f} ms "
          f"({(noticed_at - killed_at) / SCRAPE_INTERVAL_S:.1f} scrape intervals)")
    after = [o for o in outcomes if o.started > noticed_at]
    assert after and all(o.status == 200 and o.served_by != dead for o in after), after
    failed = [o for o in outcomes if o.status != 200]
    print(f"{len(outcomes)} requests, {len(failed)} failed: {sorted({o.status for o in failed})}")
    assert all(o.ended >= killed_at and o.started <= noticed_at for o in failed), failed  # only the dying server's
    assert all(o.status >= 500 or o.status == 0 for o in failed), failed  # an HTTP error, or a reset
    assert all(o.status == 200 for o in outcomes if o.served_by and o.served_by != dead)


async def _run_in_scope(
    scope: trio.CancelScope, config: SimConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    with scope:
        await run_sim(config, task_status=task_status)
