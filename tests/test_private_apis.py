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

BRIDGE = "evergreen_trio/_grpc/bridge.py"
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


def _grpclib_server_state(*names: str) -> list[Case]:
    user = f"{BRIDGE} (_GuardedServer._protocol_factory, _start)"
    return [Case("grpclib", "grpclib.server.Server", name, SetsInstanceAttr(), user) for name in names]


def _ucx(path: str, attr: str, shape: Shape, user: str = UCX_BRIDGE) -> Case:
    # "ucxx" is the import name: the distribution is ucxx-cu12 or ucxx-cu13, named in the message.
    return Case("ucxx", path, attr, shape, user, extra="ucx")


LIBUCXX = "ucxx._lib.libucxx"
CASES = [
    # trio-asyncio: the cancelled-timer purge.
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_timer_handle_cancelled", Calls(1),
         f"{BRIDGE} (_open_loop replaces it on the loop with _CancelledTimerPurge)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_timers", SetsInstanceAttr(),
         f"{BRIDGE} (_CancelledTimerPurge filters the loop's timers)"),
    Case("trio-asyncio", "trio_asyncio", "BaseTrioEventLoop", Mentions("heapq.heappush(self._timers"),
         f"{BRIDGE} (_CancelledTimerPurge re-heapifies _timers, so it must stay a heapq heap)"),
    Case("python", "asyncio.events.TimerHandle", "cancel", Mentions("_timer_handle_cancelled(self)"),
         f"{BRIDGE} (_CancelledTimerPurge learns of cancelled timers through it)"),
    # trio-asyncio: the loop's callback queue, its step and its I/O tasks, replaced on each loop instance
    # by _open_loop (_ReadyQueue, _loop_step, _io_task).
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_main_loop", Mentions("await self._main_loop_one()"),
         f"{BRIDGE} (_loop_step, set on the loop instance, is what the running loop calls at each step)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_main_loop_one", Mentions("await self._q_recv.receive()"),
         f"{BRIDGE} (_open_loop wakes the first step, waiting on the channel, with a no-op)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_main_loop_exit",
         Mentions("await self._main_loop_one(no_wait=True)"),
         f"{BRIDGE} (_loop_step: with no_wait, one callback, or WouldBlock once none is queued)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_queue_handle", Mentions("self._q_send.send_nowait(handle)"),
         f"{BRIDGE} (_ReadyQueue.send_nowait)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "call_soon",
         Mentions("return self._queue_handle(asyncio.Handle(callback, args, self, **context))"),
         f"{BRIDGE} (_call_soon does the same, less the callback check)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "call_soon_threadsafe", Mentions("self._q_send.send_nowait"),
         f"{BRIDGE} (_ReadyQueue.send_nowait)"),
    *[Case("trio-asyncio", "trio_asyncio.TrioEventLoop", name, SetsInstanceAttr(), f"{BRIDGE} (_open_loop)")
      for name in ("_nursery",)],
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "__init__",
         Mentions("self._q_send, self._q_recv = trio.open_memory_channel"), f"{BRIDGE} (_open_loop swaps both)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_add_io_handler",
         Mentions("self._nursery.start_soon(self._io_task, fd, handle, wait_ready)"),
         f"{BRIDGE} (_io_task, set on the loop instance, runs each reader and writer)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "_io_task", Mentions("handle._raise(exc)"),
         f"{BRIDGE} (_io_task does as trio-asyncio's, less its synchronize)"),
    Case("trio-asyncio", "trio_asyncio._handles.ScopedHandle", "_scope", SetsInstanceAttr(), f"{BRIDGE} (_io_task)"),
    Case("trio-asyncio", "trio_asyncio._handles", "AsyncHandle", ClassAttr(type), f"{BRIDGE} (_loop_step)"),
    Case("trio-asyncio", "trio_asyncio._handles.AsyncHandle", "_started", SetsInstanceAttr(),
         f"{BRIDGE} (_loop_step starts a Trio function's handle as trio-asyncio's step does)"),
    Case("trio-asyncio", "trio_asyncio._base", "TrioAsyncioExit", ClassAttr(type),
         f"{BRIDGE} (_run_queued leaves the loop's stop to the loop task)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "stop", Mentions("raise TrioAsyncioExit("),
         f"{BRIDGE} (_run_queued: the stop callback raises it)"),
    # grpclib: its module-level reference to asyncio.current_task, re-pointed at trio-asyncio's.
    Case("grpclib", "grpclib.utils.Wrapper", "__enter__", Mentions("_current_task()"),
         f"{BRIDGE} (sets grpclib.utils._current_task for CPython 3.12+)"),
    # grpclib: the guarded server (its own protocol, handler and start).
    Case("grpclib", "grpclib.config", "Configuration", Calls(0, ("_keepalive_time", "_keepalive_timeout")),
         f"{BRIDGE} (_GuardedServer.__init__)"),
    Case("grpclib", "grpclib.server.Server", "__gc_interval__", ClassAttr(int),
         f"{BRIDGE} (_GuardedServer sets it to 1)"),
    Case("grpclib", "grpclib.server.Server", "__gc_step__", Mentions("self.__gc_collect__()"),
         f"{BRIDGE} (_GuardedServer.__gc_collect__ overrides what it calls)"),
    Case("grpclib", "grpclib.server.Handler", "check_closed", Calls(), f"{BRIDGE} (_GuardedServer.__gc_collect__)"),
    # asyncio: the accept path, replaced on the session server's loop (_accept_connections).
    Case("python", "asyncio.selector_events.BaseSelectorEventLoop", "_start_serving",
         Mentions("self._accept_connection,"), f"{BRIDGE} (_start sets the loop's _accept_connection)"),
    Case("python", "asyncio.selector_events.BaseSelectorEventLoop", "_accept_connection", Calls(7),
         f"{BRIDGE} (_accept_connections takes its arguments)"),
    Case("python", "asyncio.selector_events.BaseSelectorEventLoop", "_make_socket_transport",
         Calls(2, ("extra", "server")), f"{BRIDGE} (_accept_connections)"),
    Case("python", "asyncio.selector_events.BaseSelectorEventLoop", "_remove_reader", Calls(1),
         f"{BRIDGE} (_accept_connections, out of descriptors)"),
    Case("python", "asyncio.selector_events._SelectorSocketTransport", "__init__",
         Mentions("self._loop.call_soon(self._protocol.connection_made, self)"),
         f"{BRIDGE} (_accept_connections: the transport starts its protocol)"),
    Case("trio-asyncio", "trio_asyncio.TrioEventLoop", "call_later",
         Mentions("asyncio.TimerHandle(delay + self.time(), callback, args, self, **context)"),
         f"{BRIDGE} (_call_later does the same, less its check)"),
    Case("grpclib", "grpclib.server.Server", "__gc_step__", Calls(), f"{BRIDGE} (_GuardedServer._protocol_factory)"),
    Case("grpclib", "grpclib.server.Server", "_protocol_factory", Calls(),
         f"{BRIDGE} (_GuardedServer overrides it; _start hands it to create_server)"),
    *_grpclib_server_state("_mapping", "_codec", "_status_details_codec", "__dispatch__", "_handlers", "_config",
                           "_h2_config", "_server", "_server_closed_fut"),
    Case("grpclib", "grpclib.server.Server", "start", Mentions("self._server_closed_fut = "),
         f"{BRIDGE} (_start does what Server.start does, with a TLS handshake deadline)"),
    Case("grpclib", "grpclib.server.Server", "__init__", Mentions("__mapping__()"),
         f"{BRIDGE} (SessionAcceptor is a servable through __mapping__)"),
    Case("grpclib", "grpclib.server", "Handler", Calls(4), f"{BRIDGE} (_GuardedServer._protocol_factory)"),
    Case("grpclib", "grpclib.server.Handler", "accept", Calls(3), f"{BRIDGE} (_Handler.accept overrides it)"),
    Case("grpclib", "grpclib.server.Handler", "accept", Mentions("self._tasks[stream] ="),
         f"{BRIDGE} (_Handler.accept reads the task grpclib's accept started)"),
    Case("grpclib", "grpclib.server.Handler", "_tasks", SetsInstanceAttr(), f"{BRIDGE} (_Handler.accept)"),
    Case("grpclib", "grpclib.protocol", "H2Protocol", Calls(3), f"{BRIDGE} (_GuardedProtocol subclasses it)"),
    *[Case("grpclib", "grpclib.protocol.H2Protocol", name, SetsInstanceAttr(), f"{BRIDGE} (_GuardedProtocol)")
      for name in ("handler", "config", "h2_config", "connection", "processor")],
    Case("grpclib", "grpclib.protocol.H2Protocol", "connection_made",
         Mentions("EventsProcessor(self.handler, self.connection)"),
         f"{BRIDGE} (_GuardedProtocol.connection_made is grpclib's, with the stream cap advertised)"),
    Case("grpclib", "grpclib.protocol", "Connection", Calls(2, ("config",)),
         f"{BRIDGE} (_GuardedProtocol.connection_made)"),
    Case("grpclib", "grpclib.protocol.Connection", "_connection", SetsInstanceAttr(),
         f"{BRIDGE} (_h2, _GuardedProtocol._admit, _GuardedProtocol._go_away)"),
    *[Case("grpclib", "grpclib.protocol.Connection", name, Calls(count), f"{BRIDGE} (_GuardedProtocol)")
      for name, count in (("feed", 1), ("flush", 0), ("initialize", 0), ("is_closing", 0), ("get_peer", 0))],
    Case("grpclib", "grpclib.protocol", "EventsProcessor", Calls(2), f"{BRIDGE} (_GuardedProtocol.connection_made)"),
    Case("grpclib", "grpclib.protocol.EventsProcessor", "streams", SetsInstanceAttr(),
         f"{BRIDGE} (_GuardedProtocol counts and looks up streams)"),
    Case("grpclib", "grpclib.protocol.EventsProcessor", "process", Calls(1), f"{BRIDGE} (_GuardedProtocol._feed)"),
    Case("grpclib", "grpclib.protocol.EventsProcessor", "close", Calls(1), f"{BRIDGE} (_GuardedProtocol)"),
    *[Case("grpclib", "grpclib.protocol.Stream", name, SetsInstanceAttr(), f"{BRIDGE} ({user})")
      for name, user in (("created", "_GuardedProtocol._feed"),)],
    Case("grpclib", "grpclib.protocol.Stream", "recv_data", Calls(1), f"{BRIDGE} (_recv_message)"),
    Case("grpclib", "grpclib.protocol.Buffer", "read", Mentions("AssertionError"),
         f"{BRIDGE} (_recv_message maps it to INVALID_ARGUMENT)"),
    Case("grpclib", "grpclib.server.Stream", "_stream", SetsInstanceAttr(), f"{BRIDGE} (_pump_in)"),
    Case("grpclib", "grpclib.health.check.ServiceStatus", "__status__", Calls(),
         "evergreen_trio/_grpc/health.py (ServerHealth.ready, which the picker's Readiness reads)"),
    # h2: the stream cap that refuses one stream instead of failing the connection.
    Case("h2", "h2.connection.H2Connection", "open_inbound_streams", ClassAttr(property),
         f"{BRIDGE} (_GuardedH2Connection overrides it; prune() calls its getter)"),
    Case("h2", "h2.connection.H2Connection", "open_inbound_streams", Mentions("self._open_streams("),
         f"{BRIDGE} (_GuardedH2Connection.prune relies on the getter dropping closed streams)"),
    Case("h2", "h2.connection.H2Connection", "_receive_headers_frame", Mentions("self.open_inbound_streams"),
         f"{BRIDGE} (_GuardedH2Connection: h2's stream cap goes through the overridden property)"),
    Case("h2", "h2.connection.H2Connection", "DEFAULT_MAX_HEADER_LIST_SIZE", ClassAttr(int),
         f"{BRIDGE} (_GuardedProtocol.connection_made)"),
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
