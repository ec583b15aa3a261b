"""One endpoint's data source polled over HTTP until cancelled: the loop under the models and
DCGM sources (:mod:`~evergreen_trio.picker.models_poll`, :mod:`~evergreen_trio.picker.dcgm_poll`).

A failed poll changes nothing the last good one set and never touches the endpoint's readiness;
the first failure of a run of them is a warning, the rest debug lines until a poll succeeds again
(a server answering badly every 50 ms must not flood the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from evergreen_trio._http import HttpGetError, KeepAliveGetter
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint


@dataclass(frozen=True)
class HttpPoll:
    """What to GET (``path`` at ``address``, at most ``max_body`` bytes, within ``timeout_s``),
    how often, and where failures are logged (``event`` in ``log``, naming ``endpoint``)."""

    endpoint: Endpoint
    address: Endpoint
    path: str
    max_body: int
    timeout_s: float
    interval_s: float
    log: logging.Logger
    event: str


async def poll_http(poll: HttpPoll, apply: Callable[[bytes], None], error: type[Exception]) -> None:
    """GET ``poll``'s path every interval and hand each 200 body to ``apply``, which raises
    ``error`` for a body it refuses; until cancelled."""
    getter = KeepAliveGetter(poll.address.host, poll.address.port, max_body=poll.max_body)
    url = f"http://{poll.address.address}{poll.path}"
    failing = False
    try:
        while True:
            try:
                with trio.fail_after(poll.timeout_s):
                    status, body = await getter.get(poll.path)
                if status != 200:
                    raise error(f"expected HTTP 200 from {url}, got {status}")
                apply(body)
                failing = False
            except (HttpGetError, error, trio.TooSlowError) as exc:
                poll.log.log(logging.DEBUG if failing else logging.WARNING, "picker.%s endpoint=%s url=%s error=%s",
                             poll.event, poll.endpoint.address, url, peer_text(str(exc) or "timeout"))
                failing = True
            await trio.sleep(poll.interval_s)
    finally:
        await getter.aclose()
