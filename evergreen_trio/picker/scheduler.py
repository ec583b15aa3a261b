"""Scheduling: the pool's metrics snapshot, the prefix-cache index, scorers, saturation, shedding.

Everything here is plain Python called synchronously: the Trio scraper writes the snapshot and the
ext_proc handler reads it on the same thread, so no locking is needed.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from evergreen_trio.picker.admission import admit, declared_admitters
from evergreen_trio.picker.affinity import AFFINITY_FILTERS, AFFINITY_SCORERS, AFFINITY_STATES
from evergreen_trio.picker.burst_prefix import burst_info, burst_match, burst_producers
from evergreen_trio.picker.config import Endpoint, ModelConfig, PickerConfig
from evergreen_trio.picker.contextlength import CONTEXT_FILTERS, CONTEXT_SCORERS
from evergreen_trio.picker.dataparallel import DataParallelHandler
from evergreen_trio.picker.endpoint_attribute import ATTRIBUTE_FILTERS, ATTRIBUTE_SCORERS
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.filters import LOAD_FILTERS
from evergreen_trio.picker.flow_control.config import UtilizationDetector
from evergreen_trio.picker.flow_control.detectors import saturation as detector_saturation
from evergreen_trio.picker.flow_control.queue import Outcome
from evergreen_trio.picker.inflight import LOAD_SCORERS, InflightLoad, prompt_tokens, uncached_tokens
from evergreen_trio.picker.latency import (
    LATENCY_FILTERS,
    LATENCY_SCORERS,
    LATENCY_STATES,
    LatencyRequest,
    admit_latency,
    declared_latency_admitters,
)
from evergreen_trio.picker.mm_cache import MEDIA_SCORERS, MEDIA_STATES
from evergreen_trio.picker.models_source import ModelData
from evergreen_trio.picker.multicluster import (
    MULTICLUSTER_FILTERS,
    MULTICLUSTER_SCORERS,
    MULTICLUSTER_STATES,
    PREFIX_SCORER,
    min_max_scores,
)
from evergreen_trio.picker.p2p_source import (
    CPU_TIER,
    REQUEST_ID_HEADER,
    P2PSourceParams,
    Peer,
    choose_source,
    computing_endpoint,
    p2p_sources,
    source_header,
    spread_fraction,
)
from evergreen_trio.picker.pickers import PICKERS, PickerFunction
from evergreen_trio.picker.plugin_state import MAX_LISTED, busiest, identity
from evergreen_trio.picker.plugins import MIN_BLOCK_TOKENS, Decider, DisaggHandler, Plugin, PrefixScorerParams, Profile
from evergreen_trio.picker.precise_prefix import PRECISE_SCORERS, PRECISE_STATES, PrecisePrefixCache, precise_caches
from evergreen_trio.picker.prefix_hash import BlockHashes
from evergreen_trio.picker.rollout import rollout_screeners
from evergreen_trio.picker.routing_headers import KV_CACHE_SOURCE_HEADER, DisaggHeaders, at_primary_port
from evergreen_trio.picker.session import SESSION_FILTERS, SESSION_SCORERS, SESSION_STATES
from evergreen_trio.picker.testing_filter import TESTING_FILTERS
from evergreen_trio.picker.token_estimate import TokenizedPrompt
from evergreen_trio.picker.topology import TOPOLOGY_FILTERS, TOPOLOGY_SCORERS, TOPOLOGY_STATES

if TYPE_CHECKING:  # the `tracing` extra, imported only with --tracing
    from evergreen_trio.picker.tracing import Tracing


@dataclass
class EndpointState:
    """The last scrape of one endpoint: metrics, when they came, whether the last scrape failed,
    the models its ``/v1/models`` last listed (None: never read; see ``models-data-source``), and
    the attributes other data sources publish, by (name, producer) (``dcgm-data-source``'s)."""

    endpoint: Endpoint
    metrics: EndpointMetrics | None = None
    updated_at: float = float("-inf")
    ready: bool = False
    scraped: bool = False
    models: tuple[ModelData, ...] | None = None
    attributes: dict[tuple[str, str], float] = field(default_factory=dict)


class PoolSnapshot:
    """Live state of every pool endpoint, kept current by the scraper tasks."""

    def __init__(self, endpoints: Sequence[Endpoint], staleness_s: float, clock: Callable[[], float]) -> None:
        self.states = {e.address: EndpointState(e) for e in endpoints}
        self.staleness_s = staleness_s
        self.clock = clock
        self.block_size: int | None = None  # the KV block size (tokens) the last scrape reported

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Follow discovery: keep the state of endpoints still listed (with their new labels), add
        new ones, drop the rest."""
        states = {}
        for endpoint in endpoints:
            state = states[endpoint.address] = self.states.get(endpoint.address) or EndpointState(endpoint)
            state.endpoint = endpoint
        self.states = states

    def metrics_of(self, address: str) -> EndpointMetrics | None:
        """``address``'s latest scraped metrics (None: none yet, or not in the pool)."""
        state = self.states.get(address)
        return state.metrics if state is not None else None

    def update(self, address: str, metrics: EndpointMetrics) -> None:
        """Record a scrape of ``address`` (ready and fresh as of now); unknown addresses are ignored."""
        state = self.states.get(address)
        if state is None:  # removed by discovery while its scrape was answered
            return
        state.metrics, state.updated_at, state.ready, state.scraped = metrics, self.clock(), True, True
        if metrics.block_size:
            self.block_size = metrics.block_size

    def set_models(self, address: str, models: tuple[ModelData, ...]) -> bool:
        """Record the models ``address`` serves; whether they changed (an unknown address: no)."""
        state = self.states.get(address)
        if state is None or state.models == models:
            return False
        state.models = models
        return True

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
        """Leading blocks of ``hashes`` each candidate holds (greedy: stop at the first miss),
        summed over the prompts' chains of a multi-prompt request (:class:`BlockHashes`)."""
        result = dict.fromkeys(candidates, 0)
        owners = self._owners
        chains = hashes.chains() if isinstance(hashes, BlockHashes) and hashes.starts else ((0, len(hashes)),)
        for start, end in chains:
            alive = set(result)
            for i in range(start, end):
                alive &= owners.get(hashes[i], set())
                if not alive:
                    break
                for address in alive:
                    result[address] += 1
        return result

    def size(self, address: str) -> int:
        return len(self._lru.get(address, ()))

    def total(self) -> int:
        """Distinct block hashes held over all endpoints."""
        return len(self._owners)

    def dump_state(self) -> dict[str, object]:
        """The ``approx-prefix-cache-producer``'s ``DumpState``: blocks held per endpoint, most
        first, the first ``MAX_LISTED`` (100); never the prompt-derived hashes."""
        counts = {address: len(lru) for address, lru in self._lru.items()}
        return {"pods": [{"pod": identity(a), "blocks": counts[a]} for a in busiest(counts)],
                "totalPods": len(counts), "maxPods": MAX_LISTED}


@dataclass(frozen=True)
class PickRequest:
    """What a pick needs: the target model, its priority, the prompt hashes, an optional subset
    (the hosts of Envoy's subset hint: an endpoint is in it by its host, whatever its port, as
    llm-d-router's candidates are located), the prompt's length in bytes (P/D deciders estimate
    its tokens from it), and the request's headers (names in lower case) and attributes (by
    (data type, producer) key, see :mod:`evergreen_trio.picker.attributes`) for the plugins that
    read them, and its media items (:func:`~evergreen_trio.picker.mm_cache.media_items`: read only
    when an ``mm-embeddings-cache-producer`` runs)."""

    model: str | None
    priority: int
    hashes: Sequence[int] = ()
    subset: frozenset[str] | None = None
    prompt_bytes: int = 0
    headers: Mapping[str, str] = field(default_factory=dict)
    attributes: Mapping[tuple[str, str], str] = field(default_factory=dict)
    media: tuple[bytes, ...] = ()
    tokens: TokenizedPrompt | None = None
    """The token producer's tokens (when the config runs one): the deciders count and read them."""
    latency: Mapping[str, LatencyRequest] = field(default_factory=dict)
    """Each ``predicted-latency-producer``'s context by plugin name (its candidates' predictions)."""


@dataclass
class Schedule:
    """A scheduling result: the primary (decode) profile's endpoints best first, the prefill
    endpoint when P/D chose one (the one in the prefill header), every profile's picks by profile
    name, the primary profile's weighted score of every candidate it scored (empty when it runs no
    scorer), the headers plugins set on the response to the client and on the request upstream
    (:mod:`evergreen_trio.picker.routing_headers`), and where the request goes when that is not
    ``endpoints`` (data parallelism: the pods' primary port)."""

    endpoints: list[str]
    prefill: str | None = None
    profiles: dict[str, list[str]] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    response_headers: dict[str, str] = field(default_factory=dict)
    request_headers: dict[str, str] = field(default_factory=dict)
    destinations: list[str] | None = None


# Filters that leave none of a non-empty candidate set mean the pool is busy, not broken: the reference
# answers as flow control's capacity rejection (scheduling/scheduler_profile.go): 429, this message,
# this drop reason. The legacy shedding of sheddable requests gives the same reason.
NO_ENDPOINTS = "no endpoints available for the given request"
SATURATED = Outcome.REJECTED_SATURATED.reason
# Bytes per token when no tokenizer is configured (what llm-d-router's estimates assume too).
BYTES_PER_TOKEN = 4
# A scorer: (scheduler, request, candidates, their fresh metrics by address, plugin params or its
# PluginState) -> a score in [0, 1] per address it has an opinion on. Other modules add types
# with register_scorer.
ScorerFunction = Callable[
    ["Scheduler", PickRequest, Sequence[EndpointState], Mapping[str, EndpointMetrics], object], Mapping[str, float]]


def _queue_scores(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                  fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    return min_max_scores({a: m.waiting for a, m in fresh.items()})


def _kv_scores(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
               fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    return {a: min(1.0, max(0.0, 1.0 - m.kv_usage)) for a, m in fresh.items()}


def _lora_scores(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                 fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    if request.model is None:
        return {}
    return {a: _lora_score(m, request.model) for a, m in fresh.items()}


_RATIO_ONLY = PrefixScorerParams(match_length_scale_tokens=1)
"""The prefix scorer of a config without its parameters (the flat one's): the matched share alone."""


def _prefix_scores(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                   fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    scorer = params if isinstance(params, PrefixScorerParams) else _RATIO_ONLY
    if scorer.producer:
        precise = scheduler.plugin_states.get(scorer.producer)
        if isinstance(precise, PrecisePrefixCache):  # the KV events' index: each candidate's cached blocks
            return precise.prefix_scores(request, candidates, scorer, scheduler.snapshot.clock())
        assigned = burst_match(request.attributes, scorer.producer)  # a burst window: a full match where assigned
        if assigned is None:
            return {}
        return {s.endpoint.address: scorer.score(assigned[1], 1.0)
                for s in candidates if s.endpoint.address == assigned[0]}
    if not request.hashes:
        return {}
    total = len(request.hashes)
    block_tokens = scheduler.prefix_geometry()[0]
    result = {}
    for state in candidates:
        matched = scheduler.prefix_matches.get(state.endpoint.address, 0)
        result[state.endpoint.address] = scorer.score(matched * block_tokens, matched / total)
    return result


SCORERS: dict[str, ScorerFunction] = {
    "queue-scorer": _queue_scores,
    "kv-cache-utilization-scorer": _kv_scores,
    "lora-affinity-scorer": _lora_scores,
    "prefix-cache-scorer": _prefix_scores,
    PREFIX_SCORER: _prefix_scores,
    **MULTICLUSTER_SCORERS,  # evergreen_trio.picker.multicluster
    **LOAD_SCORERS,  # in-flight and load scorers: evergreen_trio.picker.inflight
    **AFFINITY_SCORERS,  # evergreen_trio.picker.affinity
    **SESSION_SCORERS,  # evergreen_trio.picker.session
    **CONTEXT_SCORERS,  # evergreen_trio.picker.contextlength
    **ATTRIBUTE_SCORERS,  # evergreen_trio.picker.endpoint_attribute
    **TOPOLOGY_SCORERS,  # evergreen_trio.picker.topology
    **MEDIA_SCORERS,  # evergreen_trio.picker.mm_cache
    **PRECISE_SCORERS,  # evergreen_trio.picker.precise_prefix
    **LATENCY_SCORERS,  # evergreen_trio.picker.latency
}
# A filter that needs more than the pod's labels: (scheduler, request, candidates, plugin params or
# its PluginState) -> the candidates it keeps. The filter types not listed here are read by their
# params' keeps(labels).
FilterFunction = Callable[["Scheduler", PickRequest, Sequence[EndpointState], object], list[EndpointState]]
FILTERS: dict[str, FilterFunction] = {**AFFINITY_FILTERS, **SESSION_FILTERS, **LOAD_FILTERS, **CONTEXT_FILTERS,
                                      **TESTING_FILTERS, **ATTRIBUTE_FILTERS, **TOPOLOGY_FILTERS, **LATENCY_FILTERS,
                                      **MULTICLUSTER_FILTERS}


class PluginState(Protocol):
    """One declared plugin's state, for a stateful type: made from its params by the type's factory
    in :data:`PLUGIN_STATES`, and passed to its scorer or filter function in place of the params."""

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """A schedule succeeded at ``now`` (the reference's PreRequest: the request is about to be
        sent); the state may set response headers on ``schedule``."""


PLUGIN_STATES: dict[str, Callable[[object], PluginState]] = {
    **AFFINITY_STATES, **SESSION_STATES, **TOPOLOGY_STATES, **MEDIA_STATES, **PRECISE_STATES, **LATENCY_STATES,
    **MULTICLUSTER_STATES}


def register_scorer(scorer_type: str, function: ScorerFunction) -> None:
    """Run ``function`` for profile scorers of ``scorer_type`` (its plugin type must be registered too)."""
    SCORERS[scorer_type] = function


def register_filter(filter_type: str, function: FilterFunction) -> None:
    """Run ``function`` for profile filters of ``filter_type`` (its plugin type must be registered too)."""
    FILTERS[filter_type] = function


def register_picker(picker_type: str, function: PickerFunction) -> None:
    """Pick with ``function`` in profiles whose picker is of ``picker_type`` (registered too)."""
    PICKERS[picker_type] = function


def register_state(plugin_type: str, factory: Callable[[object], PluginState]) -> None:
    """Give each declared plugin of ``plugin_type`` a state made by ``factory(params)``."""
    PLUGIN_STATES[plugin_type] = factory


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
        # With flow control on, it alone holds back sheddable requests at saturation (as the reference).
        self.legacy_shedding = config.flow_control is None
        self.shed_detector = config.saturation_detector or UtilizationDetector(
            config.scheduler.queue_threshold, config.scheduler.kv_cache_threshold, snapshot.staleness_s)
        self.admitters = declared_admitters(config.epp.plugins.values()) if config.epp is not None else []
        self.latency_admitters = (declared_latency_admitters(list(config.epp.plugins.values()))
                                  if config.epp is not None else [])
        # Of the last pick, for the stream's report: leading blocks each candidate held, and
        # seconds spent per scorer (keyed by the reference's plugin type names).
        self.prefix_matches: dict[str, int] = {}
        self.scorer_seconds: dict[str, float] = {}
        # While a later P/D profile runs: the address the earlier one picked (the reference's
        # peer-endpoint request attribute, which topology affinity compares candidates with).
        self.peer: str | None = None
        # Stateful plugins' states by plugin name: one per declared plugin, shared by its profiles,
        # and one for a declared plugin no profile lists (the reference runs its PreRequest and
        # response hooks all the same).
        declared = [*(config.epp.plugins.values() if config.epp is not None else ()),
                    *(p for profile in self.config.effective_profiles
                      for p in (*profile.filters, *(s.plugin for s in profile.scorers)))]
        self._profiles = {p.name: p for p in self.config.effective_profiles}
        # prefix_geometry's last answer and the scraped block size it was for (it changes only with that)
        self._geometry_for: object = object()
        self._geometry: tuple[int, int | None] = (0, 0)
        self.plugin_states: dict[str, PluginState] = {}
        for plugin in declared:
            factory = PLUGIN_STATES.get(plugin.type)
            if factory is not None and plugin.name not in self.plugin_states:
                self.plugin_states[plugin.name] = factory(plugin.params)
        # Who sets the P/D headers, in turn: the disaggregation handler, then the declared headers handlers.
        handler = self.config.handler
        self.header_setters = [
            *([DisaggHeaders(handler.prefill, handler.encode)] if isinstance(handler, DisaggHandler) else []),
            *(p.params for p in (config.epp.plugins.values() if config.epp is not None else ())
              if isinstance(p.params, DisaggHeaders))]
        self.primary_port = handler.primary_port if isinstance(handler, DisaggHandler | DataParallelHandler) else 0
        # Screeners (the reference's request-control Screeners): they narrow the candidates first.
        self.screeners = rollout_screeners({p.name: p.params for p in config.epp.plugins.values()}
                                           if config.epp is not None else {})
        # p2p-source-producers with their producer's block tokens (0: the prefix index's, read per
        # pick), and the source each chose for the last pick with the tokens each candidate caches.
        bursts = burst_producers(config.epp.plugins) if config.epp is not None else {}
        self.burst_block_tokens = {name: params.block_size_tokens for name, params in bursts.items()}
        self.kv_sources = [(params, self.burst_block_tokens.get(params.producer, 0))
                           for params in (p2p_sources(config.epp.plugins) if config.epp is not None else ())]
        self.kv_picks: list[tuple[P2PSourceParams, Peer | None, dict[str, int]]] = []
        """Each p2p-source-producer's source for the last pick, and the tokens each candidate caches."""
        self.tracing: Tracing | None = None
        """Set before each pick with --tracing when the request is sampled: each profile run's spans
        (run_scheduler_profile, filter_endpoints, llm_d.epp.scoring and a span per scorer,
        pick_endpoints), as the reference's."""

    def saturation(self, states: Sequence[EndpointState] | None = None) -> float:
        """What the legacy admission's detector reads now of ``states`` (the request's located
        candidates; default the whole pool). 1.0 and above: shed sheddable requests."""
        located = list(self.snapshot.states.values()) if states is None else states
        return detector_saturation(self.shed_detector, located, self.snapshot.clock(), self.inflight).saturation

    def prefix_match_info(self, request: PickRequest, addresses: Sequence[str], producer: str,
                          approx: Mapping[str, int] | None = None) -> tuple[Mapping[str, int], int, int]:
        """The reference's ``PrefixCacheMatchInfo`` of ``producer`` (a plugin's
        ``prefixMatchInfoProducerName``): each address's matched prompt blocks, the prompt's blocks
        and the tokens of a block. "": the approximate index's (``approx`` when the caller has them,
        else this pick's); a precise producer: its tier-weighted leading blocks (truncated, as the
        reference's int); a burst producer: every block on the endpoint its window assigned, none
        elsewhere (no blocks at all for a request that did not wait in a window)."""
        if not producer:
            return (self.prefix_matches if approx is None else approx), len(request.hashes), self.prefix_geometry()[0]
        precise = self.plugin_states.get(producer)
        if isinstance(precise, PrecisePrefixCache):
            found = precise.match(request, self.snapshot.clock())
            return {a: int(found.matched.get(a, 0.0)) for a in addresses}, found.total, precise.block_tokens
        block_tokens = self.burst_block_tokens.get(producer, 0)
        window = burst_info(request.attributes, producer)
        if window is None or not block_tokens:
            return {}, 0, block_tokens
        assigned, indexed = window
        total = indexed // block_tokens
        return ({assigned: total} if assigned else {}), total, block_tokens

    def prefix_geometry(self) -> tuple[int, int | None]:
        """(block tokens, max blocks per prompt; None: every block) for hashing prompts now, as
        llm-d-router's approx-prefix-cache-producer resolves them.

        With ``prefix_auto_tune`` the block is the model servers' scraped block size (vLLM's
        ``cache_config_info``), else ``prefix_block_bytes`` at 4 bytes a token (the estimate
        backend's); either is raised to :data:`MIN_BLOCK_TOKENS`. ``max_prefix_tokens`` (> 0) caps
        the blocks at ``max_prefix_tokens // block``, else ``max_prefix_blocks`` (0: no cap).
        """
        block_size = self.snapshot.block_size
        if block_size == self._geometry_for:  # the same scraped block size as last time: the same answer
            return self._geometry
        cfg = self.config
        tokens = cfg.prefix_block_bytes // BYTES_PER_TOKEN
        if cfg.prefix_auto_tune and block_size:
            tokens = block_size
        tokens = max(tokens, MIN_BLOCK_TOKENS)
        max_blocks = (cfg.max_prefix_tokens // tokens if cfg.max_prefix_tokens > 0
                      else cfg.max_prefix_blocks or None)
        self._geometry_for, self._geometry = block_size, (tokens, max_blocks)
        return self._geometry

    def pick(self, request: PickRequest, count: int = 1) -> list[str]:
        """Up to ``count`` endpoint addresses, best first; RequestError 503 or 429 when none, 500
        when an admitter denies the request."""
        return self.schedule(request, count).endpoints

    def schedule(self, request: PickRequest, count: int = 1) -> Schedule:
        """Run the profiles the handler chooses; RequestError 503 or 429 when no endpoint fits, 500
        when an admitter denies the request.

        Without a handler the one profile picks; with a ``header-profile-handler`` the one a header
        names (429 when it names none). With a :class:`DisaggHandler` (decode-first) the
        decode profile picks, then the decider looks at the prompt's tokens not cached on the
        decode pick and may run the prefill profile (an empty prefill pick means no P/D);
        prefill-first runs prefill (when that profile exists) and then decode. The P/D headers
        follow the picks (:attr:`header_setters`), and with a primary port (data parallelism) the
        request goes there; stateful plugins then learn the result.
        """
        schedule = self._run_profiles(request, count)
        for setter in self.header_setters:
            schedule.prefill = setter.apply(schedule.profiles, schedule.request_headers)
            if self.tracing is not None:
                self.tracing.prepared_disaggregation(request, setter, schedule.profiles)
        for params, source, cached in self.kv_picks:  # each clears and may set it: the last one decides
            headers = schedule.request_headers
            headers.pop(KV_CACHE_SOURCE_HEADER, None)
            computing = computing_endpoint(params, schedule.profiles, schedule.endpoints)
            value = source_header(params, source, computing, cached.get(computing or "", 0))
            if value is not None:
                headers[KV_CACHE_SOURCE_HEADER] = value
        if self.screeners:  # their response headers: the chosen endpoint's labels
            chosen = self.snapshot.states.get(schedule.endpoints[0])
            labels = chosen.endpoint.label_map if chosen is not None else {}
            for screener in self.screeners:
                schedule.response_headers.update(screener.response_headers(labels))
        if self.primary_port:
            schedule.destinations = at_primary_port(schedule.endpoints, self.primary_port, schedule.request_headers)
        now = self.snapshot.clock()
        for state in self.plugin_states.values():
            state.scheduled(request, schedule, now)
        return schedule

    def _run_profiles(self, request: PickRequest, count: int) -> Schedule:
        # As llm-d-router's director: admission over the located candidates (the subset hint's, or
        # the pool), then scheduling over those ready.
        located = list(self.snapshot.states.values())
        if request.subset is not None:
            located = [s for s in located if s.endpoint.host in request.subset]
        if request.priority < 0 and self.legacy_shedding and self.saturation(located) >= 1.0:
            raise RequestError(429, "pool saturated: sheddable request dropped", SATURATED)
        candidates = [s for s in located if s.ready]
        if not candidates:
            what = "in the subset hint" if request.subset is not None else "in the pool"
            raise RequestError(503, f"no ready endpoint {what}", Outcome.EVICTED_NO_ENDPOINTS.reason)
        if self.screeners:
            candidates = self._screen(request, candidates)
        if self.admitters:
            admit(self.admitters, request.priority, [s.metrics for s in candidates], self.rng.random)
        if self.latency_admitters:
            admit_latency(self.latency_admitters, request, candidates)
        self.scorer_seconds = {}
        self.peer = None
        self.prefix_matches = (self.prefix.matches(request.hashes, [s.endpoint.address for s in candidates])
                               if request.hashes else {})
        if self.kv_sources:  # the reference's Produce runs before the profiles, over the same candidates
            self.kv_picks = [self._kv_source(params, block, request, candidates) for params, block in self.kv_sources]
        tracing = self.tracing
        if tracing is not None:  # the precise producers' spans, before the profiles as the reference's Produce
            tracing.produced_precise_prefix(request, precise_caches(self.plugin_states).values(), candidates,
                                            self.snapshot.clock())
        profiles = self._profiles
        handler = self.config.handler
        if not isinstance(handler, DisaggHandler):
            profile = profiles[handler.choose(request.headers, profiles) if handler else next(iter(profiles))]
            picked, scores = self.run_profile(profile, request, candidates, count)
            if not picked:
                raise RequestError(429, f"{NO_ENDPOINTS}: profile {profile.name!r}'s filters kept none", SATURATED)
            return Schedule(picked, None, {profile.name: picked}, scores)
        result: dict[str, list[str]] = {}
        prefill = profiles.get(handler.prefill)  # with --tracing: a pick_disagg_profile span per stage chosen
        if handler.stage_order == "prefill-first":
            if prefill is not None:
                if tracing is not None:
                    tracing.disagg_decision(request, "run_prefill")
                result[prefill.name] = self.run_profile(prefill, request, candidates, 1)[0]
                self.peer = result[prefill.name][0] if result[prefill.name] else None
            self._encode(handler, request, candidates, None, result)
        if tracing is not None:
            tracing.disagg_decision(request, "run_decode")
        decode, scores = self.run_profile(profiles[handler.decode], request, candidates, count)
        if not decode:
            if tracing is not None:
                tracing.disagg_decision(request, "complete", decode_failed=True)
            raise RequestError(429, f"{NO_ENDPOINTS}: decode profile {handler.decode!r}'s filters kept none",
                               SATURATED)
        result[handler.decode] = decode
        if handler.stage_order == "decode-first":
            self._encode(handler, request, candidates, decode[0], result)
            if prefill is not None and self._decides(handler.prefill_decider, request, decode[0]):
                if tracing is not None:
                    tracing.disagg_decision(request, "run_prefill")
                self.peer = decode[0]
                result[prefill.name] = self.run_profile(prefill, request, candidates, 1)[0]
        if tracing is not None:
            tracing.disagg_completed(request, bool(result.get(handler.encode)), bool(result.get(handler.prefill)))
        return Schedule(decode, None, result, scores)

    def _kv_source(self, params: P2PSourceParams, block_tokens: int, request: PickRequest,
                   candidates: Sequence[EndpointState]) -> tuple[P2PSourceParams, Peer | None, dict[str, int]]:
        """A p2p-source-producer's pull source among ``candidates`` (None: none caches the prompt),
        with the prompt tokens each candidate caches by its producer: the prefix index's matches, a
        burst producer's full match on the replica it assigned, or a precise producer's leading
        blocks (a source serving only its CPU-tier ones). Without ``x-request-id`` the
        coordinate is random, as the reference's generated request id is."""
        precise = self.plugin_states.get(params.producer) if params.producer else None
        if isinstance(precise, PrecisePrefixCache):  # pulls come from a source's CPU tier; local blocks from any
            block_tokens = precise.block_tokens
            cached, servable = precise.cached_tokens(request, (s.endpoint.address for s in candidates),
                                                     self.snapshot.clock(), CPU_TIER)
        elif params.producer:
            assigned = burst_match(request.attributes, params.producer)
            cached = servable = {assigned[0]: assigned[1]} if assigned is not None else {}
        else:
            block_tokens = self.prefix_geometry()[0]
            cached = servable = {address: blocks * block_tokens
                                 for address, blocks in self.prefix_matches.items() if blocks}
        peers = [Peer(s.endpoint.address, servable.get(s.endpoint.address, 0), block_tokens,
                      s.metrics.waiting if s.metrics is not None else 0.0) for s in candidates]
        request_id = request.headers.get(REQUEST_ID_HEADER)
        coordinate = spread_fraction(request_id) if request_id else self.rng.random()
        return params, choose_source(peers, coordinate), cached

    def _screen(self, request: PickRequest, candidates: list[EndpointState]) -> list[EndpointState]:
        """The candidates every screener keeps (each screens all of them, as the reference's
        director runs them); 503 when none is left."""
        kept = {id(s) for s in candidates}
        for screener in self.screeners:
            kept &= {id(s) for s in screener.screen(request.headers, candidates, _labels, self.rng.random)}
        candidates = [s for s in candidates if id(s) in kept]
        if not candidates:
            raise RequestError(503, "screeners eliminated all endpoint candidates", Outcome.EVICTED_NO_ENDPOINTS.reason)
        return candidates

    def _decides(self, decider: Decider | None, request: PickRequest, decode: str | None) -> bool:
        """Whether ``decider`` disaggregates ``request`` (its tokens not cached on the ``decode``
        pick, none without one), as the reference's deciders read it."""
        if decider is None:
            return False
        tokens = request.tokens
        cached = self.prefix_matches.get(decode, 0) * self.prefix_geometry()[0] if decode else 0
        count = tokens.token_count if tokens is not None else request.prompt_bytes // BYTES_PER_TOKEN
        return decider.disaggregate(count, cached, tokens is not None and tokens.multimodal)

    def _encode(self, handler: DisaggHandler, request: PickRequest, candidates: Sequence[EndpointState],
                decode: str | None, result: dict[str, list[str]]) -> None:
        """The encode stage (E/PD): when the config has the encode profile and its decider says
        so, that profile picks its picker's ``maxNumOfEndpoints`` encoders."""
        encode = self._profiles.get(handler.encode)
        if encode is not None and self._decides(handler.encode_decider, request, decode):
            if self.tracing is not None:
                self.tracing.disagg_decision(request, "run_encode")
            result[encode.name] = self.run_profile(encode, request, candidates, encode.picks)[0]

    def run_profile(self, profile: Profile, request: PickRequest, candidates: Sequence[EndpointState],
                    count: int) -> tuple[list[str], dict[str, float]]:
        """Filter, score and pick up to ``count`` addresses by ``profile`` (best first; [] if none
        passed), with the scores of the candidates that passed (empty when the profile has no scorer)."""
        tracing = self.tracing
        if tracing is not None:
            tracing.profile_started(profile.name, request, len(candidates))
        for plugin in profile.filters:
            function = FILTERS.get(plugin.type)
            if function is not None:
                candidates = function(self, request, candidates, self._params(plugin))
            else:
                keeps = plugin.params.keeps  # type: ignore[attr-defined]  # the other filter types have keeps(labels)
                candidates = [s for s in candidates if keeps(s.endpoint.label_map)]
        if tracing is not None:
            tracing.filtered(len(candidates))
        if not candidates:
            if tracing is not None:
                tracing.profile_ended()
            return [], {}
        scores = self.scores(request, candidates, profile)
        reported = scores if profile.scorers else {}
        if tracing is None:
            return PICKERS[profile.picker](self.rng, scores, count), reported
        tracing.picking(request, scores)
        picked = PICKERS[profile.picker](self.rng, scores, count)
        tracing.profile_ended()
        return picked, reported

    def _params(self, plugin: Plugin) -> object:
        """What ``plugin``'s function gets: its state for a stateful type, else its params."""
        return self.plugin_states.get(plugin.name, plugin.params)

    def scores(self, request: PickRequest, candidates: Sequence[EndpointState],
               profile: Profile | None = None) -> dict[str, float]:
        """Weighted sum of ``profile``'s scorers (default: the first profile) per candidate address.

        The prefix scorer reads :attr:`prefix_matches`, which :meth:`schedule` fills first.
        """
        profile = profile or self.config.effective_profiles[0]
        snapshot = self.snapshot
        now, staleness = snapshot.clock(), snapshot.staleness_s
        # PoolSnapshot.is_fresh, inline (a call per candidate per pick otherwise)
        fresh = {s.endpoint.address: s.metrics for s in candidates
                 if s.metrics is not None and s.ready and now - s.updated_at <= staleness}
        result = dict.fromkeys([s.endpoint.address for s in candidates], 0.0)
        clock = time.perf_counter
        seconds = self.scorer_seconds
        states = self.plugin_states
        tracing = self.tracing
        if tracing is not None:
            tracing.scoring_started(request, len(profile.scorers), len(candidates))
        for scorer in profile.scorers:
            weight = scorer.weight
            if not weight:
                continue
            started = clock()
            plugin = scorer.plugin
            key = plugin.type
            if tracing is not None:
                tracing.scorer_started(request, len(candidates), key, plugin.name, weight)
            scored = SCORERS[key](self, request, candidates, fresh, states.get(plugin.name, plugin.params))
            for address, score in scored.items():
                result[address] += weight * score
            if tracing is not None:
                tracing.scorer_ended(scored)
            seconds[key] = seconds.get(key, 0.0) + clock() - started
        if tracing is not None:
            tracing.scoring_ended()
        return result

    def prompt_tokens(self, request: PickRequest) -> int:
        """The request's prompt tokens: the token producer's count when the config runs one (as
        the reference's context-length and in-flight load read it), else estimated from its bytes."""
        if request.tokens is not None:
            return request.tokens.token_count
        return prompt_tokens(request.prompt_bytes, self.config.chars_per_token)

    def uncached_tokens(self, request: PickRequest, addresses: Iterable[str],
                        prompt_tokens: int | None = None) -> dict[str, int]:
        """The request's prompt tokens (``prompt_tokens`` when the caller has them) each endpoint
        lacks in its prefix cache, as the reference's ``uncachedInputTokens`` reads the match info
        of the producer the in-flight load producer names (:meth:`prefix_match_info`); without
        match info, the whole prompt."""
        tokens = self.prompt_tokens(request) if prompt_tokens is None else prompt_tokens
        listed = list(addresses)
        matched, total, block_tokens = self.prefix_match_info(request, listed, self.inflight.config.prefix_producer)
        return {a: uncached_tokens(tokens, matched.get(a, 0), block_tokens, total) for a in listed}


def _labels(state: EndpointState) -> Mapping[str, str]:
    return state.endpoint.label_map


def _lora_score(metrics: EndpointMetrics, model: str) -> float:
    if model in metrics.running_adapters:
        return 1.0
    if len(metrics.running_adapters) < metrics.max_lora:
        return 0.8
    if model in metrics.waiting_adapters:
        return 0.6
    return 0.0
