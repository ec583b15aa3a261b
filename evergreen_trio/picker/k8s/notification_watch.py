"""Object notifications from the API server: list-then-watch one resource type and tell a sink
of each object, the one watch loop behind ``k8s-notification-source`` and the rollout
screener's pods (:mod:`evergreen_trio.picker.k8s.rollout_pods`).

The loop is discovery's (:mod:`evergreen_trio.picker.k8s.discovery`): watch timeouts resumed by
lightkube, 410 Gone re-listed at once, an API server away or answering garbage retried with
exponential backoff while the sink keeps what it knew. The sink bounds what it keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import trio
from lightkube import AsyncClient
from lightkube.core import resource as lk_resource
from lightkube.core.exceptions import LoadResourceError
from lightkube.core.resource_registry import resource_registry
from lightkube.generic_resource import create_namespaced_resource

from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.picker.k8s.discovery import WATCH_TIMEOUT_S, _Backoff, _events, _round, listed
from evergreen_trio.picker.notifications import GVK, NotificationSource, plural_of

log = logging.getLogger(__name__)


class ObjectSink(Protocol):
    """What the loop tells: the whole listed collection, then each watch event."""

    def replace(self, objects: Sequence[Mapping[str, Any]]) -> None: ...

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None: ...


async def watch_objects(client: AsyncClient, resource: Any, namespace: str | None, sink: ObjectSink, what: str,
                        max_backoff_s: float, labels: dict[str, Any] | None = None) -> None:
    """List then watch ``resource`` (a lightkube resource type; in ``namespace``, None for a
    cluster-scoped type) matching
    ``labels``, telling ``sink``, until cancelled; ``what`` names it in the logs."""
    backoff = _Backoff(max_backoff_s)
    status: dict[str, bool] = {}
    while True:
        status["gone"] = False
        with _round(what, status):
            listing = client.list(resource, namespace=namespace, labels=labels)
            sink.replace([obj.to_dict() for obj in await listed(listing)])
            backoff.reset()
            if status.pop("failing", False):
                log.info("picker.kube_recovered what=%s", what)
            watch = client.watch(resource, namespace=namespace, labels=labels, server_timeout=WATCH_TIMEOUT_S,
                                 resource_version=listing.resourceVersion)
            async for kind, obj in _events(watch):
                sink.apply(kind, obj.to_dict())
        if not status["gone"]:
            await backoff.wait()


def resource_for(gvk: GVK) -> type[lk_resource.Resource]:
    """lightkube's model of ``gvk`` when it knows the kind (its plural and scope are then right),
    else a namespaced generic resource named by Kubernetes' plural guess."""
    try:
        return resource_registry.load(gvk.api_version, gvk.kind)
    except LoadResourceError:
        return create_namespaced_resource(gvk.group, gvk.version, gvk.kind, plural_of(gvk.kind))


async def watch_notification_sources(access: ClusterAccess, namespace: str, sources: Sequence[NotificationSource], *,
                                     max_backoff_s: float = 5.0) -> None:
    """Feed each ``k8s-notification-source`` the objects of its GVK (in ``namespace`` when the
    type is namespaced), until cancelled."""
    client = access.client()
    try:
        async with trio.open_nursery() as nursery:
            for source in sources:
                resource = resource_for(source.gvk)
                scoped = issubclass(resource, lk_resource.NamespacedResource)
                log.info("picker.notification_source source=%s gvk=%s namespace=%s", source.name, source.gvk,
                         namespace if scoped else "(cluster)")
                nursery.start_soon(watch_objects, client, resource, namespace if scoped else None, source,
                                   f"{source.gvk.kind} objects of {source.name}", max_backoff_s)
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
