"""The picker's Trio runtime: scraper tasks, readiness, the metrics exporter and the gRPC servers.

The scraper tasks and the ext_proc server (:mod:`evergreen_trio.picker.grpc_server`, a Trio
task per connection) share one :class:`PoolSnapshot`; a pick is a plain synchronous call. The
health service is grpclib's, through the bridge, on its own port.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpclib.const import Status
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health

from evergreen_trio._grpc.bridge import serve_grpclib
from evergreen_trio._grpc.health import HealthName
from evergreen_trio._http import HttpGetError, KeepAliveGetter
from evergreen_trio.metrics import serve_metrics
from evergreen_trio.picker.config import Endpoint, PickerConfig
from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES, parse_engine_metrics
from evergreen_trio.picker.errors import ExtProcError, MetricsError
from evergreen_trio.picker.grpc_server import serve_sync_bidi
from evergreen_trio.picker.grpc_wire import RpcStatusError, SyncBidiMethod
from evergreen_trio.picker.processor import ExtProcStream, Picker
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.telemetry import PickerMetrics

log = logging.getLogger(__name__)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{EXT_PROC_SERVICE}/Process"


@dataclass(frozen=True)
class PickerPorts:
    """The ports a running picker bound (what ``task_status.started`` reports)."""

    grpc: int
    health: int
    metrics: int


class _GrpcStream:
    """Adapts :class:`ExtProcStream` to the gRPC server: protocol violations end the RPC with a status."""

    __slots__ = ("_stream",)

    def __init__(self, stream: ExtProcStream) -> None:
        self._stream = stream

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def on_message(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse]:
        try:
            return self._stream.on_message(message)
        except ExtProcError as exc:
            log.warning("picker.stream_aborted error=%s", exc)
            raise RpcStatusError(Status.INVALID_ARGUMENT, str(exc)) from None

    def on_end(self) -> Sequence[ep.ProcessingResponse]:
        return self._stream.on_end()


async def _scrape_forever(
    endpoint: Endpoint,
    config: PickerConfig,
    snapshot: PoolSnapshot,
    after_scrape: Callable[[], None],
) -> None:
    getter = KeepAliveGetter(endpoint.host, endpoint.port, max_body=MAX_METRICS_BYTES)
    url = f"http://{endpoint.address}{config.pool.metrics_path}"
    was_ready = False
    try:
        while True:
            try:
                with trio.fail_after(config.pool.scrape_timeout_s):
                    status, body = await getter.get(config.pool.metrics_path)
                if status != 200:
                    raise MetricsError(f"expected HTTP 200 from {url}, got {status}")
                text = body.decode("utf-8", "replace")
                snapshot.update(endpoint.address, parse_engine_metrics(endpoint.engine, text))
                if not was_ready:
                    log.info("picker.endpoint_ready endpoint=%s", endpoint.address)
                was_ready = True
            except (HttpGetError, MetricsError, trio.TooSlowError) as exc:
                snapshot.mark_failed(endpoint.address)
                if was_ready:
                    log.warning("picker.endpoint_not_ready endpoint=%s error=%s", endpoint.address, exc or "timeout")
                was_ready = False
            after_scrape()
            await trio.sleep(config.pool.refresh_interval_s)
    finally:
        await getter.aclose()


async def run_scrapers(
    config: PickerConfig,
    snapshot: PoolSnapshot,
    after_scrape: Callable[[], None],
) -> None:
    """One Trio task per endpoint, in one nursery, scraping ``/metrics`` every refresh interval."""
    async with trio.open_nursery() as nursery:
        for endpoint in config.pool.endpoints:
            nursery.start_soon(_scrape_forever, endpoint, config, snapshot, after_scrape)


async def run_picker(
    config: PickerConfig,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 9002,
    health_port: int = 9003,
    metrics_port: int = 9090,
    task_status: trio.TaskStatus[PickerPorts] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the Endpoint Picker until cancelled; ``started`` gets the bound :class:`PickerPorts`.

    Port 0 picks a free port. Readiness (gRPC health for ``""``, the ext_proc service and
    ``readiness``) turns SERVING once every endpoint has been scraped once; ``liveness`` at once.
    """
    snapshot = PoolSnapshot(config.pool.endpoints, config.pool.staleness_threshold_s, time.monotonic)
    metrics = PickerMetrics(config.pool.name)
    picker = Picker(config, snapshot, metrics=metrics)
    live, ready = ServiceStatus(), ServiceStatus()
    live.set(True)
    ready.set(False)
    health = Health({
        OVERALL: [ready],
        HealthName(EXT_PROC_SERVICE): [ready],
        HealthName("liveness"): [live],
        HealthName("readiness"): [ready],
    })
    is_ready = False

    def after_scrape() -> None:
        nonlocal is_ready
        metrics.observe_pool(snapshot)
        if not is_ready and snapshot.first_scrape_done:
            is_ready = True
            log.info("picker.ready pool=%s", config.pool.name)
            ready.set(True)

    method = SyncBidiMethod(
        path=PROCESS_PATH,
        request_type=ep.ProcessingRequest,
        new_processor=lambda: _GrpcStream(picker.new_stream()),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_scrapers, config, snapshot, after_scrape)
        grpc_bound = await nursery.start(serve_sync_bidi, [method], host, grpc_port)
        health_bound = await nursery.start(serve_grpclib, [health], host, health_port)
        metrics_bound = await nursery.start(serve_metrics, metrics.registry, host, metrics_port)
        ports = PickerPorts(grpc_bound, health_bound, metrics_bound)
        log.info("picker.serving pool=%s grpc=%d health=%d metrics=%d", config.pool.name, *vars(ports).values())
        task_status.started(ports)
