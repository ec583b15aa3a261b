"""Every private or undocumented API of a dependency that ``evergreen_trio`` relies on, with its shape.

A dependency may rename or drop its internals in any release, and only at run time would we notice.
Each case names the distribution, the object (a dotted path), the attribute, the shape we rely on
(a module, a callable accepting what we pass, a class attribute of a type, an instance attribute its
code sets, or a behaviour its source still shows) and the code of ours that relies on it. pyproject.toml
gives each of these distributions an upper bound: raise one only once this test passes with the new
version. Cases of an optional extra are skipped when the extra is not installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

UCX_BRIDGE = "evergreen_trio/ipc/transports/ucx_bridge.py"
GENCODE = "evergreen_trio/_proto/**/*_pb2.py (protoc gencode)"


@dataclass(frozen=True)
class Module:
    """``path.attr`` imports."""

    def problem(self, owner: Any, attr: str) -> str | None:
        try:
            importlib.import_module(f"{owner.__name__}.{attr}")
        except ImportError as error:
            return f"no longer imports ({error})"
        return None


@dataclass(frozen=True)
class Calls:
    """A callable that accepts ``positional`` arguments then ``keywords`` (``self`` not counted)."""

    positional: int = 0
    keywords: tuple[str, ...] = ()

    def problem(self, owner: Any, attr: str) -> str | None:
        target = getattr(owner, attr)
        if not callable(target):
            return f"is no longer callable (it is a {type(target).__name__})"
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return None  # a compiled callable that does not describe itself: callable is all we can check
        static = inspect.getattr_static(owner, attr)
        is_method = inspect.isclass(owner) and (
            inspect.isfunction(static) or type(static).__name__ == "cython_function_or_method"
        )
        try:
            signature.bind(*[None] * (self.positional + is_method), **dict.fromkeys(self.keywords))
        except TypeError as error:
            called = ", ".join([*["_"] * self.positional, *(f"{k}=_" for k in self.keywords)])
            return f"no longer accepts ({called}): its signature is {signature} ({error})"
        return None


@dataclass(frozen=True)
class ClassAttr:
    """An attribute of the class (or module) itself, an instance of ``kind``."""

    kind: type = object

    def problem(self, owner: Any, attr: str) -> str | None:
        value = inspect.getattr_static(owner, attr)
        if not isinstance(value, self.kind):
            return f"is a {type(value).__name__}, no longer an instance of {self.kind.__name__}"
        return None


@dataclass(frozen=True)
class SetsInstanceAttr:
    """The class's own code (or a base class of the same package) assigns ``self.<attr>``."""

    def problem(self, owner: Any, attr: str) -> str | None:
        package = owner.__module__.split(".")[0]
        assignment = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=(?!=)")
        for cls in owner.__mro__:
            if cls.__module__.split(".")[0] == package and assignment.search(_source(cls)):
                return None
        return "is no longer set on its instances"


@dataclass(frozen=True)
class Mentions:
    """Behaviour we rely on, as the source of ``owner.attr`` still shows it: it contains ``text``."""

    text: str

    def problem(self, owner: Any, attr: str) -> str | None:
        if self.text not in _source(inspect.getattr_static(owner, attr)):
            return f"no longer contains {self.text!r} (the behaviour we rely on changed)"
        return None


@dataclass(frozen=True)
class HoldsFile:
    """``attr`` is a directory next to the package's ``__init__`` that holds ``relative``."""

    relative: str

    def problem(self, owner: Any, attr: str) -> str | None:
        if not (Path(owner.__file__).parent / attr / self.relative).is_file():
            return f"no longer holds {self.relative}"
        return None


def _function(value: Any) -> Any:
    """The function behind a property, classmethod or staticmethod (else ``value`` itself)."""
    if isinstance(value, property):
        return value.fget
    return getattr(value, "__func__", value)


def _source(value: Any) -> str:
    """The source of a function, or of a class's own functions (``getsource`` of a class fails
    where the package re-exports it under another ``__module__``, as trio-asyncio does)."""
    if inspect.isclass(value):
        sources = []
        for member in vars(value).values():
            with contextlib.suppress(OSError, TypeError):  # one without source (built at run time)
                sources.append(inspect.getsource(_function(member)))
        return "\n".join(sources)
    return inspect.getsource(_function(value))


Shape = Module | Calls | ClassAttr | SetsInstanceAttr | Mentions | HoldsFile


@dataclass(frozen=True)
class Case:
    distribution: str  # "python" for the standard library
    path: str  # dotted: a module, then attributes
    attr: str
    shape: Shape
    user: str  # the code of ours that relies on it
    extra: str | None = field(default=None)  # the extra that brings it; None: a core dependency

    @property
    def id(self) -> str:
        return f"{self.distribution}:{self.path}.{self.attr}:{type(self.shape).__name__}"


def _ucx(path: str, attr: str, shape: Shape, user: str = UCX_BRIDGE) -> Case:
    # "ucxx" is the import name: the distribution is ucxx-cu12 or ucxx-cu13, named in the message.
    return Case("ucxx", path, attr, shape, user, extra="ucx")


LIBUCXX = "ucxx._lib.libucxx"
CASES = [
    # protobuf: what the generated *_pb2.py modules call.
    Case("protobuf", "google.protobuf.internal", "builder", Module(), GENCODE),
    Case("protobuf", "google.protobuf.internal.builder", "BuildMessageAndEnumDescriptors", Calls(2), GENCODE),
    Case("protobuf", "google.protobuf.internal.builder", "BuildTopDescriptorsAndMessages", Calls(3), GENCODE),
    Case("protobuf", "google.protobuf.descriptor", "_USE_C_DESCRIPTORS", ClassAttr(bool), GENCODE),
    Case("protobuf", "google.protobuf.runtime_version", "ValidateProtobufRuntimeVersion", Calls(6), GENCODE),
    # hypothesis: the conformance kit collects what a failing rule prints.
    Case("hypothesis", "hypothesis.reporting", "with_reporter", Calls(1),
         "evergreen_trio/testing/conformance.py", extra="testing"),
    # grpcio-tools: the well-known protos that regenerating ours needs.
    Case("grpcio-tools", "grpc_tools", "_proto", HoldsFile("google/protobuf/struct.proto"),
         "evergreen_trio/_proto/generate.py", extra="test"),
    # The standard library.
    Case("python", "argparse", "_SubParsersAction", ClassAttr(type), "evergreen_trio/_cli.py, the register() hooks"),
    Case("python", "argparse", "_ActionsContainer", ClassAttr(type), "evergreen_trio/_cli.py (add_dataclass_options)"),
    Case("python", "argparse.ArgumentParser", "_actions", SetsInstanceAttr(), "evergreen_trio/_cli.py"),
    Case("python", "http.HTTPStatus", "_value2member_map_", ClassAttr(dict),
         "evergreen_trio/avp/codec.py (_enum_error, on our IntEnums)"),
    # ucxx: the UCX transport drives ucxx's Cython core directly (no asyncio).
    _ucx("ucxx._lib", "libucxx", Module()),
    _ucx("ucxx._lib", "arr", Module()),
    _ucx("ucxx._lib.arr", "Array", Calls(1)),
    _ucx(LIBUCXX, "UCXContext", Calls(0, ("config_dict", "feature_flags"))),
    _ucx(f"{LIBUCXX}.Feature", "TAG", ClassAttr()),
    _ucx(f"{LIBUCXX}.Feature", "WAKEUP", ClassAttr()),
    _ucx(LIBUCXX, "UCXError", ClassAttr(type)),
    _ucx(f"{LIBUCXX}.UCXAddress", "create_from_buffer", Calls(1)),
    _ucx(LIBUCXX, "UCXWorker", Calls(1)),
    *[_ucx(f"{LIBUCXX}.UCXWorker", name, Calls(*args))
      for name, *args in (("init_blocking_progress_mode", 0), ("progress", 0), ("progress_once", 0), ("arm", 0),
                          ("tag_probe", 2, ("remove",)), ("tag_recv_with_handle", 2),
                          ("cancel_inflight_requests", 2), ("create_endpoint_from_hostname", 3),
                          ("create_endpoint_from_worker_address", 2))],
    _ucx(f"{LIBUCXX}.UCXWorker", "epoll_file_descriptor", ClassAttr()),
    _ucx(f"{LIBUCXX}.UCXWorker", "address", ClassAttr()),
    _ucx(LIBUCXX, "UCXXTag", Calls(1)),
    _ucx(LIBUCXX, "UCXXTagMask", Calls(1)),
    _ucx(f"{LIBUCXX}.UCXXTag", "value", ClassAttr(), "evergreen_trio/ipc/transports/ucx.py"),
    _ucx(f"{LIBUCXX}.UCXListener", "create", Calls(3)),
    _ucx(f"{LIBUCXX}.UCXListener", "port", ClassAttr(), "evergreen_trio/ipc/transports/ucx.py"),
    _ucx(f"{LIBUCXX}.UCXListener", "create_endpoint_from_conn_request", Calls(2)),
    *[_ucx(f"{LIBUCXX}.UCXEndpoint", name, Calls(count))
      for name, count in (("tag_send", 2), ("set_close_callback", 2), ("remove_close_callback", 0), ("close", 0))],
    _ucx(f"{LIBUCXX}.UCXEndpoint", "alive", ClassAttr()),
    _ucx(f"{LIBUCXX}.UCXEndpoint", "handle", ClassAttr()),
    _ucx(f"{LIBUCXX}.UCXRequest", "completed", ClassAttr()),
    _ucx(f"{LIBUCXX}.UCXRequest", "check_error", Calls()),
    *[_ucx(f"{LIBUCXX}.TagProbeResult", name, ClassAttr(), f"{UCX_BRIDGE}, evergreen_trio/ipc/transports/ucx.py")
      for name in ("matched", "length", "sender_tag")],
]


def _resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(path)


def _installed(case: Case) -> str:
    """``distribution version`` as installed (the import name's distributions when it is not one)."""
    if case.distribution == "python":
        return f"Python {platform.python_version()}"
    try:
        return f"{case.distribution} {importlib.metadata.version(case.distribution)}"
    except importlib.metadata.PackageNotFoundError:
        names = importlib.metadata.packages_distributions().get(case.path.split(".")[0], [case.distribution])
        return " / ".join(f"{name} {importlib.metadata.version(name)}" for name in sorted(set(names)))


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_private_api_still_has_the_shape_we_rely_on(case: Case) -> None:
    if case.extra is not None:
        pytest.importorskip(case.path.split(".")[0], reason=f"{case.distribution} not installed (extra {case.extra})")
    where = f"{case.path}.{case.attr}"
    advice = (
        "check before adding this Python version to CI"
        if case.distribution == "python"
        else "check before raising the upper bound in pyproject.toml"
    )
    try:
        owner = _resolve(case.path)
        problem = case.shape.problem(owner, case.attr)
    except (AttributeError, ImportError, OSError, TypeError) as error:
        problem = f"is gone ({type(error).__name__}: {error})"
    assert problem is None, f"{_installed(case)}: {where} {problem}; {case.user} relies on it — {advice}"
