"""P/D disaggregation and multiple scheduling profiles, sans-IO: the scheduling core directly, then
the ext_proc stream's headers (decode pod in the destination, prefill pod in x-prefiller-host-port)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kube_fakes import eventually
from picker_fakes import FakeModelServer, free_port
from test_processor import lb_metadata, request_body, request_headers, set_headers

from evergreen_trio.picker.config import Endpoint, PickerConfig, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics, EngineConfig
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.k8s.pool_state import PoolState, pool_spec
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.processor import DESTINATION, PREFILLER, Picker, subset_host
from evergreen_trio.picker.runtime import Scrapers
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_text

PREFILL_1, PREFILL_2, DECODE_1, DECODE_2, BOTH = (f"10.0.1.{i}:8000" for i in range(1, 6))
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
PLUGINS = """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: queue-scorer}
- {type: prefix-cache-scorer}
- {type: max-score-picker}
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 4}}
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 32}}
- {type: always-disagg-pd-decider}
- {type: disagg-profile-handler, parameters: %s}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}, {pluginRef: prefix-cache-scorer, weight: 5}]
"""


def pool(roles: Sequence[tuple[str, str | None]]) -> str:
    lines = []
    for address, role in roles:
        labels = f", labels: {{llm-d.ai/role: {role}}}" if role else ""
        lines.append(f"  - {{address: '{address}'{labels}}}")
    return "pool:\n  name: pd\n  endpoints:\n" + "\n".join(lines) + "\n"


ROLES = [(PREFILL_1, "prefill"), (PREFILL_2, "prefill"), (DECODE_1, "decode"), (DECODE_2, None)]


def make(handler: str = "{deciders: {prefill: prefix-based-pd-decider}}",
         roles: Sequence[tuple[str, str | None]] = ROLES,
         waiting: dict[str, float] | None = None) -> tuple[PickerConfig, Scheduler]:
    config = parse_config(pool(roles) + HEAD + PLUGINS % handler)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics(waiting=(waiting or {}).get(endpoint.address, 0)))
    return config, Scheduler(config, snapshot, random.Random(5))


def request(config: PickerConfig, prompt: str) -> PickRequest:
    hashes = block_hashes("m", TokenizedPrompt((pack_text(prompt),)), 64, 64)
    return PickRequest("m", 0, hashes, None, len(prompt.encode()))


def test_long_uncached_prompt_disaggregates_to_the_least_loaded_prefill_pod() -> None:
    config, scheduler = make(waiting={PREFILL_1: 5, DECODE_2: 3})
    result = scheduler.schedule(request(config, "x" * 400))  # 100 tokens, none cached
    assert result.endpoints == [DECODE_1] and result.prefill == PREFILL_2
    assert set(result.profiles) == {"decode", "prefill"}


def test_short_or_cached_prompt_stays_on_the_decode_pod() -> None:
    config, scheduler = make()
    short = scheduler.schedule(request(config, "x" * 100))  # 25 tokens < 32
    assert short.prefill is None and "prefill" not in short.profiles and short.endpoints[0] in (DECODE_1, DECODE_2)
    long = request(config, "y" * 400)
    first = scheduler.schedule(long)
    assert first.prefill is not None
    scheduler.prefix.add(first.endpoints[0], long.hashes[:23])  # 92 of 100 tokens cached: 8 left < 32
    again = scheduler.schedule(long)
    assert again.endpoints == first.endpoints and again.prefill is None


def test_decode_filter_keeps_unlabelled_and_both_pods_prefill_filter_does_not() -> None:
    config, scheduler = make(handler="{deciders: {prefill: always-disagg-pd-decider}}",
                             roles=[(PREFILL_1, "prefill"), (DECODE_2, None), (BOTH, "both")])
    decodes, prefills = set(), set()
    for i in range(40):
        result = scheduler.schedule(request(config, f"{i}" * 10))
        decodes.add(result.endpoints[0])
        prefills.add(result.prefill)
    assert decodes == {DECODE_2, BOTH} and prefills <= {PREFILL_1, BOTH} and PREFILL_1 in prefills


def test_no_prefill_candidate_proceeds_without_prefill() -> None:
    config, scheduler = make(handler="{deciders: {prefill: always-disagg-pd-decider}}",
                             roles=[(DECODE_1, "decode"), (DECODE_2, None)])
    result = scheduler.schedule(request(config, "z" * 400))
    assert result.prefill is None and result.profiles["prefill"] == [] and result.endpoints


def test_no_decode_candidate_is_429_saturated_as_the_reference() -> None:
    config, scheduler = make(roles=[(PREFILL_1, "prefill"), (PREFILL_2, "encode")])
    with pytest.raises(RequestError) as caught:
        scheduler.schedule(request(config, "z" * 400))
    assert caught.value.status == 429 and "decode" in caught.value.message
    assert caught.value.dropped_reason == "rejected-saturated"


def test_no_prefill_decider_means_no_pd() -> None:
    config, scheduler = make(handler="{}")
    assert scheduler.schedule(request(config, "z" * 4000)).prefill is None


def test_prefill_first_runs_prefill_then_decode() -> None:
    config, scheduler = make(handler="{stageOrder: prefill-first}", waiting={PREFILL_2: 1})
    result = scheduler.schedule(request(config, "q"))
    assert result.prefill == PREFILL_1 and result.endpoints[0] in (DECODE_1, DECODE_2)


def test_subset_hint_applies_to_both_profiles() -> None:
    _, scheduler = make(handler="{deciders: {prefill: always-disagg-pd-decider}}")
    subset = frozenset({subset_host(PREFILL_2), subset_host(DECODE_2)})
    result = scheduler.schedule(PickRequest("m", 0, (), subset, 400))
    assert (result.endpoints, result.prefill) == ([DECODE_2], PREFILL_2)


def test_a_general_profile_with_a_label_selector() -> None:
    text = pool([(PREFILL_1, None), (DECODE_1, None)]).replace(
        f"'{DECODE_1}'", f"'{DECODE_1}', labels: {{gpu: h100}}") + HEAD + """plugins:
- {type: label-selector-filter, name: h100, parameters: {matchLabels: {gpu: h100}}}
- {type: random-picker}
schedulingProfiles:
- {name: only-h100, plugins: [{pluginRef: h100}, {pluginRef: random-picker}]}
"""
    config = parse_config(text)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    scheduler = Scheduler(config, snapshot, random.Random(1))
    assert {scheduler.pick(PickRequest("m", 0))[0] for _ in range(20)} == {DECODE_1}
    snapshot.mark_failed(DECODE_1)
    with pytest.raises(RequestError, match="only-h100"):
        scheduler.pick(PickRequest("m", 0))


def _route(picker: Picker, prompt: str, extra: Sequence[tuple[str, str]] = ()) -> ep.ProcessingResponse:
    stream = picker.new_stream()
    assert stream.on_message(request_headers(extra=extra)) == []
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    return stream.on_message(request_body(body))[0]


def test_stream_sets_the_prefill_header_and_strips_a_client_one() -> None:
    config, scheduler = make(waiting={PREFILL_1: 3})
    picker = Picker(config, scheduler.snapshot, rng=random.Random(2))
    forged = [(PREFILLER, "6.6.6.6:80")]
    long = _route(picker, "w" * 400, forged)
    mutation = long.request_headers.response.header_mutation
    headers = set_headers(mutation)
    assert headers[PREFILLER] == PREFILL_2 and headers[DESTINATION] in (DECODE_1, DECODE_2)
    assert lb_metadata(long) == {DESTINATION: headers[DESTINATION]}
    assert PREFILLER not in mutation.remove_headers
    short = _route(picker, "s", forged).request_headers.response.header_mutation
    assert PREFILLER not in set_headers(short) and PREFILLER in short.remove_headers
    untouched = _route(picker, "s").request_headers.response.header_mutation
    assert PREFILLER not in set_headers(untouched) and PREFILLER not in untouched.remove_headers


def test_prefill_pod_learns_the_prefix_too() -> None:
    config, scheduler = make(handler="{deciders: {prefill: always-disagg-pd-decider}}")
    picker = Picker(config, scheduler.snapshot, rng=random.Random(2))
    response = _route(picker, "v" * 400)
    headers = set_headers(response.request_headers.response.header_mutation)
    hashes = block_hashes("m", TokenizedPrompt((pack_text("v" * 400),)), *picker.scheduler.prefix_geometry())
    matches = picker.scheduler.prefix.matches(hashes, [headers[DESTINATION], headers[PREFILLER]])
    assert set(matches.values()) == {len(hashes)}


def test_pool_state_reads_roles_and_engines_from_pod_labels() -> None:
    def pod(name: str, ip: str, labels: dict[str, object]) -> dict[str, object]:
        return {"metadata": {"name": name, "labels": labels},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    state = PoolState(pool_spec({"selector": {"matchLabels": {"app": "m"}}, "targetPorts": [{"number": 8000}]}),
                      EngineConfig(default_engine="sglang"))
    state.replace_pods([
        pod("a", "10.0.0.1", {"llm-d.ai/role": "prefill", "llm-d.ai/engine-type": "vllm"}),
        pod("b", "10.0.0.2", {"inference.networking.k8s.io/engine-type": "trtllm-serve", "bad": 3}),
        pod("c", "10.0.0.3", {}),
    ])
    a, b, c = state.endpoints()
    assert (a.engine, b.engine, c.engine) == ("vllm", "trtllm-serve", "sglang")
    assert a.label_map["llm-d.ai/role"] == "prefill" and "bad" not in b.label_map
    state.apply("MODIFIED", pod("a", "10.0.0.1", {"llm-d.ai/role": "decode"}))
    assert state.endpoints()[0].label_map == {"llm-d.ai/role": "decode"} and state.endpoints()[0].engine == "sglang"


async def test_scrapers_follow_a_pod_relabelled_to_another_engine(nursery: trio.Nursery) -> None:
    server = FakeModelServer(free_port(), engine="sglang", metrics=EndpointMetrics(waiting=2))
    await nursery.start(server.serve)
    config = parse_config(f"pool: {{endpoints: ['{server.address}'], refreshMetricsInterval: 10ms}}")
    snapshot = PoolSnapshot((), 2.0, trio.current_time)
    scrapers = Scrapers(nursery, config, snapshot, lambda: None)
    scrapers.sync([Endpoint("127.0.0.1", server.port, "vllm")])
    await eventually(lambda: snapshot.first_scrape_done)
    assert not snapshot.ready_states()  # SGLang's names read as vLLM's: not ready
    scrapers.sync([Endpoint("127.0.0.1", server.port, "sglang", (("llm-d.ai/engine-type", "sglang"),))])
    await eventually(lambda: bool(snapshot.ready_states()))
    state = snapshot.ready_states()[0]
    assert state.metrics is not None and state.metrics.waiting == 2 and state.endpoint.engine == "sglang"
    server.cancel.cancel()
