"""The import layering README.md's "How the code is laid out" describes, checked by parsing imports.

- Sans-IO cores import no Trio, asyncio, sockets, threads or HTTP/gRPC machinery.
- No module imports asyncio (or trio-asyncio): servers and clients run on Trio alone.
- The protocol packages (avp, ipc, picker, sim, generate) do not import each other; the
  modules that compose them (``stack/``: gateway, demo) sit above.
- The serving runtime (``serving/``) and the session layer under it never import the stack.
- The base modules (errors, limits, _wire) import nothing of ours but ``errors``.
- The demo, the benchmarks and the docs import only package faces.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sources import parse

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "evergreen_trio"

SANS_IO_CORES = (
    "dag/*.py",
    "avp/codec.py", "avp/errors.py", "avp/handshake.py", "avp/incremental.py", "avp/kv.py", "avp/message.py",
    "ipc/config.py", "ipc/device_pool.py", "ipc/errors.py", "ipc/flatbuf.py", "ipc/framing.py", "ipc/reassembly.py",
    "ipc/uri.py",
    "picker/attribute_reporter.py", "picker/config.py", "picker/endpoint_attribute.py", "picker/engine_metrics.py",
    "picker/dataparallel.py", "picker/epp_config.py", "picker/models_source.py", "picker/routing_headers.py",
    "picker/served_verifier.py", "picker/multicluster.py", "picker/syncer.py", "picker/plugin_state.py",
    "picker/plugin_dumps.py", "picker/tracing.py", "picker/tracing_env.py",
    "picker/errors.py",
    "_grpc/server_wire.py", "picker/plugins.py",
    "picker/processor.py", "picker/request.py", "picker/scheduler.py", "picker/usage.py", "picker/parsers/*.py",
    "sim/api.py", "sim/config.py", "sim/errors.py", "sim/model.py",
    "generate/config.py", "generate/errors.py", "generate/openai.py", "generate/sse.py",
    "testing/model.py", "errors.py", "limits.py", "_wire.py", "_memory.py", "nodes.py",
    "_grpc/client_wire.py", "_grpc/limits.py", "_grpc/errors.py",
)
"""Plain Python under the Trio shells: tested without an event loop."""

IO_MODULES = frozenset({
    "trio", "trio_asyncio", "asyncio", "anyio", "socket", "selectors", "ssl", "subprocess",
    "httpx", "hypercorn", "grpclib", "grpc",
})
IO_ALLOWED = frozenset({"grpclib.const"})
"""grpclib's status enum is a plain constant table."""

PROTOCOL_PACKAGES = ("avp", "ipc", "picker", "sim", "generate")
PUBLIC_MODULE_PACKAGES = ("testing", "serving", "stack")
"""Packages without a face of their own: users import their public modules by path."""
BASE_MODULES = ("errors.py", "limits.py", "_wire.py", "_extras.py", "_memory.py")

FACE_EXCEPTIONS = {
    # Baselines that talk raw grpclib need the generated wire messages.
    "benchmarks/bench_session.py": {"evergreen_trio._proto.evergreen.v2.evergreen_pb2"},
    "benchmarks/grpclib_echo.py": {"evergreen_trio._proto.evergreen.v2.evergreen_pb2"},
    # Its grpcio client processes build the wire messages themselves.
    "benchmarks/bench_workers.py": {"evergreen_trio._proto.evergreen.v2.evergreen_pb2"},
    # The benchmark pins the UCX transports its server child uses to the bridge's default.
    "benchmarks/bench_ipc.py": {"evergreen_trio.ipc.transports.ucx_bridge"},
    # The GPU area pins the same transports plus the CUDA ones, and measures the device path itself.
    "benchmarks/bench_ipc_gpu.py": {"evergreen_trio.ipc.transports.ucx_bridge", "evergreen_trio.ipc.gpu"},
    # Its first-fetch companion pins the same transports for its server and client children.
    "benchmarks/ipc_first_fetch.py": {"evergreen_trio.ipc.transports.ucx_bridge"},
    # The pass map logs the gRPC writers' direct socket writes.
    "benchmarks/session_passes.py": {"evergreen_trio._grpc"},
    # The counts compare a session with its gRPC shells alone, and with its two ends linked in memory.
    "benchmarks/session_calls.py": {"evergreen_trio._grpc.client", "evergreen_trio._grpc.errors",
                                    "evergreen_trio._grpc.server", "evergreen_trio._grpc.streams",
                                    "evergreen_trio._proto.evergreen.v2.evergreen_pb2"},
    # The trace wraps the UCX bridge of both ends to time each step, on the device path too.
    "benchmarks/ipc_trace.py": {"evergreen_trio.ipc.transports", "evergreen_trio.ipc.gpu"},
    # The codec benchmark measures the wire messages themselves, with the picker's header names.
    "benchmarks/bench_codec.py": {"evergreen_trio._proto.evergreen.v2",
                                  "evergreen_trio.picker.processor"},
    # The picker benchmark's floor: the picker's own wire and shell with nothing decided behind them.
    "benchmarks/noop_ext_proc.py": {"evergreen_trio._grpc.server", "evergreen_trio._grpc.server_wire",
                                    "evergreen_trio.picker.processor", "evergreen_trio.picker.runtime"},
    # The precise prefix cache's block keys of a novel prompt: the token processor itself.
    "benchmarks/kv_block_keys.py": {"evergreen_trio.picker.kvblock"},
    # The picker's calls per request: its wire serving the picker as the runtime builds it, and the floor.
    "benchmarks/picker_calls.py": {"evergreen_trio._grpc.server_wire", "evergreen_trio.picker.config",
                                   "evergreen_trio.picker.processor", "evergreen_trio.picker.runtime",
                                   "evergreen_trio.picker.tracing", "evergreen_trio.picker.tracing_env"},
    # The session benchmark's Trio floor: the picker's wire echoing the session's wire messages, framed
    # as the session client frames them.
    "benchmarks/trio_floor_echo.py": {"evergreen_trio._proto.evergreen.v2.evergreen_pb2",
                                      "evergreen_trio._grpc.client_wire",
                                      "evergreen_trio._grpc.server", "evergreen_trio._grpc.server_wire"},
}



def imports(path: Path) -> Iterator[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                yield f"{base}.{node.module}" if node.module else base
            elif node.module:
                yield node.module


def module_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts)


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def test_the_listed_cores_exist() -> None:
    for pattern in SANS_IO_CORES:
        assert list(PACKAGE.glob(pattern)), pattern


@pytest.mark.parametrize("path", [p for pattern in SANS_IO_CORES for p in sorted(PACKAGE.glob(pattern))],
                         ids=relative)
def test_sans_io_cores_do_no_io(path: Path) -> None:
    bad = [name for name in imports(path) if name.split(".")[0] in IO_MODULES and name not in IO_ALLOWED]
    assert not bad, f"{relative(path)} is a sans-IO core but imports {bad}"


def test_no_module_imports_asyncio() -> None:
    users = {relative(p) for p in module_files() if any(n.split(".")[0] in {"asyncio", "trio_asyncio"}
                                                         for n in imports(p))}
    assert users == set()


IMPORT_AND_BUILD = """
import asyncio, sys
import evergreen_trio, evergreen_trio.avp, evergreen_trio.generate, evergreen_trio.ipc, evergreen_trio.picker
import evergreen_trio.sim, evergreen_trio.testing
from evergreen_trio import Client, Server
Server(), Client("127.0.0.1:1")
async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__
print("trio_asyncio" in sys.modules, asyncio.run(loop_module()))
"""


def test_importing_the_package_leaves_asyncio_alone() -> None:
    """The package installs nothing into asyncio: a user's own ``asyncio.run`` gets the standard loop
    (trio-asyncio, which the session server once ran grpclib on, replaced ``asyncio.new_event_loop``
    process-wide and doubled raw grpclib's round trip in our benchmark)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_AND_BUILD], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "asyncio.unix_events"], out.stdout + out.stderr


@pytest.mark.parametrize("package", PROTOCOL_PACKAGES)
def test_protocol_packages_do_not_import_each_other(package: str) -> None:
    others = {f"evergreen_trio.{other}" for other in PROTOCOL_PACKAGES if other != package}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = [n for n in imports(path) if any(n == o or n.startswith(o + ".") for o in others)]
        assert not bad, f"{relative(path)} imports {bad}"


@pytest.mark.parametrize("name", BASE_MODULES)
def test_base_modules_import_nothing_above_them(name: str) -> None:
    ours = [n for n in imports(PACKAGE / name) if n.startswith("evergreen_trio")]
    assert set(ours) <= {"evergreen_trio.errors"}, ours


def test_serving_and_the_session_layer_do_not_import_the_stack() -> None:
    below = [PACKAGE / "serving", *(p for p in PACKAGE.glob("*.py"))]
    for path in sorted(p for d in below for p in ([d] if d.is_file() else d.rglob("*.py"))):
        bad = [n for n in imports(path) if n == "evergreen_trio.stack" or n.startswith("evergreen_trio.stack.")]
        assert not bad, f"{relative(path)} imports {bad}"


def faces() -> set[str]:
    """Modules a user imports: each package's ``__init__``, the public top-level modules, and the public
    modules of ``testing/``, ``serving/`` and ``stack/``."""
    names = {"evergreen_trio"}
    for path in module_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and not any(p.startswith("_") for p in parts[:-1]):
            names.add(".".join(parts[:-1]))
        elif not parts[-1].startswith("_") and (len(parts) == 2 or parts[1] in PUBLIC_MODULE_PACKAGES):
            names.add(".".join(parts))
    return names


_DOC_IMPORT = re.compile(r"^\s*(?:from\s+(evergreen_trio[\w.]*)\s+import|import\s+(evergreen_trio[\w.]*))", re.M)


def users() -> list[Path]:
    return [PACKAGE / "stack" / "demo.py", *sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "README.md",
            *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", users(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_demo_benchmarks_and_docs_import_only_faces(path: Path) -> None:
    if path.suffix == ".py":
        used = {n for n in imports(path) if n.startswith("evergreen_trio")}
    else:
        used = {a or b for a, b in _DOC_IMPORT.findall(path.read_text(encoding="utf-8"))}
    allowed = faces() | FACE_EXCEPTIONS.get(path.relative_to(ROOT).as_posix(), set())
    assert used <= allowed, f"{path.relative_to(ROOT)} reaches behind a face: {sorted(used - allowed)}"
