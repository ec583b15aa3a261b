"""Sans-IO: an InferencePool and its pods (as JSON-like mappings) -> the picker's endpoints.

An endpoint is a Ready, not-terminating pod's IP with each of the pool's target ports. The
pool is read in both served versions: ``inference.networking.k8s.io/v1`` (``selector.matchLabels``,
``targetPorts[].number``) and ``inference.networking.x-k8s.io/v1alpha2`` (``selector`` as a plain
label map, ``targetPortNumber``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from evergreen_trio.picker.config import Endpoint
from evergreen_trio.picker.engine_metrics import EngineConfig
from evergreen_trio.picker.errors import PickerError

# The v1 CRD's MaxItems: every port is an endpoint of every pod, so a pool served with thousands
# (only an API server skipping validation sends them) made millions of endpoints per event.
MAX_TARGET_PORTS = 8


class PoolSpecError(PickerError):
    """The InferencePool's spec lacks a selector or target ports we can read."""


@dataclass(frozen=True)
class PoolSpec:
    """What discovery needs of a pool: the pods' label selector and the target ports."""

    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def labels(self) -> dict[str, Any]:
        """The selector as lightkube's ``labels`` argument (equality terms only)."""
        return dict(self.selector)


def _port(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise PoolSpecError(f"InferencePool {path}: expected a port in 1..65535, got {value!r}")
    return value


def pool_spec(spec: Mapping[str, Any]) -> PoolSpec:
    """Read a pool's ``spec`` (v1 or v1alpha2); PoolSpecError when a field is missing or wrong."""
    selector = spec.get("selector")
    if isinstance(selector, Mapping) and "matchLabels" in selector:
        selector = selector["matchLabels"]
    if not isinstance(selector, Mapping) or not selector or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in selector.items()):
        raise PoolSpecError(f"InferencePool spec.selector: expected label=value pairs, got {selector!r}")
    if "targetPorts" in spec:
        entries = spec["targetPorts"]
        if not isinstance(entries, list) or not 0 < len(entries) <= MAX_TARGET_PORTS:
            raise PoolSpecError(f"InferencePool spec.targetPorts: expected a list of 1 to {MAX_TARGET_PORTS} ports, "
                                f"got {str(entries)[:100]}")
        ports = tuple(_port(_map(e).get("number"), f"spec.targetPorts[{i}].number") for i, e in enumerate(entries))
        if len(set(ports)) != len(ports):
            raise PoolSpecError(f"InferencePool spec.targetPorts: expected unique port numbers, got {ports}")
    else:
        ports = (_port(spec.get("targetPortNumber"), "spec.targetPortNumber"),)
    return PoolSpec(tuple(sorted(selector.items())), ports)


def _map(value: object) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else empty: an API object with a malformed part is not Ready."""
    return value if isinstance(value, Mapping) else {}


def pod_address(pod: Mapping[str, Any]) -> str | None:
    """The pod's IP when it is Ready and not being deleted, else None."""
    metadata, status = _map(pod.get("metadata")), _map(pod.get("status"))
    if metadata.get("deletionTimestamp"):
        return None
    conditions = status.get("conditions")
    ready = isinstance(conditions, list) and any(
        _map(c).get("type") == "Ready" and _map(c).get("status") == "True" for c in conditions)
    ip = status.get("podIP")
    if not ready or not isinstance(ip, str):
        return None
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return None
    return ip


def pod_labels(pod: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The pod's string labels, sorted (what role filters and the engine label read)."""
    labels = _map(_map(pod.get("metadata")).get("labels"))
    return tuple(sorted((k, v) for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)))


class _Pod(NamedTuple):
    """What the endpoints of one pod carry: its IP (None: not Ready), labels, ``spec.hostname``
    (what topology-extractor falls back to) and node IP (``status.hostIP``: what a DCGM DaemonSet
    is scraped at)."""

    ip: str | None
    labels: tuple[tuple[str, str], ...]
    hostname: str
    node_address: str


def _pod(pod: Mapping[str, Any]) -> _Pod:
    hostname, node = _map(pod.get("spec")).get("hostname"), _map(pod.get("status")).get("hostIP")
    return _Pod(pod_address(pod), pod_labels(pod), hostname if isinstance(hostname, str) else "",
                node if isinstance(node, str) else "")


MAX_PODS = 4096  # Ready pods kept: a selector matching far more is a mistake, not a pool


class PoolState:
    """The pool's spec and its Ready pods' addresses and labels; :meth:`endpoints` is what the
    picker serves, each pod's engine read from its labels by ``engines``.

    At most ``max_pods`` Ready pods are kept, the first listed (the API server lists by name) or
    added; :attr:`left_out` counts the others since the last list (every event sorts the pods, so
    a selector matching a million made each cost seconds, and their number grew without bound)."""

    def __init__(self, spec: PoolSpec | None = None, engines: EngineConfig | None = None,
                 max_pods: int = MAX_PODS) -> None:
        self.spec = spec
        self.engines = engines or EngineConfig()
        self.max_pods = max_pods
        self.pods: dict[str, _Pod] = {}
        self.left_out = 0

    def replace_pods(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """A fresh list: forget every pod not in it."""
        self.pods, self.left_out = {}, 0
        for pod in pods:
            self._put(pod)

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED; BOOKMARK carries no pod)."""
        if event_type == "DELETED":
            self.pods.pop(_name(pod), None)
        elif event_type in ("ADDED", "MODIFIED"):
            self._put(pod)

    def _put(self, pod: Mapping[str, Any]) -> None:
        name, info = _name(pod), _pod(pod)
        if info.ip is None:
            self.pods.pop(name, None)
        elif name in self.pods or len(self.pods) < self.max_pods:
            self.pods[name] = info
        else:
            self.left_out += 1

    def endpoints(self) -> tuple[Endpoint, ...]:
        if self.spec is None:
            return ()
        pods = sorted({pod.ip: (name, pod) for name, pod in self.pods.items() if pod.ip is not None}.items())
        return tuple(Endpoint(ip, port, self.engines.engine_of(dict(pod.labels)), pod.labels, name, pod.hostname,
                              pod.node_address)
                     for ip, (name, pod) in pods for port in self.spec.ports)


def _name(pod: Mapping[str, Any]) -> str:
    return str(_map(pod.get("metadata")).get("name", ""))
