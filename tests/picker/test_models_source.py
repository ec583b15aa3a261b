"""``models-data-source`` and ``models-data-extractor``: llm-d-router's golden bodies and extractor
cases, Go's decoding rules, hostile bodies (fuzzed too), the config and its dataLayer wiring, the
command's bad input, and the poll loop against a real model server, in a running picker that keeps
routing whatever ``/v1/models`` answers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import run_cli
from picker_fakes import Body, PolledServer

from evergreen_trio.picker.config import PickerConfig, parse_config
from evergreen_trio.picker.errors import ConfigError, ModelsError
from evergreen_trio.picker.models_source import MAX_MODELS, MAX_MODELS_BYTES, ModelData, ModelsSource, parse_models
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.runtime import PickerPorts, Scrapers, run_picker
from evergreen_trio.picker.scheduler import PoolSnapshot

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
WIRED = """plugins:
- {type: models-data-source, name: models, parameters: %s}
- {type: models-data-extractor, name: extract}
- {type: queue-scorer}
dataLayer:
  sources:
  - {pluginRef: models, extractors: [{pluginRef: extract}]}
"""
VLLM_MODELS = json.dumps({"object": "list", "data": [
    {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "created": 1735689600, "owned_by": "vllm",
     "root": "meta-llama/Llama-3.1-8B-Instruct", "parent": None, "max_model_len": 131072,
     "permission": [{"id": "modelperm-1", "object": "model_permission", "allow_sampling": True}]},
    {"id": "food-review", "object": "model", "created": 1735689601, "owned_by": "vllm",
     "root": "/adapters/food-review", "parent": "meta-llama/Llama-3.1-8B-Instruct", "max_model_len": None,
     "permission": []},
]}).encode()


# -- llm-d-router's golden bodies and extractor cases ---------------------------------------------


@pytest.mark.parametrize(("body", "ids"), [
    (b'{"object":"list","data":[]}', []),
    (b'{"object":"list","data":[{"id":"qwen2.5-7b"}]}', ["qwen2.5-7b"]),
    (b'{"object":"list","data":[{"id":"a","parent":"a"},{"id":"b"}]}', ["a", "b"]),
    (b"{}", []),  # the extractor's "empty ModelsResponse"
])
def test_the_references_golden_bodies(body: bytes, ids: list[str]) -> None:
    assert [m.id for m in parse_models(body)] == ids


def test_a_vllm_answer_with_a_lora_adapter() -> None:
    assert parse_models(VLLM_MODELS) == (
        ModelData("meta-llama/Llama-3.1-8B-Instruct", "model", 1735689600, "vllm", ""),
        ModelData("food-review", "model", 1735689601, "vllm", "meta-llama/Llama-3.1-8B-Instruct"))


# -- Go's encoding/json rules ---------------------------------------------------------------------


def test_member_names_fold_the_last_one_wins_nulls_are_zero_values_and_other_members_are_ignored() -> None:
    body = b'{"OBJECT":"list","Data":[{"Id":"a","ID":"b","Owned_By":"me","extra":{"x":[1]}},null,{"parent":null}]}'
    assert parse_models(body) == (ModelData("b", owned_by="me"), ModelData(""), ModelData(""))
    assert parse_models(b"null") == parse_models(b' \n null\t') == ()  # Go decodes null into the zero response
    assert parse_models(b'{"data":null}') == ()
    assert parse_models(b'{"data":[{"id":"caf\xc3\xa9 \xff \\ud800"}]}') == (ModelData("caf\u00e9 \ufffd \ufffd"),)


@pytest.mark.parametrize("body", [
    b'{"data":[{"id":3}]}',  # a member of the wrong JSON type fails the whole body
    b'{"object":["list"]}',
    b'{"data":{"id":"a"}}',
    b'{"data":[{"created":1.5}]}',  # int64: no fraction, no exponent, in range
    b'{"data":[{"created":1e3}]}',
    b'{"data":[{"created":9223372036854775808}]}',
    b'{"data":[{"created":NaN}]}',
    b'[{"id":"a"}]',
    b'"models"',
    b"",
    b"<html>502 Bad Gateway</html>",
    b'{"data":[' + b"[" * 100_000 + b"]" * 100_000 + b"]}",  # nested too deeply
])
def test_a_body_that_does_not_decode_is_one_models_error(body: bytes) -> None:
    with pytest.raises(ModelsError, match="expected a /v1/models JSON object"):
        parse_models(body)


def test_the_hostile_input_bounds() -> None:
    at_cap = json.dumps({"data": [{"id": str(i)} for i in range(MAX_MODELS)]}).encode()
    assert len(parse_models(at_cap)) == MAX_MODELS
    with pytest.raises(ModelsError, match=f"at most {MAX_MODELS} models"):
        parse_models(json.dumps({"data": [{} for _ in range(MAX_MODELS + 1)]}).encode())
    with pytest.raises(ModelsError, match=f"at most {MAX_MODELS_BYTES} bytes"):
        parse_models(b'{"data":[{"id":"' + b"x" * MAX_MODELS_BYTES + b'"}]}')


@given(st.binary(max_size=600) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["data", "id", "object", "created", "owned_by", "parent", "x"]), inner, max_size=4),
    max_leaves=20).map(lambda doc: json.dumps(doc).encode()))
def test_any_body_is_a_list_of_models_or_a_models_error(body: bytes) -> None:
    try:
        models = parse_models(body)
    except ModelsError:
        return
    assert all(isinstance(m.id, str) and isinstance(m.created, int) for m in models) and len(models) <= MAX_MODELS


# -- the config ---------------------------------------------------------------------------------


def _pool(parameters: str = "{}", layer: str | None = None) -> PickerConfig:
    text = HEAD + WIRED % parameters
    if layer is not None:
        text = text.split("dataLayer:")[0] + layer
    return parse_config("pool: {endpoints: ['10.0.0.1:8000']}\n---\n" + text)


def test_both_types_are_implemented_beta_data_layer_plugins() -> None:
    for kind, category in (("models-data-source", Category.DATA_SOURCE),
                           ("models-data-extractor", Category.EXTRACTOR)):
        assert kind not in ALPHA_TYPES
        assert PLUGIN_TYPES[kind].category is category


def test_the_defaults_and_parameters() -> None:
    assert _pool().pool.models_sources == (ModelsSource("/v1/models", None),)
    custom = _pool("{scheme: http, path: /models, insecureSkipVerify: false, interval: 5s}")
    assert custom.pool.models_sources == (ModelsSource("/models", 5.0),)


def test_only_a_source_wired_to_a_models_extractor_is_polled() -> None:
    assert _pool(layer="").pool.models_sources == ()  # declared, not listed
    assert _pool(layer="dataLayer: {sources: [{pluginRef: models}]}\n").pool.models_sources == ()


@pytest.mark.parametrize(("layer", "field"), [
    ("dataLayer: {sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: extract}]}]}\n",
     "EndpointPickerConfig.dataLayer.sources[0].extractors[0].pluginRef"),
    ("dataLayer: {sources: [{pluginRef: extract}]}\n", "EndpointPickerConfig.dataLayer.sources[0].pluginRef"),
])
def test_a_mismatched_wiring_names_the_field(layer: str, field: str) -> None:
    text = HEAD + (WIRED % "{}").split("dataLayer:")[0] + "- {type: metrics-data-source}\n" + layer
    with pytest.raises(ConfigError) as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == field, caught.value


def test_a_core_extractor_under_a_models_source_is_refused_as_the_reference_refuses_it() -> None:
    text = HEAD + "plugins:\n- {type: models-data-source, name: models}\n- {type: core-metrics-extractor}\n" \
                  "dataLayer: {sources: [{pluginRef: models, extractors: [{pluginRef: core-metrics-extractor}]}]}\n"
    with pytest.raises(ConfigError, match="an extractor of models-data-source's data") as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == "EndpointPickerConfig.dataLayer.sources[0].extractors[0].pluginRef"


@pytest.mark.parametrize(("parameters", "field"), [
    ("{scheme: https, insecureSkipVerify: 'no'}", "insecureSkipVerify"),
    ("{scheme: ftp}", "scheme"),
    ("{path: v1/models}", "path"),
    ("{path: 7}", "path"),
    ("{insecureSkipVerify: 'no'}", "insecureSkipVerify"),
    ("{caCertPath: /ca.pem}", "caCertPath"),
    ("{clientCertPath: /c.pem}", "clientCertPath"),
    ("{clientKeyPath: /k.pem}", "clientKeyPath"),
    ("{interval: soon}", "interval"),
    ("{interval: 0s}", "interval"),
    ("{timeout: 1s}", "timeout"),
])
def test_each_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    result = run_cli(["--pool-name", "p", "--config-text", HEAD + WIRED % parameters])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line


def test_the_extractor_takes_no_parameters_from_the_command() -> None:
    text = HEAD + "plugins: [{type: models-data-extractor, parameters: {key: /v1/models}}]\n"
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.key: expected a models-data-extractor parameter (none)" in line, line


# -- the poll loop against a real model server --------------------------------------------------


def test_set_models_reports_a_change_and_ignores_an_unknown_endpoint() -> None:
    config = _pool()
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    (address,) = snapshot.states
    assert snapshot.states[address].models is None
    assert snapshot.set_models(address, ()) and not snapshot.set_models(address, ())
    assert snapshot.set_models(address, (ModelData("a"),)) and snapshot.states[address].models == (ModelData("a"),)
    assert not snapshot.set_models("10.9.9.9:1", (ModelData("a"),))


def model_server(models: Body | tuple[int, Body] | None = VLLM_MODELS) -> PolledServer:
    """A model server whose ``/v1/models`` answers ``models``: a body, an HTTP status and a body, or None
    to never answer."""
    return PolledServer("/v1/models", models, "application/json")


async def _scraping(nursery: trio.Nursery, server: PolledServer, parameters: str = "{interval: 20ms}",
                    ) -> tuple[PoolSnapshot, str, Callable[[], None]]:
    port = await nursery.start(server.serve)
    config = parse_config(f"pool: {{endpoints: ['127.0.0.1:{port}'], scrapeTimeout: 200ms}}\n---\n"
                          + HEAD + WIRED % parameters)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, trio.current_time)
    scrapers = Scrapers(nursery, config, snapshot, lambda: None)
    scrapers.sync(config.pool.endpoints)
    return snapshot, f"127.0.0.1:{port}", lambda: scrapers.sync(())


async def test_the_models_are_kept_on_the_endpoint_and_a_bad_answer_keeps_them_and_the_endpoint_ready(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    server = model_server()
    snapshot, address, stop = await _scraping(nursery, server)
    await server.next_polls(2)
    state = snapshot.states[address]
    assert [m.id for m in state.models or ()] == ["meta-llama/Llama-3.1-8B-Instruct", "food-review"]
    assert state.ready
    caplog.set_level(logging.DEBUG, "evergreen_trio.picker.models_poll")
    for answer in (b'{"data":[{"id":7}]}', (503, b"busy"), b"x" * (MAX_MODELS_BYTES + 1)):
        caplog.clear()
        server.answer = answer
        await server.next_polls(3)
        await trio.sleep(0.05)  # the last poll's answer is read
        assert [m.id for m in state.models or ()] == ["meta-llama/Llama-3.1-8B-Instruct", "food-review"]
        assert state.ready
        failures = [r for r in caplog.records if "models_poll_failed" in r.getMessage()]
        assert [r.levelno for r in failures][:1] == [logging.WARNING] and len(failures) >= 2
        assert all(r.levelno == logging.DEBUG for r in failures[1:]) and "\n" not in failures[0].getMessage()
        server.answer = b'{"data":[]}'  # recovered: the next failure warns again
        await server.next_polls(2)
        await trio.sleep(0.05)
        assert state.models == ()
        server.answer = VLLM_MODELS
        await server.next_polls(2)
        await trio.sleep(0.05)
    stop()
    await trio.sleep(0.1)  # a poll already sent when the endpoint went is still answered (a loaded machine)
    polls = server.polls
    await trio.sleep(0.2)
    assert server.polls == polls  # the endpoint is gone: so is its poll


async def test_a_server_that_never_answers_times_out_and_polls_again(nursery: trio.Nursery) -> None:
    server = model_server(models=None)
    snapshot, address, stop = await _scraping(nursery, server)
    await server.next_polls(2)  # the first timed out (scrapeTimeout 200 ms): another came
    assert snapshot.states[address].models is None and snapshot.states[address].ready
    stop()


async def test_a_running_picker_routes_while_models_answers_badly(nursery: trio.Nursery,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The plugin does not touch the request path: a picker polling garbage routes as before."""
    from test_disagg_headers import upstream_headers

    server = model_server(models=b"\x00garbage")
    port = await nursery.start(server.serve)
    config = parse_config(f"pool: {{name: m, endpoints: ['127.0.0.1:{port}']}}\n---\n" + HEAD + WIRED % "{}")
    ports: PickerPorts = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0))
    await server.next_polls(3)
    headers = await trio.to_thread.run_sync(upstream_headers, ports.grpc, "hi", [])
    assert headers["x-gateway-destination-endpoint"] == f"127.0.0.1:{port}"
    warnings = [r for r in caplog.records if "models_poll_failed" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1
