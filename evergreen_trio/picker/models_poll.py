"""The Trio loop under :mod:`evergreen_trio.picker.models_source`: one per endpoint and models
source, beside the endpoint's metrics scraper, cancelled with it.

A failed poll keeps the endpoint's last list and never touches its readiness; the first failure
of a run of them is a warning, the rest debug lines until a poll succeeds again (a model server
answering badly every 50 ms must not flood the log). A changed list is logged once, its ids cut.
"""

from __future__ import annotations

import logging

import trio

from evergreen_trio._http import HttpGetError, KeepAliveGetter
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.errors import ModelsError
from evergreen_trio.picker.models_source import MAX_MODELS_BYTES, ModelsSource, parse_models
from evergreen_trio.picker.scheduler import PoolSnapshot

log = logging.getLogger(__name__)
LOGGED_IDS_CHARS = 256


async def poll_models(endpoint: Endpoint, source: ModelsSource, pool: PoolConfig, snapshot: PoolSnapshot) -> None:
    """Poll ``endpoint``'s models every ``source.interval_s`` (else the pool's interval) until cancelled."""
    port = pool.metrics_port or endpoint.port
    getter = KeepAliveGetter(endpoint.host, port, max_body=MAX_MODELS_BYTES)
    url = f"http://{Endpoint(endpoint.host, port).address}{source.path}"
    failing = False
    try:
        while True:
            try:
                with trio.fail_after(pool.scrape_timeout_s):
                    status, body = await getter.get(source.path)
                if status != 200:
                    raise ModelsError(f"expected HTTP 200 from {url}, got {status}")
                models = parse_models(body)
                if snapshot.set_models(endpoint.address, models):
                    log.info("picker.endpoint_models endpoint=%s count=%d ids=%s", endpoint.address, len(models),
                             peer_text(",".join(m.id for m in models), LOGGED_IDS_CHARS))
                failing = False
            except (HttpGetError, ModelsError, trio.TooSlowError) as exc:
                log.log(logging.DEBUG if failing else logging.WARNING, "picker.models_poll_failed endpoint=%s "
                        "url=%s error=%s", endpoint.address, url, peer_text(str(exc) or "timeout"))
                failing = True
            await trio.sleep(source.interval_s or pool.refresh_interval_s)
    finally:
        await getter.aclose()
