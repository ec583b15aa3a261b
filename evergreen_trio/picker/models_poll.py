"""The Trio loop under :mod:`evergreen_trio.picker.models_source`: one per endpoint and models
source, beside the endpoint's metrics scraper, cancelled with it.

A failed poll keeps the endpoint's last list (:mod:`~evergreen_trio.picker.http_poll`). A changed
list is logged once, its ids cut.
"""

from __future__ import annotations

import logging

from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.errors import ModelsError
from evergreen_trio.picker.http_poll import HttpPoll, ScrapeErrors, poll_http
from evergreen_trio.picker.models_source import (
    MAX_MODELS_BYTES,
    MODELS_DATA_EXTRACTOR,
    MODELS_DATA_SOURCE,
    ModelData,
    ModelsSource,
    parse_models,
)
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.tls import client_context

log = logging.getLogger(__name__)
LOGGED_IDS_CHARS = 256


async def poll_models(endpoint: Endpoint, source: ModelsSource, pool: PoolConfig, snapshot: PoolSnapshot,
                      errors: ScrapeErrors | None = None) -> None:
    """Poll ``endpoint``'s models every ``source.interval_s`` (else the pool's interval) until
    cancelled; failures counted in ``errors`` (all poll errors: the extractor never refuses)."""

    def extract(models: tuple[ModelData, ...]) -> None:
        if snapshot.set_models(endpoint.address, models):
            log.info("picker.endpoint_models endpoint=%s count=%d ids=%s", endpoint.address, len(models),
                     peer_text(",".join(m.id for m in models), LOGGED_IDS_CHARS))

    address = Endpoint(endpoint.host, pool.metrics_port or endpoint.port)
    interval_s = source.interval_s or pool.refresh_interval_s
    await poll_http(HttpPoll(endpoint, address, source.path, MAX_MODELS_BYTES, pool.scrape_timeout_s, interval_s, log,
                             "models_poll_failed", MODELS_DATA_SOURCE, MODELS_DATA_EXTRACTOR,
                             None if source.tls is None else client_context(*source.tls)),
                    parse_models, extract, ModelsError, errors)
