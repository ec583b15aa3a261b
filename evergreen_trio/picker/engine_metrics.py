"""Model-server ``/metrics`` (Prometheus text) -> :class:`EndpointMetrics`, per engine.

Parsing uses ``prometheus_client``'s own text parser. Series of one metric (one per served model)
are summed for request counts and maxed for cache usage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio.picker.errors import MetricsError


@dataclass(frozen=True)
class EndpointMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    block_size: int | None = None
    num_blocks: int | None = None


@dataclass(frozen=True)
class _Names:
    waiting: str
    running: str
    kv: tuple[str, ...]
    cache_info: str | None
    block_label: str
    blocks_label: str
    lora: str | None


ENGINE_METRICS = {
    "vllm": _Names(
        "vllm:num_requests_waiting", "vllm:num_requests_running",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "vllm:cache_config_info", "block_size", "num_gpu_blocks", "vllm:lora_requests_info",
    ),
    "sglang": _Names(
        "sglang:num_queue_reqs", "sglang:num_running_reqs", ("sglang:token_usage",),
        "sglang:cache_config_info", "page_size", "num_pages", None,
    ),
    "trtllm": _Names(
        "trtllm_num_requests_waiting", "trtllm_num_requests_running", ("trtllm_kv_cache_utilization",),
        None, "", "", None,
    ),
}
MAX_METRICS_BYTES = 4 * 1024 * 1024


def _adapters(value: str | None) -> frozenset[str]:
    return frozenset(part.strip() for part in (value or "").split(",") if part.strip())


def _label_int(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() else None


def parse_engine_metrics(engine: str, text: str) -> EndpointMetrics:
    """Read one scrape; a text that is not Prometheus format or lacks a core metric is an error."""
    if engine not in ENGINE_METRICS:
        raise MetricsError(f"expected engine vllm, sglang or trtllm, got {engine!r}")
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsError(f"expected at most {MAX_METRICS_BYTES} bytes of metrics, got {len(text)}")
    names = ENGINE_METRICS[engine]
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    info: dict[str, str] = {}
    lora_best: tuple[float, dict[str, str]] | None = None
    wanted = {names.waiting, names.running, *names.kv}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name in wanted:
                    sums[name] = sums.get(name, 0.0) + sample.value
                    maxima[name] = max(maxima.get(name, 0.0), sample.value)
                elif name in (names.cache_info, f"{names.cache_info}_total"):
                    info = dict(sample.labels)
                elif names.lora and name == names.lora and (lora_best is None or sample.value > lora_best[0]):
                    lora_best = (sample.value, dict(sample.labels))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"expected Prometheus text format, got a parse error ({type(exc).__name__})") from None
    missing = [n for n in (names.waiting, names.running) if n not in sums]
    kv_name = next((n for n in names.kv if n in maxima), None)
    if kv_name is None:
        missing.append(names.kv[0])
    if missing or kv_name is None:
        raise MetricsError(f"expected {engine} metrics {', '.join(missing)}, got none")
    lora_labels = lora_best[1] if lora_best else {}
    return EndpointMetrics(
        waiting=sums[names.waiting],
        running=sums[names.running],
        kv_usage=min(1.0, max(0.0, maxima[kv_name])),
        running_adapters=_adapters(lora_labels.get("running_lora_adapters")),
        waiting_adapters=_adapters(lora_labels.get("waiting_lora_adapters")),
        max_lora=_label_int(lora_labels, "max_lora") or 0,
        block_size=_label_int(info, names.block_label),
        num_blocks=_label_int(info, names.blocks_label),
    )


def render_metrics(engine: str, metrics: EndpointMetrics) -> str:
    """Prometheus text an engine would serve for these values (used by tests and the simulator)."""
    names = ENGINE_METRICS[engine]
    lines: list[str] = []

    def gauge(name: str, value: float, labels: Iterable[tuple[str, str]] = ()) -> None:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels)
        lines.extend((f"# TYPE {name} gauge", f"{name}{{{label_text}}} {value}"))

    gauge(names.waiting, metrics.waiting)
    gauge(names.running, metrics.running)
    gauge(names.kv[0], metrics.kv_usage)
    if names.lora:
        gauge(names.lora, 1.0, [
            ("running_lora_adapters", ",".join(sorted(metrics.running_adapters))),
            ("waiting_lora_adapters", ",".join(sorted(metrics.waiting_adapters))),
            ("max_lora", str(metrics.max_lora)),
        ])
    if names.cache_info and metrics.block_size is not None and metrics.num_blocks is not None:
        gauge(names.cache_info, 1.0, [(names.block_label, str(metrics.block_size)),
                                      (names.blocks_label, str(metrics.num_blocks))])
    return "\n".join(lines) + "\n"
