"""In-flight eviction's metrics, named and labelled as llm-d-router's reclamation metrics.

:class:`ReclamationMetrics` is the reclamation controller's observer
(:class:`~evergreen_trio.picker.flow_control.reclamation.ReclamationObserver`); the picker's
:class:`~evergreen_trio.picker.telemetry.PickerMetrics` holds one. The ``priority`` label is a
demand band's priority: a configured band or an InferenceObjective's, not a client's choice.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from evergreen_trio.picker.flow_control.reclamation import ReclamationObserver

_CONFIRMATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ReclamationMetrics(ReclamationObserver):
    """``llm_d_epp_flow_control_revocations_issued_total``, ``…_revocations_total``,
    ``…_reclaim_target``, ``…_pending_reclaim`` and ``…_revocation_confirmation_seconds``."""

    def __init__(self, registry: CollectorRegistry, pool: str) -> None:
        self.pool = pool
        self.issued_total = Counter(
            "llm_d_epp_flow_control_revocations_issued",
            "[ALPHA] Total number of in-flight eviction revocations issued, labeled by the demand band's priority.",
            ["priority", "inference_pool"], registry=registry)
        self.revocations = Counter(
            "llm_d_epp_flow_control_revocations",
            "[ALPHA] Total number of in-flight eviction revocations by terminal outcome (confirmed, timed_out). Every "
            "issued revocation eventually increments exactly one outcome.",
            ["outcome", "inference_pool"], registry=registry)
        self.target = Gauge("llm_d_epp_flow_control_reclaim_target",
                            "[ALPHA] Last computed reclamation deficit, in saturation-gauge units.",
                            ["inference_pool"], registry=registry)
        self.pending = Gauge("llm_d_epp_flow_control_pending_reclaim",
                             "[ALPHA] Sum of outstanding and cooling pending-reclaim debits, in saturation-gauge "
                             "units.",
                             ["inference_pool"], registry=registry)
        self.confirmation = Histogram("llm_d_epp_flow_control_revocation_confirmation_seconds",
                                      "[ALPHA] Time from revocation issue to confirmed stream termination.",
                                      ["inference_pool"], buckets=_CONFIRMATION_BUCKETS, registry=registry)

    def issued(self, priority: int, count: int) -> None:
        self.issued_total.labels(str(priority), self.pool).inc(count)

    def revoked(self, outcome: str) -> None:
        self.revocations.labels(outcome, self.pool).inc()

    def reclaim_target(self, target: float) -> None:
        self.target.labels(self.pool).set(target)

    def pending_reclaim(self, pending: float) -> None:
        self.pending.labels(self.pool).set(pending)

    def confirmed_after(self, seconds: float) -> None:
        self.confirmation.labels(self.pool).observe(seconds)
