"""llm-d-router's ``file-discovery`` plugin: the endpoints listed in a YAML or JSON file.

Declared in ``plugins`` and named by ``dataLayer.discovery.pluginRef``, it replaces the
InferencePool (or the static ``pool.endpoints``) as the source of endpoints. The file format::

    endpoints:
      - name: vllm-0          # namespace defaults to "default"
        address: "10.0.0.1"   # an IPv4 literal
        port: "8000"          # a string, 1..65535
        labels: {app: vllm}

:func:`parse_endpoints_file` reads its bytes (sans-IO, here); the Trio shell that reads the file
and, with ``watchFile: true``, polls it is :mod:`evergreen_trio.picker.file_watch` (the reference
uses fsnotify).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from evergreen_trio.picker.errors import ConfigError, PickerError
from evergreen_trio.picker.gotext import atoi
from evergreen_trio.picker.plugin_state import MAX_LISTED, first_sorted
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.config import Endpoint, PoolConfig

logger = logging.getLogger(__name__)

PLUGIN_TYPE = "file-discovery"
MAX_FILE_SIZE = 1 << 20  # the reference's 1 MiB cap


class EndpointsFileError(PickerError):
    """The whole file is unusable (unreadable, too large, not YAML, wrong shape)."""


@dataclass(frozen=True)
class FileEndpoint:
    """One valid entry: its identity (namespace, name), address, port and labels."""

    namespace: str
    name: str
    address: str
    port: int
    labels: tuple[tuple[str, str], ...]


def _key_text(key: object) -> str:
    # sigs.k8s.io/yaml turns non-string keys into their text before Go's json decodes them.
    return ("true" if key else "false") if isinstance(key, bool) else str(key)


def _fields(raw: object, where: str, names: Sequence[str]) -> dict[str, Any]:
    """A JSON object decoded as Go's json into a struct: unknown keys ignored, the last of
    case-insensitively equal keys wins, null is the zero value."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise EndpointsFileError(f"{where}: an object expected, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        folded = _key_text(key).casefold()  # Go's json matches field names case-insensitively
        for name in names:
            if folded == name.casefold() and value is not None:
                out[name] = value
    return out


def _string(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise EndpointsFileError(f"{where}: a string expected, got {type(value).__name__}")
    return value


def _labels(raw: object, where: str) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise EndpointsFileError(f"{where}: an object expected, got {type(raw).__name__}")
    labels = {_key_text(k): "" if v is None else _string(v, f"{where}.{k}") for k, v in raw.items()}
    return tuple(sorted(labels.items()))


def valid_ipv4(address: str) -> bool:
    """Go's ``net.ParseIP(a).To4() != nil``: an IPv4 literal or an IPv4-mapped IPv6 one."""
    if "%" in address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return ip.version == 4 or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None)


EntryCheck = Callable[[str, Mapping[str, str]], "str | None"]
"""An entry's address and labels -> why the entry is refused (None: it is not)."""


def pod_address(address: str, labels: Mapping[str, str]) -> str | None:
    """``file-discovery``'s check: a pod is reached at an IPv4 literal."""
    return None if valid_ipv4(address) else f"invalid IPv4 address {address!r}"


def parse_endpoints_file(data: bytes, check: EntryCheck = pod_address) -> tuple[list[FileEndpoint], list[str]]:
    """The valid entries of an endpoints file (``check`` refuses none of their addresses and
    labels) and one message per entry skipped.

    Raises :class:`EndpointsFileError` when the file as a whole is unusable.
    """
    if len(data) > MAX_FILE_SIZE:
        raise EndpointsFileError("endpoints file exceeds 1 MiB limit")
    try:
        doc = yaml.safe_load(data)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise EndpointsFileError(f"parsing: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    raw_entries = _fields(doc, "endpoints file", ("endpoints",)).get("endpoints", [])
    if not isinstance(raw_entries, list):
        raise EndpointsFileError(f"endpoints: a list expected, got {type(raw_entries).__name__}")
    parsed: list[dict[str, Any]] = []
    for i, raw in enumerate(raw_entries):
        where = f"endpoints[{i}]"
        entry = _fields(raw, where, ("name", "namespace", "address", "port", "labels"))
        for key in ("name", "namespace", "address", "port"):
            entry[key] = _string(entry.get(key, ""), f"{where}.{key}")
        entry["labels"] = _labels(entry.get("labels"), f"{where}.labels")
        parsed.append(entry)
    endpoints: list[FileEndpoint] = []
    errors: list[str] = []
    for e in parsed:
        port = atoi(e["port"])
        refused = check(e["address"], dict(e["labels"]))
        if refused is not None:
            errors.append(f"endpoint {e['name']!r}: {refused}")
        elif port is None or not 1 <= port <= 65535:
            errors.append(f"endpoint {e['name']!r}: invalid port {e['port']!r}")
        else:
            endpoints.append(FileEndpoint(e["namespace"] or "default", e["name"], e["address"], port, e["labels"]))
    return endpoints, errors


def to_endpoints(entries: Sequence[FileEndpoint], pool: PoolConfig) -> list[Endpoint]:
    """The picker's endpoints: one per identity (a later entry replaces an earlier one of the same
    namespace/name, as the reference's upsert does), then one per address."""
    from evergreen_trio.picker.config import Endpoint  # config reads EndpointPickerConfigs, which register us

    by_id = {(e.namespace, e.name): e for e in entries}
    by_address: dict[str, Endpoint] = {}
    for e in by_id.values():
        labels = dict(e.labels)
        endpoint = Endpoint(e.address, e.port, pool.engines.engine_of(labels), e.labels, name=e.name)
        by_address[endpoint.address] = endpoint
    return list(by_address.values())


@dataclass(frozen=True)
class FileDiscovery:
    """The parameters of one ``file-discovery`` plugin (or a variant's: ``check`` refuses entries)."""

    path: str
    watch_file: bool = False
    check: EntryCheck = pod_address


class DiscoveredEndpoints:
    """The identities (``namespace/name``) a file discovery applied last: its ``DumpState``."""

    def __init__(self) -> None:
        self.identities: frozenset[str] = frozenset()

    def loaded(self, entries: Sequence[FileEndpoint]) -> None:
        """A load applied ``entries``."""
        self.identities = frozenset(f"{e.namespace}/{e.name}" for e in entries)

    def dump_state(self) -> dict[str, object]:
        """The reference's: the identities sorted, the first ``MAX_LISTED`` (100); no addresses or labels."""
        return {"endpoints": first_sorted(self.identities), "totalEndpoints": len(self.identities),
                "maxEndpoints": MAX_LISTED}


def file_discovery_params(params: Params, check: EntryCheck = pod_address) -> FileDiscovery:
    """A file discovery plugin's ``path`` (required) and ``watchFile``."""
    path = params.text("path", "")
    if not path:
        raise ConfigError(params.where("path"), "the endpoints file's path (required)", path or None)
    return FileDiscovery(path, params.boolean("watchFile", False), check)


register(PLUGIN_TYPE, PluginType(Category.DISCOVERY, ("path", "watchFile"), file_discovery_params))
