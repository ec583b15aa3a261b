"""Pod notifications for ``disaggregatedset-rollout-screener``: list-then-watch the pods in its
``scope.labelSelector`` and tell the screener of each (the reference's core/v1 Pod notification
source feeding ``disaggregatedset-rollout-pod-extractor``), through the one watch loop of
:mod:`evergreen_trio.picker.k8s.notification_watch`. The screener bounds what it keeps and
ignores a malformed pod.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import trio
from lightkube.resources.core_v1 import Pod

from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.picker.k8s.notification_watch import watch_objects
from evergreen_trio.picker.rollout import RolloutScreener, selector_terms

log = logging.getLogger(__name__)


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
                    nursery.start_soon(partial(watch_objects, client, Pod, namespace, screener,
                                               f"pods of {screener.name}", max_backoff_s,
                                               labels=selector_terms(screener.params.scope)))
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
