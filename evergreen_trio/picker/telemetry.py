"""The picker's Prometheus metrics, in a registry of their own (one per picker instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage

_LATENCY_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1)


class PickerMetrics:
    """Requests, errors by code, scheduling latency, pool gauges, served endpoints and tokens."""

    def __init__(self, pool: str, registry: CollectorRegistry | None = None) -> None:
        self.pool = pool
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("inference_objective_request", "Requests routed, by model and target model",
                                ["model_name", "target_model_name"], registry=r)
        self.errors = Counter("inference_objective_request_error", "Requests answered with an error, by code",
                              ["model_name", "error_code"], registry=r)
        self.scheduling = Histogram("inference_extension_scheduler_e2e_duration_seconds",
                                    "Time to pick an endpoint", buckets=_LATENCY_BUCKETS, registry=r)
        self.avg_queue = Gauge("inference_pool_average_queue_size", "Mean waiting requests per ready endpoint",
                               ["name"], registry=r)
        self.avg_kv = Gauge("inference_pool_average_kv_cache_utilization", "Mean KV-cache usage per ready endpoint",
                            ["name"], registry=r)
        self.ready = Gauge("inference_pool_ready_pods", "Endpoints whose last scrape succeeded", ["name"], registry=r)
        self.served = Counter("inference_extension_served_requests", "Requests Envoy reports served, by endpoint",
                              ["endpoint"], registry=r)
        self.tokens = Counter("inference_objective_tokens", "Tokens reported in responses, by model and kind",
                              ["model_name", "kind"], registry=r)

    def observe_pool(self, snapshot: PoolSnapshot) -> None:
        ready = [s.metrics for s in snapshot.ready_states() if s.metrics is not None]
        self.ready.labels(self.pool).set(len(ready))
        self.avg_queue.labels(self.pool).set(sum(m.waiting for m in ready) / len(ready) if ready else 0.0)
        self.avg_kv.labels(self.pool).set(sum(m.kv_usage for m in ready) / len(ready) if ready else 0.0)

    def observe_usage(self, model: str, usage: Usage) -> None:
        for kind, value in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens),
                            ("cached", usage.cached_tokens)):
            if value:
                self.tokens.labels(model, kind).inc(value)
