"""`evergreen-trio picker --tracing` as a subprocess, its spans sent to a stand-in OTLP collector.

The collector is grpcio serving ``opentelemetry.proto.collector.trace.v1.TraceService/Export``
from the ``opentelemetry-proto`` package's generated code: the picker's exporter is the SDK's own.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_disagg_headers import upstream_headers

from evergreen_trio.picker.processor import DESTINATION

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import serve_fake_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
SCHEDULER_SPANS = {"run_scheduler_profile", "filter_endpoints", "llm_d.epp.scoring", "pick_endpoints"}
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER_ARG": "1"}


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, str], trace_pb2.Span]] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # the generated name
               context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                self.spans.extend((resource, span) for scope in resource_spans.scope_spans for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self) -> dict[str, trace_pb2.Span]:
        with self.lock:
            return {span.name: span for _, span in self.spans}


@contextmanager
def collector() -> Iterator[tuple[Collector, int]]:
    service = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield service, port
    finally:
        server.stop(None)


async def _config(nursery: trio.Nursery, tmp_path: Path) -> tuple[Path, str]:
    engine = f"127.0.0.1:{await nursery.start(serve_fake_engine)}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool:\n  name: traced\n  endpoints: ['{engine}']\n")
    return config, engine


async def _route(port: int, headers: list[tuple[str, str]]) -> dict[str, str]:
    with trio.fail_after(20):
        while True:  # until the first scrapes are in (503 before)
            try:
                return await trio.to_thread.run_sync(upstream_headers, port, "hi", headers)
            except ValueError:
                await trio.sleep(0.05)


async def test_the_collector_gets_the_requests_spans_under_the_clients_traceparent(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    config, engine = await _config(nursery, tmp_path)
    with collector() as (service, port):
        env = {**FAST_EXPORT, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
               "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
        async with picker_process(["--config", str(config), "--tracing", *EPHEMERAL_PORTS], env) as picker:
            await wait_health("127.0.0.1", picker.health, "readiness")
            routed = await _route(picker.grpc, [("traceparent", TRACEPARENT), ("x-request-id", "r-1")])
            assert routed[DESTINATION] == engine
            with trio.fail_after(20):
                while {"gateway.request", "gateway.request_orchestration"} - set(service.named()):  # noqa: ASYNC110
                    await trio.sleep(0.05)  # the collector is another thread's
        spans = service.named()
    request, orchestration = spans["gateway.request"], spans["gateway.request_orchestration"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    assert request.kind == orchestration.kind == trace_pb2.Span.SPAN_KIND_SERVER
    # The request went upstream with the picker's request span as its parent.
    assert routed["traceparent"] == f"00-{TRACE_ID}-{request.span_id.hex()}-01"
    assert orchestration.parent_span_id == request.span_id
    assert {a.key for a in orchestration.attributes} == {"target_model", "request_prio"}
    assert set(spans) >= SCHEDULER_SPANS
    profile = spans["run_scheduler_profile"]
    assert profile.parent_span_id == orchestration.span_id
    assert all(spans[name].parent_span_id == profile.span_id for name in SCHEDULER_SPANS - {"run_scheduler_profile"})
    assert all(span.trace_id.hex() == TRACE_ID for span in spans.values())
    filtered = {a.key: a.value for a in spans["filter_endpoints"].attributes}
    assert filtered["gen_ai.request.id"].string_value == "r-1"
    assert filtered["llm_d.epp.filter.filtered_endpoints"].int_value == 1
    resource = service.spans[0][0]
    assert resource["service.name"] == "llm-d-epp" and resource["deployment.environment"] == "test"


async def test_a_collector_that_is_down_costs_one_warning_and_no_request(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    config, engine = await _config(nursery, tmp_path)
    with collector() as (_, port):
        pass  # a port nothing listens on now
    env = {**FAST_EXPORT, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "300"}
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        async with picker_process(["--config", str(config), "--tracing", *EPHEMERAL_PORTS], env,
                                  stderr=stderr) as picker:
            await wait_health("127.0.0.1", picker.health, "readiness")
            for _ in range(5):
                assert (await _route(picker.grpc, [("traceparent", TRACEPARENT)]))[DESTINATION] == engine
                await trio.sleep(0.4)  # several export rounds, each failing
    lines = log.read_text().splitlines()
    failed = [line for line in lines if "picker.tracing_export_failed" in line]
    assert len(failed) == 1, lines
    assert "exporter=otlp" in failed[0]
    assert "Connection refused" in failed[0]  # the SDK's reason, in our one line: not logged by the SDK
    assert not [line for line in lines if "Traceback" in line or ("Failed to export" in line and line not in failed)]


async def test_the_console_exporter_prints_each_span_as_json_on_stdout(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    config, _ = await _config(nursery, tmp_path)
    async with picker_process(["--config", str(config), "--tracing=true", *EPHEMERAL_PORTS], FAST_EXPORT) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await _route(picker.grpc, [("traceparent", TRACEPARENT)])
        assert picker.process.stdout is not None
        text = b""
        with trio.fail_after(20):
            while b'"name": "gateway.request"' not in text:
                text += await picker.process.stdout.receive_some(65536)
    assert '"trace_id": "0x' + TRACE_ID + '"' in text.decode()


@pytest.mark.parametrize(("env", "says"), [
    ({"OTEL_TRACES_SAMPLER": "always_on"}, "OTEL_TRACES_SAMPLER='always_on' is not supported"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY='soon' is not a positive number"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1", "OTEL_TRACES_EXPORTER": "otlp"}, "OTEL_EXPORTER_OTLP_TIMEOUT='-1'"),
])
async def test_bad_otel_values_are_one_line_each_and_the_picker_serves(
        nursery: trio.Nursery, tmp_path: Path, env: dict[str, str], says: str) -> None:
    config, engine = await _config(nursery, tmp_path)
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        async with picker_process(["--config", str(config), "--tracing", *EPHEMERAL_PORTS],
                                  {"OTEL_TRACES_SAMPLER_ARG": "not-a-ratio", **env}, stderr=stderr) as picker:
            assert (await _route(picker.grpc, []))[DESTINATION] == engine
    lines = [line for line in log.read_text().splitlines() if "picker.tracing_setting" in line]
    assert len(lines) == 1 and says in lines[0], lines


def test_an_exporter_setting_the_sdk_refuses_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  name: traced\n  endpoints: ['127.0.0.1:1']\n")
    done = run_cli(["--config", str(config), "--tracing", *EPHEMERAL_PORTS],
                   {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"})
    assert done.returncode == 2, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert "OTEL_EXPORTER_OTLP_" in line and "brotli" in line


def test_tracing_off_imports_no_opentelemetry() -> None:
    script = ("import sys, runpy\n"
              "sys.argv = ['evergreen-trio', 'picker', '--help']\n"
              "try:\n    runpy.run_module('evergreen_trio.cli', run_name='__main__')\n"
              "except SystemExit:\n    pass\n"
              "from evergreen_trio.picker import runtime, processor, scheduler\n"
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))")
    done = subprocess.run([sys.executable, "-c", "import json\n" + script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], done.stderr


def _traced_picker_with(tmp_path: Path, setup: str) -> subprocess.CompletedProcess[str]:
    """``picker --tracing`` run after ``setup`` (Python that breaks the install as a user's can be)."""
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  name: traced\n  endpoints: ['127.0.0.1:1']\n")
    return subprocess.run([sys.executable, "-c", f"import sys, types\n{setup}\nfrom evergreen_trio.cli import main\n"
                           f"sys.exit(main(['picker', '--config', {str(config)!r}, '--tracing', '--grpc-port', '0']))"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_flag_without_the_extra_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    done = _traced_picker_with(tmp_path, "sys.modules['opentelemetry'] = None")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "evergreen-trio picker: error: picker tracing (--tracing) needs the 'tracing' extra: "
        "pip install 'evergreen-trio[tracing]' (missing: opentelemetry)"]


def test_xds_protos_stale_copy_of_the_otlp_messages_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    # xds-protos installed after opentelemetry-proto leaves a common_pb2 without InstrumentationScope
    # (grpc/grpc#42926): the exporter's import fails although the extra is installed.
    done = _traced_picker_with(tmp_path, "import opentelemetry.proto.common.v1 as v1\n"
                                         "sys.modules[v1.__name__ + '.common_pb2'] = types.ModuleType('common_pb2')")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    version = importlib.metadata.version("opentelemetry-proto")
    assert line == ("evergreen-trio picker: error: picker tracing (--tracing): xds-protos overwrote "
                    "opentelemetry-proto's modules with an older copy (grpc/grpc#42926); reinstall it after "
                    f"xds-protos: pip install --force-reinstall --no-deps 'opentelemetry-proto=={version}'")


def test_this_install_has_opentelemetry_protos_own_otlp_messages() -> None:
    # What `make test`, CI and the image do after installing (Makefile OTLP_PROTO, the Dockerfile).
    from opentelemetry.proto.common.v1 import common_pb2

    assert hasattr(common_pb2, "InstrumentationScope")
