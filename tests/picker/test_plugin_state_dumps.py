"""The eight reference ``DumpState`` shapes from our plugins' state (field names, order of the
lists, the 100-item caps, what is never shown), and which configured plugin dumps what."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing
from test_processor import request_body, request_headers

from evergreen_trio.picker.affinity import NoHitLRU, NoHitLRUParams
from evergreen_trio.picker.config import Endpoint, PoolConfig, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.file_discovery import DiscoveredEndpoints
from evergreen_trio.picker.file_watch import file_discovery
from evergreen_trio.picker.flow_control.program_aware import ProgramAware, ProgramAwareParams
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.kvevents_zmq import subscribe_bound, subscribe_endpoint
from evergreen_trio.picker.latency import PredictedLatency, ProducerParams, _RunningQueue
from evergreen_trio.picker.mm_cache import MediaCache, MediaProducerParams
from evergreen_trio.picker.plugin_dumps import plugin_dumps
from evergreen_trio.picker.plugin_state import MAX_ID_CHARS, MAX_LISTED, UNSUPPORTED, render
from evergreen_trio.picker.precise_prefix import PreciseParams, PrecisePrefixCache
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, PrefixIndex, Schedule
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_ids

MANY = 150  # past every cap


def _address(i: int) -> str:
    return f"10.0.{i // 250}.{i % 250}:8000"


def test_no_hit_lru_lists_least_recently_used_first_up_to_the_cap() -> None:
    lru = NoHitLRU(NoHitLRUParams(lru_size=1024))
    assert lru.dump_state() == {"endpoints": [], "totalEndpoints": 0, "maxEndpoints": MAX_LISTED}
    for i in range(MANY):
        lru.lru[_address(i)] = None
    lru.lru.move_to_end(_address(0))  # the most recent now
    state = lru.dump_state()
    assert state["endpoints"] == [_address(i) for i in range(1, MAX_LISTED + 1)]
    assert (state["totalEndpoints"], state["maxEndpoints"]) == (MANY, MAX_LISTED)


def test_the_multimodal_cache_counts_items_per_endpoint_never_the_hashes() -> None:
    cache = MediaCache(MediaProducerParams(capacity=1000))
    for i in range(MANY):
        items = tuple(f"secret-item-{i}-{k}".encode() for k in range(i % 7))
        cache.scheduled(PickRequest("m", 0, media=items or (b"one",)), Schedule([_address(i)]), 0.0)
    known = [_address(i) for i in range(MANY + 10)]
    state = cache.dump_state(known)
    assert list(state) == ["podList", "totalKnownPods", "pods", "totalPods", "maxPods"]
    assert state["podList"] == sorted(known)[:MAX_LISTED] and state["totalKnownPods"] == MANY + 10
    pods = state["pods"]
    assert isinstance(pods, list) and len(pods) == MAX_LISTED and state["totalPods"] == MANY
    assert [p["items"] for p in pods] == sorted((p["items"] for p in pods), reverse=True)
    assert pods[0]["items"] == 6
    assert "secret-item" not in json.dumps(state)
    assert MediaCache(MediaProducerParams()).dump_state([]) == {
        "podList": [], "totalKnownPods": 0, "pods": [], "totalPods": 0, "maxPods": MAX_LISTED}


def test_the_approximate_prefix_index_counts_blocks_per_endpoint_most_first() -> None:
    index = PrefixIndex(capacity=1000)
    for i in range(MANY):
        index.add(_address(i), range(1_000_000 + i, 1_000_000 + i + i % 11))
    state = index.dump_state()
    pods = state["pods"]
    assert isinstance(pods, list) and len(pods) == MAX_LISTED and state["totalPods"] == MANY
    first = min(_address(i) for i in range(MANY) if i % 11 == 10)
    assert pods[0] == {"pod": first, "blocks": 10}  # the most blocks, the first name among them
    assert [p["blocks"] for p in pods] == sorted((p["blocks"] for p in pods), reverse=True)
    assert "1000010" not in json.dumps(state)  # block hashes are prompt-derived: never shown


def test_in_flight_load_lists_the_busiest_and_says_when_truncated() -> None:
    load = InflightLoad()
    assert load.dump_state() == {"endpoints": [], "totalEndpoints": 0, "maxEndpoints": MAX_LISTED,
                                 "truncated": False}
    tickets = [load.dispatch(_address(i), i) for i in range(MANY)]
    tickets[0].release()
    state = load.dump_state()
    assert state["truncated"] is True and state["totalEndpoints"] == MANY
    endpoints = state["endpoints"]
    assert isinstance(endpoints, list) and len(endpoints) == MAX_LISTED
    assert endpoints[0] == {"endpoint": _address(MANY - 1), "requests": 1, "tokens": MANY - 1}
    assert {"endpoint": _address(0), "requests": 0, "tokens": 0} not in endpoints  # the idlest left out


def test_program_aware_fairness_reports_aggregates_never_program_ids() -> None:
    # TestDumpState, TestDumpStateOmitsProgramIDs, TestComputeFairnessIndex_*
    fairness = ProgramAware(ProgramAwareParams(), 0.0)
    assert fairness.dump_state(0.0) == {"totalPrograms": 0, "totalInFlight": 0, "fairnessIndex": 1.0}
    fairness.dispatched("secret-tenant-xyz", 0.0, 0.01)
    fairness.dispatched("prog-b", 0.0, 0.02)
    state = fairness.dump_state(1.0)
    assert (state["totalPrograms"], state["totalInFlight"]) == (2, 2)
    assert isinstance(state["fairnessIndex"], float) and 0.0 <= state["fairnessIndex"] <= 1.0
    assert "secret-tenant-xyz" not in json.dumps(state)
    equal = ProgramAware(ProgramAwareParams(), 0.0)
    for program in "abc":
        equal.dispatched(program, 0.0, 0.1)
    assert equal.dump_state(1.0)["fairnessIndex"] == pytest.approx(1.0)
    skewed = ProgramAware(ProgramAwareParams(), 0.0)
    skewed.dispatched("a", 0.0, 0.01)
    skewed.dispatched("b", 0.0, 1.0)
    assert skewed.dump_state(1.0)["fairnessIndex"] < 0.9


def test_program_aware_fairness_applies_the_sweeps_due_before_dumping() -> None:
    fairness = ProgramAware(ProgramAwareParams(eviction_ttl_s=10.0, eviction_sweep_s=1.0), 0.0)
    fairness.dispatched("p", None, 0.0)
    fairness.completed("p", None, 0.0)
    assert fairness.dump_state(5.0)["totalPrograms"] == 1
    assert fairness.dump_state(20.0)["totalPrograms"] == 0  # the periodic sweep's answer at 20 s


def _tokens(n: int) -> TokenizedPrompt:
    return TokenizedPrompt((pack_ids(list(range(n))),))


def test_precise_prefix_lists_subscribers_and_live_speculative_request_ids() -> None:
    cache = PrecisePrefixCache(PreciseParams(speculative=True, speculative_ttl_s=2.0))
    state = cache.dump_state(0.0)
    assert state == {"subscribers": [], "totalSubscribers": 0, "maxSubscribers": MAX_LISTED,
                     "speculativeIndexing": True, "speculativeEntries": [], "totalSpeculativeEntries": 0,
                     "maxSpeculativeEntries": MAX_LISTED, "blockSizeTokens": cache.block_tokens}
    for i in range(MANY):
        cache.subscribed(_address(i), True)
    for i in range(MANY):
        headers = {"x-request-id": f"req-{i:03d}"} if i % 50 else {}
        cache.scheduled(PickRequest("m", 0, headers=headers, tokens=_tokens(64)), Schedule([_address(i)]), 1.0)
    cache.scheduled(PickRequest("m", 0, headers={"x-request-id": "a" * 60_000}, tokens=_tokens(64)),
                    Schedule([_address(0)]), 1.5)
    state = cache.dump_state(2.0)
    assert state["subscribers"] == sorted(_address(i) for i in range(MANY))[:MAX_LISTED]
    assert state["totalSubscribers"] == MANY and state["totalSpeculativeEntries"] == MANY + 1
    entries = state["speculativeEntries"]
    assert isinstance(entries, list) and len(entries) == MAX_LISTED
    assert entries[:2] == ["a" * MAX_ID_CHARS, "req-001"]  # a client's long id is cut
    assert "req-050" not in entries and "a" * (MAX_ID_CHARS + 1) not in json.dumps(state)  # no id: not listed
    later = cache.dump_state(3.2)  # the first entries' TTL is over: rolled back first
    assert (later["totalSpeculativeEntries"], later["speculativeEntries"]) == (1, ["a" * MAX_ID_CHARS])


def test_predicted_latency_reports_running_requests_with_a_finite_tightest_slo() -> None:
    producer = PredictedLatency(ProducerParams())
    assert producer.dump_state() == {"endpoints": [], "totalEndpoints": 0, "maxEndpoints": MAX_LISTED,
                                     "truncated": False, "trackedRequests": 0}
    busiest = sorted(_address(i) for i in range(MANY) if i % 4 == 3)
    for i in range(MANY):
        queue = producer.running.setdefault(_address(i), _RunningQueue())
        for key in range(i % 4 + 1):  # a client's +Inf TPOT SLO header on the first listed
            queue.add(key, math.inf if _address(i) == busiest[0] else 10.0 + key, 0.0)
    state = producer.dump_state()
    assert state["truncated"] is True and state["totalEndpoints"] == MANY
    assert state["trackedRequests"] == sum(i % 4 + 1 for i in range(MANY))
    endpoints = state["endpoints"]
    assert isinstance(endpoints, list) and len(endpoints) == MAX_LISTED
    assert endpoints[0] == {"endpoint": busiest[0], "runningRequests": 4, "minTpotSlo": 0.0}
    assert endpoints[1] == {"endpoint": busiest[1], "runningRequests": 4, "minTpotSlo": 10.0}
    json.dumps(state, allow_nan=False)


async def test_the_kv_event_subscribers_are_listed_while_they_run() -> None:
    pytest.importorskip("zmq", reason="needs pyzmq (extra picker): pip install 'evergreen-trio[picker]'")
    cache = PrecisePrefixCache(PreciseParams())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(subscribe_endpoint, Endpoint("127.0.0.1", 8000), [cache], 5557, "kv@")
        nursery.start_soon(subscribe_bound, "tcp://127.0.0.1:*", [cache], "kv@")
        await trio.testing.wait_all_tasks_blocked()  # both connected (or bound) and reading
        state = cache.dump_state(0.0)
        assert (state["subscribers"], state["totalSubscribers"]) == (["127.0.0.1:8000", "local-subscriber"], 2)
        nursery.cancel_scope.cancel()
    assert cache.subscribers == {}
    cache.subscribed("10.0.0.1:8000", True)  # relabelled: the new subscriber starts before the old one ends
    cache.subscribed("10.0.0.1:8000", True)
    cache.subscribed("10.0.0.1:8000", False)
    assert cache.dump_state(0.0)["subscribers"] == ["10.0.0.1:8000"]


async def test_file_discovery_dumps_the_identities_it_applied_never_addresses(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    lines = [f'  - {{name: pod-{i:03d}, namespace: ns, address: "10.1.{i // 250}.{i % 250}", port: "8000"}}'
             for i in range(MANY)]
    path.write_text("endpoints:\n" + "\n".join(lines) + "\n")
    state = DiscoveredEndpoints()
    assert state.dump_state() == {"endpoints": [], "totalEndpoints": 0, "maxEndpoints": MAX_LISTED}
    seen = [trio.Event()]

    def on_endpoints(endpoints: Sequence[Endpoint]) -> None:
        seen[0].set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(file_discovery, str(path), True, PoolConfig("p", ()), on_endpoints,
                                   interval=0.01, state=state))
        await seen[0].wait()
        dumped = state.dump_state()
        assert dumped["endpoints"] == [f"ns/pod-{i:03d}" for i in range(MAX_LISTED)]
        assert dumped["totalEndpoints"] == MANY and "10.1." not in json.dumps(dumped)
        seen[0] = trio.Event()
        path.write_text('endpoints: [{name: only, address: "10.2.0.1", port: "80"}]')
        with trio.fail_after(10):
            await seen[0].wait()
        assert state.dump_state()["endpoints"] == ["default/only"]
        nursery.cancel_scope.cancel()


HEAD = "pool:\n  endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']\n---\napiVersion: llm-d.ai/v1alpha1\n" \
       "kind: EndpointPickerConfig\n"
CONFIG = HEAD + """featureGates: [flowControl]
plugins:
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 4}}
- {type: prefix-cache-scorer}
- {type: no-hit-lru-scorer, name: lru}
- {type: inflight-load-producer}
- {type: program-aware-fairness, name: fair}
- {type: mm-embeddings-cache-producer}
- {type: queue-scorer}
- {type: max-score-picker}
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: fair}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: prefix-cache-scorer}, {pluginRef: lru}, {pluginRef: queue-scorer},
                            {pluginRef: max-score-picker}]}
"""


def _picker(text: str) -> Picker:
    config = parse_config(text)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    return Picker(config, snapshot, rng=random.Random(3))


def _states(picker: Picker) -> dict[str, dict[str, object]]:
    body = json.loads(render(plugin_dumps(picker), datetime.now(UTC)))
    plugins: dict[str, dict[str, object]] = body["plugins"]
    return plugins


def test_the_configured_plugins_dump_what_the_picker_holds() -> None:
    picker = _picker(CONFIG)
    states = _states(picker)
    assert set(states) == {"approx-prefix-cache-producer", "prefix-cache-scorer", "lru", "inflight-load-producer",
                           "fair", "mm-embeddings-cache-producer", "queue-scorer", "max-score-picker"}
    for name in ("prefix-cache-scorer", "queue-scorer", "max-score-picker"):
        assert states[name] == {"name": name, "type": name, "message": UNSUPPORTED}
    assert states["lru"]["type"] == "no-hit-lru-scorer"
    assert states["fair"]["state"] == {"totalPrograms": 0, "totalInFlight": 0, "fairnessIndex": 1.0}
    assert states["mm-embeddings-cache-producer"]["state"]["podList"] == ["10.0.0.1:8000", "10.0.0.2:8000"]

    stream = picker.new_stream()  # one request routed: the producers' states follow it
    stream.on_message(request_headers(extra=[("x-gateway-inference-fairness-id", "tenant-secret")]))
    stream.on_message(request_body(json.dumps({"model": "m", "prompt": "cold " * 40}).encode()))
    states = _states(picker)
    routed = states["lru"]["state"]["endpoints"]
    assert states["lru"]["state"]["totalEndpoints"] == 1 and routed[0] in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert states["inflight-load-producer"]["state"]["endpoints"][0]["endpoint"] == routed[0]
    assert states["inflight-load-producer"]["state"]["endpoints"][0]["requests"] == 1
    assert states["approx-prefix-cache-producer"]["state"]["pods"][0]["pod"] == routed[0]
    assert states["fair"]["state"]["totalPrograms"] == 1
    assert "tenant-secret" not in json.dumps(states) and "cold" not in json.dumps(states)


def test_without_the_gate_program_aware_tracks_nothing_and_a_legacy_precise_scorer_dumps_nothing() -> None:
    states = _states(_picker(HEAD + """plugins:
- {type: token-producer}
- {type: program-aware-fairness}
- {type: precise-prefix-cache-producer, name: events, parameters: {speculativeIndexing: true}}
- {type: precise-prefix-cache-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: precise-prefix-cache-scorer}]}
"""))
    assert states["program-aware-fairness"]["state"] == {"totalPrograms": 0, "totalInFlight": 0,
                                                         "fairnessIndex": 1.0}
    assert states["precise-prefix-cache-scorer"]["message"] == UNSUPPORTED  # the reference's scorer dumps nothing
    events = states["events"]["state"]
    assert events["speculativeIndexing"] is True and events["subscribers"] == []


def test_a_declared_file_discovery_that_is_not_the_data_layer_one_dumps_nothing_loaded(tmp_path: Path) -> None:
    states = _states(_picker(HEAD + f"""plugins:
- {{type: file-discovery, parameters: {{path: {tmp_path / "none.yaml"}}}}}
- {{type: queue-scorer}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: queue-scorer}}]}}
"""))
    assert states["file-discovery"]["state"] == {"endpoints": [], "totalEndpoints": 0, "maxEndpoints": MAX_LISTED}


def test_a_failing_dump_leaves_the_other_plugins_their_state() -> None:
    picker = _picker(CONFIG)
    picker.scheduler.inflight._counters = None  # type: ignore[assignment]  # a broken state
    states = _states(picker)
    assert states["inflight-load-producer"]["message"].startswith("failed to dump plugin state: ")
    assert "state" in states["lru"] and "state" in states["fair"]
