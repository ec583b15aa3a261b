"""``context-length-aware``, sans-IO: llm-d-router's own test cases, the score tiers as
invariants, both roles through the scheduler, and its parameters in an EndpointPickerConfig."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_processor import lb_metadata, request_body, request_headers

from evergreen_trio.picker.config import PickerConfig, load_config, parse_config
from evergreen_trio.picker.contextlength import (
    DEFAULT_LABEL,
    ContextLengthParams,
    context_filter,
    context_scores,
    parse_range,
    range_score,
)
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
FILTERING = ContextLengthParams(enable_filtering=True)


def _pods(**ranges: str | None) -> dict[str, dict[str, str]]:
    return {name: {} if value is None else {DEFAULT_LABEL: value} for name, value in ranges.items()}


# -- llm-d-router's cases (context_length_aware_test.go) ----------------------------------------


def test_filter_keeps_the_unlabelled_and_those_in_range() -> None:
    pods = _pods(short="0-100", medium="100-500", wide="0-2000", none=None)
    assert context_filter(FILTERING, 0, pods) == ["short", "wide", "none"]  # no tokens: length 0
    tight = _pods(tight_match="0-52", no_match="142-242")
    assert context_filter(FILTERING, 42, tight) == ["tight_match"]
    assert context_filter(FILTERING, 0, _pods(matching="0-50", other="100-200")) == ["matching"]


def test_filter_is_off_by_default_and_drops_an_unparsable_label() -> None:
    pods = _pods(a="500-1000", b="oops", c=None)
    assert context_filter(ContextLengthParams(), 0, pods) == ["a", "b", "c"]
    assert context_filter(FILTERING, 700, pods) == ["a", "c"]


def test_score_tiers() -> None:
    scores = context_scores(ContextLengthParams(), 0, _pods(tight="0-20", wide="0-10000", no_match="500-1000",
                                                            none=None, bad="x-1"))
    assert scores["tight"] > scores["wide"] > 0.3
    assert 0.0 < scores["no_match"] < 0.3
    assert scores["none"] == 0.5
    assert scores["bad"] == 0.0


def test_parse_range() -> None:
    assert parse_range("0-100") == (0, 100)
    assert parse_range(" 2048 - 8192 ") == (2048, 8192)  # each bound trimmed
    assert parse_range("+5-007") == (5, 7)  # as Go's Atoi reads them
    assert parse_range("7-7") == (7, 7)
    for bad in ("", "0-100-200", "100-50", "abc-100", "-5-10", "1_000-2000", "0x10-20", "1.5-2", "0-",
                "0-9223372036854775808", "\u0663-5"):
        assert parse_range(bad) is None, bad
    assert parse_range("0-9223372036854775807") == (0, 2**63 - 1)


def test_fallback_prefers_the_nearest_range() -> None:
    small_max, large_max = range_score(9000, 0, 2048), range_score(9000, 0, 8192)
    assert 0.0 < small_max < large_max < 0.3
    far_min, close_min = range_score(50, 500, 2048), range_score(50, 100, 1024)
    assert 0.0 < far_min < close_min < 0.3
    # A wide range at its top still beats any out-of-range endpoint.
    assert range_score(14999, 0, 15000) > 0.3 > range_score(14999, 15001, 20000)


def test_exact_scores() -> None:
    assert range_score(5, 5, 5) == 1.0
    # width 20: 0.3 + (0.7 / (1 + 20/10000) + 0.3 * headroom / width) * 0.7
    assert range_score(0, 0, 20) == 0.3 + (0.7 * (1.0 / 1.002) + 0.3 * 1.0) * 0.7
    assert range_score(20, 0, 20) == 0.3 + (0.7 * (1.0 / 1.002) + 0.3 * 0.0) * 0.7
    assert range_score(3000, 0, 1000) == 0.3 / 3.0
    assert range_score(0, 500, 1000) == 0.3 / 1.5


# -- invariants ---------------------------------------------------------------------------------

_bounds = st.integers(0, 10**7)


@given(st.integers(0, 10**7), _bounds, _bounds)
def test_in_range_always_outscores_out_of_range(length: int, a: int, b: int) -> None:
    low, high = min(a, b), max(a, b)
    assert parse_range(f"{low}-{high}") == (low, high)
    score = range_score(length, low, high)
    if low <= length <= high:
        assert 0.3 < score <= 1.0
    else:
        assert 0.0 < score < 0.3


@given(st.integers(0, 10**5), st.dictionaries(st.text(max_size=3), st.none() | st.text(max_size=12), max_size=6))
def test_filter_keeps_an_ordered_subset_and_scores_every_candidate(length: int, ranges: dict[str, str | None]) -> None:
    pods = _pods(**ranges)
    kept = context_filter(FILTERING, length, pods)
    assert kept == [a for a in pods if a in kept]
    scores = context_scores(FILTERING, length, pods)
    assert set(scores) == set(pods) and all(0.0 <= s <= 1.0 for s in scores.values())
    for address in pods:  # kept exactly when unlabelled (0.5) or in range (above 0.3)
        assert (address in kept) == (scores[address] > 0.3)


# -- through the scheduler and the stream -------------------------------------------------------

POOL = f"""pool:
  endpoints:
  - {{address: '{A}', labels: {{{DEFAULT_LABEL}: '0-100'}}}}
  - {{address: '{B}', labels: {{{DEFAULT_LABEL}: '100-8192'}}}}
  - {{address: '{C}'}}
"""


def _picker(plugins: str, waiting: tuple[float, float, float] = (0, 0, 0)) -> tuple[PickerConfig, Picker]:
    config = parse_config(POOL + HEAD + plugins)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, queue in zip(config.pool.endpoints, waiting, strict=True):
        snapshot.update(endpoint.address, EndpointMetrics(waiting=queue))
    return config, Picker(config, snapshot, rng=random.Random(2))


def _route(picker: Picker, prompt: str) -> str:
    stream = picker.new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(json.dumps({"model": "m", "prompt": prompt}).encode()))
    return lb_metadata(head)[DESTINATION]


def test_scores_route_by_prompt_length() -> None:
    _, picker = _picker("""plugins:
- {type: context-length-aware, name: ctx}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: ctx}]}
""")
    assert _route(picker, "x" * 40) == A  # 10 tokens: in A's tight range
    assert _route(picker, "x" * 2000) == B  # 500 tokens: in B's range
    assert _route(picker, "x" * 40_000) == C  # 10,000 tokens: past every range, the unlabelled 0.5 wins


def test_filtering_with_a_scorer_weight() -> None:
    config, picker = _picker("""plugins:
- {type: context-length-aware, name: ctx, parameters: {enableFiltering: true}}
- {type: queue-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: ctx, weight: 0}, {pluginRef: queue-scorer}]}
""", waiting=(0, 3, 6))
    profile = config.scheduler.effective_profiles[0]
    assert [f.name for f in profile.filters] == ["ctx"]
    assert [s.plugin.name for s in profile.scorers] == ["ctx", "queue-scorer"]
    scheduler = picker.scheduler
    assert scheduler.pick(PickRequest("m", 0, prompt_bytes=40)) == [A]  # the queue decides among A and C
    assert scheduler.pick(PickRequest("m", 0, prompt_bytes=2000)) == [B]  # A filtered out; B's queue beats C's
    assert scheduler.pick(PickRequest("m", 0, prompt_bytes=40_000)) == [C]  # only the unlabelled one is left


# -- EndpointPickerConfig -----------------------------------------------------------------------


def test_the_type_is_implemented_as_a_scorer_that_filters() -> None:
    kind = PLUGIN_TYPES["context-length-aware"]
    assert kind.category is Category.SCORER and kind.also_filter


def test_loads_from_a_file_into_both_roles(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + """plugins:
- {type: context-length-aware, name: context-router, parameters: {label: example.com/ctx, enableFiltering: true}}
- {type: max-score-picker}
""")
    profile = load_config(path).scheduler.effective_profiles[0]  # the default profile: every plugin
    (as_filter,) = profile.filters
    (as_scorer,) = profile.scorers
    assert as_filter is as_scorer.plugin and as_scorer.weight == 1.0
    assert as_filter.params == ContextLengthParams("example.com/ctx", True)


def test_defaults() -> None:
    config = parse_config(HEAD + "plugins: [{type: context-length-aware}]", cluster_pool="p")
    assert config.scheduler.effective_profiles[0].scorers[0].plugin.params == ContextLengthParams(DEFAULT_LABEL, False)


@pytest.mark.parametrize(("parameters", "field"), [
    ("{label: ''}", f"{P}.label"),
    ("{label: 3}", f"{P}.label"),
    ("{enableFiltering: 'yes'}", f"{P}.enableFiltering"),
    ("{labelName: x}", f"{P}.labelName"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {{type: context-length-aware, parameters: {parameters}}}\n",
                     cluster_pool="p")
    assert caught.value.field == field, caught.value
