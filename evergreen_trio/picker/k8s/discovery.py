"""Discovery: watch an InferencePool and its pods, report the endpoint set on every change.

Two list-then-watch loops share one :class:`PoolState`: the pool (by name) and the pods matching
its selector (restarted when the selector changes). Each loop lists (getting the collection's
``resourceVersion``), then watches from there. A watch that ends cleanly (the server's
``timeoutSeconds``) is resumed by lightkube from the last version seen; 410 Gone (the version
expired) re-lists at once; an API server that is down or answers garbage is retried with
exponential backoff. The endpoint set is only replaced by a successful list or an event, so the
last known endpoints keep serving while the API server is away.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx2
import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import GenericNamespacedResource, create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.k8s.access import ANSWER_ERRORS, LOGGED_ERROR_CHARS, ClusterAccess
from evergreen_trio.picker.k8s.pool_state import PoolSpec, PoolSpecError, PoolState, pool_spec

log = logging.getLogger(__name__)
_T = TypeVar("_T")
POOL_VERSIONS = {"inference.networking.k8s.io": "v1", "inference.networking.x-k8s.io": "v1alpha2"}
WATCH_TIMEOUT_S = 60  # the server closes each watch after this; lightkube resumes it
IDLE_TIMEOUT_S = 90.0  # no event and no clean close for this long: the connection is dead, re-list
LIST_TIMEOUT_S = 60.0  # the API server's own request timeout: a list taking longer is a stuck peer
MAX_ENDPOINTS = 4096  # one scraper task each: a selector matching far more pods is a mistake, not a pool
ROUND_ERRORS = (*ANSWER_ERRORS, PoolSpecError)  # of one list or watch round


@dataclass(frozen=True)
class PoolRef:
    """Which pool to follow; ``selector`` and ``ports`` given means no InferencePool (selector mode)."""

    name: str
    namespace: str
    group: str = "inference.networking.k8s.io"
    selector: tuple[tuple[str, str], ...] = ()
    ports: tuple[int, ...] = ()


def parse_selector(text: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` (the reference's ``--endpoint-selector``) -> sorted pairs; ConfigError otherwise."""
    pairs = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--endpoint-selector", "key=value pairs separated by commas", text)
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


def pool_resource(group: str) -> type[GenericNamespacedResource]:
    if group not in POOL_VERSIONS:
        raise ConfigError("--pool-group", " or ".join(POOL_VERSIONS), group)
    return create_namespaced_resource(group, POOL_VERSIONS[group], "InferencePool", "inferencepools")


class _Backoff:
    """Exponential backoff with jitter between failed rounds, reset by a successful list."""

    def __init__(self, maximum_s: float) -> None:
        self.maximum_s = maximum_s
        self.delay_s = 0.0

    def reset(self) -> None:
        self.delay_s = 0.0

    async def wait(self) -> None:
        self.delay_s = min(self.maximum_s, max(0.1, self.delay_s * 2))
        await trio.sleep(self.delay_s * random.uniform(0.5, 1.0))


async def _events(watch: AsyncIterable[tuple[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    """The watch's events, ending it with TooSlowError when the connection goes silent."""
    events = watch.__aiter__()
    while True:
        with trio.fail_after(IDLE_TIMEOUT_S):
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                return
        yield event


async def listed(listing: AsyncIterable[_T]) -> list[_T]:
    """A list's objects; ``httpx2.ReadTimeout`` past :data:`LIST_TIMEOUT_S` (the client's timeout is
    per read, so a server sending a byte every few seconds would hold the list forever)."""
    with trio.move_on_after(LIST_TIMEOUT_S):
        return [obj async for obj in listing]
    raise httpx2.ReadTimeout(f"expected the list within {LIST_TIMEOUT_S}s, still reading")


@contextmanager
def _round(what: str, state: dict[str, bool]) -> Iterator[None]:
    """Log one failed list/watch round (once per outage, then at debug) and swallow it."""
    try:
        yield
    except ApiError as exc:
        code = exc.status.code if exc.status is not None else None
        if code == 410:
            log.info("picker.watch_expired what=%s (410 Gone, re-listing)", what)
            state["gone"] = True
            return
        _log_failure(what, state, f"HTTP {code}: {exc.status.message if exc.status else exc}")
    except trio.TooSlowError:
        _log_failure(what, state, f"no event or close in {IDLE_TIMEOUT_S}s")
    except ROUND_ERRORS as exc:
        _log_failure(what, state, f"{type(exc).__name__}: {exc}")


def _log_failure(what: str, state: dict[str, bool], error: str) -> None:
    error = peer_text(error, LOGGED_ERROR_CHARS)
    if state.get("failing"):
        log.debug("picker.kube_retry what=%s error=%s", what, error)
    else:
        log.warning("picker.kube_unavailable what=%s error=%s (keeping the last endpoints, retrying)", what, error)
    state["failing"] = True


class _Sync:
    """The shared state: reports the endpoints once both lists are in, then on every change."""

    def __init__(self, on_endpoints: Callable[[Sequence[Endpoint]], None], state: PoolState) -> None:
        self.on_endpoints = on_endpoints
        self.state = state
        self.pods_listed = False
        self._last: tuple[Endpoint, ...] | None = None
        self._told_left_out = False

    def changed(self) -> None:
        if self.state.spec is None or not self.pods_listed:
            return
        if self.state.left_out and not self._told_left_out:
            log.error("picker.too_many_pods limit=%d left_out=%d (serving the first %d Ready pods listed)",
                      self.state.max_pods, self.state.left_out, self.state.max_pods)
        self._told_left_out = bool(self.state.left_out)
        endpoints = self.state.endpoints()
        if len(endpoints) > MAX_ENDPOINTS:
            log.error("picker.too_many_endpoints count=%d limit=%d (serving the first %d)",
                      len(endpoints), MAX_ENDPOINTS, MAX_ENDPOINTS)
            endpoints = endpoints[:MAX_ENDPOINTS]
        if endpoints != self._last:
            log.info("picker.endpoints count=%d endpoints=%s", len(endpoints), ",".join(e.address for e in endpoints))
            self._last = endpoints
            self.on_endpoints(endpoints)


async def _watch_pods(client: AsyncClient, namespace: str, spec: PoolSpec, sync: _Sync, max_backoff_s: float) -> None:
    backoff = _Backoff(max_backoff_s)
    status: dict[str, bool] = {}
    while True:
        status["gone"] = False
        with _round("pods", status):
            listing = client.list(Pod, namespace=namespace, labels=spec.labels)
            sync.state.replace_pods([pod.to_dict() for pod in await listed(listing)])
            sync.pods_listed = True
            sync.changed()
            backoff.reset()
            if status.pop("failing", False):
                log.info("picker.kube_recovered what=pods")
            watch = client.watch(Pod, namespace=namespace, labels=spec.labels, server_timeout=WATCH_TIMEOUT_S,
                                 resource_version=listing.resourceVersion)
            async for kind, pod in _events(watch):
                sync.state.apply(kind, pod.to_dict())
                sync.changed()
        if not status["gone"]:
            await backoff.wait()


class _PodWatcher:
    """Runs the pod loop for the current selector, restarting it when the selector changes."""

    def __init__(self, nursery: trio.Nursery, client: AsyncClient, namespace: str, sync: _Sync,
                 max_backoff_s: float) -> None:
        self.nursery, self.client, self.namespace, self.sync = nursery, client, namespace, sync
        self.max_backoff_s = max_backoff_s
        self._selector: tuple[tuple[str, str], ...] | None = None
        self._scope: trio.CancelScope | None = None

    def on_spec(self, spec: PoolSpec) -> None:
        self.sync.state.spec = spec
        if spec.selector != self._selector:
            if self._scope is not None:
                self._scope.cancel()
                self.sync.pods_listed = False  # keep serving the old pods until the new list is in
            self._selector = spec.selector
            self._scope = trio.CancelScope()
            self.nursery.start_soon(self._run, spec, self._scope)
        self.sync.changed()

    async def _run(self, spec: PoolSpec, scope: trio.CancelScope) -> None:
        with scope:
            await _watch_pods(self.client, self.namespace, spec, self.sync, self.max_backoff_s)


async def _watch_pool(client: AsyncClient, ref: PoolRef, pods: _PodWatcher, max_backoff_s: float) -> None:
    resource = pool_resource(ref.group)
    fields: dict[str, Any] = {"metadata.name": ref.name}
    backoff = _Backoff(max_backoff_s)
    status: dict[str, bool] = {}
    where = f"{ref.group}/{POOL_VERSIONS[ref.group]} InferencePool {ref.namespace}/{ref.name}"
    while True:
        status["gone"] = False
        with _round("inferencepool", status):
            listing = client.list(resource, namespace=ref.namespace, fields=fields)
            pools = await listed(listing)
            backoff.reset()
            if status.pop("failing", False):
                log.info("picker.kube_recovered what=inferencepool")
            if pools:
                pods.on_spec(pool_spec(pools[0].get("spec") or {}))
            else:
                log.warning("picker.pool_not_found pool=%s (waiting for it)", where)
            watch = client.watch(resource, namespace=ref.namespace, fields=fields, server_timeout=WATCH_TIMEOUT_S,
                                 resource_version=listing.resourceVersion)
            async for kind, pool in _events(watch):
                if kind in ("ADDED", "MODIFIED"):
                    pods.on_spec(pool_spec(pool.get("spec") or {}))
                elif kind == "DELETED":
                    log.warning("picker.pool_deleted pool=%s (keeping the last endpoints)", where)
        if not status["gone"]:
            await backoff.wait()


async def pool_discovery(
    access: ClusterAccess,
    ref: PoolRef,
    pool: PoolConfig,
    on_endpoints: Callable[[Sequence[Endpoint]], None],
    *,
    max_backoff_s: float = 5.0,
) -> None:
    """Follow ``ref``'s Ready pods until cancelled, calling ``on_endpoints`` with each new set.

    The first call comes once the pool and its pods have been listed (the picker's readiness
    waits for it). ``pool`` is the picker's pool config (its name is logged; its ``engines``
    read each pod's engine from its labels).
    """
    client = access.client()
    try:
        async with trio.open_nursery() as nursery:
            sync = _Sync(on_endpoints, PoolState(engines=pool.engines, max_pods=MAX_ENDPOINTS))
            pods = _PodWatcher(nursery, client, ref.namespace, sync, max_backoff_s)
            log.info("picker.discovery pool=%s namespace=%s group=%s", pool.name, ref.namespace, ref.group)
            if ref.selector:
                pods.on_spec(PoolSpec(ref.selector, ref.ports))
            else:
                nursery.start_soon(_watch_pool, client, ref, pods, max_backoff_s)
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
