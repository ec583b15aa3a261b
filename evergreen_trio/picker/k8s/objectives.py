"""Watch InferenceObjectives: each names a priority for requests that name it in a header.

llm-d-router's ``llm-d.ai/v1alpha2`` and the legacy ``inference.networking.x-k8s.io/v1alpha2``
are both followed (list, then watch; the same recovery as discovery: 410 Gone re-lists, an
outage keeps the last known objectives and retries with backoff). An objective counts when its
``spec.poolRef.name`` is the picker's pool; ``spec.priority`` unset means 0. The llm-d group wins
when both define a name. One that is malformed (a priority that is not an integer) is skipped with a
warning; at most :data:`MAX_OBJECTIVES` are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio
from lightkube import AsyncClient
from lightkube.generic_resource import create_namespaced_resource

from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.picker.k8s.discovery import WATCH_TIMEOUT_S, _Backoff, _events, _round, listed

log = logging.getLogger(__name__)
# Group -> version, first wins on a name both define.
OBJECTIVE_GROUPS = {"llm-d.ai": "v1alpha2", "inference.networking.x-k8s.io": "v1alpha2"}
MAX_OBJECTIVES = 10_000


def objective_priority(obj: Mapping[str, Any], pool: str) -> tuple[str, int] | None:
    """(name, priority) of an InferenceObjective of ``pool``; None when it is another pool's or malformed."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not isinstance(spec, Mapping):
        return None
    ref = spec.get("poolRef")
    if not isinstance(ref, Mapping) or ref.get("name") != pool:
        return None
    priority = spec.get("priority", 0)
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
        log.warning("picker.objective_skipped name=%s reason=spec.priority %s is not an int32", peer_text(name),
                    peer_text(repr(priority), 64))
        return None
    return name, priority


class _Objectives:
    """The objectives of every group, merged and reported on each change."""

    def __init__(self, pool: str, on_objectives: Callable[[Mapping[str, int]], None]) -> None:
        self.pool = pool
        self.on_objectives = on_objectives
        self.by_group: dict[str, dict[str, int]] = {group: {} for group in OBJECTIVE_GROUPS}
        self._last: dict[str, int] | None = None

    def replace(self, group: str, objects: list[Mapping[str, Any]]) -> None:
        """A fresh list of ``group``'s: those over :data:`MAX_OBJECTIVES` in one line (a line each
        made a list of a million a million lines)."""
        self.by_group[group] = {}
        left_out = sum(self._put(group, "ADDED", obj) is not None for obj in objects)
        if left_out:
            log.error("picker.too_many_objectives limit=%d left_out=%d", MAX_OBJECTIVES, left_out)
        self.report()

    def apply(self, group: str, kind: str, obj: Mapping[str, Any]) -> None:
        left_out = self._put(group, kind, obj)
        if left_out is not None:
            log.error("picker.too_many_objectives limit=%d (skipping %s)", MAX_OBJECTIVES, peer_text(left_out))
        self.report()

    def _put(self, group: str, kind: str, obj: Mapping[str, Any]) -> str | None:
        """One event; the objective's name when it is left out, over :data:`MAX_OBJECTIVES`."""
        objectives = self.by_group[group]
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if isinstance(name, str):
            objectives.pop(name, None)  # deleted, or edited to another pool or a bad spec
        entry = objective_priority(obj, self.pool) if kind != "DELETED" else None
        if entry is None:
            return None
        if len(objectives) >= MAX_OBJECTIVES:
            return entry[0]
        objectives[entry[0]] = entry[1]
        return None

    def report(self) -> None:
        merged: dict[str, int] = {}
        for group in reversed(OBJECTIVE_GROUPS):
            merged.update(self.by_group[group])
        if merged != self._last:
            self._last = merged
            log.info("picker.objectives count=%d", len(merged))
            self.on_objectives(dict(merged))


def _plain(obj: Any) -> Mapping[str, Any]:
    """A generic resource as plain dicts (lightkube may hold its metadata as an ObjectMeta)."""
    plain: Mapping[str, Any] = obj.to_dict()
    return plain


async def _watch_group(client: AsyncClient, group: str, namespace: str, objectives: _Objectives,
                       max_backoff_s: float) -> None:
    resource = create_namespaced_resource(group, OBJECTIVE_GROUPS[group], "InferenceObjective",
                                          "inferenceobjectives")
    backoff = _Backoff(max_backoff_s)
    status: dict[str, bool] = {}
    what = f"inferenceobjectives.{group}"
    while True:
        status["gone"] = False
        with _round(what, status):
            listing = client.list(resource, namespace=namespace)
            objectives.replace(group, [_plain(obj) for obj in await listed(listing)])
            backoff.reset()
            if status.pop("failing", False):
                log.info("picker.kube_recovered what=%s", what)
            watch = client.watch(resource, namespace=namespace, server_timeout=WATCH_TIMEOUT_S,
                                 resource_version=listing.resourceVersion)
            async for kind, obj in _events(watch):
                objectives.apply(group, kind, _plain(obj))
        if not status["gone"]:
            await backoff.wait()


async def objective_watch(
    access: ClusterAccess,
    namespace: str,
    pool: str,
    on_objectives: Callable[[Mapping[str, int]], None],
    *,
    max_backoff_s: float = 5.0,
) -> None:
    """Follow the pool's InferenceObjectives in ``namespace`` until cancelled, calling
    ``on_objectives`` with every new name -> priority map."""
    client = access.client()
    try:
        async with trio.open_nursery() as nursery:
            objectives = _Objectives(pool, on_objectives)
            for group in OBJECTIVE_GROUPS:
                nursery.start_soon(_watch_group, client, group, namespace, objectives, max_backoff_s)
    finally:
        with trio.CancelScope(shield=True):
            await client.close()
