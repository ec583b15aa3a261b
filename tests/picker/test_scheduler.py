"""Scorers, the prefix index, saturation and shedding, target model choice (sans-IO)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import Endpoint, ModelConfig, PickerConfig, PoolConfig, SchedulerConfig, TargetModel
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.inflight import LoadConfig
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.processor import subset_host
from evergreen_trio.picker.scheduler import (
    PickRequest,
    PoolSnapshot,
    PrefixIndex,
    Scheduler,
    choose_target,
)
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(metrics: list[EndpointMetrics | None], **weights: float) -> tuple[Scheduler, list[str], Clock]:
    endpoints = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(len(metrics))]  # a host each, as pods
    # Weights given: those scorers alone (the in-flight one of the default profile off).
    scheduler_config = SchedulerConfig(**weights, load=LoadConfig(active_request=0)) if weights else SchedulerConfig()
    config = PickerConfig(PoolConfig("p", tuple(endpoints)), scheduler=scheduler_config)
    clock = Clock()
    snapshot = PoolSnapshot(endpoints, 2.0, clock)
    for endpoint, m in zip(endpoints, metrics, strict=True):
        if m is None:
            snapshot.mark_failed(endpoint.address)
        else:
            snapshot.update(endpoint.address, m)
    return Scheduler(config, snapshot, random.Random(7)), [e.address for e in endpoints], clock


def test_queue_and_kv_scores() -> None:
    scheduler, addresses, _ = make(
        [EndpointMetrics(waiting=0, kv_usage=0.2), EndpointMetrics(waiting=10, kv_usage=0.6),
         EndpointMetrics(waiting=5, kv_usage=1.0)], queue=1, kv_cache=1, prefix_cache=0)
    scores = scheduler.scores(PickRequest("m", 0), scheduler.snapshot.ready_states())
    assert scores == pytest.approx({addresses[0]: 1.8, addresses[1]: 0.4, addresses[2]: 0.5})
    equal, addresses, _ = make([EndpointMetrics(waiting=3)] * 2, queue=1, kv_cache=0, prefix_cache=0)
    assert set(equal.scores(PickRequest("m", 0), equal.snapshot.ready_states()).values()) == {1.0}


def test_lora_affinity_scores() -> None:
    scheduler, addresses, _ = make([
        EndpointMetrics(running_adapters=frozenset({"a"}), max_lora=1),
        EndpointMetrics(running_adapters=frozenset({"b"}), max_lora=2),
        EndpointMetrics(running_adapters=frozenset({"b"}), waiting_adapters=frozenset({"a"}), max_lora=1),
        EndpointMetrics(running_adapters=frozenset({"b"}), max_lora=1),
    ], queue=0, kv_cache=0, prefix_cache=0, lora_affinity=1)
    scores = scheduler.scores(PickRequest("a", 0), scheduler.snapshot.ready_states())
    assert [scores[a] for a in addresses] == [1.0, 0.8, 0.6, 0.0]


def test_prefix_index_greedy_match_and_lru_eviction() -> None:
    index = PrefixIndex(capacity=3)
    index.add("a", [1, 2, 3])
    index.add("b", [1, 9])
    assert index.matches([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.add("a", [4])
    assert index.size("a") == 3
    assert index.matches([1, 2], ["a"]) == {"a": 0}
    assert index.matches([2, 3, 4], ["a"]) == {"a": 3}


def test_prefix_scorer_prefers_the_endpoint_that_has_the_prefix() -> None:
    scheduler, addresses, _ = make([EndpointMetrics()] * 3, queue=0, kv_cache=0, prefix_cache=1)
    hashes = block_hashes("m", TokenizedPrompt((pack_text("p" * 2560),)), *scheduler.prefix_geometry())
    scheduler.prefix.add(addresses[2], hashes[:5])
    assert scheduler.pick(PickRequest("m", 0, hashes)) == [addresses[2]]


def test_saturation_and_shedding_only_for_sheddable() -> None:
    scheduler, _, clock = make([EndpointMetrics(waiting=5, kv_usage=0.1), EndpointMetrics(waiting=0, kv_usage=0.4)])
    assert scheduler.saturation() == pytest.approx(0.75)
    assert scheduler.pick(PickRequest("m", -1))
    clock.now += 10  # every endpoint's metrics are stale now: saturated
    assert scheduler.saturation() == 1.0
    with pytest.raises(RequestError) as info:
        scheduler.pick(PickRequest("m", -1))
    assert info.value.status == 429
    assert scheduler.pick(PickRequest("m", 0))


def test_no_ready_endpoint_and_subset() -> None:
    scheduler, addresses, _ = make([None, EndpointMetrics(), EndpointMetrics(waiting=9)])
    hosts = [subset_host(a) for a in addresses]
    assert scheduler.pick(PickRequest("m", 0, subset=frozenset({hosts[2]}))) == [addresses[2]]
    for subset in (frozenset(), frozenset({hosts[0]})):
        with pytest.raises(RequestError) as info:
            scheduler.pick(PickRequest("m", 0, subset=subset))
        assert info.value.status == 503
    down, _, _ = make([None])
    with pytest.raises(RequestError, match="no ready endpoint"):
        down.pick(PickRequest("m", 0))


def test_choose_target_by_weight() -> None:
    rng = random.Random(1)
    model = ModelConfig("m", target_models=(TargetModel("a", 90), TargetModel("b", 10), TargetModel("c", 0)))
    counts = Counter(choose_target(model, rng) for _ in range(2000))
    assert counts["c"] == 0 and counts["a"] > counts["b"] > 0
    uniform = ModelConfig("m", target_models=(TargetModel("a", 0), TargetModel("b", 0)))
    assert set(choose_target(uniform, rng) for _ in range(100)) == {"a", "b"}
    assert choose_target(ModelConfig("m"), rng) == "m"


@given(st.lists(st.none() | st.builds(EndpointMetrics, waiting=st.integers(0, 20),
                                      kv_usage=st.floats(0, 1)), min_size=1, max_size=6),
       st.sets(st.integers(0, 7)), st.integers(1, 4), st.integers(-1, 1))
def test_pick_only_returns_ready_endpoints_in_the_subset(
    metrics: list[EndpointMetrics | None], subset_index: set[int], count: int, priority: int
) -> None:
    scheduler, addresses, _ = make(metrics)
    subset = frozenset(f"10.0.0.{i + 1}" for i in subset_index)
    allowed = {a for a, m in zip(addresses, metrics, strict=True) if m is not None and subset_host(a) in subset}
    try:
        picked = scheduler.pick(PickRequest("m", priority, subset=subset), count)
    except RequestError as exc:
        assert (exc.status == 503 and not allowed) or (exc.status == 429 and priority < 0)
    else:
        assert picked and set(picked) <= allowed and len(picked) == min(count, len(allowed))
