"""Affinity plugin types, sans-IO, with llm-d-router's semantics (ebab68792).

``prefix-cache-affinity-filter`` (``filter/prefixcacheaffinity``): keeps only the "sticky"
candidates, those holding at least ``affinityThreshold`` of the prompt's blocks in the prefix
index, unless none is, an exploration draw skips it, or the sticky ones' estimated TTFT (their
in-flight tokens / ``peakPrefillThroughput``, or with ``ttftSource: latencyPredictor`` the
``predicted-latency-producer``'s predicted TTFT) exceeds the others' by more than ``maxTTFTPenaltyMs``.

``no-hit-lru-scorer`` (``scorer/nohitlru``): for a cold request (no candidate holds a block of
its prompt) ranks candidates by when they last took a cold request, never first; a warm request
scores 0.5 everywhere. Each declared instance keeps its own LRU of endpoints, updated after a
successful schedule with the primary profile's pick and the ``prefill`` profile's.

``header-label-affinity-scorer`` (``scorer/headerlabelaffinity``): 1 for candidates whose
``labelKey`` label equals the request's ``headerName`` header, 0 for the others.

The scheduler runs them (their functions are merged into its registries, as
:mod:`evergreen_trio.picker.inflight`'s scorers are); the types are registered on import.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.latency import PRODUCER as LATENCY_PRODUCER
from evergreen_trio.picker.latency import request_infos
from evergreen_trio.picker.plugin_state import MAX_LISTED, identity
from evergreen_trio.picker.plugins import Category, Params, PluginType, prefix_producer_name, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

PREFIX_AFFINITY = "prefix-cache-affinity-filter"
NO_HIT_LRU = "no-hit-lru-scorer"
HEADER_LABEL_AFFINITY = "header-label-affinity-scorer"
# Types that read the request's prefix matches: a profile using one makes the picker hash prompts
# (the reference creates the approximate prefix producer for them).
PREFIX_READERS = frozenset({PREFIX_AFFINITY, NO_HIT_LRU})
# The profile name the no-hit LRU also records, fixed in the reference (nohitlru's defaultPrefillProfile).
PREFILL_PROFILE = "prefill"
_TTFT_SOURCES = ("prefillThroughput", "latencyPredictor")


# -- prefix-cache-affinity-filter ---------------------------------------------------------------


@dataclass(frozen=True)
class PrefixAffinityParams:
    """``prefix-cache-affinity-filter``'s parameters; ``latency_producer``: the
    ``predicted-latency-producer`` whose predictions ``ttftSource: latencyPredictor`` reads."""

    affinity_threshold: float = 0.80
    exploration_probability: float = 0.0
    max_ttft_penalty_ms: float = 18_000.0
    peak_prefill_throughput: float = 15_928.0
    ttft_source: str = "prefillThroughput"
    latency_producer: str = LATENCY_PRODUCER


def _prefix_affinity(params: Params) -> PrefixAffinityParams:
    # The reference only bounds the threshold above: at or below 0 the filter keeps everything.
    threshold = params.number("affinityThreshold", 0.80, minimum=-math.inf, maximum=1.0)
    exploration = params.number("explorationProbability", 0.0, maximum=1.0)
    penalty = params.number("maxTTFTPenaltyMs", 18_000.0)
    throughput = params.number("peakPrefillThroughput", 15_928.0)
    source = params.text("ttftSource", "prefillThroughput", choices=_TTFT_SOURCES)
    prefix_producer_name(params)
    params.text("inFlightLoadProducerName", "")
    producer = params.text("latencyPredictionInfoProducerName", "") or LATENCY_PRODUCER
    if penalty > 0 and throughput == 0 and source == "prefillThroughput":
        raise ConfigError(params.where("peakPrefillThroughput"), "> 0 when ttftSource is prefillThroughput and "
                          "maxTTFTPenaltyMs > 0", throughput)
    return PrefixAffinityParams(threshold, exploration, penalty, throughput, source, producer)


def prefix_affinity(params: PrefixAffinityParams, candidates: Sequence[str], matches: Mapping[str, int],
                    total_blocks: int, inflight_tokens: Mapping[str, int], draw: float,
                    predicted_ttft: Mapping[str, float] | None = None) -> list[str]:
    """The candidates the filter keeps, in their order.

    ``matches``: leading prompt blocks each candidate holds, of ``total_blocks``;
    ``inflight_tokens``: each candidate's in-flight tokens; ``draw``: a uniform draw in [0, 1)
    for the exploration skip; ``predicted_ttft``: each candidate's predicted TTFT in ms, read
    with ``ttftSource: latencyPredictor`` (a candidate without one is never the fastest).
    """
    if len(candidates) <= 1 or params.affinity_threshold <= 0 or draw < params.exploration_probability:
        return list(candidates)
    sticky: list[str] = []
    others: list[str] = []
    for address in candidates:
        score = matches.get(address, 0) / total_blocks if total_blocks > 0 else 0.0
        (sticky if score >= params.affinity_threshold else others).append(address)
    if not sticky:
        return list(candidates)
    if params.max_ttft_penalty_ms > 0 and others:
        def best_ttft_ms(group: list[str]) -> float:
            if params.ttft_source == "latencyPredictor":
                predicted = predicted_ttft or {}
                return min(predicted.get(a, sys.float_info.max) for a in group)  # Go's math.MaxFloat64
            return min(inflight_tokens.get(a, 0) for a in group) / params.peak_prefill_throughput * 1000

        if best_ttft_ms(sticky) - best_ttft_ms(others) > params.max_ttft_penalty_ms:
            return list(candidates)
    return sticky


def _prefix_affinity_filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                            params: object) -> list[EndpointState]:
    assert isinstance(params, PrefixAffinityParams)
    by_address = {s.endpoint.address: s for s in candidates}
    # Drawn only when it can matter, so a profile without exploration leaves the rng's sequence alone.
    draw = scheduler.rng.random() if params.exploration_probability > 0 and len(candidates) > 1 else 1.0
    predicted = ({a: i.ttft for a, i in request_infos(request, params.latency_producer).items()}
                 if params.ttft_source == "latencyPredictor" else None)
    kept = prefix_affinity(params, list(by_address), scheduler.prefix_matches, len(request.hashes),
                           {a: scheduler.inflight.tokens(a) for a in by_address}, draw, predicted)
    return [by_address[a] for a in kept]


# -- no-hit-lru-scorer --------------------------------------------------------------------------


@dataclass(frozen=True)
class NoHitLRUParams:
    """``no-hit-lru-scorer``: how many endpoints its LRU holds."""

    lru_size: int = 1024


def _no_hit_lru(params: Params) -> NoHitLRUParams:
    for key in ("prefixPluginType", "prefixPluginName"):  # deprecated in the reference, never read
        params.text(key, "")
    prefix_producer_name(params)
    # Go's int: anything at or below 0 means the default.
    size = params.integer("lruSize", 0, minimum=-(2**63), maximum=2**63 - 1)
    return NoHitLRUParams(size if size > 0 else 1024)


class NoHitLRU:
    """One ``no-hit-lru-scorer`` instance: endpoints by when they last took a cold request."""

    def __init__(self, params: object) -> None:
        assert isinstance(params, NoHitLRUParams)
        self.size = params.lru_size
        self.lru: OrderedDict[str, None] = OrderedDict()  # least recently used first
        # The request last scored and whether it was cold (the reference's per-request plugin state).
        self._scored: tuple[PickRequest, bool] | None = None

    def score(self, request: PickRequest, candidates: Sequence[str], matches: Mapping[str, int]) -> dict[str, float]:
        """0.5 each when a candidate holds a block of the prompt; else the LRU ranking."""
        cold = not any(matches.get(a, 0) > 0 for a in candidates)
        self._scored = (request, cold)
        if not cold:
            return dict.fromkeys(candidates, 0.5)
        if len(candidates) == 1:
            return {candidates[0]: 1.0}
        last = len(candidates) - 1
        positions = {a: i for i, a in enumerate(self.lru)}
        never = [a for a in candidates if a not in positions]
        scores = {a: 1.0 - i / last for i, a in enumerate(never)}
        for address in candidates:
            if address in positions:
                # The position is in the whole LRU, endpoints outside this profile included.
                scores[address] = max(0.0, 1.0 - (len(never) + positions[address]) / last)
        return scores

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """After a successful schedule: a cold request's primary and ``prefill`` picks become the most recent."""
        scored, self._scored = self._scored, None
        if scored is None or scored[0] is not request or not scored[1]:
            return
        for picked in (schedule.endpoints, schedule.profiles.get(PREFILL_PROFILE, [])):
            if picked:
                self.lru[picked[0]] = None
                self.lru.move_to_end(picked[0])
                if len(self.lru) > self.size:
                    self.lru.popitem(last=False)

    def dump_state(self) -> dict[str, object]:
        """The reference's ``DumpState``: the LRU's endpoints, least recently used first (the next
        cold request's favourites), the first ``MAX_LISTED`` (100)."""
        return {"endpoints": [identity(a) for a in itertools.islice(self.lru, MAX_LISTED)],
                "totalEndpoints": len(self.lru), "maxEndpoints": MAX_LISTED}


def _no_hit_lru_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                       fresh: Mapping[str, EndpointMetrics], state: object) -> dict[str, float]:
    assert isinstance(state, NoHitLRU)
    return state.score(request, [s.endpoint.address for s in candidates], scheduler.prefix_matches)


# -- header-label-affinity-scorer ---------------------------------------------------------------


@dataclass(frozen=True)
class HeaderLabelParams:
    """``header-label-affinity-scorer``: the request header (lower case) and the endpoint label it names."""

    header: str
    label: str


def _header_label(params: Params) -> HeaderLabelParams:
    header, label = params.text("headerName", ""), params.text("labelKey", "")
    if not header:
        raise ConfigError(params.where("headerName"), "a request header name (required)", header)
    if not label:
        raise ConfigError(params.where("labelKey"), "an endpoint label key (required)", label)
    return HeaderLabelParams(header.lower(), label)


def header_label_scores(params: HeaderLabelParams, headers: Mapping[str, str],
                        labels: Mapping[str, Mapping[str, str]]) -> dict[str, float]:
    """1.0 for each address whose label equals the header's (non-empty) value, else 0.0."""
    wanted = headers.get(params.header, "")
    return {a: 1.0 if wanted and pod.get(params.label) == wanted else 0.0 for a, pod in labels.items()}


def _header_label_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                         fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    assert isinstance(params, HeaderLabelParams)
    return header_label_scores(params, request.headers, {s.endpoint.address: s.endpoint.label_map for s in candidates})


register(PREFIX_AFFINITY, PluginType(Category.FILTER, (
    "affinityThreshold", "explorationProbability", "maxTTFTPenaltyMs", "ttftSource", "peakPrefillThroughput",
    "prefixMatchInfoProducerName", "latencyPredictionInfoProducerName", "inFlightLoadProducerName"),
    _prefix_affinity))
register(NO_HIT_LRU, PluginType(Category.SCORER, (
    "prefixPluginType", "prefixPluginName", "lruSize", "prefixMatchInfoProducerName"), _no_hit_lru))
register(HEADER_LABEL_AFFINITY, PluginType(Category.SCORER, ("headerName", "labelKey"), _header_label))

AFFINITY_FILTERS = {PREFIX_AFFINITY: _prefix_affinity_filter}
AFFINITY_SCORERS = {NO_HIT_LRU: _no_hit_lru_scorer, HEADER_LABEL_AFFINITY: _header_label_scorer}
# Stateful types: the scheduler makes one state per declared plugin and passes it in place of the params.
AFFINITY_STATES = {NO_HIT_LRU: NoHitLRU}
