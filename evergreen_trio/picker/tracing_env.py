"""The picker's tracing settings from the ``OTEL_*`` environment, sans-IO, as llm-d-router's
``InitTracing`` reads them (``pkg/common/observability/tracing/telemetry.go``).

A bad value never stops the picker: each falls back to its default and leaves one line in
:attr:`TracingSettings.notes`, which the caller logs. What is read here:

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (gRPC), anything else the console, as the reference (unset: console).
- ``OTEL_TRACES_SAMPLER``: ``parentbased_traceidratio`` only (unset: that); another name falls back to it
  at 0.1. ``OTEL_TRACES_SAMPLER_ARG``: its ratio (unset or not a number: 0.1; clamped into [0, 1], as
  Go's ``TraceIDRatioBased`` treats a ratio outside it).
- The OTLP exporter's transport: when none of :data:`OTLP_TRANSPORT_ENV` is set, a plaintext collector
  on ``localhost:4317`` (the reference's loopback fallback); else the SDK reads them.
  ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` / ``OTEL_EXPORTER_OTLP_TIMEOUT`` are milliseconds, as the
  specification and Go's SDK read them (Python's SDK would read seconds): parsed here.
- The batching of ``OTEL_BSP_*`` (Go's ``WithBatcher`` reads them too): queue size, batch size, delay
  and export timeout, in the specification's units (milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

SERVICE_NAME = "llm-d-epp"
"""The resource's default ``service.name`` (the reference runner's; ``OTEL_SERVICE_NAME`` wins)."""
SAMPLER = "parentbased_traceidratio"
DEFAULT_RATIO = 0.1
LOCAL_COLLECTOR = "localhost:4317"
OTLP_TRANSPORT_ENV = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
)
"""Where spans go and how the connection is secured: any of them set turns the loopback fallback off."""
MAX_QUEUE_SIZE = 1 << 20
"""A larger ``OTEL_BSP_MAX_QUEUE_SIZE`` is cut to this (spans held in memory while the collector is slow)."""
MAX_TIMEOUT_S = 600.0
"""A larger timeout (export, OTLP) is cut to this: a shutdown waits at most a bounded time."""


@dataclass(frozen=True)
class TracingSettings:
    """What ``evergreen_trio.picker.tracing`` builds the tracer provider and exporter from."""

    exporter: str = "console"
    """``console`` or ``otlp``."""
    ratio: float = DEFAULT_RATIO
    """The parent-based sampler's ratio for root spans (a sampled parent is always followed)."""
    local_collector: bool = True
    """OTLP to ``localhost:4317`` in plaintext (no transport variable is set)."""
    otlp_timeout_s: float = 10.0
    queue_size: int = 2048
    batch_size: int = 512
    delay_s: float = 5.0
    export_timeout_s: float = 30.0
    notes: tuple[str, ...] = field(default=(), compare=False)
    """One line per value that was bad and what was used instead."""


def tracing_settings(env: Mapping[str, str]) -> TracingSettings:
    """The settings ``env`` asks for (bad values: defaults, each named in ``notes``)."""
    notes: list[str] = []
    exporter = "otlp" if env.get("OTEL_TRACES_EXPORTER", "console") == "otlp" else "console"
    sampler = env.get("OTEL_TRACES_SAMPLER", SAMPLER)
    ratio = DEFAULT_RATIO
    if sampler == SAMPLER:
        ratio = _ratio(env.get("OTEL_TRACES_SAMPLER_ARG", str(DEFAULT_RATIO)))
    else:
        notes.append(f"OTEL_TRACES_SAMPLER={sampler[:64]!r} is not supported: "
                     f"{SAMPLER} at {DEFAULT_RATIO} instead")
    timeout_env = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" if "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" in env
                   else "OTEL_EXPORTER_OTLP_TIMEOUT")
    queue_size = _number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048, MAX_QUEUE_SIZE, notes)
    batch_size = _number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, MAX_QUEUE_SIZE, notes)
    if batch_size > queue_size:  # as the SDKs: a batch is at most the queue
        batch_size = queue_size
    return TracingSettings(
        exporter=exporter,
        ratio=ratio,
        local_collector=not any(name in env for name in OTLP_TRANSPORT_ENV),
        otlp_timeout_s=_number(env, timeout_env, 10_000, MAX_TIMEOUT_S * 1000, notes) / 1000,
        queue_size=int(queue_size),
        batch_size=int(batch_size),
        delay_s=_number(env, "OTEL_BSP_SCHEDULE_DELAY", 5_000, MAX_TIMEOUT_S * 1000, notes) / 1000,
        export_timeout_s=_number(env, "OTEL_BSP_EXPORT_TIMEOUT", 30_000, MAX_TIMEOUT_S * 1000, notes) / 1000,
        notes=tuple(notes),
    )


def _ratio(text: str) -> float:
    """``OTEL_TRACES_SAMPLER_ARG`` as the reference reads it: not a number (NaN too) is 0.1, and a
    ratio outside [0, 1] is clamped (Go samples all at 1 and above, none at 0 and below)."""
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_RATIO
    if math.isnan(value):
        return DEFAULT_RATIO
    return min(1.0, max(0.0, value))


def _number(env: Mapping[str, str], name: str, default: float, limit: float, notes: list[str]) -> float:
    """A positive number from ``env[name]`` (unset: ``default``; not a positive number: ``default``
    with a note; above ``limit``: ``limit`` with a note)."""
    text = env.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # NaN, zero, negative
        notes.append(f"{name}={text[:64]!r} is not a positive number: {default:g} instead")
        return default
    if value > limit:
        notes.append(f"{name}={text[:64]!r} is above {limit:g}: {limit:g} instead")
        return limit
    return value
