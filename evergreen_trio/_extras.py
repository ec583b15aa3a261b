"""The optional parts and the extra each needs: importing a part without its extra fails in one line.

``pip install evergreen-trio`` is Evergreen sessions alone (server, client, DAG, refs, built-in
actions). Each protocol package checks its extra's modules when it is imported, so a missing
one is a :class:`MissingExtraError` naming the extra to install, not a ``ModuleNotFoundError``
from deep inside. ``tests/test_extras.py`` keeps this table in step with pyproject's extras.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

from evergreen_trio.errors import ConfigurationError

AVP_CODEC_MODULES = ("numpy", "ml_dtypes", "zstandard", "isal")
"""What ``evergreen_trio.avp`` (the codec) imports; its HTTP client and server add httpx."""
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "picker": ("yaml", "xxhash", "httpx", "envoy.service.ext_proc.v3.external_processor_pb2"),
    "avp": (*AVP_CODEC_MODULES, "httpx"),
    "ipc": ("pyarrow", "numpy"),
    "ucx": ("ucxx",),
    "gpu": ("cupy",),
    "generate": ("httpx",),
    "sim": ("xxhash",),
    "testing": ("hypothesis", "grpc"),
    "tracing": ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
}
"""The modules each extra brings that its part imports (what :func:`require_extra` checks)."""
# `gateway` is the picker and the simulator (with Envoy's binary, which find_envoy looks for).
EXTRA_MODULES["gateway"] = tuple(dict.fromkeys(EXTRA_MODULES["picker"] + EXTRA_MODULES["sim"]))


CUDA_13_EXTRAS = {"ucx": "ucx-cu13", "gpu": "gpu-cu13"}
"""The CUDA 12 extras and their CUDA 13 twins (the same modules, built for CUDA 13)."""


class MissingExtraError(ConfigurationError, ImportError):
    """A part of evergreen-trio was imported without the extra it needs; the message names the extra."""

    def __init__(self, part: str, extra: str, missing: str) -> None:
        twin = f" or '[{CUDA_13_EXTRAS[extra]}]' on CUDA 13" if extra in CUDA_13_EXTRAS else ""
        super().__init__(
            f"{part} needs the {extra!r} extra: pip install 'evergreen-trio[{extra}]'{twin} (missing: {missing})"
        )
        self.part, self.extra, self.missing = part, extra, missing


class OverwrittenModulesError(ConfigurationError, ImportError):
    """An extra is installed but another package overwrote its modules; the message says what to reinstall."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(f"{part}: {message}")
        self.part = part


def require_extra(extra: str, part: str, modules: tuple[str, ...] | None = None) -> None:
    """Import ``extra``'s modules (or those of them ``part`` uses); the first that fails raises
    :class:`MissingExtraError` for ``part``, or :class:`OverwrittenModulesError` where the extra is
    there but another package's files replaced some of it."""
    for module in EXTRA_MODULES[extra] if modules is None else modules:
        try:
            importlib.import_module(module)
        except ImportError:
            overwritten = stale_otlp_protos() if module.startswith("opentelemetry.") else None
            if overwritten is not None:
                raise OverwrittenModulesError(part, overwritten) from None
            raise MissingExtraError(part, extra, module.split(".")[0]) from None


def stale_otlp_protos() -> str | None:
    """Why the OTLP exporter cannot import, when xds-protos' copy of opentelemetry-proto is installed.

    xds-protos (the picker's Envoy messages) ships generated ``opentelemetry/proto`` modules from
    opentelemetry-proto 0.9 under the same paths (grpc/grpc#42926): installed after
    opentelemetry-proto, its ``common_pb2`` lacks ``InstrumentationScope`` and the exporter fails to
    import. ``None`` when that is not the cause.
    """
    try:
        common = importlib.import_module("opentelemetry.proto.common.v1.common_pb2")
    except ImportError:
        return None
    if hasattr(common, "InstrumentationScope"):
        return None
    try:
        wanted = f"opentelemetry-proto=={version('opentelemetry-proto')}"
    except PackageNotFoundError:
        wanted = "opentelemetry-proto"
    return (f"xds-protos overwrote opentelemetry-proto's modules with an older copy (grpc/grpc#42926); "
            f"reinstall it after xds-protos: pip install --force-reinstall --no-deps '{wanted}'")
