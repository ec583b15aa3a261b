"""Scheduling: the pool's metrics snapshot, the prefix-cache index, scorers, saturation, shedding.

Everything here is plain Python called synchronously: the Trio scraper writes the snapshot and the
ext_proc handler reads it on the same thread, so no locking is needed.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

from evergreen_trio.picker.config import Endpoint, ModelConfig, PickerConfig, SchedulerConfig
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.inflight import InflightLoad, add_load_scores, uncached_tokens


@dataclass
class EndpointState:
    """The last scrape of one endpoint: metrics, when they came, whether the last scrape failed."""

    endpoint: Endpoint
    metrics: EndpointMetrics | None = None
    updated_at: float = float("-inf")
    ready: bool = False
    scraped: bool = False


class PoolSnapshot:
    """Live state of every pool endpoint, kept current by the scraper tasks."""

    def __init__(self, endpoints: Sequence[Endpoint], staleness_s: float, clock: Callable[[], float]) -> None:
        self.states = {e.address: EndpointState(e) for e in endpoints}
        self.staleness_s = staleness_s
        self.clock = clock

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Follow discovery: keep the state of endpoints still listed, add new ones, drop the rest."""
        self.states = {e.address: self.states.get(e.address) or EndpointState(e) for e in endpoints}

    def update(self, address: str, metrics: EndpointMetrics) -> None:
        """Record a scrape of ``address`` (ready and fresh as of now); unknown addresses are ignored."""
        state = self.states.get(address)
        if state is None:  # removed by discovery while its scrape was answered
            return
        state.metrics, state.updated_at, state.ready, state.scraped = metrics, self.clock(), True, True

    def mark_failed(self, address: str) -> None:
        """Record a failed scrape of ``address``: not ready until a scrape succeeds."""
        state = self.states.get(address)
        if state is not None:
            state.ready, state.scraped = False, True

    @property
    def first_scrape_done(self) -> bool:
        """True once every endpoint has had one scrape answered (or failed)."""
        return all(s.scraped for s in self.states.values())

    def is_fresh(self, state: EndpointState, now: float) -> bool:
        """Ready and scraped within ``staleness_s`` of ``now``."""
        return state.ready and now - state.updated_at <= self.staleness_s

    def ready_states(self) -> list[EndpointState]:
        """The endpoints whose last scrape succeeded."""
        return [s for s in self.states.values() if s.ready]


def prefix_hashes(model: str, prompt: str, config: SchedulerConfig) -> list[int]:
    """The xxhash64 chain over the prompt's full blocks, seeded with the target model name.

    Each block hash covers the previous hash (8 bytes, little endian) and the block's bytes, so a
    hash names the whole prefix up to and including its block.
    """
    data = prompt.encode()
    size = config.prefix_block_bytes
    count = min(len(data) // size, config.max_prefix_blocks)
    previous = xxhash.xxh64_intdigest(model.encode())
    hashes = []
    for i in range(count):
        previous = xxhash.xxh64_intdigest(previous.to_bytes(8, "little") + data[i * size : (i + 1) * size])
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per-endpoint LRU sets of block hashes, with a reverse map for greedy longest-prefix match."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, set[str]] = {}

    def add(self, address: str, hashes: Iterable[int]) -> None:
        lru = self._lru.setdefault(address, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._owners.setdefault(h, set()).add(address)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                owners = self._owners[old]
                owners.discard(address)
                if not owners:
                    del self._owners[old]

    def matches(self, hashes: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each candidate holds (greedy: stop at the first miss)."""
        result = dict.fromkeys(candidates, 0)
        alive = set(result)
        for i, h in enumerate(hashes):
            alive &= self._owners.get(h, set())
            if not alive:
                break
            for address in alive:
                result[address] = i + 1
        return result

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))

    def total(self) -> int:
        """Distinct block hashes held over all endpoints."""
        return len(self._owners)


@dataclass(frozen=True)
class PickRequest:
    """What a pick needs: the target model, its priority, the prompt hashes and an optional subset.

    ``prompt_tokens`` (estimated) feeds the in-flight token load.
    """

    model: str | None
    priority: int
    hashes: Sequence[int] = ()
    subset: frozenset[str] | None = None
    prompt_tokens: int = 0


def choose_target(model: ModelConfig, rng: random.Random) -> str:
    """A weighted-random target model name (uniform if all weights are 0; the name if none)."""
    if not model.target_models:
        return model.name
    weights = [t.weight for t in model.target_models]
    if not any(weights):
        return rng.choice(model.target_models).name
    return rng.choices(model.target_models, weights=weights)[0].name


class Scheduler:
    """Scores ready endpoints and returns them best first; sheds sheddable work when saturated."""

    def __init__(self, config: PickerConfig, snapshot: PoolSnapshot, rng: random.Random | None = None) -> None:
        self.config = config.scheduler
        self.snapshot = snapshot
        self.prefix = PrefixIndex(config.scheduler.prefix_cache_capacity)
        self.rng = rng or random.Random()
        self.inflight = InflightLoad(config.scheduler.load)
        # Of the last pick, for the stream's report: leading blocks each candidate held, and
        # seconds spent per scorer (keyed by the reference's plugin type names).
        self.prefix_matches: dict[str, int] = {}
        self.scorer_seconds: dict[str, float] = {}

    def saturation(self) -> float:
        """Mean over endpoints of max(queue/threshold, kv/threshold); stale or down counts 1.0."""
        states = self.snapshot.states.values()
        now = self.snapshot.clock()
        total = 0.0
        for state in states:
            if state.metrics is None or not self.snapshot.is_fresh(state, now):
                total += 1.0
            else:
                total += max(state.metrics.waiting / self.config.queue_threshold,
                             state.metrics.kv_usage / self.config.kv_cache_threshold)
        return total / len(states) if states else 1.0

    def pick(self, request: PickRequest, count: int = 1) -> list[str]:
        """Up to ``count`` endpoint addresses, best first; RequestError 503 or 429 when none."""
        candidates = self.snapshot.ready_states()
        if request.subset is not None:
            candidates = [s for s in candidates if s.endpoint.address in request.subset]
        if not candidates:
            what = "in the subset hint" if request.subset is not None else "in the pool"
            raise RequestError(503, f"no ready endpoint {what}")
        if request.priority < 0 and self.saturation() >= 1.0:
            raise RequestError(429, "pool saturated: sheddable request dropped")
        scores = self.scores(request, candidates)
        order = sorted(scores, key=lambda a: (scores[a], self.rng.random()), reverse=True)
        return order[:count]

    def scores(self, request: PickRequest, candidates: Sequence[EndpointState]) -> dict[str, float]:
        """Weighted sum of the enabled scorers per candidate address."""
        cfg = self.config
        now = self.snapshot.clock()
        fresh = {s.endpoint.address: s.metrics for s in candidates
                 if s.metrics is not None and self.snapshot.is_fresh(s, now)}
        result = dict.fromkeys((s.endpoint.address for s in candidates), 0.0)
        timings: dict[str, float] = {}
        self.scorer_seconds, self.prefix_matches = timings, {}
        clock = time.perf_counter
        started = clock()
        if cfg.queue and fresh:
            queues = [m.waiting for m in fresh.values()]
            low, high = min(queues), max(queues)
            for address, m in fresh.items():
                result[address] += cfg.queue * (1.0 if high == low else (high - m.waiting) / (high - low))
            timings["queue-scorer"], started = clock() - started, clock()
        if cfg.kv_cache:
            for address, m in fresh.items():
                result[address] += cfg.kv_cache * min(1.0, max(0.0, 1.0 - m.kv_usage))
            timings["kv-cache-utilization-scorer"], started = clock() - started, clock()
        if cfg.lora_affinity and request.model is not None:
            for address, m in fresh.items():
                result[address] += cfg.lora_affinity * _lora_score(m, request.model)
            timings["lora-affinity-scorer"], started = clock() - started, clock()
        if cfg.prefix_cache and request.hashes:
            total = len(request.hashes)
            self.prefix_matches = self.prefix.matches(request.hashes, result)
            for address, matched in self.prefix_matches.items():
                result[address] += cfg.prefix_cache * matched / total
            timings["prefix-cache-scorer"] = clock() - started
        if cfg.load.enabled:
            tokens = self.uncached_tokens(request, result) if cfg.load.token_load else {}
            add_load_scores(cfg.load, self.inflight, result, fresh, tokens, timings)
        return result

    def uncached_tokens(self, request: PickRequest, addresses: Iterable[str]) -> dict[str, int]:
        """The request's prompt tokens each endpoint lacks in its (approximate) prefix cache."""
        if not self.prefix_matches and request.hashes:
            self.prefix_matches = self.prefix.matches(request.hashes, addresses)
        block, total = self.config.prefix_block_tokens, len(request.hashes)
        return {a: uncached_tokens(request.prompt_tokens, total, self.prefix_matches.get(a, 0), block)
                for a in addresses}


def _lora_score(metrics: EndpointMetrics, model: str) -> float:
    if model in metrics.running_adapters:
        return 1.0
    if len(metrics.running_adapters) < metrics.max_lora:
        return 0.8
    if model in metrics.waiting_adapters:
        return 0.6
    return 0.0
