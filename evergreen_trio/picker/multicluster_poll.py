"""The Trio loop under :mod:`evergreen_trio.picker.multicluster`: one per peer cluster, in place of
the model-server scrape when ``dataLayer.sources`` lists a ``multicluster-metrics-data-source``.

A cluster is a candidate from discovery on (its per-pod metrics stay empty, as the reference's
cluster-endpoints' do); each page read refreshes it and writes its pool aggregates. A failed poll
keeps its last aggregates and is counted, one warning per run of failures
(:mod:`~evergreen_trio.picker.http_poll`). A page over :data:`OFFLOAD_BYTES` is parsed in a worker
thread, one at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import MetricsError
from evergreen_trio.picker.http_poll import HttpPoll, ScrapeErrors, poll_http
from evergreen_trio.picker.multicluster import (
    CLUSTER_EXTRACTOR,
    CLUSTER_SOURCE,
    MAX_PAGE_BYTES,
    ClusterPoll,
    metrics_target,
    parse_pool_page,
    write_pool_attributes,
)
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.tls import client_context

log = logging.getLogger(__name__)
_NO_METRICS = EndpointMetrics()
OFFLOAD_BYTES = 1 << 20
"""A page over this is parsed in a worker thread: a picker's own page is some 20 KB (3 ms), a
hostile 8 MiB one takes seconds."""


async def poll_cluster(endpoint: Endpoint, poll: ClusterPoll, pool: PoolConfig, snapshot: PoolSnapshot,
                       after_scrape: Callable[[], None], errors: ScrapeErrors | None = None) -> None:
    """Make ``endpoint`` a candidate, then poll its metrics page every ``poll.source.interval_s``
    (else the pool's interval) until cancelled; failures counted in ``errors``."""
    snapshot.update(endpoint.address, _NO_METRICS)
    after_scrape()

    def extract(values: Mapping[str, float]) -> None:
        state = snapshot.states.get(endpoint.address)
        if state is None:  # removed by discovery while its page was read
            return
        snapshot.update(endpoint.address, _NO_METRICS)
        if poll.metrics is not None:
            write_pool_attributes(state.attributes, values)

    host, port = metrics_target(endpoint)
    source = poll.source
    options = source.tls_options
    await poll_http(HttpPoll(endpoint, Endpoint(host, port), source.path, MAX_PAGE_BYTES, pool.scrape_timeout_s,
                             source.interval_s or pool.refresh_interval_s, log, "cluster_poll_failed", CLUSTER_SOURCE,
                             CLUSTER_EXTRACTOR, None if options is None else client_context(*options), OFFLOAD_BYTES),
                    lambda body: parse_pool_page(body, poll.metrics), extract, MetricsError, errors)
