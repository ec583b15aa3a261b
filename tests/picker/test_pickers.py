"""Pickers, sans-IO: ``weighted-random-picker`` (llm-d-router's A-Res sampling) beside
``max-score-picker`` and ``random-picker``, alone and as a profile's picker."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.pickers import max_score, uniform_random, weighted_random
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
_scores = st.dictionaries(st.sampled_from("abcdefgh"), st.sampled_from([0.0, -1.0, 0.001, 0.5, 1.0, 3.0, 100.0]),
                          min_size=1)


@given(_scores, st.integers(1, 10), st.integers(0, 2**32))
def test_weighted_random_picks_positive_scores_before_any_other(scores: dict[str, float], count: int,
                                                                 seed: int) -> None:
    picked = weighted_random(random.Random(seed), scores, count)
    assert len(picked) == len(set(picked)) == min(count, len(scores)) and set(picked) <= set(scores)
    positive = [a for a, s in scores.items() if s > 0]
    if positive:
        # Zero (and negative) scores come only once every positive one has been taken.
        head = picked[: len(positive)]
        assert all(scores[a] > 0 for a in head)


def test_weighted_random_first_pick_is_proportional_to_the_score() -> None:
    rng = random.Random(11)
    scores = {"a": 10.0, "b": 30.0, "c": 60.0, "z": 0.0}
    draws = 20_000
    counts = Counter(weighted_random(rng, scores, 1)[0] for _ in range(draws))
    assert counts["z"] == 0
    for address in "abc":
        assert counts[address] / draws == pytest.approx(scores[address] / 100, abs=0.02)


def test_weighted_random_with_no_positive_score_is_uniform() -> None:
    rng = random.Random(5)
    scores = {"a": 0.0, "b": 0.0, "c": -2.0}
    counts = Counter(weighted_random(rng, scores, 1)[0] for _ in range(3_000))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 800
    assert sorted(weighted_random(rng, scores, 5)) == ["a", "b", "c"]


def test_weighted_random_fills_the_count_with_zero_scores_last() -> None:
    picked = weighted_random(random.Random(1), {"z": 0.0, "a": 1.0, "b": 2.0}, 3)
    assert set(picked[:2]) == {"a", "b"} and picked[2] == "z"


def test_max_score_and_uniform_random() -> None:
    rng = random.Random(2)
    assert max_score(rng, {"a": 0.1, "b": 0.9, "c": 0.5}, 2) == ["b", "c"]
    assert {max_score(rng, {"a": 1.0, "b": 1.0}, 1)[0] for _ in range(50)} == {"a", "b"}
    assert sorted(uniform_random(rng, {"a": 0.0, "b": 9.0}, 5)) == ["a", "b"]


def _scheduler(picker: str, waiting: list[float]) -> tuple[Scheduler, list[str]]:
    addresses = [f"10.0.0.{i}:8000" for i in range(1, len(waiting) + 1)]
    pool = "pool: {endpoints: [" + ", ".join(f"'{a}'" for a in addresses) + "]}\n"
    config = parse_config(pool + HEAD + f"""plugins:
- {{type: queue-scorer}}
- {{type: {picker}, name: pick, parameters: {{maxNumOfEndpoints: 2}}}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: pick}}]}}
""")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address, queue in zip(addresses, waiting, strict=True):
        snapshot.update(address, EndpointMetrics(waiting=queue))
    return Scheduler(config, snapshot, random.Random(4)), addresses


def test_a_profile_with_the_weighted_random_picker() -> None:
    scheduler, (a, b, c) = _scheduler("weighted-random-picker", [0, 5, 10])
    assert scheduler.config.effective_profiles[0].picker == "weighted-random-picker"
    # Queue scores 1, 0.5 and 0: the idle pod twice as often as the half-busy one, the busiest never first.
    firsts = Counter(scheduler.pick(PickRequest("m", 0), 1)[0] for _ in range(6_000))
    assert firsts[c] == 0 and firsts[a] / firsts[b] == pytest.approx(2.0, rel=0.15)
    assert sorted(scheduler.pick(PickRequest("m", 0), 3)[:2]) == sorted([a, b])


def test_the_weighted_random_picker_is_implemented() -> None:
    assert PLUGIN_TYPES["weighted-random-picker"].category is Category.PICKER


def test_default_profile_takes_the_declared_picker() -> None:
    config = parse_config("pool: {endpoints: ['10.0.0.1:1']}\n" + HEAD +
                          "plugins: [{type: queue-scorer}, {type: weighted-random-picker}]")
    assert config.scheduler.effective_profiles[0].picker == "weighted-random-picker"


@pytest.mark.parametrize(("parameters", "field"), [
    ("{maxNumOfEndpoints: 0}", "maxNumOfEndpoints"),
    ("{maxNumOfEndpoints: two}", "maxNumOfEndpoints"),
    ("{temperature: 1}", "temperature"),
])
def test_weighted_random_picker_bad_parameters(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins: [{{type: weighted-random-picker, parameters: {parameters}}}]",
                     cluster_pool="p")
    assert caught.value.field == f"EndpointPickerConfig.plugins[0].parameters.{field}"
