"""Affinity plugin types, sans-IO: ``prefix-cache-affinity-filter``, ``no-hit-lru-scorer`` and
``header-label-affinity-scorer`` (the cases of llm-d-router's own tests), then through the
scheduler and the ext_proc stream, and their parameters in an EndpointPickerConfig."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_processor import lb_metadata, request_body, request_headers

from evergreen_trio.picker.affinity import (
    HeaderLabelParams,
    NoHitLRU,
    NoHitLRUParams,
    PrefixAffinityParams,
    header_label_scores,
    prefix_affinity,
)
from evergreen_trio.picker.config import PickerConfig, load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Schedule, Scheduler
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_text

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
NO_DRAW = 1.0  # an exploration draw that never skips the gate


# -- prefix-cache-affinity-filter ---------------------------------------------------------------


def _filter(params: PrefixAffinityParams, matches: dict[str, int], tokens: dict[str, int] | None = None,
            draw: float = NO_DRAW) -> list[str]:
    return prefix_affinity(params, list(matches), matches, 100, tokens or {}, draw)


def test_prefix_affinity_narrows_to_sticky_endpoints() -> None:
    params = PrefixAffinityParams(0.80, 0.0, 5000, 1000)
    assert _filter(params, {"a": 90, "b": 85, "c": 10}) == ["a", "b"]
    assert _filter(params, {"a": 10, "b": 20, "c": 50}) == ["a", "b", "c"]  # none sticky: all kept
    assert _filter(params, {"a": 80, "b": 79}) == ["a"]  # the threshold itself is sticky


def test_prefix_affinity_is_off_for_one_candidate_or_a_threshold_at_or_below_zero() -> None:
    assert _filter(PrefixAffinityParams(0.80), {"a": 90}) == ["a"]
    for threshold in (0.0, -0.5):
        assert _filter(PrefixAffinityParams(threshold), {"a": 0, "b": 90}) == ["a", "b"]


def test_prefix_affinity_exploration_skips_the_gate() -> None:
    params = PrefixAffinityParams(0.80, exploration_probability=0.25)
    assert _filter(params, {"a": 90, "b": 10}, draw=0.2) == ["a", "b"]
    assert _filter(params, {"a": 90, "b": 10}, draw=0.25) == ["a"]
    assert _filter(PrefixAffinityParams(0.80, exploration_probability=1.0), {"a": 90, "b": 10}, draw=0.99) == ["a", "b"]


def test_prefix_affinity_ttft_gate() -> None:
    # 1000 tokens/s: in-flight tokens are milliseconds. a (sticky) 500 ms, b 50 ms.
    tokens = {"a": 500, "b": 50}
    assert _filter(PrefixAffinityParams(0.80, 0.0, 100, 1000), {"a": 90, "b": 10}, tokens) == ["a", "b"]
    assert _filter(PrefixAffinityParams(0.80, 0.0, 1000, 1000), {"a": 90, "b": 10}, tokens) == ["a"]
    # 0 ms penalty: always stick, however loaded.
    assert _filter(PrefixAffinityParams(0.80, 0.0, 0, 1000), {"a": 90, "b": 10}, {"a": 5000, "b": 50}) == ["a"]
    # The best of each group counts: a lightly loaded sticky pod keeps the group sticky.
    tokens = {"a": 9000, "s": 100, "b": 50}
    assert _filter(PrefixAffinityParams(0.80, 0.0, 100, 1000), {"a": 90, "s": 95, "b": 0}, tokens) == ["a", "s"]


def test_prefix_affinity_ttft_gate_from_the_latency_predictor() -> None:
    params = PrefixAffinityParams(0.80, 0.0, 100, 0, "latencyPredictor")  # no throughput needed
    matches = {"a": 90, "b": 10}
    assert prefix_affinity(params, ["a", "b"], matches, 100, {}, NO_DRAW, {"a": 500, "b": 50}) == ["a", "b"]
    assert prefix_affinity(params, ["a", "b"], matches, 100, {}, NO_DRAW, {"a": 140, "b": 50}) == ["a"]
    # The reference's MaxFloat64 for a candidate without a prediction: a sticky one never the
    # fastest (the gate breaks), and nothing predicted anywhere keeps the sticky ones.
    assert prefix_affinity(params, ["a", "b"], matches, 100, {}, NO_DRAW, {"b": 50}) == ["a", "b"]
    assert prefix_affinity(params, ["a", "b"], matches, 100, {}, NO_DRAW, {}) == ["a"]


def test_prefix_affinity_without_blocks_keeps_everyone() -> None:
    params = PrefixAffinityParams(0.80)
    assert prefix_affinity(params, ["a", "b"], {}, 0, {}, NO_DRAW) == ["a", "b"]


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 100), min_size=1),
       st.floats(-1.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_prefix_affinity_keeps_a_nonempty_ordered_subset(matches: dict[str, int], threshold: float,
                                                         exploration: float, draw: float) -> None:
    kept = _filter(PrefixAffinityParams(threshold, exploration, 50, 1000), matches, {"a": 10_000}, draw)
    assert kept and kept == [a for a in matches if a in kept]
    if len(kept) < len(matches):  # narrowed: exactly the sticky ones
        assert kept == [a for a, m in matches.items() if m / 100 >= threshold]


# -- no-hit-lru-scorer --------------------------------------------------------------------------


def _schedule(primary: str, prefill: str | None = None) -> Schedule:
    profiles = {"decode": [primary], **({"prefill": [prefill]} if prefill else {})}
    return Schedule([primary], prefill, profiles)


def test_no_hit_lru_cold_warm_and_single() -> None:
    lru = NoHitLRU(NoHitLRUParams())
    request = PickRequest("m", 0)
    assert lru.score(request, ["a", "b", "c"], {}) == {"a": 1.0, "b": 0.5, "c": 0.0}
    assert lru.score(request, ["a", "b", "c"], {"a": 5}) == {"a": 0.5, "b": 0.5, "c": 0.5}
    assert lru.score(request, ["a"], {}) == {"a": 1.0}


def test_no_hit_lru_prefers_the_least_recently_used_after_cold_requests() -> None:
    lru = NoHitLRU(NoHitLRUParams())
    endpoints = ["a", "b", "c"]

    def cold_to(target: str) -> None:
        request = PickRequest("m", 0)
        lru.score(request, endpoints, {})
        lru.scheduled(request, _schedule(target), 0.0)

    cold_to("a")
    assert lru.score(PickRequest("m", 0), endpoints, {}) == {"b": 1.0, "c": 0.5, "a": 0.0}
    warm = PickRequest("m", 0)
    assert set(lru.score(warm, endpoints, {"a": 5}).values()) == {0.5}
    lru.scheduled(warm, _schedule("b"), 0.0)  # a warm request leaves the LRU alone
    assert list(lru.lru) == ["a"]
    cold_to("b")
    assert lru.score(PickRequest("m", 0), endpoints, {}) == {"c": 1.0, "a": 0.5, "b": 0.0}
    cold_to("c")
    assert lru.score(PickRequest("m", 0), endpoints, {}) == {"a": 1.0, "b": 0.5, "c": 0.0}


def test_no_hit_lru_records_the_primary_and_prefill_picks_of_the_scored_request_only() -> None:
    lru = NoHitLRU(NoHitLRUParams(lru_size=2))
    first, other = PickRequest("m", 0), PickRequest("m", 0)
    lru.score(first, ["d1", "p1"], {})
    lru.scheduled(other, _schedule("d1"), 0.0)  # not the request it scored: nothing learned
    assert not lru.lru
    lru.score(first, ["d1", "p1"], {})
    lru.scheduled(first, _schedule("d1", "p1"), 0.0)
    assert list(lru.lru) == ["d1", "p1"]
    lru.scheduled(first, _schedule("x"), 0.0)  # the scoring is used once
    assert list(lru.lru) == ["d1", "p1"]
    request = PickRequest("m", 0)
    lru.score(request, ["d2"], {})
    lru.scheduled(request, _schedule("d2"), 0.0)  # over lruSize: the least recent goes
    assert list(lru.lru) == ["p1", "d2"]


def test_no_hit_lru_ranks_by_position_in_the_whole_lru() -> None:
    lru = NoHitLRU(NoHitLRUParams())
    for target in ("x", "y", "a"):  # x and y are not candidates below, but they hold LRU positions
        request = PickRequest("m", 0)
        lru.score(request, [target], {})
        lru.scheduled(request, _schedule(target), 0.0)
    assert lru.score(PickRequest("m", 0), ["a", "b", "c"], {}) == {"b": 1.0, "c": 0.5, "a": 0.0}


# -- header-label-affinity-scorer ---------------------------------------------------------------


def test_header_label_scores() -> None:
    params = HeaderLabelParams("x-slice", "slice")
    labels = {"m": {"slice": "slice-a"}, "n": {"slice": "slice-b"}, "o": {}}
    assert header_label_scores(params, {"x-slice": "slice-a"}, labels) == {"m": 1.0, "n": 0.0, "o": 0.0}
    assert set(header_label_scores(params, {"x-slice": "unknown"}, labels).values()) == {0.0}
    assert set(header_label_scores(params, {}, labels).values()) == {0.0}
    assert set(header_label_scores(params, {"x-slice": ""}, {"o": {"slice": ""}}).values()) == {0.0}


# -- through the scheduler and the ext_proc stream ----------------------------------------------

POOL = f"""pool:
  endpoints:
  - {{address: '{A}', labels: {{zone: a}}}}
  - {{address: '{B}', labels: {{zone: b}}}}
  - {{address: '{C}'}}
"""


def _picker(plugins: str, waiting: tuple[float, float, float] = (0, 0, 0)) -> tuple[PickerConfig, Picker]:
    config = parse_config(POOL + HEAD + plugins)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, queue in zip(config.pool.endpoints, waiting, strict=True):
        snapshot.update(endpoint.address, EndpointMetrics(waiting=queue))
    return config, Picker(config, snapshot, rng=random.Random(8))


def _route(picker: Picker, headers: list[tuple[str, str]], prompt: str = "hello") -> str:
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=headers))
    (head, *_) = stream.on_message(request_body(json.dumps({"model": "m", "prompt": prompt}).encode()))
    return lb_metadata(head)[DESTINATION]


def test_header_label_affinity_through_the_stream() -> None:
    _, picker = _picker("""plugins:
- {type: queue-scorer}
- {type: header-label-affinity-scorer, name: zone, parameters: {headerName: X-Preferred-Zone, labelKey: zone}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: queue-scorer}, {pluginRef: zone, weight: 3}]}
""", waiting=(5, 9, 0))
    assert _route(picker, [("x-preferred-zone", "b")]) == B  # the header outweighs B's queue
    assert _route(picker, [("X-Preferred-Zone", "a")]) == A
    assert _route(picker, []) == C  # no header: the queue decides
    assert _route(picker, [("x-preferred-zone", "nowhere")]) == C


NO_HIT = """plugins:
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 4}}
- {type: prefix-cache-scorer}
- {type: no-hit-lru-scorer, name: lru, parameters: {lruSize: 8}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: prefix-cache-scorer, weight: 2}, {pluginRef: lru}]}
"""


def test_no_hit_lru_spreads_cold_prompts_and_keeps_warm_ones() -> None:
    config, picker = _picker(NO_HIT)
    assert config.scheduler.uses_prefix
    cold = [_route(picker, [], prompt=f"{i} " * 40) for i in range(3)]
    assert sorted(cold) == [A, B, C]  # each cold prompt to the endpoint least recently given one
    state = picker.scheduler.plugin_states["lru"]
    assert isinstance(state, NoHitLRU) and list(state.lru) == cold
    assert _route(picker, [], prompt="0 " * 40) == cold[0]  # warm: the prefix scorer decides
    assert list(state.lru) == cold  # and the LRU did not move
    assert _route(picker, [], prompt="new " * 40) == cold[0]  # cold again: the least recent


def test_prefix_affinity_filter_through_the_scheduler() -> None:
    config, picker = _picker("""plugins:
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 4}}
- {type: prefix-cache-affinity-filter, name: sticky, parameters: {affinityThreshold: 0.5, maxTTFTPenaltyMs: 100,
                                                                   peakPrefillThroughput: 1000}}
- {type: queue-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: sticky}, {pluginRef: queue-scorer}]}
""", waiting=(0, 5, 9))
    assert config.scheduler.uses_prefix
    scheduler = picker.scheduler
    hashes = block_hashes("m", TokenizedPrompt((pack_text("p" * 2560),)), 64, 64)  # 10 blocks of 64 tokens
    scheduler.prefix.add(C, hashes)
    assert scheduler.pick(PickRequest("m", 0, hashes)) == [C]  # sticky despite its queue
    scheduler.prefix.add(B, hashes[:4])  # 40%: not sticky
    assert scheduler.pick(PickRequest("m", 0, hashes)) == [C]
    ticket = scheduler.inflight.dispatch(C, 200)  # 200 ms of in-flight prefill on C, 0 elsewhere
    assert scheduler.pick(PickRequest("m", 0, hashes)) == [A]  # the gate broke: the queue decides
    ticket.release()
    assert scheduler.pick(PickRequest("m", 0, [*hashes[:1], 1, 2])) == [A]  # 1 of 3 blocks: no sticky pod


def test_stateful_plugins_are_per_declared_instance() -> None:
    config = parse_config(POOL + HEAD + """plugins:
- {type: no-hit-lru-scorer, name: one}
- {type: no-hit-lru-scorer, name: two}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: one}, {pluginRef: two}]}
""")
    scheduler = Scheduler(config, PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0))
    assert set(scheduler.plugin_states) == {"one", "two"}
    assert scheduler.plugin_states["one"] is not scheduler.plugin_states["two"]


# -- EndpointPickerConfig -----------------------------------------------------------------------

ALL_TYPES = """plugins:
- {type: prefix-cache-affinity-filter, name: strict, parameters: {affinityThreshold: 0.99, explorationProbability: 0.01,
   maxTTFTPenaltyMs: 5000, ttftSource: prefillThroughput, peakPrefillThroughput: 20000,
   prefixMatchInfoProducerName: approx-prefix-cache-producer, inFlightLoadProducerName: inflight-load-producer}}
- {type: prefix-cache-affinity-filter, name: stick, parameters: {maxTTFTPenaltyMs: 0, ttftSource: latencyPredictor}}
- {type: no-hit-lru-scorer, parameters: {lruSize: 2048, prefixPluginType: prefix-cache-scorer,
   prefixPluginName: prefix-cache-scorer}}
- {type: header-label-affinity-scorer, name: slice, parameters: {headerName: x-disagg-slice,
   labelKey: disaggregatedset.x-k8s.io/slice}}
- {type: weighted-random-picker, parameters: {maxNumOfEndpoints: 1}}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: strict}
  - {pluginRef: stick}
  - {pluginRef: no-hit-lru-scorer, weight: 2}
  - {pluginRef: slice, weight: 3}
  - {pluginRef: weighted-random-picker}
"""


@pytest.mark.parametrize(("kind", "category"), [
    ("prefix-cache-affinity-filter", Category.FILTER), ("no-hit-lru-scorer", Category.SCORER),
    ("header-label-affinity-scorer", Category.SCORER)])
def test_the_types_are_implemented(kind: str, category: Category) -> None:
    assert PLUGIN_TYPES[kind].category is category


def test_every_new_type_loads_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + ALL_TYPES)
    profile = load_config(path).scheduler.effective_profiles[0]
    strict, stick = (f.params for f in profile.filters)
    assert strict == PrefixAffinityParams(0.99, 0.01, 5000, 20000)
    assert stick == PrefixAffinityParams(max_ttft_penalty_ms=0, ttft_source="latencyPredictor")
    lru, slice_ = (s.plugin.params for s in profile.scorers)
    assert lru == NoHitLRUParams(2048)
    assert slice_ == HeaderLabelParams("x-disagg-slice", "disaggregatedset.x-k8s.io/slice")
    assert profile.picker == "weighted-random-picker"


def test_defaults() -> None:
    config = parse_config(HEAD + """plugins:
- {type: prefix-cache-affinity-filter}
- {type: no-hit-lru-scorer, parameters: {lruSize: -3}}
""", cluster_pool="p")
    profile = config.scheduler.effective_profiles[0]
    assert profile.filters[0].params == PrefixAffinityParams(0.80, 0.0, 18_000, 15_928)
    assert profile.scorers[0].plugin.params == NoHitLRUParams(1024)  # at or below 0: the default, as Go's


P = "EndpointPickerConfig.plugins[0].parameters"


@pytest.mark.parametrize(("plugin", "field"), [
    ("{type: prefix-cache-affinity-filter, parameters: {affinityThreshold: 1.5}}", f"{P}.affinityThreshold"),
    ("{type: prefix-cache-affinity-filter, parameters: {explorationProbability: -0.1}}",
     f"{P}.explorationProbability"),
    ("{type: prefix-cache-affinity-filter, parameters: {maxTTFTPenaltyMs: -1}}", f"{P}.maxTTFTPenaltyMs"),
    ("{type: prefix-cache-affinity-filter, parameters: {peakPrefillThroughput: -1}}", f"{P}.peakPrefillThroughput"),
    ("{type: prefix-cache-affinity-filter, parameters: {peakPrefillThroughput: 0}}", f"{P}.peakPrefillThroughput"),
    ("{type: prefix-cache-affinity-filter, parameters: {ttftSource: ''}}", f"{P}.ttftSource"),
    ("{type: prefix-cache-affinity-filter, parameters: {ttftSource: bogus}}", f"{P}.ttftSource"),
    ("{type: prefix-cache-affinity-filter, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}",
     f"{P}.prefixMatchInfoProducerName"),
    ("{type: prefix-cache-affinity-filter, parameters: {threshold: 0.5}}", f"{P}.threshold"),
    ("{type: no-hit-lru-scorer, parameters: {lruSize: 1.5}}", f"{P}.lruSize"),
    ("{type: no-hit-lru-scorer, parameters: {lruSize: big}}", f"{P}.lruSize"),
    ("{type: no-hit-lru-scorer, parameters: {size: 3}}", f"{P}.size"),
    ("{type: header-label-affinity-scorer}", f"{P}.headerName"),
    ("{type: header-label-affinity-scorer, parameters: {headerName: x-zone}}", f"{P}.labelKey"),
    ("{type: header-label-affinity-scorer, parameters: {headerName: 3, labelKey: zone}}", f"{P}.headerName"),
    ("{type: header-label-affinity-scorer, parameters: {headerName: x, labelKey: z, mode: strict}}", f"{P}.mode"),
])
def test_bad_parameters_name_the_field(plugin: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {plugin}\n", cluster_pool="p")
    assert caught.value.field == field, caught.value


def test_a_bad_parameter_in_a_file_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + ALL_TYPES.replace("lruSize: 2048", "lruSize: many"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.field == f"{path}: EndpointPickerConfig.plugins[2].parameters.lruSize"


def test_the_gate_off_allows_zero_throughput() -> None:
    config = parse_config(HEAD + "plugins: [{type: prefix-cache-affinity-filter, parameters: "
                                 "{maxTTFTPenaltyMs: 0, peakPrefillThroughput: 0}}]", cluster_pool="p")
    assert config.scheduler.effective_profiles[0].filters[0].params == PrefixAffinityParams(0.80, 0.0, 0.0, 0.0)
