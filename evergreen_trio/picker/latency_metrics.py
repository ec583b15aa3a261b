"""The ``predicted-latency-producer``'s metrics, as llm-d-router's ``predictedlatency/metrics.go``.

Labelled ``plugin_name, plugin_type, model_name, target_model_name``: the predicted TTFT and TPOT
histograms (``llm_d_epp_request_predicted_{ttft,tpot}_seconds``), the prediction call's duration
(``llm_d_epp_request_{ttft,tpot}_prediction_duration_seconds``, the same bulk call for both), SLO
violations by ``type`` (``llm_d_epp_request_slo_violation_total``), and the last value of each
(``llm_d_epp_inference_request_metric`` by ``type``: ``ttft``, ``predicted_ttft``, ``tpot``, ...,
``ttft_slo_violation`` 1 or 0). Each has its deprecated ``inference_objective_*`` name without the
plugin labels (a sum over the producers). The observed TTFT and TPOT histograms are the request
set's (:mod:`~evergreen_trio.picker.telemetry`), which the reference also has. Model names are
folded as the request set folds them (:class:`~evergreen_trio.picker.guards.ModelLabels`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from evergreen_trio.picker.guards import ModelLabels
from evergreen_trio.picker.latency import PRODUCER, LatencyRequest
from evergreen_trio.picker.telemetry import CounterFamily, DerivedFamily, GaugeFamily, HistogramFamily, alpha

_LABELS = ("plugin_name", "plugin_type", "model_name", "target_model_name")
_GENERAL = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45, 60,
            120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_TPOT = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1,
         1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270, 360)
_PREDICTION = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Observation kinds the producer reports and the histogram each also goes to (None: the gauge only).
_HISTOGRAMS = {"predicted_ttft": ("request_predicted_ttft_seconds", "Inference model Predicted TTFT", _GENERAL),
               "predicted_tpot": ("request_predicted_tpot_seconds", "Inference model Predicted TPOT", _TPOT),
               "ttft_prediction_duration": ("request_ttft_prediction_duration_seconds",
                                            "Duration taken to generate TTFT predictions", _PREDICTION),
               "tpot_prediction_duration": ("request_tpot_prediction_duration_seconds",
                                            "Duration taken to generate TPOT predictions", _PREDICTION)}


class LatencyMetrics:
    """The families in ``registry``; :meth:`observe` is each producer's ``observe``."""

    def __init__(self, registry: CollectorRegistry, labels: ModelLabels) -> None:
        self.labels = labels
        self._series: dict[tuple[str, ...], Any] = {}

        def derived(source: Any, name: str, help_: str, labelnames: tuple[str, ...], suffix: str = "") -> None:
            keep = [source.labelnames.index(n) for n in labelnames]
            DerivedFamily(source, f"inference_objective_{name}",
                          alpha(f"[Deprecated: Use llm_d_epp_{name}{suffix}] {help_}"), labelnames, keep, registry)

        help_ = "Consolidated gauge for various inference request metrics including TTFT, TPOT, SLOs, and " \
                "prediction durations."
        self.gauge = GaugeFamily("llm_d_epp_inference_request_metric", alpha(help_), (*_LABELS, "type"), registry)
        derived(self.gauge, "inference_request_metric", help_, ("model_name", "target_model_name", "type"))
        help_ = "Counter of SLO violations for each model, target model, and violation type."
        self.violations = CounterFamily("llm_d_epp_request_slo_violation", alpha(help_), (*_LABELS, "type"), registry)
        derived(self.violations, "request_slo_violation", help_, ("model_name", "target_model_name", "type"), "_total")
        self.histograms = {}
        for kind, (name, what, buckets) in _HISTOGRAMS.items():
            help_ = f"{what} distribution in seconds for each model and target model."
            family = HistogramFamily(f"llm_d_epp_{name}", alpha(help_), _LABELS, registry, buckets=buckets)
            derived(family, name, help_, ("model_name", "target_model_name"))
            self.histograms[kind] = family

    def _of(self, family: Any, *values: str) -> Any:
        key = (family.name, *values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = family.labels(*values)
        return series

    def observe(self, plugin: str, context: LatencyRequest, kind: str, value: float) -> None:
        """One observation of the producer ``plugin`` for ``context``'s request: ``kind`` is an
        ``inference_request_metric`` type (seconds, or 1/0 for a ``*_slo_violation``)."""
        model, target = self.labels.pair(context.model, context.target_model)
        labels = (plugin, PRODUCER, model, target)
        self._of(self.gauge, *labels, kind).set(value)
        histogram = self.histograms.get(kind)
        if histogram is not None:
            self._of(histogram, *labels).observe(value)
        if kind.endswith("_slo_violation") and value:
            self._of(self.violations, *labels, kind.removesuffix("_slo_violation")).inc()
