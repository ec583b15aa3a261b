"""``dcgm-data-source`` and ``dcgm-extractor``, sans-IO, as llm-d-router's (ebab68792,
``datalayer/source/dcgm``, ``datalayer/extractor/dcgm``): each endpoint's GPU utilization, read
from NVIDIA DCGM exporter's Prometheus page, as the endpoint attribute ``GPUUtilization`` of
producer ``dcgm-extractor`` (what ``endpoint-attribute-filter`` and ``-scorer`` read). The Trio
loop is :mod:`evergreen_trio.picker.dcgm_poll`.

A source polls only when ``dataLayer.sources`` lists it with a ``dcgm-extractor``. It GETs
``path`` (``/metrics``) at the pod's IP and ``port`` (9400: a sidecar exporter), or at its node's
IP with ``useNodeAddress`` (a DaemonSet; the pod's IP when discovery knows no node), every
``interval`` (default: the pool's scrape interval); ``port: 0`` scrapes where the model server's
metrics are scraped. Plain http only (``https`` is refused, as for ``metrics-data-source``).

The page is read by ``prometheus_client``'s text parser, only the ``DCGM_FI_DEV_GPU_UTIL`` lines
handed to it (a big exporter page costs a line scan, not a parse). The family must be a gauge;
its samples whose ``pod`` label names another pod are skipped (a DaemonSet's page lists every
pod on the node; a sample without the label, or an endpoint whose pod name is unknown, counts);
the highest value over the pod's GPUs, divided by 100, is the attribute. A page over
:data:`~evergreen_trio.picker.engine_metrics.MAX_METRICS_BYTES`, without the metric, or without
a sample of the pod fails the poll, which keeps the endpoint's last value and the endpoint
serving, as the reference keeps its attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES
from evergreen_trio.picker.errors import ConfigError, MetricsError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, TlsOptions, http_source, register

DCGM_DATA_SOURCE = "dcgm-data-source"
DCGM_EXTRACTOR = "dcgm-extractor"
GPU_UTILIZATION = "GPUUtilization"
GPU_UTILIZATION_KEY = (GPU_UTILIZATION, DCGM_EXTRACTOR)
"""The attribute the extractor publishes: (name, producer), whatever the extractor's plugin name."""
GPU_UTIL_METRIC = "DCGM_FI_DEV_GPU_UTIL"
POD_LABEL = "pod"
DEFAULT_PORT = 9400


@dataclass(frozen=True)
class DcgmSource:
    """``dcgm-data-source``: where each endpoint's exporter is scraped, and how often (None: the
    pool's scrape interval). ``port`` 0: the model server's metrics host and port. Over https its
    TLS options (None: plain http; the reference reads ``insecureSkipVerify`` only, no certificate
    paths)."""

    path: str = "/metrics"
    port: int = DEFAULT_PORT
    use_node_address: bool = False
    interval_s: float | None = None
    tls: TlsOptions | None = None


def _dcgm_source(params: Params) -> DcgmSource:
    from evergreen_trio.picker.config import parse_duration  # config imports the plugin registry

    path, tls = http_source(params, "/metrics", "DCGM metrics are scraped")
    port = params.integer("port", DEFAULT_PORT, maximum=65535)
    use_node = params.boolean("useNodeAddress", False)
    if use_node and port == 0:
        raise ConfigError(params.where("port"), "a port in 1..65535 with useNodeAddress", port)
    interval = params.text("interval", "")
    return DcgmSource(path, port, use_node, parse_duration(interval, params.where("interval")) if interval else None,
                      tls)


def _utilization_lines(text: str) -> str:
    """The page's lines about the GPU utilization metric (its samples, HELP and TYPE)."""
    wanted = (GPU_UTIL_METRIC, f"# TYPE {GPU_UTIL_METRIC}", f"# HELP {GPU_UTIL_METRIC}")
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith(wanted))


def gpu_utilization(text: str, pod: str = "") -> float:
    """The highest GPU utilization of ``pod`` (any sample when empty) in a DCGM exporter page, in
    [0, 1] for values in 0..100; :class:`MetricsError` when the page does not give one."""
    return pod_utilization(utilization_families(text), pod)


def utilization_families(text: str) -> list[Metric]:
    """The page's GPU utilization families (the source's parse: a poll error in llm-d-router when it
    fails); :class:`MetricsError` for a page too large or not in Prometheus text format."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"expected at most {MAX_METRICS_BYTES} bytes of DCGM metrics, got {len(text)}")
    try:
        return [f for f in text_string_to_metric_families(_utilization_lines(text)) if f.name == GPU_UTIL_METRIC]
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"expected Prometheus text format, got a parse error ({type(exc).__name__})") from None


def pod_utilization(families: list[Metric], pod: str = "") -> float:
    """``dcgm-extractor``: the highest utilization of ``pod`` in ``families`` (an extract error in
    llm-d-router when there is none); :class:`MetricsError` when they do not give one."""
    if not families:
        raise MetricsError(f"metric {GPU_UTIL_METRIC!r} not found in DCGM response")
    highest, found = 0.0, False
    for family in families:
        for sample in family.samples:
            if not _belongs(sample.labels, pod):
                continue
            if family.type != "gauge":
                raise MetricsError(f"expected gauge metric for {GPU_UTIL_METRIC}, got {family.type}")
            if sample.value > highest:  # as Go compares: a NaN never raises it
                highest = sample.value
            found = True
    if not found:
        raise MetricsError(f"metric {GPU_UTIL_METRIC!r} present but has no samples for pod {pod[:253]!r}")
    return highest / 100.0


def _belongs(labels: Mapping[str, str], pod: str) -> bool:
    """A sample counts for ``pod`` unless both name a pod and they differ."""
    return not pod or labels.get(POD_LABEL, pod) == pod


def dcgm_published(plugins: Mapping[str, Plugin]) -> set[tuple[str, str]]:
    """The attributes the declared DCGM extractors publish."""
    return {GPU_UTILIZATION_KEY} if any(p.type == DCGM_EXTRACTOR for p in plugins.values()) else set()


register(DCGM_DATA_SOURCE, PluginType(
    Category.DATA_SOURCE, ("scheme", "path", "port", "insecureSkipVerify", "useNodeAddress", "interval"),
    _dcgm_source))
register(DCGM_EXTRACTOR, PluginType(Category.EXTRACTOR))
