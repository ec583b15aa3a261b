"""llm-d-router's multicluster plugin family (``*/multicluster.go``), sans-IO: a cluster-scoped
picker whose endpoints are peer clusters, each reached at its gateway and scored by the pool
aggregates its own picker publishes.

- ``multicluster-file-discovery``: ``file-discovery`` whose ``address`` may be a hostname (a
  DNS-1123 subdomain) or an IP literal, v4 or v6; a ``metricsAddress`` label (and
  ``metricsPort``, default the entry's port) moves the scrape off the gateway's address.
- ``multicluster-metrics-data-source``: GETs each cluster's metrics page over https by default,
  the certificate verified (``caCertPath`` for a private CA, ``insecureSkipVerify`` to skip,
  ``clientCertPath``/``clientKeyPath`` for mTLS), at most :data:`MAX_PAGE_BYTES`. Listed in
  ``dataLayer.sources`` it replaces the model-server scrape: a cluster is a candidate from
  discovery on, and a failed poll keeps its last aggregates (:mod:`~evergreen_trio.picker.multicluster_poll`).
- ``multicluster-metrics-extractor``: ``llm_d_epp_average_kv_cache_utilization`` and
  ``llm_d_epp_average_queue_size`` (or ``kvCacheUtilizationMetric``/``queueSizeMetric``) ->
  the cluster's attributes :data:`KV_ATTRIBUTE` and :data:`QUEUE_ATTRIBUTE`; a missing one is an
  extract error that leaves the other written.
- ``multicluster-kv-cache-utilization-scorer``: 1 - the cluster's KV-cache utilization;
  ``multicluster-queue-scorer``: the queue sizes min-max normalized (shortest 1, longest 0, all
  equal 1). A cluster without the attribute is unscored. Both need a declared extractor (the
  reference: no default producer for the key they require).
- ``multicluster-prefix-cache-scorer``, ``multicluster-approx-prefix-cache-producer`` and
  ``multicluster-session-affinity-filter`` are the stock plugins under another type name.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.engine_metrics import EngineSpec, MetricSpec, parse_engine_metrics, parse_spec
from evergreen_trio.picker.errors import ConfigError, MetricsError
from evergreen_trio.picker.file_discovery import file_discovery_params
from evergreen_trio.picker.gotext import atoi
from evergreen_trio.picker.plugins import (
    APPROX_PRODUCER,
    MULTICLUSTER_APPROX_PRODUCER,
    PLUGIN_TYPES,
    Category,
    Params,
    Plugin,
    PluginType,
    https_options,
    register,
    tls_parameters,
)
from evergreen_trio.picker.session import SESSION_FILTER, SESSION_FILTERS, SESSION_STATES

if TYPE_CHECKING:
    from evergreen_trio.picker.config import Endpoint
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

FILE_DISCOVERY = "multicluster-file-discovery"
CLUSTER_SOURCE = "multicluster-metrics-data-source"
CLUSTER_EXTRACTOR = "multicluster-metrics-extractor"
QUEUE_SCORER = "multicluster-queue-scorer"
KV_SCORER = "multicluster-kv-cache-utilization-scorer"
PREFIX_SCORER = "multicluster-prefix-cache-scorer"
SESSION_AFFINITY_FILTER = "multicluster-session-affinity-filter"
KV_ATTRIBUTE = ("llm-d.ai/multicluster-kv-cache-utilization", "")
QUEUE_ATTRIBUTE = ("llm-d.ai/multicluster-queue-size", "")
"""The pool aggregates' attributes: (name, producer), no producer name (any extractor may write them)."""
DEFAULT_KV_METRIC = "llm_d_epp_average_kv_cache_utilization"
DEFAULT_QUEUE_METRIC = "llm_d_epp_average_queue_size"
MAX_PAGE_BYTES = 8 << 20  # the reference's maxResponseBytes: a peer's page crosses a trust boundary
METRICS_ADDRESS, METRICS_PORT = "metricsAddress", "metricsPort"
_DNS_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


# -- discovery ----------------------------------------------------------------------------------


def valid_host_or_ip(address: str) -> bool:
    """The reference's ``validateHostOrIP``: an IP literal (v4 or v6, no zone) or a DNS-1123
    subdomain (lower case, at most 253 characters, no trailing dot)."""
    if "%" not in address:
        try:
            ipaddress.ip_address(address)
            return True
        except ValueError:
            pass
    return len(address) <= 253 and _DNS_SUBDOMAIN.fullmatch(address) is not None


def cluster_entry(address: str, labels: Mapping[str, str]) -> str | None:
    """``multicluster-file-discovery``'s check of an entry: its address, and the metrics host
    and port its labels name (refused here, where the reference would fail every scrape)."""
    if not valid_host_or_ip(address):
        return f"invalid host {address!r}"
    metrics_host = labels.get(METRICS_ADDRESS, "")
    if metrics_host and not valid_host_or_ip(metrics_host):
        return f"invalid {METRICS_ADDRESS} label {metrics_host!r}"
    port = labels.get(METRICS_PORT, "")
    number = atoi(port)
    if metrics_host and port and (number is None or not 1 <= number <= 65535):
        return f"invalid {METRICS_PORT} label {port!r}"
    return None


def metrics_target(endpoint: Endpoint) -> tuple[str, int]:
    """Where a cluster's metrics are scraped: its ``metricsAddress`` label and ``metricsPort``
    (default: its port), else its own address; ``metricsPort`` alone is ignored."""
    labels = endpoint.label_map
    host = labels.get(METRICS_ADDRESS, "")
    if not host:
        return endpoint.host, endpoint.port
    port = atoi(labels.get(METRICS_PORT, ""))
    return host, port if port is not None and 1 <= port <= 65535 else endpoint.port


# -- data source and extractor ------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSource:
    """``multicluster-metrics-data-source``: the page's ``path``, how often it is polled (None: the
    pool's scrape interval), and https's client options (``https`` false: plain http)."""

    path: str = "/metrics"
    interval_s: float | None = None
    https: bool = True
    skip_verify: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def tls_options(self) -> tuple[bool, str, str, str] | None:
        """The arguments of ``tls.client_context`` (skip verify, CA, client cert, key); None over http."""
        return (self.skip_verify, self.ca_file, self.cert_file, self.key_file) if self.https else None


def _cluster_source(params: Params) -> ClusterSource:
    from evergreen_trio.picker.config import parse_duration  # config imports the plugin registry

    scheme = params.text("scheme", "https", choices=("https", "http"))
    path = params.text("path", "/metrics")
    if not path.startswith("/"):
        raise ConfigError(params.where("path"), "a path starting with '/'", path)
    params.integer("port", 1, minimum=1, maximum=65535)  # decoded and unused, as the reference's
    interval = params.text("interval", "")
    https = scheme == "https"
    tls = https_options(params, False) if https else tls_parameters(params, False)
    return ClusterSource(path, parse_duration(interval, params.where("interval")) if interval else None, https, *tls)


_DEFAULT_KV, _DEFAULT_QUEUE = MetricSpec(DEFAULT_KV_METRIC), MetricSpec(DEFAULT_QUEUE_METRIC)


@dataclass(frozen=True)
class PoolMetrics:
    """``multicluster-metrics-extractor``: the metric specs read into the two attributes."""

    kv: MetricSpec = _DEFAULT_KV
    queue: MetricSpec = _DEFAULT_QUEUE

    @property
    def engine(self) -> EngineSpec:
        """The page read as an engine with these two custom metrics (the latest series of each)."""
        return EngineSpec("multicluster", None, None,
                          custom=((KV_ATTRIBUTE[0], self.kv), (QUEUE_ATTRIBUTE[0], self.queue)))


_PAGE_ONLY = EngineSpec("multicluster", None, None)


def _pool_metrics(params: Params) -> PoolMetrics:
    specs = []
    for key, default in (("kvCacheUtilizationMetric", DEFAULT_KV_METRIC), ("queueSizeMetric", DEFAULT_QUEUE_METRIC)):
        text = params.text(key, "") or default
        try:
            specs.append(parse_spec(text))
        except ValueError:
            raise ConfigError(params.where(key), "a metric spec like 'name' or 'name{label=value}'", text) from None
    return PoolMetrics(*specs)


@dataclass(frozen=True)
class ClusterPoll:
    """What the pool's ``dataLayer`` wires: the source, and its extractor (None: none listed)."""

    source: ClusterSource
    metrics: PoolMetrics | None = None


def parse_pool_page(body: bytes, metrics: PoolMetrics | None) -> Mapping[str, float]:
    """The source's parse of one page (at most :data:`MAX_PAGE_BYTES`): the values ``metrics``
    names, by attribute name; MetricsError for a page that is not Prometheus text."""
    text = body.decode("utf-8", "replace")
    return parse_engine_metrics(metrics.engine if metrics else _PAGE_ONLY, text, MAX_PAGE_BYTES).attributes


def pool_attributes(values: Mapping[str, float]) -> tuple[dict[tuple[str, str], float], list[str]]:
    """The extractor: the attributes a parsed page gives, and what it lacks (a name per attribute
    missing, or not a finite number: the peer's bytes are untrusted)."""
    found: dict[tuple[str, str], float] = {}
    missing = []
    for key in (KV_ATTRIBUTE, QUEUE_ATTRIBUTE):
        value = values.get(key[0])
        if value is None or not math.isfinite(value):
            missing.append(f"{key[0]}: {'not found' if value is None else value}")
        else:
            found[key] = value
    return found, missing


def write_pool_attributes(attributes: dict[tuple[str, str], float], values: Mapping[str, float]) -> None:
    """Write what ``values`` gives into ``attributes``; MetricsError naming what it lacks (the
    others are written all the same)."""
    found, missing = pool_attributes(values)
    attributes.update(found)
    if missing:
        raise MetricsError("; ".join(missing))


# -- scorers ------------------------------------------------------------------------------------


def min_max_scores(values: Mapping[str, float]) -> dict[str, float]:
    """Each value min-max normalized and inverted, in [0, 1]: the least 1, the greatest 0, all 1
    when they are equal (the queue scorers'). Finite values only."""
    if not values:
        return {}
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    if math.isinf(high - low):  # values near the float range: halve them first (exact)
        return {key: (high / 2 - value / 2) / (high / 2 - low / 2) for key, value in values.items()}
    return {key: (high - value) / (high - low) for key, value in values.items()}


def _attribute(candidates: Sequence[EndpointState], key: tuple[str, str]) -> dict[str, float]:
    return {s.endpoint.address: s.attributes[key] for s in candidates if key in s.attributes}


def _queue_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                  fresh: Mapping[str, object], params: object) -> dict[str, float]:
    return min_max_scores(_attribute(candidates, QUEUE_ATTRIBUTE))


def _kv_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
               fresh: Mapping[str, object], params: object) -> dict[str, float]:
    return {address: min(1.0, max(0.0, 1.0 - value)) for address, value in _attribute(candidates, KV_ATTRIBUTE).items()}


def check_pool_producers(plugins: Mapping[str, Plugin], where: str) -> None:
    """A declared aggregate scorer needs a declared extractor, as the reference fails a config
    whose required key has no producer; ``where``: the plugins list's path."""
    if any(p.type == CLUSTER_EXTRACTOR for p in plugins.values()):
        return
    for i, plugin in enumerate(plugins.values()):
        if plugin.type in (QUEUE_SCORER, KV_SCORER):
            key = QUEUE_ATTRIBUTE[0] if plugin.type == QUEUE_SCORER else KV_ATTRIBUTE[0]
            raise ConfigError(f"{where}[{i}]", f"a {CLUSTER_EXTRACTOR} declared to produce {key}",
                              f"{plugin.name} (no default producer found for that key)")


# -- registration -------------------------------------------------------------------------------

register(FILE_DISCOVERY, PluginType(Category.DISCOVERY, ("path", "watchFile"),
                                    lambda params: file_discovery_params(params, cluster_entry)))
register(CLUSTER_SOURCE, PluginType(
    Category.DATA_SOURCE, ("scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                           "clientKeyPath", "interval"), _cluster_source))
register(CLUSTER_EXTRACTOR, PluginType(Category.EXTRACTOR, ("kvCacheUtilizationMetric", "queueSizeMetric"),
                                       _pool_metrics))
register(QUEUE_SCORER, PluginType(Category.SCORER))
register(KV_SCORER, PluginType(Category.SCORER))
register(PREFIX_SCORER, PLUGIN_TYPES["prefix-cache-scorer"])
register(MULTICLUSTER_APPROX_PRODUCER, PLUGIN_TYPES[APPROX_PRODUCER])
register(SESSION_AFFINITY_FILTER, PLUGIN_TYPES[SESSION_FILTER])

MULTICLUSTER_SCORERS = {QUEUE_SCORER: _queue_scorer, KV_SCORER: _kv_scorer}
MULTICLUSTER_FILTERS = {SESSION_AFFINITY_FILTER: SESSION_FILTERS[SESSION_FILTER]}
MULTICLUSTER_STATES = {SESSION_AFFINITY_FILTER: SESSION_STATES[SESSION_FILTER]}
