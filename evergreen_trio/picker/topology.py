"""``topology-extractor``, ``topology-affinity-filter`` and ``topology-affinity-scorer``, sans-IO,
with llm-d-router's semantics (ebab68792: ``datalayer/extractor/topology``,
``scheduling/filter/topologyaffinity``, ``scheduling/scorer/topologyaffinity``,
``scheduling/util/topology``).

An endpoint's :class:`Topology` (hostname, rack, zone, region) comes from its pod labels, named by
the extractor's ``hostname``, ``rack``, ``zone`` and ``region`` parameters (defaults: the
Kubernetes labels ``kubernetes.io/hostname``, ``topology.kubernetes.io/rack``, ``-/zone``,
``-/region``); without a hostname label, the pod's ``spec.hostname`` (Kubernetes discovery only:
a file-discovered or static endpoint has its labels alone). An endpoint with none of the four has
no topology. The extractor publishes under its plugin name; the filter and scorer read the one
their ``topologyProducerName`` names (default ``topology-extractor``), and a config where no such
extractor is declared loads with a warning (every endpoint then lacks the attribute).

The peer is the endpoint the disaggregation handler picked first: the decode pick while the
prefill profile runs (decode-first), the prefill pick while decode runs (prefill-first).
:func:`compare` gives the tightest level at which two topologies share a non-empty, equal value.

- The filter keeps the candidates at ``minAffinity`` (``host`` < ``rack`` < ``zone`` <
  ``region``) or tighter; with no peer topology, or none kept, it keeps every candidate.
- The scorer gives 1.0 (host), 0.2 (rack), 0.05 (zone), 0.02 (region), 0 otherwise, and 0 to all
  without a peer topology.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.config import Endpoint
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

log = logging.getLogger(__name__)

TOPOLOGY_EXTRACTOR = "topology-extractor"
TOPOLOGY_FILTER = "topology-affinity-filter"
TOPOLOGY_SCORER = "topology-affinity-scorer"
DEFAULT_LABELS = {"hostname": "kubernetes.io/hostname", "rack": "topology.kubernetes.io/rack",
                  "zone": "topology.kubernetes.io/zone", "region": "topology.kubernetes.io/region"}


@dataclass(frozen=True)
class Topology:
    """Where an endpoint runs; an empty field is unknown (and matches nothing)."""

    hostname: str = ""
    rack: str = ""
    zone: str = ""
    region: str = ""


class Level(enum.IntEnum):
    """A topology tier, tightest first; ``NONE``: nothing shared."""

    HOST = 0
    RACK = 1
    ZONE = 2
    REGION = 3
    NONE = 4


LEVEL_NAMES = {"host": Level.HOST, "rack": Level.RACK, "zone": Level.ZONE, "region": Level.REGION}
# The scorer's fixed curve (the reference's levelScores: KV-transfer bandwidth, not even spacing).
LEVEL_SCORES = {Level.HOST: 1.0, Level.RACK: 0.2, Level.ZONE: 0.05, Level.REGION: 0.02, Level.NONE: 0.0}


def compare(peer: Topology | None, candidate: Topology | None) -> Level:
    """The tightest level at which both hold the same non-empty value; NONE when either is None."""
    if peer is None or candidate is None:
        return Level.NONE
    pairs = ((Level.HOST, peer.hostname, candidate.hostname), (Level.RACK, peer.rack, candidate.rack),
             (Level.ZONE, peer.zone, candidate.zone), (Level.REGION, peer.region, candidate.region))
    for level, mine, theirs in pairs:
        if mine and mine == theirs:
            return level
    return Level.NONE


@dataclass(frozen=True)
class TopologyExtractor:
    """``topology-extractor``: the pod labels read for each field."""

    hostname: str = DEFAULT_LABELS["hostname"]
    rack: str = DEFAULT_LABELS["rack"]
    zone: str = DEFAULT_LABELS["zone"]
    region: str = DEFAULT_LABELS["region"]

    def topology(self, endpoint: Endpoint) -> Topology | None:
        """``endpoint``'s topology; None when it has none of the four."""
        labels = endpoint.label_map
        found = Topology(labels.get(self.hostname) or endpoint.hostname, labels.get(self.rack, ""),
                         labels.get(self.zone, ""), labels.get(self.region, ""))
        return found if found != _UNKNOWN else None

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """Nothing to learn from a schedule (it is a plugin state only to be found by name)."""


_UNKNOWN = Topology()


def _extractor(params: Params) -> TopologyExtractor:
    # An empty label name is the default one, as the reference's omitempty fields.
    return TopologyExtractor(*(params.text(key, "") or label for key, label in DEFAULT_LABELS.items()))


@dataclass(frozen=True)
class TopologyFilterParams:
    """``topology-affinity-filter``: the loosest level kept and the extractor read."""

    min_affinity: Level = Level.HOST
    producer: str = TOPOLOGY_EXTRACTOR


@dataclass(frozen=True)
class TopologyScorerParams:
    """``topology-affinity-scorer``: the extractor read."""

    producer: str = TOPOLOGY_EXTRACTOR


def _producer(params: Params) -> str:
    return params.text("topologyProducerName", "") or TOPOLOGY_EXTRACTOR


def _filter_params(params: Params) -> TopologyFilterParams:
    name = params.text("minAffinity", "") or "host"
    if name not in LEVEL_NAMES:
        raise ConfigError(params.where("minAffinity"), " | ".join(LEVEL_NAMES), name)
    return TopologyFilterParams(LEVEL_NAMES[name], _producer(params))


def topology_filter(min_affinity: Level, peer: Topology | None,
                    candidates: Mapping[str, Topology | None]) -> list[str]:
    """The addresses kept, in order (every one when ``peer`` is None or none is close enough)."""
    if peer is None:
        return list(candidates)
    kept = [address for address, topology in candidates.items() if compare(peer, topology) <= min_affinity]
    return kept or list(candidates)


def topology_scores(peer: Topology | None, candidates: Mapping[str, Topology | None]) -> dict[str, float]:
    """A score per address from the fixed curve (all 0 without a peer)."""
    return {address: LEVEL_SCORES[compare(peer, topology)] for address, topology in candidates.items()}


def warn_unproduced(plugins: Mapping[str, Plugin]) -> None:
    """One warning per topology filter or scorer whose extractor is not declared (the reference's
    optional-dependency warning): it then keeps every candidate, or scores all 0."""
    for plugin in plugins.values():
        if isinstance(plugin.params, TopologyFilterParams | TopologyScorerParams):
            producer = plugins.get(plugin.params.producer)
            if producer is None or not isinstance(producer.params, TopologyExtractor):
                log.warning("picker.topology_not_produced plugin=%s producer=%r: no topology-extractor of that name "
                            "is declared, so no endpoint has a topology", plugin.name, plugin.params.producer)


# -- in the scheduler ---------------------------------------------------------------------------


def _topologies(scheduler: Scheduler, producer: str,
                candidates: Sequence[EndpointState]) -> tuple[Topology | None, dict[str, Topology | None]]:
    """The peer's topology and each candidate's, as ``producer`` reads them (None: unknown)."""
    extractor = scheduler.plugin_states.get(producer)
    if not isinstance(extractor, TopologyExtractor):
        return None, dict.fromkeys((s.endpoint.address for s in candidates), None)
    peer_state = scheduler.snapshot.states.get(scheduler.peer) if scheduler.peer is not None else None
    peer = extractor.topology(peer_state.endpoint) if peer_state is not None else None
    return peer, {s.endpoint.address: extractor.topology(s.endpoint) for s in candidates}


def _filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            params: object) -> list[EndpointState]:
    assert isinstance(params, TopologyFilterParams)
    peer, topologies = _topologies(scheduler, params.producer, candidates)
    if peer is None:
        return list(candidates)
    by_address = {s.endpoint.address: s for s in candidates}
    return [by_address[a] for a in topology_filter(params.min_affinity, peer, topologies)]


def _scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            fresh: Mapping[str, object], params: object) -> dict[str, float]:
    assert isinstance(params, TopologyScorerParams)
    return topology_scores(*_topologies(scheduler, params.producer, candidates))


register(TOPOLOGY_EXTRACTOR, PluginType(Category.EXTRACTOR, tuple(DEFAULT_LABELS), _extractor))
register(TOPOLOGY_FILTER, PluginType(Category.FILTER, ("minAffinity", "topologyProducerName"), _filter_params))
register(TOPOLOGY_SCORER, PluginType(Category.SCORER, ("topologyProducerName",), lambda p: TopologyScorerParams(
    _producer(p))))

TOPOLOGY_FILTERS = {TOPOLOGY_FILTER: _filter}
TOPOLOGY_SCORERS = {TOPOLOGY_SCORER: _scorer}
TOPOLOGY_STATES = {TOPOLOGY_EXTRACTOR: lambda params: params}
