"""``disagg-headers-handler`` and ``prefill-header-handler`` (deprecated in llm-d-router, Beta):
its own tests of the P/D headers, the order the setters run in, the ext_proc stream's headers, the
command's bad input, and llm-d-router's e2e P/D config on a started picker driven by grpcio."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import grpc
import pytest
import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_processor import request_body, request_headers, set_headers

from evergreen_trio.picker.config import Endpoint, PickerConfig, load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.routing_headers import (
    DATA_PARALLEL_HEADER,
    ENCODERS_HEADER,
    PREFILL_HEADER,
    DisaggHeaders,
)
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import PROCESS, serve_fake_engine

FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
ADDR, ADDR_2, IPV6 = "10.0.0.5:8000", "10.0.0.6:8000", Endpoint("fd00::1", 8000).address
HANDLER = DisaggHeaders()


def _declared(plugin: str) -> object:
    config = parse_config(HEAD + f"plugins:\n- {plugin}\n- {{type: queue-scorer}}\n", cluster_pool="p")
    assert config.epp is not None
    return next(iter(config.epp.plugins.values())).params


# -- llm-d-router's tests (profilehandler/disagg/disagg_headers_handler_test.go) -------------------


@pytest.mark.parametrize(("parameters", "expected"), [
    ("", DisaggHeaders("prefill", "encode")),
    (", parameters: {prefillProfile: my-prefill}", DisaggHeaders("my-prefill", "encode")),
    (", parameters: {encodeProfile: my-encode}", DisaggHeaders("prefill", "my-encode")),
    (", parameters: {prefillProfile: '', encodeProfile: ''}", DisaggHeaders("", "")),  # names no profile
])
def test_the_factory(parameters: str, expected: DisaggHeaders) -> None:
    assert _declared(f"{{type: disagg-headers-handler, name: my-handler{parameters}}}") == expected


def test_prefill_header_handler_is_the_same_plugin_and_both_are_deprecated(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert _declared("{type: prefill-header-handler, parameters: {prefillProfile: prefill}}") == HANDLER
        assert _declared("{type: disagg-headers-handler}") == HANDLER
    deprecations = [r.getMessage() for r in caplog.records if "config_deprecated" in r.getMessage()]
    assert deprecations == ["picker.config_deprecated plugin type 'prefill-header-handler' "
                            "(use 'disagg-profile-handler')",
                            "picker.config_deprecated plugin type 'disagg-headers-handler' "
                            "(use 'disagg-profile-handler')"]
    headers: dict[str, str] = {}
    assert HANDLER.apply({"decode": [ADDR_2], "prefill": [ADDR]}, headers) == ADDR
    assert headers == {PREFILL_HEADER: ADDR}  # a P/D-only result: no encode header


@pytest.mark.parametrize(("profiles", "stale", "expected"), [
    ({"decode": [ADDR_2], "prefill": [ADDR]}, {}, {PREFILL_HEADER: ADDR}),
    ({"decode": [ADDR_2]}, {}, {}),  # the prefill profile did not run
    ({"prefill": [ADDR]}, {PREFILL_HEADER: "old-host:9999"}, {PREFILL_HEADER: ADDR}),  # replaced
    ({}, {PREFILL_HEADER: "stale-host:9999"}, {}),  # cleared
    ({"prefill": []}, {}, {}),  # ran and picked none
    ({"prefill": [IPV6]}, {}, {PREFILL_HEADER: "[fd00::1]:8000"}),
    ({"encode": [ADDR]}, {}, {ENCODERS_HEADER: ADDR}),
    ({"encode": [ADDR]}, {ENCODERS_HEADER: "old-host:9999"}, {ENCODERS_HEADER: ADDR}),
    ({}, {ENCODERS_HEADER: "stale-host:9999"}, {}),
    ({"encode": []}, {ENCODERS_HEADER: "stale-host:9999"}, {}),
    ({"encode": [IPV6]}, {}, {ENCODERS_HEADER: "[fd00::1]:8000"}),
    ({"encode": [ADDR, ADDR_2]}, {}, {ENCODERS_HEADER: f"{ADDR},{ADDR_2}"}),
    ({"prefill": [ADDR], "encode": [ADDR_2]}, {}, {PREFILL_HEADER: ADDR, ENCODERS_HEADER: ADDR_2}),
])
def test_pre_request(profiles: dict[str, list[str]], stale: dict[str, str], expected: dict[str, str]) -> None:
    headers = dict(stale)
    prefill = HANDLER.apply(profiles, headers)
    assert headers == expected and prefill == expected.get(PREFILL_HEADER)


def test_custom_profile_names() -> None:
    headers: dict[str, str] = {}
    custom = DisaggHeaders("my-custom-prefill", "my-custom-encode")
    custom.apply({"my-custom-prefill": [ADDR], "my-custom-encode": [ADDR_2], "prefill": ["x:1"]}, headers)
    assert headers == {PREFILL_HEADER: ADDR, ENCODERS_HEADER: ADDR_2}


_picks = st.lists(st.sampled_from([ADDR, ADDR_2, IPV6]), max_size=3)


@given(st.dictionaries(st.sampled_from(["prefill", "encode", "decode", "other"]), _picks),
       st.dictionaries(st.sampled_from([PREFILL_HEADER, ENCODERS_HEADER, "x-other"]), st.text(max_size=5)))
def test_the_headers_follow_the_picks_and_nothing_else_is_touched(profiles: dict[str, list[str]],
                                                                  stale: dict[str, str]) -> None:
    headers = dict(stale)
    prefill = HANDLER.apply(profiles, headers)
    assert prefill == (profiles["prefill"][0] if profiles.get("prefill") else None)
    assert headers.get(PREFILL_HEADER) == prefill
    assert headers.get(ENCODERS_HEADER) == (",".join(profiles["encode"]) if profiles.get("encode") else None)
    assert {k: v for k, v in headers.items() if k not in (PREFILL_HEADER, ENCODERS_HEADER)} == {
        k: v for k, v in stale.items() if k not in (PREFILL_HEADER, ENCODERS_HEADER)}


def test_both_types_are_implemented_beta_pre_request_plugins() -> None:
    for kind in ("disagg-headers-handler", "prefill-header-handler"):
        assert kind not in ALPHA_TYPES
        assert PLUGIN_TYPES[kind].category is Category.PRE_REQUEST
        assert PLUGIN_TYPES[kind].replaced_by == "disagg-profile-handler"


@pytest.mark.parametrize(("parameters", "field"), [
    ("{prefillProfile: 3}", f"{P}.prefillProfile"),
    ("{encodeProfile: [e]}", f"{P}.encodeProfile"),
    ("{decodeProfile: d}", f"{P}.decodeProfile"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _declared(f"{{type: disagg-headers-handler, parameters: {parameters}}}")
    assert caught.value.field == field, caught.value


# -- through the scheduler ----------------------------------------------------------------------

PREFILL, DECODE = "10.0.1.1:8000", "10.0.1.2:8000"
POOL = f"""pool:
  endpoints:
  - {{address: '{PREFILL}', labels: {{llm-d.ai/role: prefill}}}}
  - {{address: '{DECODE}', labels: {{llm-d.ai/role: decode}}}}
"""
PROFILES = """schedulingProfiles:
- {name: %s, plugins: [{pluginRef: prefill-filter}]}
- {name: decode, plugins: [{pluginRef: decode-filter}]}
"""


def _scheduler(text: str) -> tuple[PickerConfig, Scheduler]:
    """A scheduler over the prefill and the decode endpoint, for an EndpointPickerConfig (HEAD added
    unless it has its own)."""
    config = parse_config(POOL + ("---\n" + text if "kind: EndpointPickerConfig" in text else HEAD + text))
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    return config, Scheduler(config, snapshot, random.Random(1))


def test_the_references_e2e_pd_config_sets_the_header_through_its_headers_handler() -> None:
    """llm-d-router's test/e2e ``deprecatedPdConfig``: pd-profile-handler with prefill-header-handler."""
    config = load_config(FIXTURES / "e2e-deprecated-pd-config.yaml", cluster_pool="pool")
    assert config.epp is not None and config.epp.plugins["prefill-header-handler"].params == HANDLER
    _, scheduler = _scheduler((FIXTURES / "e2e-deprecated-pd-config.yaml").read_text())
    long = scheduler.schedule(PickRequest("m", 0, prompt_bytes=400))  # 100 tokens: past nonCachedTokens 16
    assert (long.endpoints, long.prefill, long.request_headers) == ([DECODE], PREFILL, {PREFILL_HEADER: PREFILL})
    short = scheduler.schedule(PickRequest("m", 0, prompt_bytes=8))
    assert (short.prefill, short.request_headers) == (None, {})


def test_the_last_setter_decides_the_handler_first_then_headers_handlers_in_declaration_order() -> None:
    plugins = """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: always-disagg-pd-decider}
- {type: disagg-profile-handler, parameters: {profiles: {prefill: p}, deciders: {prefill: always-disagg-pd-decider}}}
"""
    _, alone = _scheduler(plugins + PROFILES % "p")
    assert alone.schedule(PickRequest("m", 0)).request_headers == {PREFILL_HEADER: PREFILL}
    # A headers handler naming the default "prefill", which did not run: it clears the handler's header.
    _, cleared = _scheduler(plugins + "- {type: disagg-headers-handler}\n" + PROFILES % "p")
    assert (cleared.schedule(PickRequest("m", 0)).prefill, cleared.header_setters[-1]) == (None, HANDLER)
    _, agreed = _scheduler(plugins + "- {type: disagg-headers-handler, name: a}\n"
                           "- {type: prefill-header-handler, name: b, parameters: {prefillProfile: p}}\n"
                           + PROFILES % "p")
    assert agreed.schedule(PickRequest("m", 0)).prefill == PREFILL


def test_with_the_header_profile_handler_a_chosen_encode_profile_fills_the_encoders_header() -> None:
    _, scheduler = _scheduler("""plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: header-profile-handler}
- {type: disagg-headers-handler}
""" + PROFILES % "encode")
    chosen = scheduler.schedule(PickRequest("m", 0, headers={"epp-profile": "encode"}))
    assert chosen.request_headers == {ENCODERS_HEADER: PREFILL} and chosen.endpoints == [PREFILL]
    assert scheduler.schedule(PickRequest("m", 0, headers={"epp-profile": "decode"})).request_headers == {}


def test_a_profile_may_list_a_headers_handler_where_it_does_nothing() -> None:
    config, _ = _scheduler("plugins:\n- {type: decode-filter}\n- {type: disagg-headers-handler, name: h}\n"
                           "schedulingProfiles:\n- {name: decode, plugins: [{pluginRef: decode-filter}, "
                           "{pluginRef: h}]}\n")
    (profile,) = config.scheduler.effective_profiles
    assert [f.name for f in profile.filters] == ["decode-filter"] and not profile.scorers


# -- the ext_proc stream ------------------------------------------------------------------------


def test_the_stream_sets_the_encoders_header_and_strips_every_client_routing_header() -> None:
    config, scheduler = _scheduler("""plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: header-profile-handler}
- {type: disagg-headers-handler}
""" + PROFILES % "encode")
    picker = Picker(config, scheduler.snapshot, rng=random.Random(2))
    forged = [(PREFILL_HEADER, "6.6.6.6:80"), (ENCODERS_HEADER, "6.6.6.6:81"), (DATA_PARALLEL_HEADER, "6.6.6.6:82")]

    def route(profile: str) -> ep.HeaderMutation:
        stream = picker.new_stream()
        assert stream.on_message(request_headers(extra=[*forged, ("epp-profile", profile)])) == []
        reply = stream.on_message(request_body(json.dumps({"model": "m", "prompt": "hi"}).encode()))[0]
        return reply.request_headers.response.header_mutation

    encode = route("encode")
    assert set_headers(encode)[ENCODERS_HEADER] == PREFILL and set_headers(encode)[DESTINATION] == PREFILL
    assert set(encode.remove_headers) >= {PREFILL_HEADER, DATA_PARALLEL_HEADER}
    assert ENCODERS_HEADER not in encode.remove_headers
    decode = route("decode")
    assert not {PREFILL_HEADER, ENCODERS_HEADER, DATA_PARALLEL_HEADER} & set(set_headers(decode))
    assert set(decode.remove_headers) >= {PREFILL_HEADER, ENCODERS_HEADER, DATA_PARALLEL_HEADER}


# -- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize(("parameters", "field"), [
    ("{prefillProfile: [p]}", "prefillProfile"),
    ("{encodeProfile: 7}", "encodeProfile"),
    ("{primaryPort: 8000}", "primaryPort"),
])
def test_each_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: prefill-header-handler, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


def upstream_headers(port: int, prompt: str, extra: list[tuple[str, str]]) -> dict[str, str]:
    """One buffered request through the ext_proc port: the headers set on it upstream (blocking)."""
    pairs = [(":path", "/v1/completions"), (":method", "POST"), ("content-type", "application/json"), *extra]
    head = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])))
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps({"model": "m", "prompt": prompt}).encode(),
                                                         end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        replies = list(call(iter([head, body]), timeout=10))
    # Without a protocol_config the body is buffered: the decision rides on the body's reply.
    (mutation,) = [r.request_body.response.header_mutation for r in replies
                   if r.request_body.response.header_mutation.set_headers]
    assert {PREFILL_HEADER, ENCODERS_HEADER, DATA_PARALLEL_HEADER} & {k for k, _ in extra} <= set(
        mutation.remove_headers) | set(set_headers(mutation))
    return set_headers(mutation)


async def test_a_started_picker_runs_the_references_e2e_pd_config(nursery: trio.Nursery, tmp_path: Path) -> None:
    prefill, decode = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(2)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool:
  name: pd
  endpoints:
  - {{address: '{prefill}', labels: {{llm-d.ai/role: prefill}}}}
  - {{address: '{decode}', labels: {{llm-d.ai/role: decode}}}}
---
""" + (FIXTURES / "e2e-deprecated-pd-config.yaml").read_text())
    forged = [(PREFILL_HEADER, "6.6.6.6:80")]
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(10):
            while True:  # until the first scrapes are in (503 before)
                try:
                    long = await trio.to_thread.run_sync(upstream_headers, picker.grpc, "x" * 400, forged)
                    break
                except ValueError:
                    await trio.sleep(0.05)
        assert (long[DESTINATION], long[PREFILL_HEADER]) == (decode, prefill)
        short = await trio.to_thread.run_sync(upstream_headers, picker.grpc, "hi", forged)
        assert short[DESTINATION] == decode and PREFILL_HEADER not in short
