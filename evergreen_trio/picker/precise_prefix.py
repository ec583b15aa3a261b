"""``precise-prefix-cache-producer`` and the legacy ``precise-prefix-cache-scorer``, sans-IO:
llm-d-router's precise prefix cache (``requestcontrol/dataproducer/preciseprefixcache``).

The producer owns a KV-block index fed by the model servers' KV-cache events
(:mod:`evergreen_trio.picker.kvevents`; the Trio shell is :mod:`evergreen_trio.picker.kvevents_zmq`).
Per request it hashes the token producer's tokens into block keys (the cache salt folded into
block 0, multimodal hashes into the blocks they overlap), looks them up, and gives each candidate
its ``PrefixCacheMatchInfo``: the tier-weighted count of leading blocks it holds, of the prompt's
total. A ``prefix-cache-scorer`` naming the producer in ``prefixMatchInfoProducerName`` scores
those. With ``speculativeIndexing`` the chosen endpoint (and the prefill one) is entered at once
as holding the prompt's blocks, for ``speculativeTTL``. The deprecated
``precise-prefix-cache-scorer`` is such a producer and scorer in one plugin, or, when a
``precise-prefix-cache-producer`` is declared too, a ``prefix-cache-scorer`` reading that one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.kvblock import (
    DEFAULT_INDEX_SIZE,
    DEFAULT_PODS_PER_KEY,
    DEFAULT_TIER_WEIGHTS,
    HASH_ALGORITHMS,
    HASH_CBOR_FNV,
    KVBlockIndex,
    PodEntry,
    TokenProcessor,
    TokenProcessorConfig,
    block_extras,
    fold_cache_salt,
    longest_prefix_scores,
    matched_blocks,
    matched_blocks_by_tier,
)
from evergreen_trio.picker.kvevents import KVEventIndexer
from evergreen_trio.picker.p2p_source import REQUEST_ID_HEADER
from evergreen_trio.picker.plugin_state import MAX_LISTED, first_sorted, identity
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, PrefixScorerParams, register

if TYPE_CHECKING:
    from evergreen_trio.picker.engine_metrics import EndpointMetrics
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

PRECISE_PRODUCER = "precise-prefix-cache-producer"
LEGACY_SCORER = "precise-prefix-cache-scorer"
DEFAULT_SOCKET_PORT = 5557
DEFAULT_TOPIC_FILTER = "kv@"
DEFAULT_SPECULATIVE_TTL_S = 2.0
MAX_INDEX_SIZE = 100_000_000  # the reference's default size: the most we let a config ask for
MAX_SPECULATIVE = 10_000
"""Speculative routing decisions remembered at once (the oldest are rolled back first)."""
PREFILL_PROFILE = "prefill"
_PARAMS = ("tokenProcessorConfig", "indexerConfig", "kvEventsConfig", "speculativeIndexing", "speculativeTTL")


@dataclass(frozen=True)
class KVEventsConfig:
    """``kvEventsConfig``: where KV events come from. With ``discover_pods`` one SUB socket per
    pool endpoint connects to ``tcp://<host>:<socket_port>``; ``zmq_endpoint`` is one more socket
    the engines connect to (bound here), whose topics name the endpoint."""

    zmq_endpoint: str = ""
    topic_filter: str = DEFAULT_TOPIC_FILTER
    discover_pods: bool = True
    socket_port: int = DEFAULT_SOCKET_PORT


@dataclass(frozen=True)
class PreciseParams:
    """The producer's parameters (the legacy scorer's too)."""

    tokens: TokenProcessorConfig = field(default_factory=TokenProcessorConfig)
    index_size: int = DEFAULT_INDEX_SIZE
    pods_per_key: int = DEFAULT_PODS_PER_KEY
    tier_weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_TIER_WEIGHTS.items())
    events: KVEventsConfig = field(default_factory=KVEventsConfig)
    speculative: bool = False
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    legacy: bool = False  # a precise-prefix-cache-scorer's


def _token_config(params: Params) -> TokenProcessorConfig:
    section = params.section("tokenProcessorConfig", ("blockSize", "blockSizeTokens", "hashSeed", "hashAlgorithm"))
    size = section.integer("blockSizeTokens", 0, minimum=-(2**63))
    legacy = section.integer("blockSize", 0, minimum=-(2**63))
    size = size or legacy or TokenProcessorConfig.block_size_tokens
    if size <= 0:
        raise ConfigError(section.where("blockSizeTokens"), "blockSizeTokens greater than 0", size)
    algorithm = section.text("hashAlgorithm", "") or HASH_CBOR_FNV
    if algorithm not in HASH_ALGORITHMS:
        raise ConfigError(section.where("hashAlgorithm"), " | ".join(HASH_ALGORITHMS), algorithm)
    return TokenProcessorConfig(size, section.text("hashSeed", ""), algorithm)


def _index_config(params: Params) -> tuple[int, int, tuple[tuple[str, float], ...]]:
    section = params.section("indexerConfig", ("kvBlockIndexConfig", "kvCacheBackendConfigs", "tokenizersPoolConfig"))
    if section.raw.get("tokenizersPoolConfig") is not None:
        raise ConfigError(section.where("tokenizersPoolConfig"), "absent: configure a token-producer plugin instead",
                          "tokenizersPoolConfig (not supported)")
    index = section.section("kvBlockIndexConfig", ("inMemoryConfig", "redisConfig", "costAwareMemoryConfig",
                                                   "enableMetrics", "metricsLoggingInterval"))
    for other in ("costAwareMemoryConfig", "redisConfig"):
        if index.raw.get(other) is not None:
            raise ConfigError(index.where(other), "inMemoryConfig (the one index backend this picker runs)",
                              f"{other} (not implemented)")
    index.boolean("enableMetrics", False)
    memory = index.section("inMemoryConfig", ("size", "podCacheSize"))
    size = memory.integer("size", DEFAULT_INDEX_SIZE, minimum=1, maximum=MAX_INDEX_SIZE)
    pods = memory.integer("podCacheSize", DEFAULT_PODS_PER_KEY, minimum=1, maximum=1024)
    weights = dict(DEFAULT_TIER_WEIGHTS)
    if "kvCacheBackendConfigs" in section.raw:
        raw = section.raw["kvCacheBackendConfigs"]
        if not isinstance(raw, list):
            raise ConfigError(section.where("kvCacheBackendConfigs"), "a list of {name, weight}", raw)
        weights = {}
        for i, item in enumerate(raw):
            backend = Params(item, section.where(f"kvCacheBackendConfigs[{i}]"), "kvCacheBackendConfigs",
                             ("name", "weight"))
            weights[backend.text("name", "")] = backend.number("weight", 0.0, minimum=-1e308)
    return size, pods, tuple(weights.items())


def _events_config(params: Params) -> KVEventsConfig:
    section = params.section("kvEventsConfig", ("zmqEndpoint", "topicFilter", "concurrency", "engineType",
                                                "discoverPods", "podDiscoveryConfig"))
    engine = section.text("engineType", "") or "vllm"
    if engine == "sglang":
        raise ConfigError(section.where("engineType"), "vllm (SGLang's KV events are not implemented here)", engine)
    if engine != "vllm":
        raise ConfigError(section.where("engineType"), "vllm | sglang", engine)
    section.integer("concurrency", 4, minimum=1, maximum=1024)  # one subscriber task per endpoint: no worker pool
    endpoint = section.text("zmqEndpoint", "")
    if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(section.where("zmqEndpoint"), "a ZMQ address like tcp://*:5557", endpoint)
    discovery = section.section("podDiscoveryConfig", ("podLabelSelector", "podNamespace", "socketPort",
                                                       "replaySocketPort"))
    discovery.text("podLabelSelector", "")
    discovery.text("podNamespace", "")
    if discovery.integer("replaySocketPort", 0, minimum=-(2**63)) > 0:
        raise ConfigError(discovery.where("replaySocketPort"), "0 or absent (event replay is not implemented here)",
                          discovery.raw["replaySocketPort"])
    port = discovery.integer("socketPort", DEFAULT_SOCKET_PORT, minimum=1, maximum=65535)
    return KVEventsConfig(endpoint, section.text("topicFilter", DEFAULT_TOPIC_FILTER),
                          section.boolean("discoverPods", True), port)


def _require_packages(path: str) -> None:
    """ConfigError naming the package when msgpack or pyzmq (the ``picker`` extra's) is missing."""
    for module, package in (("msgpack", "msgpack"), ("zmq", "pyzmq")):
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(path, f"{package} installed (pip install 'evergreen-trio[picker]')",
                              f"missing: {module}") from None


def _precise(params: Params, *, legacy: bool = False) -> PreciseParams:
    _require_packages(params.path)
    tokens = _token_config(params)
    size, pods, weights = _index_config(params)
    events = _events_config(params)
    speculative = params.boolean("speculativeIndexing", False)
    ttl = DEFAULT_SPECULATIVE_TTL_S
    if params.raw.get("speculativeTTL", "") != "":
        from evergreen_trio.picker.config import parse_duration  # config imports the plugin registry: not at load

        ttl = parse_duration(params.raw["speculativeTTL"], params.where("speculativeTTL"))
    return PreciseParams(tokens, size, pods, weights, events, speculative, ttl, legacy)


def _legacy(params: Params) -> PreciseParams:
    return _precise(params, legacy=True)


register(PRECISE_PRODUCER, PluginType(Category.EXTRACTOR, _PARAMS, _precise))
register(LEGACY_SCORER, PluginType(Category.SCORER, _PARAMS, _legacy, replaced_by=PRECISE_PRODUCER))


# -- the producer's state -------------------------------------------------------------------------


@dataclass
class PrefixMatch:
    """One request's lookup: its block keys per prompt, and per endpoint the tier-weighted
    leading blocks it holds (summed over the prompts)."""

    keys: list[list[int]]
    matched: dict[str, float] = field(default_factory=dict)
    holders: list[dict[int, list[PodEntry]]] = field(default_factory=list)
    """Per prompt, who holds each of its block keys (the index's lookup)."""

    @property
    def total(self) -> int:
        return sum(len(k) for k in self.keys)


_Speculative = tuple[float, list[list[int]], tuple[PodEntry, ...], str]
"""A speculative entry: its deadline, the prompts' block keys, the picks' entries, the request's
``x-request-id`` (cut short; "" without one)."""


class PrecisePrefixCache:
    """One producer: the index, the event indexer the subscribers feed, the speculative entries."""

    def __init__(self, params: object) -> None:
        assert isinstance(params, PreciseParams)
        self.params = params
        self.processor = TokenProcessor(params.tokens)
        self.index = KVBlockIndex(params.index_size, params.pods_per_key)
        self.events = KVEventIndexer(self.index, self.processor)
        self.weights = dict(params.tier_weights)
        self._last: tuple[PickRequest, PrefixMatch] | None = None
        self._speculative: deque[_Speculative] = deque()
        # The KV-event subscribers running, by endpoint: a count, as an endpoint re-subscribed
        # (relabelled) may start before its old subscriber's cleanup has run.
        self.subscribers: dict[str, int] = {}

    @property
    def block_tokens(self) -> int:
        return self.processor.block_size

    def block_keys(self, request: PickRequest) -> list[list[int]]:
        """The request's block keys per prompt with a full block (``computeBlockKeys``); none
        without the token producer's tokens."""
        tokens = request.tokens
        if tokens is None:
            return []
        size = self.processor.block_size
        out = []
        for prompt in tokens.prompts:
            ids = prompt.token_ids()
            count = len(ids) // size
            extras = block_extras(prompt.features, size, len(ids)) if prompt.features else None
            extras = fold_cache_salt(extras, tokens.cache_salt, count)
            keys = self.processor.block_keys(ids, request.model or "", extras)
            if keys:
                out.append(keys)
        return out

    def match(self, request: PickRequest, now: float) -> PrefixMatch:
        """The request's :class:`PrefixMatch` (computed once per request: every profile reads it)."""
        if self._last is not None and self._last[0] is request:
            return self._last[1]
        self.expire(now)
        result = PrefixMatch(self.block_keys(request))
        for keys in result.keys:
            holders = self.index.lookup(keys)
            result.holders.append(holders)
            for pod, score in longest_prefix_scores(keys, holders, self.weights).items():
                result.matched[pod] = result.matched.get(pod, 0.0) + score
        self._last = (request, result)
        return result

    def prefix_scores(self, request: PickRequest, candidates: Sequence[EndpointState], scorer: PrefixScorerParams,
                      now: float) -> dict[str, float]:
        """A ``prefix-cache-scorer``'s scores from this producer's match info (none without keys)."""
        found = self.match(request, now)
        total = found.total
        if not total:
            return {}
        out = {}
        for state in candidates:
            blocks = int(found.matched.get(state.endpoint.address, 0.0))  # the reference's int(score)
            out[state.endpoint.address] = scorer.score(blocks * self.block_tokens, blocks / total)
        return out

    def cached_tokens(self, request: PickRequest, addresses: Iterable[str], now: float,
                      tier: str) -> tuple[dict[str, int], dict[str, int]]:
        """Per endpoint, the prompt tokens it caches in any tier, and those it caches in ``tier``
        alone (each prompt's leading blocks until the first gap, as the reference's match info's
        ``CachedBlockCount`` and ``CachedBlocksByTier``)."""
        found = self.match(request, now)
        size = self.block_tokens
        pairs = list(zip(found.keys, found.holders, strict=True))
        anywhere: dict[str, int] = {}
        in_tier: dict[str, int] = {}
        for address in addresses:
            anywhere[address] = size * sum(matched_blocks(keys, holders, address) for keys, holders in pairs)
            in_tier[address] = size * sum(matched_blocks_by_tier(keys, holders, address).get(tier, 0)
                                          for keys, holders in pairs)
        return anywhere, in_tier

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """With speculative indexing: the picks hold the prompt's blocks until ``speculativeTTL``."""
        if not self.params.speculative or not schedule.endpoints:
            return
        keys = self.match(request, now).keys
        if not keys:
            return
        picks = [schedule.endpoints[0], *schedule.profiles.get(PREFILL_PROFILE, [])[:1]]
        entries = tuple(PodEntry(pod, speculative=True) for pod in dict.fromkeys(picks))
        for prompt_keys in keys:
            self.index.add(None, prompt_keys, entries)
        # The id cut short now: a client's 60 KiB header is not kept for the entry's TTL.
        self._speculative.append((now + self.params.speculative_ttl_s, keys, entries,
                                  identity(request.headers.get(REQUEST_ID_HEADER, ""))))
        if len(self._speculative) > MAX_SPECULATIVE:
            self._roll_back(self._speculative.popleft())

    def expire(self, now: float) -> None:
        """Roll back the speculative entries whose time is up."""
        while self._speculative and self._speculative[0][0] <= now:
            self._roll_back(self._speculative.popleft())

    def _roll_back(self, item: _Speculative) -> None:
        for prompt_keys in item[1]:
            for key in prompt_keys:
                self.index.evict_request_key(key, item[2])

    def forget(self, pod: str) -> None:
        """``pod`` left the pool: its entries go (the reference clears the index on delete)."""
        self.events.forget(pod)

    def subscribed(self, name: str, running: bool) -> None:
        """A KV-event subscriber of ``name`` (an endpoint, or the bound socket's) started or ended."""
        count = self.subscribers.get(name, 0) + (1 if running else -1)
        if count > 0:
            self.subscribers[name] = count
        else:
            self.subscribers.pop(name, None)

    def dump_state(self, now: float) -> dict[str, object]:
        """The reference's ``DumpState`` at ``now`` (expired speculative entries rolled back
        first): the KV-event subscribers, the live speculative entries' request ids, each list
        sorted, the first ``MAX_LISTED`` (100), and the block size; never the block index."""
        self.expire(now)
        ids = {item[3] for item in self._speculative if item[3]}
        return {"subscribers": first_sorted(self.subscribers), "totalSubscribers": len(self.subscribers),
                "maxSubscribers": MAX_LISTED, "speculativeIndexing": self.params.speculative,
                "speculativeEntries": first_sorted(ids), "totalSpeculativeEntries": len(self._speculative),
                "maxSpeculativeEntries": MAX_LISTED, "blockSizeTokens": self.block_tokens}


def precise_caches(states: Mapping[str, object]) -> dict[str, PrecisePrefixCache]:
    """The producers to feed with events, by plugin name: each declared producer, and a legacy
    scorer's own one only when no producer is declared (it then reads that one instead)."""
    caches = {name: s for name, s in states.items() if isinstance(s, PrecisePrefixCache)}
    producers = {name: s for name, s in caches.items() if not s.params.legacy}
    return producers or caches


_DEFAULT_SCORER = PrefixScorerParams()  # the legacy scorer scores as a prefix-cache-scorer of defaults


def _legacy_scores(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                   fresh: Mapping[str, EndpointMetrics], state: object) -> dict[str, float]:
    """A ``precise-prefix-cache-scorer``: a default ``prefix-cache-scorer`` over its own producer,
    or over the declared ``precise-prefix-cache-producer`` when there is one."""
    producers = [s for s in precise_caches(scheduler.plugin_states).values() if not s.params.legacy]
    cache = producers[0] if len(producers) == 1 else state
    if not isinstance(cache, PrecisePrefixCache):
        return {}
    tracing = scheduler.tracing  # with --tracing: the reference's score_prefix_cache span
    if tracing is not None:
        tracing.scorer_started(request, len(candidates), name="score_prefix_cache")
    scores = cache.prefix_scores(request, candidates, _DEFAULT_SCORER, scheduler.snapshot.clock())
    if tracing is not None:
        tracing.scorer_ended(scores)
    return scores


def check_precise(plugins: Mapping[str, Plugin], where: Callable[[str], str]) -> set[str]:
    """The declared producers' names (what ``prefixMatchInfoProducerName`` may name); ConfigError
    when a legacy scorer has two producers to choose from (the reference cannot disambiguate)."""
    producers = [name for name, p in plugins.items() if p.type == PRECISE_PRODUCER]
    if len(producers) > 1 and any(p.type == LEGACY_SCORER for p in plugins.values()):
        raise ConfigError(where(producers[1]), f"one {PRECISE_PRODUCER} beside a {LEGACY_SCORER} "
                          "(configure prefix-cache-scorer with an explicit prefixMatchInfoProducerName)", producers)
    return set(producers)


PRECISE_STATES = {PRECISE_PRODUCER: PrecisePrefixCache, LEGACY_SCORER: PrecisePrefixCache}
PRECISE_SCORERS = {LEGACY_SCORER: _legacy_scores}
