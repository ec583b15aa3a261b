"""Model-server ``/metrics`` (Prometheus text) -> :class:`EndpointMetrics`, per engine.

Each engine names its metrics by spec (``name`` or ``name{label=value,...}``), as llm-d-router's
``core-metrics-extractor`` does: vLLM, SGLang, trtllm-serve, Triton with TensorRT-LLM and plain
Triton are built in (:data:`ENGINE_METRICS`); a config's ``engineConfigs`` add or replace some.
Parsing uses ``prometheus_client``'s own text parser. Series matching a spec (one per served
model) are summed for request counts and maxed for cache usage.

An engine's ``customMetrics`` publish more numbers as endpoint attributes (what
``endpoint-attribute-filter`` and ``-scorer`` read), as the reference's extractor reads them: the
matching series with the latest timestamp (the first one when none has a timestamp), its value
when the family is a gauge or a counter and 0 otherwise (an untyped series too). A counter is
found by the name its ``TYPE`` line gives, and by that name without ``_total`` (where the reference
finds none). A custom metric the scrape lacks leaves the endpoint without that attribute (the
reference keeps its last value), not failing the scrape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio.picker.errors import MetricsError

# The pod labels naming a pod's engine (llm-d-router's, then GIE's deprecated one), and the default.
ENGINE_LABEL = "llm-d.ai/engine-type"
LEGACY_ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True)
class EndpointMetrics:
    """One scrape of one model server: queue depths, KV-cache use, LoRA adapters and cache geometry."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_lora: int = 0
    block_size: int | None = None
    num_blocks: int | None = None
    attributes: Mapping[str, float] = field(default_factory=dict, hash=False)  # customMetrics: key -> value


_SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^{}]*)\})?\s*$")
_MATCHER = re.compile(r"^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*\"?([^\"]*)\"?\s*$")


@dataclass(frozen=True)
class MetricSpec:
    """A metric name and the label values a sample must carry to count."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        return name == self.name and all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.labels)
        return f"{self.name}{{{inner}}}" if inner else self.name


def parse_spec(text: str) -> MetricSpec:
    """``name`` or ``name{label=value,label2="v"}`` -> :class:`MetricSpec`; ValueError otherwise."""
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(f"expected 'name' or 'name{{label=value}}', got {text!r}")
    labels = []
    for part in filter(str.strip, (match.group(2) or "").split(",")):
        matcher = _MATCHER.match(part)
        if matcher is None:
            raise ValueError(f"expected label=value in {text!r}, got {part!r}")
        labels.append((matcher.group(1), matcher.group(2)))
    return MetricSpec(match.group(1), tuple(labels))


@dataclass(frozen=True)
class EngineSpec:
    """Where one engine's numbers are: request counts, KV usage, LoRA, and cache geometry (either
    labels of an info metric, or metrics of their own). A ``None`` spec is not read."""

    name: str
    waiting: MetricSpec | None
    running: MetricSpec | None
    kv: tuple[MetricSpec, ...] = ()
    lora: MetricSpec | None = None
    cache_info: MetricSpec | None = None
    block_label: str = "block_size"
    blocks_label: str = "num_gpu_blocks"
    block_size: MetricSpec | None = None
    num_blocks: MetricSpec | None = None
    custom: tuple[tuple[str, MetricSpec], ...] = ()  # customMetrics: (attribute key, spec)


ENGINE_METRICS: dict[str, EngineSpec] = {
    "vllm": EngineSpec(
        "vllm", parse_spec("vllm:num_requests_waiting"), parse_spec("vllm:num_requests_running"),
        (parse_spec("vllm:kv_cache_usage_perc"), parse_spec("vllm:gpu_cache_usage_perc")),
        parse_spec("vllm:lora_requests_info"), parse_spec("vllm:cache_config_info")),
    "sglang": EngineSpec(
        "sglang", parse_spec("sglang:num_queue_reqs"), parse_spec("sglang:num_running_reqs"),
        (parse_spec("sglang:token_usage"),), None, parse_spec("sglang:cache_config_info"), "page_size", "num_pages"),
    "trtllm-serve": EngineSpec(
        "trtllm-serve", parse_spec("trtllm_num_requests_waiting"), parse_spec("trtllm_num_requests_running"),
        (parse_spec("trtllm_kv_cache_utilization"),), block_size=parse_spec("trtllm_kv_cache_tokens_per_block"),
        num_blocks=parse_spec("trtllm_kv_cache_max_blocks")),
    "triton-tensorrt-llm": EngineSpec(
        "triton-tensorrt-llm", parse_spec("nv_trt_llm_request_metrics{request_type=waiting}"),
        parse_spec("nv_trt_llm_request_metrics{request_type=scheduled}"),
        (parse_spec("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),),
        block_size=parse_spec("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}"),
        num_blocks=parse_spec("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}")),
    "triton": EngineSpec(
        "triton", parse_spec("nv_inference_pending_request_count"), parse_spec("nv_inference_exec_count")),
}
ENGINE_ALIASES = {"trtllm": "trtllm-serve"}  # our earlier name for trtllm-serve
MAX_METRICS_BYTES = 4 * 1024 * 1024


def engine_spec(engine: str | EngineSpec) -> EngineSpec:
    """The built-in spec of ``engine`` (a name or alias); MetricsError for an unknown name."""
    if isinstance(engine, EngineSpec):
        return engine
    spec = ENGINE_METRICS.get(ENGINE_ALIASES.get(engine, engine))
    if spec is None:
        raise MetricsError(f"expected engine {' | '.join(ENGINE_METRICS)}, got {engine!r}")
    return spec


def _adapters(value: str | None) -> frozenset[str]:
    return frozenset(part.strip() for part in (value or "").split(",") if part.strip())


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    """The label's value as Go's ``strconv.Atoi`` reads a count: ASCII digits within int64, else None
    (``str.isdigit`` alone passes "²", and digits past 4300, which ``int`` refuses with ValueError)."""
    value = labels.get(key, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 19):
        return None
    number = int(value)
    return number if number < 2**63 else None


def _positive_int(value: float | None) -> int | None:
    return int(value) if value is not None and value >= 1 and value < 2**31 else None


_TYPED = ("gauge", "counter")  # the family types whose value the reference's extractValue reads


class MetricsPageError(MetricsError):
    """A scraped page that is not Prometheus text: the reference's metrics source fails the poll
    (a parsed page that lacks a metric fails its extractor instead)."""


def parse_engine_metrics(engine: str | EngineSpec, text: str, max_chars: int = MAX_METRICS_BYTES) -> EndpointMetrics:
    """Read one scrape of at most ``max_chars``; a text that is not Prometheus format
    (``MetricsPageError``) or lacks a core metric is an error."""
    spec = engine_spec(engine)
    if len(text) > max_chars:
        raise MetricsPageError(f"expected at most {max_chars} bytes of metrics, got {len(text)}")
    summed = [s for s in (spec.waiting, spec.running) if s is not None]
    maxed = [s for s in (*spec.kv, spec.block_size, spec.num_blocks) if s is not None]
    sums: dict[MetricSpec, float] = {}
    maxima: dict[MetricSpec, float] = {}
    info: dict[str, str] = {}
    lora_best: tuple[float, dict[str, str]] | None = None
    # customMetrics: attribute key -> (timestamp in s, value) of the latest series; -1 ms to start, as Go's.
    custom: dict[str, tuple[float, float]] = {}
    info_names = {spec.cache_info.name, f"{spec.cache_info.name}_total"} if spec.cache_info else set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                for wanted in summed:
                    if wanted.matches(name, labels):
                        sums[wanted] = sums.get(wanted, 0.0) + sample.value
                for wanted in maxed:
                    if wanted.matches(name, labels):
                        maxima[wanted] = max(maxima.get(wanted, 0.0), sample.value)
                if name in info_names:
                    info = dict(labels)
                elif spec.lora and spec.lora.matches(name, labels) and (
                        lora_best is None or sample.value > lora_best[0]):
                    lora_best = (sample.value, dict(labels))
                for key, wanted in spec.custom:
                    # The parser names a counter's samples <family>_total, whether written so or not.
                    named = wanted.matches(name, labels) or (
                        family.type == "counter" and wanted.matches(family.name, labels))
                    stamp = float(sample.timestamp or 0)
                    if named and stamp > custom.get(key, (-0.001, 0.0))[0]:
                        custom[key] = (stamp, sample.value if family.type in _TYPED else 0.0)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsPageError(f"expected Prometheus text format, got a parse error ({type(exc).__name__})") from None
    missing = [str(s) for s in summed if s not in sums]
    kv_spec = next((s for s in spec.kv if s in maxima), None)
    if spec.kv and kv_spec is None:
        missing.append(str(spec.kv[0]))
    if missing:
        raise MetricsError(f"expected {spec.name} metrics {', '.join(missing)}, got none")
    lora_labels = lora_best[1] if lora_best else {}
    block_size = _label_int(info, spec.block_label)
    num_blocks = _label_int(info, spec.blocks_label)
    if spec.block_size is not None:
        block_size = _positive_int(maxima.get(spec.block_size))
    if spec.num_blocks is not None:
        num_blocks = _positive_int(maxima.get(spec.num_blocks))
    return EndpointMetrics(
        waiting=sums.get(spec.waiting, 0.0) if spec.waiting else 0.0,
        running=sums.get(spec.running, 0.0) if spec.running else 0.0,
        kv_usage=min(1.0, max(0.0, maxima[kv_spec])) if kv_spec is not None else 0.0,
        running_adapters=_adapters(lora_labels.get("running_lora_adapters")),
        waiting_adapters=_adapters(lora_labels.get("waiting_lora_adapters")),
        max_lora=_label_int(lora_labels, "max_lora") or 0,
        block_size=block_size,
        num_blocks=num_blocks,
        attributes={key: value for key, (_, value) in custom.items()},
    )


def render_metrics(engine: str | EngineSpec, metrics: EndpointMetrics) -> str:
    """Prometheus text an engine would serve for these values (used by tests and the simulator)."""
    spec = engine_spec(engine)
    lines: list[str] = []
    typed: set[str] = set()

    def gauge(metric: MetricSpec | None, value: float, labels: Iterable[tuple[str, str]] = ()) -> None:
        if metric is None:
            return
        if metric.name not in typed:
            typed.add(metric.name)
            lines.append(f"# TYPE {metric.name} gauge")
        label_text = ",".join(f'{k}="{v}"' for k, v in (*metric.labels, *labels))
        lines.append(f"{metric.name}{{{label_text}}} {value}")

    gauge(spec.waiting, metrics.waiting)
    gauge(spec.running, metrics.running)
    gauge(spec.kv[0] if spec.kv else None, metrics.kv_usage)
    gauge(spec.lora, 1.0, [
        ("running_lora_adapters", ",".join(sorted(metrics.running_adapters))),
        ("waiting_lora_adapters", ",".join(sorted(metrics.waiting_adapters))),
        ("max_lora", str(metrics.max_lora)),
    ])
    if metrics.block_size is not None and metrics.num_blocks is not None:
        if spec.cache_info is not None:
            gauge(spec.cache_info, 1.0, [(spec.block_label, str(metrics.block_size)),
                                         (spec.blocks_label, str(metrics.num_blocks))])
        gauge(spec.block_size, metrics.block_size)
        gauge(spec.num_blocks, metrics.num_blocks)
    for key, metric in spec.custom:
        if key in metrics.attributes:
            gauge(metric, metrics.attributes[key])
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class EngineConfig:
    """``core-metrics-extractor``: which pod label names the engine, the default, the engine specs."""

    label_key: str = ENGINE_LABEL
    default_engine: str = DEFAULT_ENGINE
    engines: Mapping[str, EngineSpec] = field(default_factory=lambda: dict(ENGINE_METRICS))

    def engine_of(self, labels: Mapping[str, str]) -> str:
        """The engine a pod's labels name (``label_key``, then GIE's label), else the default."""
        return labels.get(self.label_key) or labels.get(LEGACY_ENGINE_LABEL) or self.default_engine

    def spec(self, engine: str) -> EngineSpec:
        """The spec for ``engine``; an unknown engine uses the default engine's (as llm-d does)."""
        name = ENGINE_ALIASES.get(engine, engine)
        return self.engines.get(name) or self.engines[ENGINE_ALIASES.get(self.default_engine, self.default_engine)]
