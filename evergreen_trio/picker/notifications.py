"""``k8s-notification-source`` and ``endpoint-notification-source``, sans-IO: llm-d-router's
notification data sources (``datalayer/source/notifications``).

A :class:`NotificationSource` follows the objects of one configured GVK (the Trio shell,
:mod:`evergreen_trio.picker.k8s.notification_watch`, lists then watches them in the pool's
namespace) and tells its extractors of each add, update and delete; an
:class:`EndpointNotifications` tells its extractors of each endpoint added to, changed in or
removed from the pool. Both pass events through unchanged, as the reference's do; the extractors
do the work. What they keep is bounded: at most :data:`MAX_OBJECTS` objects, none larger than
:data:`MAX_OBJECT_BYTES` encoded (such an object is dropped and counted), and only each object's
``resourceVersion``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:  # config imports this module (through epp_config)
    from evergreen_trio.picker.config import Endpoint

log = logging.getLogger(__name__)
K8S_NOTIFICATION_SOURCE = "k8s-notification-source"
ENDPOINT_NOTIFICATION_SOURCE = "endpoint-notification-source"
ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
MAX_OBJECTS = 65_536  # as the rollout screener's pods: a watch matching more is a mistake
MAX_OBJECT_BYTES = 1_572_864  # etcd's default request limit (1.5 MiB): no stored object is larger
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")

# An extractor: (event type, the object as the API server sent it).
Extractor = Callable[[str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class GVK:
    """The group (empty: the core group), version and kind a source watches."""

    group: str
    version: str
    kind: str

    @property
    def api_version(self) -> str:
        """``version`` for the core group, else ``group/version`` (an object's ``apiVersion``)."""
        return f"{self.group}/{self.version}" if self.group else self.version

    def __str__(self) -> str:  # the reference's schema.GroupVersionKind.String()
        return f"{self.group}/{self.version}, Kind={self.kind}"


def _gvk(params: Params) -> GVK:
    group = params.text("group", "")
    version = params.text("version", "")
    kind = params.text("kind", "")
    # Required, as the reference's factory; and each goes into a URL path, so it must be a name.
    if not _DNS_LABEL.fullmatch(version):
        raise ConfigError(params.where("version"), "an API version (required; a DNS label such as v1)", version)
    if not _KIND.fullmatch(kind):
        raise ConfigError(params.where("kind"), "a resource kind (required; letters and digits such as Pod)", kind)
    if group and (len(group) > 253 or not all(_DNS_LABEL.fullmatch(part) for part in group.split("."))):
        raise ConfigError(params.where("group"), "an API group (a DNS subdomain; empty: the core group)", group)
    return GVK(group, version, kind)


register(K8S_NOTIFICATION_SOURCE, PluginType(Category.DATA_SOURCE, ("group", "version", "kind"), _gvk))
register(ENDPOINT_NOTIFICATION_SOURCE, PluginType(Category.DATA_SOURCE))


def plural_of(kind: str) -> str:
    """The resource name Kubernetes guesses for ``kind`` (apimachinery's UnsafeGuessKindToResource):
    used for a kind lightkube does not know."""
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + "s"


def _key(obj: object) -> tuple[str, str] | None:
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    namespace = metadata.get("namespace") if isinstance(metadata, Mapping) else None
    return (namespace if isinstance(namespace, str) else "", name)


def _version(obj: Mapping[str, Any]) -> str:
    version = obj["metadata"].get("resourceVersion")
    return version if isinstance(version, str) else ""


@dataclass
class NotificationSource:
    """One ``k8s-notification-source``: the ``resourceVersion`` of each object of its GVK it saw
    (by namespace and name), and the extractors it tells of every change. ``dropped`` counts the
    objects refused (malformed, too large, past ``MAX_OBJECTS``)."""

    name: str
    gvk: GVK
    extractors: list[Extractor] = field(default_factory=list)
    versions: dict[tuple[str, str], str] = field(default_factory=dict)
    events: int = 0
    dropped: int = 0

    def replace(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """A fresh list: the objects gone are deleted, the new ones added, the changed ones
        modified (as an informer's relist tells its handlers)."""
        listed: dict[tuple[str, str], Mapping[str, Any]] = {}
        for obj in objects:
            key = self._admit(obj)
            if key is not None and (key in listed or len(listed) < MAX_OBJECTS):
                listed[key] = obj
            elif key is not None:
                self._drop(key, "too many objects")
        for key in [k for k in self.versions if k not in listed]:
            del self.versions[key]
            self._tell(DELETED, {"metadata": {"namespace": key[0], "name": key[1]}})
        for key, obj in listed.items():
            self._upsert(key, obj)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED; anything else, or an object refused, is
        ignored). An update that changes nothing (a relist's) tells no one."""
        if kind not in (ADDED, MODIFIED, DELETED):
            return
        key = self._admit(obj)
        if key is None:
            return
        if kind == DELETED:
            if self.versions.pop(key, None) is not None:
                self._tell(DELETED, obj)
            return
        self._upsert(key, obj)

    def _upsert(self, key: tuple[str, str], obj: Mapping[str, Any]) -> None:
        known = self.versions.get(key)
        if known is None and len(self.versions) >= MAX_OBJECTS:
            self._drop(key, "too many objects")
            return
        version = _version(obj)
        if known is not None and version and known == version:
            return
        self.versions[key] = version
        self._tell(ADDED if known is None else MODIFIED, obj)

    def _admit(self, obj: Mapping[str, Any]) -> tuple[str, str] | None:
        key = _key(obj)
        if key is None:
            self._drop(("", ""), "no metadata.name")
            return None
        try:
            size = len(json.dumps(obj, separators=(",", ":")))
        except (TypeError, ValueError):
            size = MAX_OBJECT_BYTES + 1
        if size > MAX_OBJECT_BYTES:
            self._drop(key, f"over {MAX_OBJECT_BYTES} bytes")
            return None
        return key

    def _drop(self, key: tuple[str, str], why: str) -> None:
        self.dropped += 1
        log.debug("picker.notification_dropped source=%s object=%s/%s why=%s", self.name, *key, why)

    def _tell(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.events += 1
        for extractor in self.extractors:
            extractor(kind, obj)


@dataclass
class EndpointNotifications:
    """One ``endpoint-notification-source``: the pool's endpoints it last saw (by address), and
    the extractors it tells of each one added, changed (labels, engine, ports) or removed."""

    name: str
    extractors: list[Callable[[str, Endpoint], None]] = field(default_factory=list)  # (event type, endpoint)
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    events: int = 0

    def update(self, endpoints: Sequence[Endpoint]) -> None:
        """The pool's whole endpoint set now."""
        current = {e.address: e for e in endpoints}
        told = {ADDED: 0, MODIFIED: 0, DELETED: 0}
        for address in [a for a in self.endpoints if a not in current]:
            self._tell(DELETED, self.endpoints.pop(address))
            told[DELETED] += 1
        for address, endpoint in current.items():
            known = self.endpoints.get(address)
            if known != endpoint:
                self.endpoints[address] = endpoint
                kind = ADDED if known is None else MODIFIED
                self._tell(kind, endpoint)
                told[kind] += 1
        if any(told.values()):
            log.info("picker.endpoint_notifications source=%s added=%d modified=%d deleted=%d", self.name,
                     told[ADDED], told[MODIFIED], told[DELETED])

    def _tell(self, kind: str, endpoint: Endpoint) -> None:
        self.events += 1
        for extractor in self.extractors:
            extractor(kind, endpoint)


def notification_sources(plugins: Mapping[str, Plugin]) -> list[NotificationSource]:
    """A :class:`NotificationSource` per declared ``k8s-notification-source``."""
    return [NotificationSource(p.name, p.params) for p in plugins.values() if isinstance(p.params, GVK)]


def endpoint_notifications(plugins: Mapping[str, Plugin]) -> list[EndpointNotifications]:
    """An :class:`EndpointNotifications` per declared ``endpoint-notification-source``."""
    return [EndpointNotifications(p.name) for p in plugins.values() if p.type == ENDPOINT_NOTIFICATION_SOURCE]
