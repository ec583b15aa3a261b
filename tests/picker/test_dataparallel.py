"""``data-parallel-profile-handler`` (and ``pd-profile-handler``'s ``primaryPort``): llm-d-router's
own tests, the port rewrite as an invariant, the ext_proc stream, the command's bad input, and
llm-d-router's data-parallel config on a started picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_processor import lb_metadata, request_body, request_headers, set_headers

from evergreen_trio.picker.config import Endpoint, PickerConfig, load_config, parse_config
from evergreen_trio.picker.dataparallel import DataParallelHandler
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.routing_headers import DATA_PARALLEL_HEADER, PREFILL_HEADER, at_primary_port
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import LEGIT_BODY, ext_proc, serve_fake_engine, wait_routable
from test_disagg_headers import upstream_headers

FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
RANK_0, RANK_1 = "10.0.0.1:8000", "10.0.0.1:8001"
POOL = f"pool: {{endpoints: ['{RANK_0}', '{RANK_1}', '[fd00::1]:8002']}}\n"


def _handler(parameters: str) -> object:
    text = HEAD + f"plugins:\n- {{type: data-parallel-profile-handler{parameters}}}\n- {{type: queue-scorer}}\n"
    return parse_config(text, cluster_pool="p").scheduler.handler


# -- llm-d-router's tests (profilehandler/dataparallel/dp_profile_handler_test.go) -----------------


@pytest.mark.parametrize(("parameters", "port"), [
    ("", 8000),
    (", parameters: {}", 8000),
    (", parameters: {primaryPort: 9000}", 9000),
    (", parameters: {primaryPort: 1}", 1),
    (", parameters: {primaryPort: 65535}", 65535),
])
def test_the_factory(parameters: str, port: int) -> None:
    assert _handler(parameters) == DataParallelHandler(port)


@pytest.mark.parametrize("value", ["-1", "65536", "'8000'", "true", "0", "8000.5"])
def test_a_bad_primary_port_names_the_field(value: str) -> None:
    """0 too: the reference takes it, and sends every request to port 0."""
    with pytest.raises(ConfigError) as caught:
        _handler(f", parameters: {{primaryPort: {value}}}")
    assert caught.value.field == f"{P}.primaryPort", caught.value


def test_exactly_one_profile_is_checked_at_startup() -> None:
    """The reference fails each request with two profiles (its Pick logs an error); we fail the config."""
    text = HEAD + """plugins:
- {type: data-parallel-profile-handler}
- {type: queue-scorer}
schedulingProfiles:
- {name: profile1, plugins: [{pluginRef: queue-scorer}]}
- {name: profile2, plugins: [{pluginRef: queue-scorer}]}
"""
    with pytest.raises(ConfigError, match=r"one profile \(the data-parallel-profile-handler\)") as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == "EndpointPickerConfig.schedulingProfiles"


def _scheduler(handler: str, count_profiles: str = "") -> tuple[PickerConfig, Scheduler]:
    config = parse_config(POOL + HEAD + f"plugins:\n- {handler}\n- {{type: queue-scorer}}\n{count_profiles}")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, waiting in zip(config.pool.endpoints, (3, 0, 6), strict=True):
        snapshot.update(endpoint.address, EndpointMetrics(waiting=waiting))
    return config, Scheduler(config, snapshot, random.Random(1))


def test_the_port_is_rewritten_and_the_header_names_the_picked_rank() -> None:
    _, scheduler = _scheduler("{type: data-parallel-profile-handler, parameters: {primaryPort: 9000}}")
    schedule = scheduler.schedule(PickRequest("m", 0))
    assert schedule.endpoints == [RANK_1]  # the bookkeeping keeps the rank
    assert schedule.destinations == ["10.0.0.1:9000"]
    assert schedule.request_headers == {DATA_PARALLEL_HEADER: RANK_1}
    several = scheduler.schedule(PickRequest("m", 0), 3)  # every target endpoint's port, as the reference's
    assert several.destinations == ["10.0.0.1:9000", "10.0.0.1:9000", "[fd00::1]:9000"]
    assert several.request_headers == {DATA_PARALLEL_HEADER: RANK_1}


def test_the_one_profile_runs_by_any_name() -> None:
    _, scheduler = _scheduler("{type: data-parallel-profile-handler}",
                              "schedulingProfiles: [{name: dp-profile, plugins: [{pluginRef: queue-scorer}]}]\n")
    schedule = scheduler.schedule(PickRequest("m", 0))
    assert schedule.profiles == {"dp-profile": [RANK_1]} and schedule.destinations == ["10.0.0.1:8000"]


@given(st.lists(st.builds(Endpoint, st.sampled_from(["10.0.0.1", "fd00::1", "pod.example", "::"]),
                          st.integers(1, 65535)), min_size=1, max_size=4), st.integers(1, 65535))
def test_at_primary_port_keeps_each_host_and_names_the_first_pick(picked: list[Endpoint], port: int) -> None:
    headers: dict[str, str] = {}
    rewritten = at_primary_port([e.address for e in picked], port, headers)
    assert rewritten == [Endpoint(e.host, port).address for e in picked]
    assert headers == {DATA_PARALLEL_HEADER: picked[0].address}


def test_the_type_is_implemented_beta_and_deprecated_for_the_single_profile_handler(
        caplog: pytest.LogCaptureFixture) -> None:
    kind = "data-parallel-profile-handler"
    assert kind not in ALPHA_TYPES
    assert PLUGIN_TYPES[kind].category is Category.PROFILE_HANDLER
    with caplog.at_level(logging.WARNING):
        load_config(FIXTURES / "dp-epp-config.yaml", cluster_pool="pool")
    assert "plugin type 'data-parallel-profile-handler' (use 'single-profile-handler')" in caplog.text


# -- pd-profile-handler's primaryPort -----------------------------------------------------------


def test_pd_profile_handler_primary_port_rewrites_the_decode_pick(caplog: pytest.LogCaptureFixture) -> None:
    """As the reference's ProcessResults: the decode result at the primary port, the header naming
    the decode rank; the prefill header (from the headers handler) keeps the prefill pod's port."""
    text = """pool:
  endpoints:
  - {address: '10.0.1.1:8001', labels: {llm-d.ai/role: prefill}}
  - {address: '10.0.1.2:8003', labels: {llm-d.ai/role: decode}}
""" + HEAD + """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: always-disagg-pd-decider}
- {type: pd-profile-handler, parameters: {primaryPort: 8000, deciderPluginName: always-disagg-pd-decider}}
- {type: prefill-header-handler}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
- {name: decode, plugins: [{pluginRef: decode-filter}]}
"""
    with caplog.at_level(logging.WARNING):
        config = parse_config(text)
    assert "parameters.primaryPort (use none: Istio >= 1.28.1 needs no primaryPort)" in caplog.text
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    schedule = Scheduler(config, snapshot, random.Random(1)).schedule(PickRequest("m", 0))
    assert schedule.endpoints == ["10.0.1.2:8003"] and schedule.destinations == ["10.0.1.2:8000"]
    assert schedule.request_headers == {DATA_PARALLEL_HEADER: "10.0.1.2:8003", PREFILL_HEADER: "10.0.1.1:8001"}


# -- the ext_proc stream ------------------------------------------------------------------------


def test_the_stream_routes_to_the_primary_port_and_a_forged_header_is_replaced() -> None:
    config, scheduler = _scheduler("{type: data-parallel-profile-handler}")
    picker = Picker(config, scheduler.snapshot, rng=random.Random(2))
    stream = picker.new_stream()
    assert stream.on_message(request_headers(extra=[(DATA_PARALLEL_HEADER, "6.6.6.6:80")])) == []
    reply = stream.on_message(request_body(json.dumps({"model": "m", "prompt": "hi"}).encode()))[0]
    mutation = reply.request_headers.response.header_mutation
    assert set_headers(mutation)[DESTINATION] == "10.0.0.1:8000" == lb_metadata(reply)[DESTINATION]
    assert set_headers(mutation)[DATA_PARALLEL_HEADER] == RANK_1
    assert DATA_PARALLEL_HEADER not in mutation.remove_headers


# -- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize(("plugins", "field"), [
    ("[{type: data-parallel-profile-handler, parameters: {primaryPort: -1}}]", f"{P}.primaryPort"),
    ("[{type: data-parallel-profile-handler, parameters: {primaryPort: 65536}}]", f"{P}.primaryPort"),
    ("[{type: data-parallel-profile-handler, parameters: {primaryPort: '8000'}}]", f"{P}.primaryPort"),
    ("[{type: data-parallel-profile-handler, parameters: {primaryPort: 0}}]", f"{P}.primaryPort"),
    ("[{type: data-parallel-profile-handler, parameters: {port: 8000}}]", f"{P}.port"),
    ("[{type: data-parallel-profile-handler}, {type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: "
     "[{pluginRef: queue-scorer}]}, {name: b, plugins: [{pluginRef: queue-scorer}]}]",
     "EndpointPickerConfig.schedulingProfiles"),
    ("[{type: pd-profile-handler, parameters: {primaryPort: 65536}}]", f"{P}.primaryPort"),
])
def test_each_bad_input_is_one_line_and_exit_2_from_the_command(plugins: str, field: str) -> None:
    result = run_cli(["--pool-name", "p", "--config-text", HEAD + f"plugins: {plugins}\n"])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{field}: expected" in line, line


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


async def test_a_started_picker_runs_the_references_data_parallel_config(nursery: trio.Nursery,
                                                                        tmp_path: Path) -> None:
    ranks = [f"127.0.0.1:{await nursery.start(serve_fake_engine, waiting)}" for waiting in (4, 0)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: dp, endpoints: {ranks}}}\n---\n" + (FIXTURES / "dp-epp-config.yaml").read_text())
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await wait_routable(picker.grpc)
        answer = await trio.to_thread.run_sync(ext_proc, picker.grpc, LEGIT_BODY)
        assert (answer.status, answer.endpoint) == (200, "127.0.0.1:8000")  # the primary port, in envoy.lb
        forged = [(DATA_PARALLEL_HEADER, "6.6.6.6:80")]
        for _ in range(4):
            headers = await trio.to_thread.run_sync(upstream_headers, picker.grpc, "hi", forged)
            assert headers[DESTINATION] == "127.0.0.1:8000" and headers[DATA_PARALLEL_HEADER] in ranks
