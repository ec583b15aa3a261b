"""An Evergreen server's Prometheus metrics, and the Trio HTTP exporter that serves a registry.

The Trio shells record (``server.py`` for sessions, ``nursery_session.py`` for actions and
fragments); the sans-IO cores know nothing of metrics. Counters are bumped once per received
batch or emitted write, not per byte. Under ``evergreen-trio serve --workers N`` the workers
record into prometheus_client's multiprocess files and the supervisor serves the sum
(``evergreen_trio.serving.workers``); ``evergreen_sessions_active`` then has one series per worker
(label ``pid``).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.dag.errors import SessionError, StatusCode

ACTION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Action durations span a cached ECHO (about a millisecond) to a long generation (minutes)."""

MAX_REQUEST_BODY = 4096
"""A scrape is a GET: a client sending a larger body is cut off with 413."""

SCRAPE_SEND_TIMEOUT = 10.0
"""Seconds one write of a scrape's response may wait for the client to read, then the connection is closed."""

MAX_SCRAPE_CONNECTIONS = 256
"""Connections open at once on the metrics port; a new one past it is closed at accept."""

MAX_SCRAPE_CONNECTIONS_PER_CLIENT = 16
"""Connections open at once from one remote address (a Prometheus scraper needs one or two)."""


def abort_reason(error: SessionError) -> str:
    """A bounded label for why a session aborted: the error's class in snake case, less a trailing
    ``Error`` (``ProtocolViolationError[Error]`` -> ``protocol_violation``, ``SessionError`` -> ``session``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__.removesuffix("Error") or "Error").lower()


class SessionMetrics:
    """Sessions, actions, fragments, aborts and limit hits of one server, in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.sessions_started = Counter("evergreen_sessions_started", "Sessions accepted", registry=r)
        self.sessions_active = Gauge("evergreen_sessions_active", "Sessions open now", registry=r,
                                     multiprocess_mode="liveall")
        self.sessions_ended = Counter("evergreen_sessions_ended", "Sessions ended, by final gRPC status",
                                      ["code"], registry=r)
        self.action_seconds = Histogram("evergreen_action_duration_seconds",
                                        "Action run time, by action name and final status (its _count counts "
                                        "actions)", ["action", "code"], buckets=ACTION_BUCKETS, registry=r)
        fragments = Counter("evergreen_fragments", "Node fragments, received (in) and sent (out)",
                            ["direction"], registry=r)
        fragment_bytes = Counter("evergreen_fragment_bytes", "Serialized node-fragment bytes, in and out",
                                 ["direction"], registry=r)
        self.aborts = Counter("evergreen_session_aborts", "Sessions that ended with an error, by reason",
                              ["reason"], registry=r)
        self.limit_hits = Counter("evergreen_limit_hits", "Limits crossed, by limit", ["limit"], registry=r)
        # Children resolved once: these two are bumped on every batch.
        self._fragments_in, self._fragments_out = fragments.labels("in"), fragments.labels("out")
        self._bytes_in, self._bytes_out = fragment_bytes.labels("in"), fragment_bytes.labels("out")
        # And the duration's, per registered action and status as they come (labels() took about 1%
        # of an ECHO round trip's CPU); bounded: only registered actions finish.
        self._action_children: dict[tuple[str, StatusCode], Any] = {}

    def session_started(self) -> None:
        """Count a session that began (started and active)."""
        self.sessions_started.inc()
        self.sessions_active.inc()

    def session_ended(self, code: str) -> None:
        """A session ended with the gRPC status named ``code`` (``"OK"``, ``"UNAVAILABLE"``, ...)."""
        self.sessions_active.dec()
        self.sessions_ended.labels(code).inc()

    def aborted(self, reason: str) -> None:
        """Count a session that ended abnormally, by ``reason`` (a fixed set: :func:`abort_reason`)."""
        self.aborts.labels(reason).inc()

    def limit_hit(self, limit: str) -> None:
        """A limit was crossed; ``limit`` names it (``max_nodes``, ``max_sessions``, ...)."""
        self.limit_hits.labels(limit).inc()

    def action_finished(self, name: str, code: StatusCode, seconds: float) -> None:
        """Record one action's duration under its name and final status."""
        child = self._action_children.get((name, code))
        if child is None:
            child = self._action_children[name, code] = self.action_seconds.labels(name, code.name)
        child.observe(seconds)

    def received(self, fragments: int, nbytes: int) -> None:
        """Count fragments and bytes a session received."""
        self._fragments_in.inc(fragments)
        self._bytes_in.inc(nbytes)

    def sent(self, fragments: int, nbytes: int) -> None:
        """Count fragments and bytes a session sent."""
        self._fragments_out.inc(fragments)
        self._bytes_out.inc(nbytes)


Authorize = Callable[[str, str, Mapping[str, str]], Awaitable[tuple[int, str] | None]]
"""A check of each scrape: ``(method, path, headers)`` -> None to serve it, else ``(status, text)``."""


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    send_timeout: float = SCRAPE_SEND_TIMEOUT,
    max_connections_per_client: int = MAX_SCRAPE_CONNECTIONS_PER_CLIENT,
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
    authorize: Authorize | None = None,
    pages: Mapping[str, Callable[[], HttpResponse]] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The Prometheus exporter: ``GET`` (any path) renders ``registry``; other methods get 405.

    Serves until cancelled; ``started`` gets the bound port (0 picks a free one). A client that
    does not read a response within ``send_timeout`` is disconnected; one remote address holds at
    most ``max_connections_per_client`` of the port's ``MAX_SCRAPE_CONNECTIONS``. ``ssl_context``
    serves it over TLS (a callable is asked per connection, for reloading). ``authorize`` is asked
    first with each request's method, path and headers (names in lower case): None serves it, a
    ``(status, text)`` answers that instead. ``pages`` serves other paths (without the query) on
    the same port, behind the same checks: a ``GET`` of one gets what its callable returns (called
    on the Trio thread: it reads state that thread owns, so it must be quick and bounded).
    """
    pages = pages or {}

    # Rendering runs in a worker thread, one at a time: a scrape never holds the Trio thread that
    # routes requests (the GIL is handed back every few ms while it renders).
    render = trio.CapacityLimiter(1)

    async def handle(request: HttpRequest) -> HttpResponse:
        path = request.target.split("?", 1)[0]
        if authorize is not None:
            refused = await authorize(request.method, path, request.headers)
            if refused is not None:
                return HttpResponse(refused[0], [("content-type", "text/plain")], refused[1].encode() + b"\n")
        if request.method != "GET":
            return HttpResponse(405, [("allow", "GET")])
        page = pages.get(path)
        if page is not None:
            return page()
        body = await trio.to_thread.run_sync(generate_latest, registry, limiter=render)
        return HttpResponse(200, [("content-type", CONTENT_TYPE_LATEST)], body)

    await serve_http(handle, host, port, max_body=MAX_REQUEST_BODY, max_connections=MAX_SCRAPE_CONNECTIONS,
                     send_timeout=send_timeout, max_connections_per_client=max_connections_per_client,
                     ssl_context=ssl_context, task_status=task_status)


__all__ = [
    "ACTION_BUCKETS",
    "MAX_REQUEST_BODY",
    "Authorize",
    "SessionMetrics",
    "abort_reason",
    "serve_metrics",
]
