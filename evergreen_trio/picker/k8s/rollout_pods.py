"""Pod notifications for ``disaggregatedset-rollout-screener``: list-then-watch the pods in its
``scope.labelSelector`` and tell the screener of each (the reference's core/v1 Pod notification
source feeding ``disaggregatedset-rollout-pod-extractor``).

The loop is discovery's (:mod:`evergreen_trio.picker.k8s.discovery`): watch timeouts resumed by
lightkube, 410 Gone re-listed at once, an API server away or answering garbage retried with
exponential backoff while the screener keeps the pods it knew. The screener bounds what it keeps
and ignores a malformed pod.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.picker.k8s.discovery import WATCH_TIMEOUT_S, _Backoff, _events, _round
from evergreen_trio.picker.rollout import RolloutScreener, selector_terms

log = logging.getLogger(__name__)


async def _watch(client: AsyncClient, namespace: str, screener: RolloutScreener, max_backoff_s: float) -> None:
    what = f"pods of {screener.name}"
    labels = selector_terms(screener.params.scope)
    backoff = _Backoff(max_backoff_s)
    status: dict[str, bool] = {}
    while True:
        status["gone"] = False
        with _round(what, status):
            listing = client.list(Pod, namespace=namespace, labels=labels)
            screener.replace([pod.to_dict() async for pod in listing])
            backoff.reset()
            if status.pop("failing", False):
                log.info("picker.kube_recovered what=%s", what)
            watch = client.watch(Pod, namespace=namespace, labels=labels, server_timeout=WATCH_TIMEOUT_S,
                                 resource_version=listing.resourceVersion)
            async for kind, pod in _events(watch):
                screener.apply(kind, pod.to_dict())
        if not status["gone"]:
            await backoff.wait()


async def watch_rollout_pods(access: ClusterAccess, namespace: str, screeners: Sequence[RolloutScreener], *,
                             max_backoff_s: float = 5.0) -> None:
    """Feed each gating screener the pods in its scope, in ``namespace``, until cancelled."""
    client = access.client()
    try:
        async with trio.open_nursery() as nursery:
            for screener in screeners:
                if screener.params.gating:
                    log.info("picker.rollout_pods screener=%s namespace=%s selector=%s", screener.name, namespace,
                             screener.params.scope_text)
                    nursery.start_soon(_watch, client, namespace, screener, max_backoff_s)
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
