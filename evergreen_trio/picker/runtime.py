"""The picker's Trio runtime: scraper tasks, readiness, the metrics exporter and the gRPC servers.

The scraper tasks and the ext_proc server (:mod:`evergreen_trio._grpc.server`, a Trio
task per connection) share one :class:`PoolSnapshot`; a pick is a plain synchronous call. The
health service is on the same kind of server, on its own port. The endpoints are the static
config's, or what a discovery task reports (:mod:`evergreen_trio.picker.k8s`): one scraper task
per endpoint, started and cancelled as the set changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpclib.const import Status
from prometheus_client import CollectorRegistry

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.health import ServerHealth
from evergreen_trio._grpc.server import GracefulStop, SSLContextSource, serve_grpc
from evergreen_trio._grpc.server_wire import SyncBidiMethod, WireLimits
from evergreen_trio._http import HttpGetError, HttpResponse, KeepAliveGetter
from evergreen_trio._logsafe import peer_text
from evergreen_trio.errors import plain_errors
from evergreen_trio.picker.burst_shell import seal_windows
from evergreen_trio.picker.config import Endpoint, PickerConfig
from evergreen_trio.picker.dcgm_poll import poll_dcgm
from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES, MetricsPageError, parse_engine_metrics
from evergreen_trio.picker.errors import ExtProcError, MetricsError
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.flow_metrics import FlowControlMetrics
from evergreen_trio.picker.guards import ModelLabels
from evergreen_trio.picker.http_poll import ScrapeErrors
from evergreen_trio.picker.kvevents_zmq import bound_subscribers, endpoint_subscribers, subscribe_bound
from evergreen_trio.picker.latency_client import LatencyPredictorClient
from evergreen_trio.picker.latency_metrics import LatencyMetrics
from evergreen_trio.picker.latency_wire import config_from_env
from evergreen_trio.picker.models_poll import poll_models
from evergreen_trio.picker.multicluster import metrics_target
from evergreen_trio.picker.multicluster_poll import poll_cluster
from evergreen_trio.picker.notifications import NotificationSource, endpoint_notifications, notification_sources
from evergreen_trio.picker.plugin_dumps import plugin_dumps
from evergreen_trio.picker.plugin_state import PATH as PLUGIN_STATE_PATH
from evergreen_trio.picker.plugin_state import DumpState, PluginDump, StatePage
from evergreen_trio.picker.precise_prefix import precise_caches
from evergreen_trio.picker.processor import ExtProcStream, Picker
from evergreen_trio.picker.render_client import render_starter
from evergreen_trio.picker.rollout import RolloutCollector, RolloutScreener
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.telemetry import PickerMetrics
from evergreen_trio.picker.tls import client_context
from evergreen_trio.picker.tracing_export import exporting
from evergreen_trio.picker.vllm_render import VllmRender
from evergreen_trio.serving.metrics import Authorize, serve_metrics

if TYPE_CHECKING:  # the `tracing` extra, imported only with --tracing
    from evergreen_trio.picker.tracing import Tracing

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{EXT_PROC_SERVICE}/Process"
# The official chart probes ``inference-extension``; load balancers ask for "" (overall).
READINESS_NAMES = ("inference-extension", EXT_PROC_SERVICE, "readiness")
# Discovery: called with ``on_endpoints``, which it calls with the whole set on every change.
Discovery = Callable[[Callable[[Sequence[Endpoint]], None]], Awaitable[None]]
# InferenceObjectives: called with a callback it calls with the name -> priority map on every change.
ObjectiveWatch = Callable[[Callable[[Mapping[str, int]], None]], Awaitable[None]]
# Leader election: called with ``on_leader``, which it calls with True/False as leadership changes.
LeaderElection = Callable[[Callable[[bool], None]], Awaitable[None]]
# Pod notifications for the rollout screeners: called with them, it feeds each its pods.
PodNotifications = Callable[[Sequence[RolloutScreener]], Awaitable[None]]
# The k8s-notification-sources' watches: called with them, it feeds each the objects of its GVK.
NotificationWatch = Callable[[Sequence[NotificationSource]], Awaitable[None]]
# The metrics port's scrape check, opened while the port serves (MetricsAuth.serving, in cluster mode).
MetricsAuthSource = Callable[[], AbstractAsyncContextManager[Authorize]]

DRAIN_WINDOW_SECONDS = 30.0
"""How long a draining picker serves ext_proc on, NOT_SERVING: the reference EPP's ``--drain-timeout``
default, time for Kubernetes to take the pod out of the Service and for Envoy to learn of it."""
STOP_GRACE_SECONDS = 90.0
"""How long the ext_proc streams in flight after the window may take to end (one that observes a
response lasts as long as it). With the window, 120 s: inside the 130 s termination grace period
the reference chart gives the pod."""


@dataclass(frozen=True)
class PickerPorts:
    """The ports a running picker bound (what ``task_status.started`` reports)."""

    grpc: int
    health: int
    metrics: int


class _GrpcStream(ExtProcStream):
    """:class:`ExtProcStream` for the gRPC server: protocol violations end the RPC with a status,
    and the stream's report is recorded in the metrics when it ends. A subclass rather than a
    wrapper, so that the wire reads ``finished``, ``parked`` and ``on_unpark`` as plain attributes."""

    def __init__(self, picker: Picker, metrics: PickerMetrics) -> None:
        super().__init__(picker)
        self._metrics = metrics
        self._started = time.monotonic()
        self._running = False
        if metrics.streams is not None:
            metrics.streams.opened()

    def __del__(self) -> None:
        # A stream Envoy resets gets neither on_end nor finished: record it when it is dropped (a
        # finalizer, with no weakref.finalize to register per stream).
        if "_started" not in self.__dict__:  # __init__ failed: nothing was counted (a check, not a call)
            return
        ExtProcStream.on_abort(self)
        if not self.report.recorded:  # most were when their response ended: no call for those
            self._record()

    def resume(self) -> Sequence[ep.ProcessingResponse]:
        replies = ExtProcStream.resume(self)
        self._after()
        return replies

    def on_message(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse]:
        try:
            replies = ExtProcStream.on_message(self, message)
        except ExtProcError as exc:
            log.warning("picker.stream_aborted error=%s", exc)
            if self.trace is not None:
                self.trace.end(self.report, str(exc))
            self._record()
            raise RpcAbortError(Status.INVALID_ARGUMENT, str(exc)) from None
        if self.finished or (self.report.routed and not self._running):  # else _after has nothing to do
            self._after()
        return replies

    def _after(self) -> None:
        if self.report.routed and not self._running:
            self._running = True
            self._metrics.started(self.report)
        if self.finished:
            self._record()

    def on_end(self) -> Sequence[ep.ProcessingResponse]:
        replies = ExtProcStream.on_end(self)
        self._record()
        return replies

    def on_abort(self) -> None:
        ExtProcStream.on_abort(self)
        self._record()

    def on_closed(self, status: Status) -> None:
        if self._metrics.streams is not None:
            self._metrics.streams.closed(status, time.monotonic() - self._started)

    def _record(self) -> None:
        if not self.report.recorded:
            self.report.recorded = True
            self._metrics.record(self.report, time.monotonic() - self._started,
                                 prefix_index_size=self.picker.scheduler.prefix.total())
            if self.trace is not None:
                self.trace.end(self.report)


async def _flow_control(gate: FlowGate, interval_s: float, wake: trio.Event, new_wake: Callable[[], trio.Event],
                        ) -> None:
    """Poll flow control after each scrape (``wake``), at the next TTL deadline and at least every
    ``interval_s``; on the way out (shutdown) every queued request gets its 503."""
    try:
        while True:
            # The queue's deadlines are on its own clock (the pool snapshot's), not Trio's.
            wait_s = gate.next_deadline() - gate.queue.clock()
            with trio.move_on_after(min(max(wait_s, 0.0), interval_s)):
                await wake.wait()
            wake = new_wake()
            gate.poll()
    finally:
        gate.queue.shutdown()


# The reference's names of the data source and extractor a metrics scrape stands for.
METRICS_SOURCE, METRICS_EXTRACTOR = "metrics-data-source", "core-metrics-extractor"


async def _scrape_forever(
    endpoint: Endpoint,
    config: PickerConfig,
    snapshot: PoolSnapshot,
    after_scrape: Callable[[], None],
    errors: ScrapeErrors | None = None,
) -> None:
    port = config.pool.metrics_port or endpoint.port
    tls = config.pool.metrics_tls
    getter = KeepAliveGetter(endpoint.host, port, max_body=MAX_METRICS_BYTES,
                             ssl_context=client_context(*tls) if tls is not None else None)
    url = f"{'https' if tls else 'http'}://{Endpoint(endpoint.host, port).address}{config.pool.metrics_path}"
    engine = config.pool.engines.spec(endpoint.engine)
    was_ready = False
    try:
        while True:
            polled = False
            try:
                with trio.fail_after(config.pool.scrape_timeout_s):
                    status, body = await getter.get(config.pool.metrics_path)
                if status != 200:
                    raise MetricsError(f"expected HTTP 200 from {url}, got {status}")
                polled = True
                text = body.decode("utf-8", "replace")
                snapshot.update(endpoint.address, parse_engine_metrics(engine, text))
                if not was_ready:
                    log.info("picker.endpoint_ready endpoint=%s", endpoint.address)
                was_ready = True
            except (HttpGetError, MetricsError, trio.TooSlowError) as exc:
                snapshot.mark_failed(endpoint.address)
                if errors is not None:
                    if polled and not isinstance(exc, MetricsPageError):  # a page without the engine's metrics
                        errors.extract_error(METRICS_SOURCE, METRICS_EXTRACTOR)
                    else:
                        errors.poll_error(METRICS_SOURCE)
                if was_ready:
                    # The error may quote the bytes h11 could not parse: one escaped, bounded token.
                    log.warning("picker.endpoint_not_ready endpoint=%s error=%s", endpoint.address,
                                peer_text(str(exc) or "timeout", 300))
                was_ready = False
            after_scrape()
            await trio.sleep(config.pool.refresh_interval_s)
    finally:
        await getter.aclose()


class Scrapers:
    """One scraper task per endpoint in ``nursery``, following the endpoint set :meth:`sync` is given."""

    def __init__(self, nursery: trio.Nursery, config: PickerConfig, snapshot: PoolSnapshot,
                 after_scrape: Callable[[], None], errors: ScrapeErrors | None = None,
                 beside: Sequence[Callable[[Endpoint], Awaitable[None]]] = ()) -> None:
        self.nursery, self.config, self.snapshot, self.after_scrape = nursery, config, snapshot, after_scrape
        self.errors = errors
        self.beside = beside  # more per-endpoint tasks (the precise prefix cache's KV-event subscribers)
        self._scopes: dict[str, tuple[Endpoint, trio.CancelScope]] = {}

    def sync(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = {e.address: e for e in endpoints}
        for address in [a for a in self._scopes if a not in wanted]:
            self._scopes.pop(address)[1].cancel()
            log.info("picker.endpoint_removed endpoint=%s", address)
        for address, endpoint in wanted.items():  # a pod relabelled to another engine: scrape anew
            if address in self._scopes and self._moved(self._scopes[address][0], endpoint):
                self._scopes.pop(address)[1].cancel()
        self.snapshot.set_endpoints(wanted.values())
        for address, endpoint in wanted.items():
            if address not in self._scopes:
                scope = trio.CancelScope()
                self._scopes[address] = (endpoint, scope)
                self.nursery.start_soon(self._run, endpoint, scope)

    def _moved(self, old: Endpoint, new: Endpoint) -> bool:
        """Whether ``new`` is scraped apart from ``old``: another engine, or a cluster's metrics
        elsewhere (its ``metricsAddress``/``metricsPort`` labels changed)."""
        return old.engine != new.engine or (
            self.config.pool.multicluster is not None and metrics_target(old) != metrics_target(new))

    async def _run(self, endpoint: Endpoint, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as beside:  # models-data-source and dcgm-data-source polls, if any
                for source in self.config.pool.models_sources:
                    beside.start_soon(poll_models, endpoint, source, self.config.pool, self.snapshot, self.errors)
                for dcgm in self.config.pool.dcgm_sources:
                    beside.start_soon(poll_dcgm, endpoint, dcgm, self.config.pool, self.snapshot, self.errors)
                for task in self.beside:
                    beside.start_soon(task, endpoint)
                clusters = self.config.pool.multicluster
                if clusters is not None:  # a peer cluster: its pool aggregates, not a model server's metrics
                    await poll_cluster(endpoint, clusters, self.config.pool, self.snapshot, self.after_scrape,
                                       self.errors)
                else:
                    await _scrape_forever(endpoint, self.config, self.snapshot, self.after_scrape, self.errors)


class PickerDrain:
    """A graceful stop of :func:`run_picker`, the reference EPP's on SIGTERM; ``await drain()`` runs it.

    At once, every readiness name answers NOT_SERVING (``liveness`` stays SERVING: a probe must
    not restart a draining picker) and a leader releases its Lease, so Kubernetes takes the pod
    out of the Service and another replica takes over. ext_proc is served on for ``window_s``:
    Envoy sends requests here until it learns of that. Then the ext_proc port closes, each
    connection gets a graceful GOAWAY, and the streams in flight have ``grace_s`` to end.
    Cancelling ``run_picker`` afterwards ends whatever is left.
    """

    def __init__(self, window_s: float = DRAIN_WINDOW_SECONDS, grace_s: float = STOP_GRACE_SECONDS) -> None:
        self.window_s = window_s
        self.grace_s = grace_s
        self.requested = trio.Event()
        self.done = trio.Event()

    async def drain(self) -> None:
        """Start the drain (a second call joins the first) and return once it is over."""
        self.requested.set()
        await self.done.wait()


class Readiness:
    """Readiness = endpoints known (static, or discovery listed them) + each scraped once + leader,
    and not draining.

    ``liveness`` is SERVING from the start; every name in ``READINESS_NAMES`` and ``""``
    follow readiness, as the reference picker's health server does.
    """

    def __init__(self, pool: str, *, discovered: bool, elected: bool) -> None:
        self.pool = pool
        self.synced = not discovered
        self.leader = not elected
        self.scraped = False
        self.draining = False
        self.health = ServerHealth(("", *READINESS_NAMES))
        self.health.set(ready=False, live=True)

    def drain(self) -> None:
        """NOT_SERVING from now on, live still."""
        self.draining = True
        self._publish()

    def update(self, snapshot: PoolSnapshot) -> None:
        # Latched: a pod added later is scraped within a refresh interval, and readiness must not
        # flap on every scale-up while it is.
        self.scraped = self.scraped or (self.synced and snapshot.first_scrape_done)
        self._publish()

    def _publish(self) -> None:
        ready = self.scraped and self.leader and not self.draining
        if ready != self.health.ready:
            log.info("picker.%s pool=%s", "ready" if ready else "not_ready", self.pool)
            self.health.set(ready=ready, live=True)


async def _drain_when_asked(drain: PickerDrain, readiness: Readiness, election: trio.CancelScope,
                            ext_proc: GracefulStop) -> None:
    await drain.requested.wait()
    log.info("picker.draining window_s=%g grace_s=%g: NOT_SERVING, ext_proc served through the window",
             drain.window_s, drain.grace_s)
    readiness.drain()
    election.cancel()  # the election's own cleanup releases the Lease
    await trio.sleep(drain.window_s)
    with trio.move_on_after(drain.grace_s) as grace:
        await ext_proc()
    log.info("picker.drained%s", " grace_over=true: cancelling the streams left" if grace.cancelled_caught else "")
    drain.done.set()


async def _elect_in(scope: trio.CancelScope, election: LeaderElection, on_leader: Callable[[bool], None]) -> None:
    with scope:  # a drain cancels it, so that the Lease is released first
        await election(on_leader)


def plugin_state_page(plugins: Sequence[PluginDump]) -> Callable[[], HttpResponse]:
    """The metrics port's ``/debug/plugins/state`` page: ``plugins``' states, dumped at most once
    per ``REUSE_S`` however many GETs come."""
    state = StatePage(plugins)

    def page() -> HttpResponse:
        return HttpResponse(200, [("content-type", "application/json")], state.body(time.monotonic(),
                                                                                    datetime.now(UTC)))

    return page


async def _serve_metrics(registry: CollectorRegistry, host: str, port: int, ssl_context: SSLContextSource | None,
                         auth: MetricsAuthSource | None, plugins: Sequence[PluginDump], *,
                         task_status: trio.TaskStatus[int]) -> None:
    async with auth() if auth is not None else nullcontext() as authorize:
        # The debug page behind the same checks as /metrics, as the reference's metrics/admin server.
        await serve_metrics(registry, host, port, ssl_context=ssl_context, authorize=authorize,
                            pages={PLUGIN_STATE_PATH: plugin_state_page(plugins)}, task_status=task_status)


def wire_limits(config: PickerConfig) -> WireLimits:
    """The ext_proc port's limits for ``config``: a message holds at most one whole body (BUFFERED
    sends it in one) plus 64 KiB of headers and framing, so the body caps bound each message,
    unless ``max_receive_message_bytes`` says otherwise; replies up to ``max_send_message_bytes``."""
    ext_proc = config.ext_proc
    message = ext_proc.max_receive_message_bytes or (
        max(ext_proc.max_request_body_bytes, ext_proc.max_response_body_bytes) + 64 * 1024)
    return WireLimits(max_message_bytes=message,
                      max_send_message_bytes=ext_proc.max_send_message_bytes or WireLimits.max_send_message_bytes,
                      max_buffered_bytes=max(WireLimits.max_buffered_bytes, 2 * message))


def picker_metrics(config: PickerConfig) -> PickerMetrics:
    """The metrics a picker serving ``config`` records its streams in (labels and stream metrics
    as its config says)."""
    return PickerMetrics(config.pool.name, labels=ModelLabels.for_config(config),
                         stream_metrics=config.ext_proc.stream_metrics)


def ext_proc_method(picker: Picker, metrics: PickerMetrics) -> SyncBidiMethod[ep.ProcessingRequest,
                                                                               ep.ProcessingResponse]:
    """The ext_proc ``Process`` method: each stream served by ``picker``, recorded in ``metrics``."""
    return SyncBidiMethod(path=PROCESS_PATH, request_type=ep.ProcessingRequest,
                          new_processor=partial(_GrpcStream, picker, metrics))


async def run_picker(
    config: PickerConfig,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 9002,
    health_port: int = 9003,
    metrics_port: int = 9090,
    ssl_context: SSLContextSource | None = None,
    metrics_ssl_context: SSLContextSource | None = None,
    metrics_auth: MetricsAuthSource | None = None,
    discovery: Discovery | None = None,
    leader_election: LeaderElection | None = None,
    objectives: ObjectiveWatch | None = None,
    drain: PickerDrain | None = None,
    pod_notifications: PodNotifications | None = None,
    notifications: NotificationWatch | None = None,
    discovery_state: DumpState | None = None,
    tracing: Tracing | None = None,
    task_status: trio.TaskStatus[PickerPorts] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the Endpoint Picker until cancelled; ``started`` gets the bound :class:`PickerPorts`.

    Port 0 picks a free port. ``ssl_context`` serves ext_proc over TLS (a callable is asked per
    connection, for reloading), ``metrics_ssl_context`` the metrics port, whose scrapes
    ``metrics_auth`` checks while it serves (see ``MetricsAuth.serving``). ``discovery`` replaces
    the static endpoint list; with ``leader_election`` only the leader reports ready. See
    :class:`~evergreen_trio.picker.runtime.Readiness`. ``objectives`` follows the cluster's
    InferenceObjectives (:mod:`evergreen_trio.picker.k8s`). ``drain``: see :class:`PickerDrain`.
    ``pod_notifications`` tells the ``disaggregatedset-rollout-screener`` plugins of their pods,
    ``notifications`` the ``k8s-notification-source`` plugins of their objects; each
    ``endpoint-notification-source`` learns of every endpoint set. The metrics port serves
    ``/debug/plugins/state`` too (``evergreen_trio.picker.plugin_state``); ``discovery_state``
    is the ``dataLayer.discovery`` plugin's dump, when ``discovery`` is one. ``tracing``
    (``--tracing``): each request's spans, exported by a task of the picker's
    (``evergreen_trio.picker.tracing_export``).
    """
    snapshot = PoolSnapshot((), config.pool.staleness_threshold_s, time.monotonic)
    metrics = picker_metrics(config)
    picker = Picker(config, snapshot)
    flow_metrics = FlowControlMetrics(metrics)  # registered with or without flow control, as the reference's
    readiness = Readiness(config.pool.name, discovered=discovery is not None, elected=leader_election is not None)

    flow_wake = [trio.Event()]

    def new_flow_wake() -> trio.Event:
        flow_wake[0] = trio.Event()
        return flow_wake[0]

    def after_scrape() -> None:
        metrics.observe_pool(snapshot)
        metrics.observe_load(snapshot, picker.scheduler.inflight, picker.flow)
        readiness.update(snapshot)
        flow_wake[0].set()

    method = ext_proc_method(picker, metrics)
    election, ext_proc = trio.CancelScope(), GracefulStop()
    plugins = config.epp.plugins if config.epp is not None else {}
    endpoint_sources = endpoint_notifications(plugins)
    with plain_errors():  # a failing task (a discovery, a port) leaves as itself, not in a group
        async with exporting(tracing), trio.open_nursery() as nursery:
            picker.tracing = tracing
            if picker.tokens is not None and isinstance(picker.tokens.backend, VllmRender):
                picker.start_render = render_starter(nursery, picker.tokens.backend)
            if picker.latency:
                latency_metrics = LatencyMetrics(metrics.registry, metrics.labels)
                for producer in picker.latency.values():
                    producer.observe = latency_metrics.observe
                predictor = LatencyPredictorClient(config_from_env(os.environ), list(picker.latency.values()))
                await nursery.start(predictor.run)
                picker.start_predict = predictor.start
            caches = precise_caches(picker.scheduler.plugin_states)
            scrapers = Scrapers(nursery, config, snapshot, after_scrape, metrics.gauges, endpoint_subscribers(caches))
            for address, subscribed in bound_subscribers(caches).items():
                nursery.start_soon(subscribe_bound, address, *subscribed)
            if discovery is None:
                scrapers.sync(config.pool.endpoints)
                for source in endpoint_sources:
                    source.update(config.pool.endpoints)
            else:

                def on_endpoints(endpoints: Sequence[Endpoint]) -> None:
                    readiness.synced = True
                    scrapers.sync(endpoints)
                    for source in endpoint_sources:
                        source.update(endpoints)
                    picker.scheduler.inflight.forget([e.address for e in endpoints])
                    after_scrape()

                nursery.start_soon(discovery, on_endpoints)
            if leader_election is not None:

                def on_leader(leader: bool) -> None:
                    readiness.leader = leader
                    readiness.update(snapshot)

                nursery.start_soon(_elect_in, election, leader_election, on_leader)
            if objectives is not None:
                nursery.start_soon(objectives, picker.set_cluster_objectives)
            if picker.flow is not None:
                picker.flow.wake = lambda: flow_wake[0].set()  # an evicted request ended: poll again at once
                if picker.flow.reclamation is not None:
                    picker.flow.reclamation.observer = metrics.reclamation
                picker.flow.queue.observer = flow_metrics
                nursery.start_soon(_flow_control, picker.flow, config.pool.refresh_interval_s, flow_wake[0],
                                   new_flow_wake)
            screeners = picker.scheduler.screeners
            if screeners:
                metrics.registry.register(RolloutCollector(screeners))
                if pod_notifications is not None:
                    nursery.start_soon(pod_notifications, screeners)
                elif any(s.params.gating for s in screeners):
                    log.warning("picker.rollout_without_pods: revision gating needs pod notifications (cluster mode); "
                                "every request fails closed")
            sources = notification_sources(plugins)
            if sources and notifications is not None:
                nursery.start_soon(notifications, sources)
            elif sources:
                log.warning("picker.notifications_without_cluster: k8s-notification-source needs cluster mode; "
                            "sources=%s see no object", ",".join(s.name for s in sources))
            if picker.burst is not None:
                nursery.start_soon(seal_windows, picker.burst)
            grpc_bound = await nursery.start(partial(
                serve_grpc, [method], host, grpc_port, limits=wire_limits(config), ssl_context=ssl_context,
                graceful_stop=ext_proc))
            health_bound = await nursery.start(serve_grpc, readiness.health.methods, host, health_port)
            metrics_bound = await nursery.start(_serve_metrics, metrics.registry, host, metrics_port,
                                                metrics_ssl_context, metrics_auth,
                                                plugin_dumps(picker, discovery_state))
            ports = PickerPorts(grpc_bound, health_bound, metrics_bound)
            log.info("picker.serving pool=%s grpc=%d health=%d metrics=%d tls=%s", config.pool.name,
                     *vars(ports).values(), ssl_context is not None)
            if drain is not None:
                nursery.start_soon(_drain_when_asked, drain, readiness, election, ext_proc)
            task_status.started(ports)
