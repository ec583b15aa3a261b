"""Hypothesis profiles: `ci` (default, quick) and `deep` (`make fuzz-deep`, >= 100,000 examples per decoder)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "deep", max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile("ci")
