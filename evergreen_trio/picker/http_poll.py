"""One endpoint's data source polled over HTTP until cancelled: the loop under the models and
DCGM sources (:mod:`~evergreen_trio.picker.models_poll`, :mod:`~evergreen_trio.picker.dcgm_poll`).

A poll is llm-d-router's ``HTTPDataSource.Dispatch``: GET the page and ``parse`` it (the source's
parser), then hand the parsed page to ``extract`` (its extractor). A failed GET or parse is a poll
error of the source's type, a failed extract an extract error of the extractor's (both counted on
every failure, as the reference's collector does). A failed poll changes nothing the last good one
set and never touches the endpoint's readiness; the first failure of a run of them is a warning,
the rest debug lines until a poll succeeds again (a server answering badly every 50 ms must not
flood the log).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import trio

from evergreen_trio._http import HttpGetError, KeepAliveGetter
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint

T = TypeVar("T")


class ScrapeErrors(Protocol):
    """Where the data sources count their failures (llm-d-router's data-layer error counters)."""

    def poll_error(self, source_type: str) -> None: ...

    def extract_error(self, source_type: str, extractor_type: str) -> None: ...


@dataclass(frozen=True)
class HttpPoll:
    """What to GET (``path`` at ``address``, at most ``max_body`` bytes, within ``timeout_s``),
    how often, where failures are logged (``event`` in ``log``, naming ``endpoint``) and the
    reference's plugin types they are counted under (``source_type``, ``extractor_type``); over
    https with ``ssl_context``; a body over ``offload_bytes`` is parsed in a worker thread."""

    endpoint: Endpoint
    address: Endpoint
    path: str
    max_body: int
    timeout_s: float
    interval_s: float
    log: logging.Logger
    event: str
    source_type: str
    extractor_type: str
    ssl_context: ssl.SSLContext | None = None
    offload_bytes: int | None = None


# One page parsed off the event loop at a time, per run: a big page costs a worker thread, not routing.
_PARSING: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("http_poll_parsing")


async def _parse(poll: HttpPoll, parse: Callable[[bytes], T], body: bytes) -> T:
    """``parse(body)``, in a worker thread when the body is over ``poll.offload_bytes`` (a peer's
    8 MiB page takes seconds of parsing, which would stall every stream on this thread)."""
    if poll.offload_bytes is None or len(body) <= poll.offload_bytes:
        return parse(body)
    try:
        limiter = _PARSING.get()
    except LookupError:
        limiter = trio.CapacityLimiter(1)
        _PARSING.set(limiter)
    return await trio.to_thread.run_sync(parse, body, limiter=limiter)


async def poll_http(poll: HttpPoll, parse: Callable[[bytes], T], extract: Callable[[T], None], error: type[Exception],
                    errors: ScrapeErrors | None = None) -> None:
    """GET ``poll``'s path every interval, ``parse`` each 200 body and ``extract`` the result, either
    raising ``error`` for what it refuses; failures counted in ``errors``. Until cancelled."""
    getter = KeepAliveGetter(poll.address.host, poll.address.port, max_body=poll.max_body,
                             ssl_context=poll.ssl_context)
    url = f"{'http' if poll.ssl_context is None else 'https'}://{poll.address.address}{poll.path}"
    failing = False
    try:
        while True:
            parsed = False
            try:
                with trio.fail_after(poll.timeout_s):
                    status, body = await getter.get(poll.path)
                if status != 200:
                    raise error(f"expected HTTP 200 from {url}, got {status}")
                page = await _parse(poll, parse, body)
                parsed = True
                extract(page)
                failing = False
            except (HttpGetError, error, trio.TooSlowError) as exc:
                if errors is not None:
                    if parsed:
                        errors.extract_error(poll.source_type, poll.extractor_type)
                    else:
                        errors.poll_error(poll.source_type)
                poll.log.log(logging.DEBUG if failing else logging.WARNING, "picker.%s endpoint=%s url=%s error=%s",
                             poll.event, poll.endpoint.address, url, peer_text(str(exc) or "timeout"))
                failing = True
            await trio.sleep(poll.interval_s)
    finally:
        await getter.aclose()
