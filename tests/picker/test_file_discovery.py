"""file-discovery: the endpoints file format (sans-IO), the polling watcher, the config and the command."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from kube_fakes import start_sims
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio.picker.config import Endpoint, PoolConfig, parse_config
from evergreen_trio.picker.errors import ConfigError, PickerError
from evergreen_trio.picker.file_discovery import MAX_FILE_SIZE, EndpointsFileError, FileDiscovery, parse_endpoints_file
from evergreen_trio.picker.file_watch import file_discovery

TWO = b"""
endpoints:
  - name: vllm-0
    address: "10.0.0.1"
    port: "8000"
  - name: vllm-1
    namespace: ns
    address: "10.0.0.2"
    port: "8001"
    labels: {app: vllm}
"""


def test_parses_entries_with_default_namespace() -> None:
    entries, errors = parse_endpoints_file(TWO)
    assert errors == []
    assert [(e.namespace, e.name, e.address, e.port, e.labels) for e in entries] == [
        ("default", "vllm-0", "10.0.0.1", 8000, ()), ("ns", "vllm-1", "10.0.0.2", 8001, (("app", "vllm"),))]


@pytest.mark.parametrize(("address", "port", "error"), [
    ("not-an-ip", "8000", "invalid IPv4 address"), ("::1", "8000", "invalid IPv4 address"),
    ("10.0.0.1", "99999", "invalid port"), ("10.0.0.1", "0", "invalid port"), ("10.0.0.1", " 80", "invalid port"),
    ("", "8000", "invalid IPv4 address"),
])
def test_bad_entry_is_skipped_with_a_message(address: str, port: str, error: str) -> None:
    data = TWO + f'  - name: bad\n    address: "{address}"\n    port: "{port}"\n'.encode()
    entries, errors = parse_endpoints_file(data)
    assert len(entries) == 2 and len(errors) == 1 and error in errors[0] and "'bad'" in errors[0]


def test_go_json_decoding_edge_cases() -> None:
    # Go's strconv.Atoi takes a sign; net.ParseIP(..).To4() takes an IPv4-mapped IPv6 address.
    entries, errors = parse_endpoints_file(b'endpoints: [{Name: a, ADDRESS: "::ffff:10.0.0.9", port: "+80", x: 1}]')
    assert errors == [] and (entries[0].name, entries[0].port) == ("a", 80)
    assert parse_endpoints_file(b"") == ([], [])  # YAML null: no endpoints
    assert parse_endpoints_file(b"endpoints: null") == ([], [])


@pytest.mark.parametrize("data", [
    b"endpoints: [", b"[1, 2]", b"endpoints: {a: 1}", b"endpoints: [{name: a, address: 10.0.0.1, port: 8000}]",
    b"endpoints: [{name: a, address: 10.0.0.1, port: '80', labels: {a: 1}}]", b"endpoints: [3]",
    b"a" * (MAX_FILE_SIZE + 1),
])
def test_unusable_file_is_a_typed_error(data: bytes) -> None:
    with pytest.raises(EndpointsFileError):
        parse_endpoints_file(data)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_a_result_or_a_typed_error(data: bytes) -> None:
    with contextlib.suppress(EndpointsFileError):
        parse_endpoints_file(data)


def test_bad_parameters_name_the_field() -> None:
    def config(params: str) -> str:
        return ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
                f"plugins:\n- type: file-discovery\n  parameters: {params}\n"
                "dataLayer:\n  discovery:\n    pluginRef: file-discovery\n")

    with pytest.raises(ConfigError, match=r"parameters\.path"):
        parse_config(config("{}"))
    with pytest.raises(ConfigError, match=r"parameters\.watchFile"):
        parse_config(config("{path: /x, watchFile: 3}"))
    parsed = parse_config(config("{path: /x, watchFile: true}"))
    assert parsed.epp is not None and parsed.epp.discovery is not None
    assert parsed.epp.discovery.params == FileDiscovery("/x", True) and parsed.pool.endpoints == ()


async def test_watcher_follows_edits_and_keeps_the_last_set_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_bytes(TWO)
    seen: list[list[str]] = []
    changed = trio.Event()

    def on_endpoints(endpoints: Sequence[Endpoint]) -> None:
        seen.append(sorted(e.address for e in endpoints))
        changed.set()

    pool = PoolConfig("pool", ())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(file_discovery, str(path), True, pool, on_endpoints, interval=0.01))
        await changed.wait()
        assert seen == [["10.0.0.1:8000", "10.0.0.2:8001"]]
        path.write_bytes(b"endpoints:\n  - name: vllm-0\n    address: \"10.0.0.1")  # half-written
        await trio.sleep(0.1)
        assert len(seen) == 1
        changed = trio.Event()
        path.write_bytes(b'endpoints: [{name: c, address: "10.0.0.3", port: "9000"}]')
        await changed.wait()
        assert seen[-1] == ["10.0.0.3:9000"]
        nursery.cancel_scope.cancel()


async def test_initial_bad_entry_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_bytes(b'endpoints: [{name: a, address: "nope", port: "80"}]')
    with pytest.raises(PickerError, match="initial load failed"):
        await file_discovery(str(path), False, PoolConfig("pool", ()), lambda endpoints: None)
    with pytest.raises(PickerError, match="initial load failed"):
        await file_discovery(str(tmp_path / "missing"), False, PoolConfig("pool", ()), lambda endpoints: None)


async def test_picker_command_follows_the_file(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = await start_sims(nursery, ("127.0.0.2", "127.0.0.3"))
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(f'endpoints: [{{name: a, address: "127.0.0.2", port: "{port}"}}]')
    config = tmp_path / "picker.yaml"
    config.write_text(
        "pool: {name: pool}\n---\n"
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        f"plugins:\n- type: file-discovery\n  parameters: {{path: {endpoints}, watchFile: true}}\n"
        "dataLayer:\n  discovery:\n    pluginRef: file-discovery\n")

    async def wait_ready_pods(port: int, count: int) -> None:
        want = f'inference_pool_ready_pods{{name="pool"}} {count}.0'
        with trio.fail_after(10):
            while want not in (await trio.to_thread.run_sync(httpx.get, f"http://127.0.0.1:{port}/metrics")).text:  # noqa: ASYNC110 (another process)
                await trio.sleep(0.2)

    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await wait_ready_pods(picker.metrics, 1)
        endpoints.write_text(f'endpoints: [{{name: a, address: "127.0.0.2", port: "{port}"}},'
                             f' {{name: b, address: "127.0.0.3", port: "{port}"}}]')
        await wait_ready_pods(picker.metrics, 2)


def test_the_command_exits_with_one_line_when_the_first_load_fails(tmp_path: Path) -> None:
    """The discovery fails while the picker's servers start: the command exits (it hung before)."""
    config = tmp_path / "picker.yaml"
    missing = tmp_path / "missing.yaml"
    config.write_text("pool: {name: p}\n---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
                      f"plugins:\n- {{type: file-discovery, name: d, parameters: {{path: '{missing}'}}}}\n"
                      "- {type: queue-scorer}\ndataLayer:\n  discovery: {pluginRef: d}\n")
    done = run_cli(["--config", str(config), *EPHEMERAL_PORTS])
    assert done.returncode == 1, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "error:" in line]  # after the log lines
    assert "initial load failed" in line and "missing.yaml" in line
