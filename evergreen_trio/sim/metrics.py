"""vLLM's Prometheus metrics for one simulated server, in its own CollectorRegistry (or, with
``metrics_engine``, the load and cache gauges under another engine's names).

Gauges and token counters are read from the engine at scrape time (never stale); the
latency histograms are observed as requests finish.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from evergreen_trio.sim.model import Engine, Timings, Usage

# Fewer buckets than vLLM's 19: every scrape is parsed by the picker 20 times a second per server,
# and the parse cost grows with the lines.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class _EngineCollector:
    """Yields the gauges and counters of the engine's current state."""

    def __init__(self, engine: Engine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        engine, names, values = self._engine, list(self._labels), list(self._labels.values())
        stats, counters, config = engine.stats(), engine.counters, engine.config

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        if config.metrics_engine != "vllm":
            yield from _other_engine(engine)
            return
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        # vLLM sets this gauge to the wall time the label set was seen; a reader takes the newest series.
        lora.add_metric(
            [str(config.max_loras), ",".join(stats.waiting_loras), ",".join(stats.running_loras)], time.time()
        )
        yield lora
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        cache.add_metric([str(config.block_size), str(config.kv_blocks), "True"], 1.0)
        yield cache
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      counters.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      counters.prefix_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*names, "finished_reason"]
        )
        success.add_metric([*values, "length"], counters.finished)
        yield success


def _other_engine(engine: Engine) -> Iterator[Metric]:
    """The load and cache gauges under SGLang's, trtllm-serve's or Triton TensorRT-LLM's names."""
    stats, config = engine.stats(), engine.config
    if config.metrics_engine == "triton-tensorrt-llm":  # one metric per kind, told apart by a label
        requests = GaugeMetricFamily("nv_trt_llm_request_metrics", "TRT LLM request metrics",
                                     labels=["model", "request_type", "version"])
        for kind, count in (("waiting", stats.waiting), ("scheduled", stats.running), ("context", 0),
                            ("max", config.max_batch)):
            requests.add_metric([config.model, kind, "1"], count)
        blocks = GaugeMetricFamily("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics",
                                   labels=["kv_cache_block_type", "model", "version"])
        for kind, value in (("fraction", stats.kv_usage), ("tokens_per", config.block_size),
                            ("max", config.kv_blocks)):
            blocks.add_metric([kind, config.model, "1"], value)
        yield requests
        yield blocks
        return
    if config.metrics_engine == "sglang":
        names = ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage")
    else:
        names = ("trtllm_num_requests_waiting", "trtllm_num_requests_running", "trtllm_kv_cache_utilization")
    for name, gauge in zip(names, (stats.waiting, stats.running, stats.kv_usage), strict=True):
        family = GaugeMetricFamily(name, name, labels=["model_name"])
        family.add_metric([config.model], gauge)
        yield family
    if config.metrics_engine == "sglang":
        cache = GaugeMetricFamily("sglang:cache_config_info", "cache config", labels=["num_pages", "page_size"])
        cache.add_metric([str(config.kv_blocks), str(config.block_size)], 1.0)
        yield cache
    else:
        for name, size in (("trtllm_kv_cache_tokens_per_block", config.block_size),
                           ("trtllm_kv_cache_max_blocks", config.kv_blocks)):
            yield GaugeMetricFamily(name, name, value=size)


class SimMetrics:
    """The registry ``/metrics`` renders, and the histograms the server observes into."""

    def __init__(self, engine: Engine) -> None:
        labels = {"model_name": engine.config.model, "engine": "0"}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, labels))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, labelnames=list(labels), buckets=buckets, registry=self.registry)
            return family.labels(**labels)

        self._ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               _LATENCY_BUCKETS)
        self._itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              _LATENCY_BUCKETS)
        self._e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              _LATENCY_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS)

    def observe_finished(self, timings: Timings, usage: Usage) -> None:
        """Record one finished request's latencies and sizes."""
        self._ttft.observe(timings.first_token - timings.arrival)
        self._e2e.observe(timings.finished - timings.arrival)
        self._queue.observe(timings.scheduled - timings.arrival)
        if usage.completion_tokens > 1:
            self._itl.observe((timings.finished - timings.first_token) / (usage.completion_tokens - 1))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
