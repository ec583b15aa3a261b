"""The Trio loop under :mod:`evergreen_trio.picker.dcgm`: one per endpoint and DCGM source, beside
the endpoint's metrics scraper, cancelled with it.

A failed poll keeps the endpoint's last GPU utilization and never touches its readiness; the first
failure of a run of them is a warning, the rest debug lines until a poll succeeds again.
"""

from __future__ import annotations

import logging

import trio

from evergreen_trio._http import HttpGetError, KeepAliveGetter
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.dcgm import GPU_UTILIZATION_KEY, DcgmSource, gpu_utilization
from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES
from evergreen_trio.picker.errors import MetricsError
from evergreen_trio.picker.scheduler import PoolSnapshot

log = logging.getLogger(__name__)


def exporter_address(endpoint: Endpoint, source: DcgmSource, pool: PoolConfig) -> Endpoint:
    """Where ``endpoint``'s exporter is scraped: ``source.port`` at its node (``useNodeAddress``,
    when known) or pod IP; port 0: where its model server's metrics are."""
    if not source.port:
        return Endpoint(endpoint.host, pool.metrics_port or endpoint.port)
    host = endpoint.node_address if source.use_node_address and endpoint.node_address else endpoint.host
    return Endpoint(host, source.port)


async def poll_dcgm(endpoint: Endpoint, source: DcgmSource, pool: PoolConfig, snapshot: PoolSnapshot) -> None:
    """Poll ``endpoint``'s GPU utilization every ``source.interval_s`` (else the pool's interval) until cancelled."""
    exporter = exporter_address(endpoint, source, pool)
    getter = KeepAliveGetter(exporter.host, exporter.port, max_body=MAX_METRICS_BYTES)
    url = f"http://{exporter.address}{source.path}"
    failing = False
    try:
        while True:
            try:
                with trio.fail_after(pool.scrape_timeout_s):
                    status, body = await getter.get(source.path)
                if status != 200:
                    raise MetricsError(f"expected HTTP 200 from {url}, got {status}")
                value = gpu_utilization(body.decode("utf-8", "replace"), endpoint.name)
                state = snapshot.states.get(endpoint.address)
                if state is not None:  # else removed by discovery while the exporter answered
                    state.attributes[GPU_UTILIZATION_KEY] = value
                failing = False
            except (HttpGetError, MetricsError, trio.TooSlowError) as exc:
                log.log(logging.DEBUG if failing else logging.WARNING, "picker.dcgm_poll_failed endpoint=%s url=%s "
                        "error=%s", endpoint.address, url, peer_text(str(exc) or "timeout"))
                failing = True
            await trio.sleep(source.interval_s or pool.refresh_interval_s)
    finally:
        await getter.aclose()
