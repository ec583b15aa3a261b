"""``dcgm-data-source`` and ``dcgm-extractor``: llm-d-router's test tables over DCGM exporter pages,
invariants, the poll against a stand-in exporter, the command's bad input, and a started picker
routing by GPU utilization, driven by grpcio as Envoy.

No real DCGM exporter runs here: :func:`dcgm_page` writes what dcgm-exporter serves (its metric
names, ``# HELP``/``# TYPE`` lines and label layout: ``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``, and ``container``/``namespace``/``pod`` with ``DCGM_EXPORTER_KUBERNETES=true``),
and our side reads it with its real Prometheus text parser."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from picker_fakes import Body, PolledServer

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.dcgm import GPU_UTILIZATION_KEY, DcgmSource, gpu_utilization
from evergreen_trio.picker.dcgm_poll import exporter_address
from evergreen_trio.picker.engine_metrics import MAX_METRICS_BYTES
from evergreen_trio.picker.errors import MetricsError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES
from evergreen_trio.picker.runtime import Scrapers
from evergreen_trio.picker.scheduler import PoolSnapshot

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import LEGIT_BODY, ext_proc, wait_routable

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
UTIL = "DCGM_FI_DEV_GPU_UTIL"


def dcgm_page(samples: list[tuple[str, float]], *, util_type: str = "gauge") -> str:
    """A dcgm-exporter page: per GPU (its pod, utilization %) the real families around GPU_UTIL."""
    families = [("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", 1980),
                ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", 41),
                (UTIL, util_type, "GPU utilization (in %).", None),
                ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", 70111),
                ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.", 0.42)]
    lines = []
    for name, kind, help_text, fixed in families:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for gpu, (pod, value) in enumerate(samples):
            labels = (f'gpu="{gpu}",UUID="GPU-5c2a1f6e-9d3b-4c1e-8a7f-{gpu:012d}",device="nvidia{gpu}",'
                      f'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="550.54.15"')
            if pod:
                labels += f',container="vllm",namespace="default",pod="{pod}"'
            lines.append(f"{name}{{{labels}}} {value if fixed is None else fixed}")
    return "\n".join(lines) + "\n"


# -- llm-d-router's tests (extractor/dcgm/extractor_test.go) --------------------------------------


@pytest.mark.parametrize(("samples", "pod", "expected"), [
    ([("", 73)], "", 0.73),  # single GPU
    ([("", 73), ("", 81), ("", 65)], "", 0.81),  # multi-GPU takes max
    ([("vllm-pod-1", 25), ("vllm-pod-2", 80), ("vllm-pod-3", 10)], "vllm-pod-2", 0.80),  # DaemonSet: by pod label
    ([("vllm-pod-1", 40), ("vllm-pod-1", 70), ("vllm-pod-2", 99)], "vllm-pod-1", 0.70),  # same pod: max
    ([("", 55)], "vllm-pod-1", 0.55),  # unlabelled samples kept when the pod is known (sidecar)
    ([("vllm-pod-1", 25), ("vllm-pod-2", 80)], "", 0.80),  # the pod unknown: every sample counts
    ([("", -5)], "", 0.0),  # Go's max starts at 0
])
def test_the_extractor_reads_the_pods_highest_gpu(samples: list[tuple[str, float]], pod: str,
                                                   expected: float) -> None:
    assert math.isclose(gpu_utilization(dcgm_page(samples), pod), expected)


@pytest.mark.parametrize(("text", "pod", "message"), [
    ("", "", f"metric '{UTIL}' not found"),  # missing metric
    (dcgm_page([]), "", "has no samples"),  # empty samples
    (dcgm_page([("vllm-pod-1", 50)]), "missing-pod", "missing-pod"),  # no matching pod label
    (dcgm_page([("", 50)], util_type="counter"), "", "expected gauge"),
    (dcgm_page([("", 50)]).replace(f"# TYPE {UTIL} gauge\n", ""), "", "expected gauge"),  # untyped
    (f"{UTIL}{{gpu=0}} 1\n", "", "Prometheus text format"),
    ("x" * (MAX_METRICS_BYTES + 1), "", "bytes of DCGM metrics"),
])
def test_a_page_without_the_pods_utilization_is_an_error(text: str, pod: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        gpu_utilization(text, pod)


def test_a_big_page_is_scanned_not_parsed_whole() -> None:
    """Only the utilization lines reach the parser: a page of 100,000 other series costs a line scan."""
    other = "".join(f'DCGM_FI_DEV_XID_ERRORS{{gpu="{i}"}} 0\n' for i in range(100_000))
    assert gpu_utilization(other + dcgm_page([("", 12)])) == 0.12


@given(st.lists(st.tuples(st.sampled_from(["", "a", "b"]), st.integers(0, 100)), min_size=1, max_size=8),
       st.sampled_from(["", "a", "b"]))
def test_the_value_is_the_pods_max_over_100(samples: list[tuple[str, int]], pod: str) -> None:
    counted = [value for owner, value in samples if not pod or not owner or owner == pod]
    if not counted:
        with pytest.raises(MetricsError):
            gpu_utilization(dcgm_page(samples), pod)
        return
    value = gpu_utilization(dcgm_page(samples), pod)
    assert 0.0 <= value <= 1.0 and math.isclose(value, max(counted) / 100)


@given(st.text(max_size=300))
def test_any_text_is_a_value_or_a_metrics_error(text: str) -> None:
    with contextlib.suppress(MetricsError):
        assert isinstance(gpu_utilization(f"# TYPE {UTIL} gauge\n" + text), float)


# -- the source's parameters (source/dcgm/datasource_test.go) ------------------------------------


def _source(parameters: str) -> object:
    config = parse_config(HEAD + f"plugins:\n- {{type: dcgm-data-source, name: s, parameters: {{{parameters}}}}}\n",
                          cluster_pool="pool")
    return config.epp.plugins["s"].params if config.epp is not None else None


def test_source_defaults_and_custom_parameters() -> None:
    assert _source("") == DcgmSource("/metrics", 9400, False, None)
    assert _source("scheme: http, path: /gpu, port: 9500, insecureSkipVerify: false, useNodeAddress: true, "
                   "interval: 1s") == DcgmSource("/gpu", 9500, True, 1.0)


@pytest.mark.parametrize(("parameters", "field"), [
    ("{scheme: grpc}", "scheme"),
    ("{scheme: https, insecureSkipVerify: 1}", "insecureSkipVerify"),
    ("{bogus: value}", "bogus"),
    ("{port: 70000}", "port"),
    ("{port: '9400'}", "port"),
    ("{port: 0, useNodeAddress: true}", "port"),
    ("{useNodeAddress: 1}", "useNodeAddress"),
    ("{path: metrics}", "path"),
    ("{interval: soon}", "interval"),
])
def test_each_bad_parameter_is_one_line_and_exit_2(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: dcgm-data-source, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"EndpointPickerConfig.plugins[0].parameters.{field}: expected" in line, line


def test_the_extractor_takes_no_parameters_and_reads_only_a_dcgm_source() -> None:
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text",
                      HEAD + "plugins:\n- {type: dcgm-extractor, parameters: {metric: x}}\n"])
    assert result.returncode == 2 and "parameters.metric: expected" in result.stderr
    text = HEAD + ("plugins:\n- {type: metrics-data-source}\n- {type: dcgm-extractor}\n"
                   "dataLayer: {sources: [{pluginRef: metrics-data-source,\n"
                   "                       extractors: [{pluginRef: dcgm-extractor}]}]}\n")
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2 and "extractors[0].pluginRef: expected an extractor of metrics-data-source" \
        in result.stderr


def test_both_types_are_implemented_alpha_types() -> None:
    for name in ("dcgm-data-source", "dcgm-extractor"):
        assert name in PLUGIN_TYPES and name in ALPHA_TYPES
    result = run_cli(["--pool-name", "p", "--config-text", HEAD + "plugins:\n- {type: dcgm-extractor}\n"])
    assert result.returncode == 2 and "dcgm-extractor" in result.stderr


def test_where_the_exporter_is_scraped() -> None:
    pool = parse_config("pool: {name: p, endpoints: ['10.0.0.1:8000']}\n").pool
    pod = Endpoint("10.0.0.1", 8000, node_address="192.168.0.9")
    assert exporter_address(pod, DcgmSource(), pool).address == "10.0.0.1:9400"  # sidecar
    assert exporter_address(pod, DcgmSource(use_node_address=True), pool).address == "192.168.0.9:9400"
    assert exporter_address(Endpoint("10.0.0.1", 8000), DcgmSource(use_node_address=True),
                            pool).address == "10.0.0.1:9400"  # the node unknown: the pod
    assert exporter_address(pod, DcgmSource(port=0), pool).address == "10.0.0.1:8000"


# -- the poll, against a stand-in exporter --------------------------------------------------------


def gpu_node(page: Body | tuple[int, Body]) -> PolledServer:
    """A model server whose ``/dcgm`` is a dcgm-exporter page (a text, or an HTTP status and a body)."""
    return PolledServer("/dcgm", page, "text/plain; version=0.0.4")


PLUGINS = """plugins:
- {type: dcgm-data-source, name: gpus, parameters: {port: 0, path: /dcgm, interval: 20ms}}
- {type: dcgm-extractor}
"""
LAYER = "dataLayer: {sources: [{pluginRef: gpus, extractors: [{pluginRef: dcgm-extractor}]}]}\n"
WIRED = PLUGINS + LAYER


async def test_the_poll_publishes_the_attribute_and_a_bad_page_keeps_it_and_the_endpoint_serving(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    node = gpu_node(dcgm_page([("", 30), ("", 64)]))
    port = await nursery.start(node.serve)
    config = parse_config(f"pool: {{endpoints: ['127.0.0.1:{port}'], scrapeTimeout: 200ms}}\n---\n" + HEAD + WIRED)
    assert config.pool.dcgm_sources == (DcgmSource("/dcgm", 0, False, 0.02),)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, trio.current_time)
    scrapers = Scrapers(nursery, config, snapshot, lambda: None)
    scrapers.sync(config.pool.endpoints)
    await node.next_polls(2)
    state = snapshot.states[f"127.0.0.1:{port}"]
    assert state.attributes == {GPU_UTILIZATION_KEY: 0.64}
    caplog.set_level(logging.DEBUG, "evergreen_trio.picker.dcgm_poll")
    bad_pages = ((500, "oops"), "garbage{{\n", dcgm_page([("", 99)], util_type="counter"),
                 "y" * (MAX_METRICS_BYTES + 1))
    for page in bad_pages:
        caplog.clear()
        node.answer = page
        await node.next_polls(3)
        await trio.sleep(0.05)
        assert state.attributes == {GPU_UTILIZATION_KEY: 0.64} and state.ready
        failures = [r for r in caplog.records if "dcgm_poll_failed" in r.getMessage()]
        assert [r.levelno for r in failures][:1] == [logging.WARNING] and len(failures) >= 2
        assert all(r.levelno == logging.DEBUG for r in failures[1:]) and "\n" not in failures[0].getMessage()
        node.answer = dcgm_page([("", 64)])  # recovered: the next failure warns again
        await node.next_polls(2)
    scrapers.sync(())
    polls = node.polls
    await trio.sleep(0.1)
    assert node.polls == polls  # the endpoint is gone: so is its poll


# -- a started picker, grpcio as Envoy ----------------------------------------------------------

ROUTING = PLUGINS + """- type: endpoint-attribute-filter
  name: cool-enough
  parameters: {attribute: GPUUtilization, producer: dcgm-extractor, onMissing: Fail,
               algorithm: {type: threshold, threshold: {operator: LessThanOrEqual, value: 0.9}}}
- type: endpoint-attribute-scorer
  name: coolest
  parameters: {attributeKey: GPUUtilization, producer: dcgm-extractor,
               algorithm: {type: linear_lower_is_better, normalization: {fixedRange: {min: 0, max: 1}}}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: cool-enough}, {pluginRef: coolest}]}
""" + LAYER


async def test_a_started_picker_routes_to_the_coolest_gpu(nursery: trio.Nursery, tmp_path: Path) -> None:
    nodes = [gpu_node(dcgm_page([("", util)])) for util in (95, 40, 70)] + [gpu_node((404, "no exporter"))]
    hot, cool, warm, bare = [f"127.0.0.1:{await nursery.start(node.serve)}" for node in nodes]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: gpu, endpoints: ['{hot}', '{cool}', '{warm}', '{bare}']}}\n---\n"
                      + HEAD + ROUTING)
    args = ["--config", str(config), "--allow-experimental-plugins=true", "--refresh-metrics-interval", "50ms",
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await wait_routable(picker.grpc)
        with trio.fail_after(10):  # until every exporter's first poll is in: then only the cool one wins
            while (await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)).endpoint != cool:  # noqa: ASYNC110
                await trio.sleep(0.05)
        for _ in range(5):
            answer = await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)
            assert (answer.status, answer.endpoint) == (200, cool)
        nodes[1].answer = dcgm_page([("", 97)])  # the cool one heats up: the warm one is left
        with trio.fail_after(10):
            while (await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)).endpoint != warm:  # noqa: ASYNC110
                await trio.sleep(0.05)
