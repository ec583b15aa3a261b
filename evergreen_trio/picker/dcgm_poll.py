"""The Trio loop under :mod:`evergreen_trio.picker.dcgm`: one per endpoint and DCGM source, beside
the endpoint's metrics scraper, cancelled with it.

A failed poll keeps the endpoint's last GPU utilization (:mod:`~evergreen_trio.picker.http_poll`).
"""

from __future__ import annotations

import logging

from prometheus_client.metrics_core import Metric

from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.dcgm import (
    DCGM_DATA_SOURCE,
    DCGM_EXTRACTOR,
    GPU_UTILIZATION_KEY,
    DcgmSource,
    pod_utilization,
    utilization_families,
)
from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES
from evergreen_trio.picker.errors import MetricsError
from evergreen_trio.picker.http_poll import HttpPoll, ScrapeErrors, poll_http
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.tls import client_context

log = logging.getLogger(__name__)


def exporter_address(endpoint: Endpoint, source: DcgmSource, pool: PoolConfig) -> Endpoint:
    """Where ``endpoint``'s exporter is scraped: ``source.port`` at its node (``useNodeAddress``,
    when known) or pod IP; port 0: where its model server's metrics are."""
    if not source.port:
        return Endpoint(endpoint.host, pool.metrics_port or endpoint.port)
    host = endpoint.node_address if source.use_node_address and endpoint.node_address else endpoint.host
    return Endpoint(host, source.port)


async def poll_dcgm(endpoint: Endpoint, source: DcgmSource, pool: PoolConfig, snapshot: PoolSnapshot,
                    errors: ScrapeErrors | None = None) -> None:
    """Poll ``endpoint``'s GPU utilization every ``source.interval_s`` (else the pool's interval) until
    cancelled; failures counted in ``errors``."""

    def extract(families: list[Metric]) -> None:
        value = pod_utilization(families, endpoint.name)
        state = snapshot.states.get(endpoint.address)
        if state is not None:  # else removed by discovery while the exporter answered
            state.attributes[GPU_UTILIZATION_KEY] = value

    await poll_http(HttpPoll(endpoint, exporter_address(endpoint, source, pool), source.path, MAX_METRICS_BYTES,
                             pool.scrape_timeout_s, source.interval_s or pool.refresh_interval_s, log,
                             "dcgm_poll_failed", DCGM_DATA_SOURCE, DCGM_EXTRACTOR,
                             None if source.tls is None else client_context(*source.tls)),
                    lambda body: utilization_families(body.decode("utf-8", "replace")), extract, MetricsError, errors)
