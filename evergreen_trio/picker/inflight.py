"""In-flight load, sans-IO: what the picker itself dispatched, and the scorers that read it.

Scraped metrics lag by up to a scrape interval, so a burst routed between two scrapes sees the
same numbers for every pick. :class:`InflightLoad` counts, per endpoint, the requests the picker
dispatched and not yet seen finish, and their uncached prompt tokens, as llm-d-router's
``inflight-load-producer`` does: +1 request and the request's tokens on dispatch; the tokens go
at the first response chunk (prefill is done) unless ``addEstimatedOutputTokens``, and the
request at the response's end of stream or when the stream is aborted (client gone, Envoy reset,
picker error). A :class:`Ticket` releases each part at most once, and onto the counter it
incremented, so an endpoint removed and re-added meanwhile is not driven negative.

The scorers (llm-d's semantics; plugin types registered here, run by the scheduler's profiles):
``active-request-scorer`` (in-flight requests), ``token-load-scorer`` (in-flight tokens plus this
request's uncached tokens, against ``queueThresholdTokens``), ``running-requests-size-scorer``
(the scraped running count) and ``load-aware-scorer`` (the scraped waiting count, 0.5 at most).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.plugin_state import MAX_LISTED, busiest, identity
from evergreen_trio.picker.plugins import APPROX_PRODUCER, Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

PRODUCER = "inflight-load-producer"
ACTIVE_REQUEST = "active-request-scorer"
TOKEN_LOAD = "token-load-scorer"
RUNNING_REQUESTS = "running-requests-size-scorer"
LOAD_AWARE = "load-aware-scorer"
# The OpenAI fields that cap a request's output, by API.
_OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True)
class LoadConfig:
    """The in-flight producer's parameters, and the load scorers' weights in the profile a plain
    config's flat weights describe (an ``EndpointPickerConfig``'s profiles weigh them instead).

    ``active_request`` is 2 by default: our default profile counts in-flight requests
    (docs/picker.md, "In-flight load", has the measurement behind it).
    """

    active_request: float = 2.0
    token_load: float = 0.0
    running_requests: float = 0.0
    load_aware: float = 0.0
    add_estimated_output_tokens: bool = False
    output_ratio: float = 1.5
    max_estimated_output_tokens: int | None = None
    producer_name: str = PRODUCER  # the ``inflight-load-producer`` plugin's name (a metrics label)
    prefix_producer: str = ""
    """Whose prefix matches discount the cached prompt ("": the approximate index; else a declared
    ``precise-prefix-cache-producer``'s name)."""

    def weights(self) -> dict[str, float]:
        """Scorer type -> weight for the flat profile."""
        return {ACTIVE_REQUEST: self.active_request, TOKEN_LOAD: self.token_load,
                RUNNING_REQUESTS: self.running_requests, LOAD_AWARE: self.load_aware}


@dataclass(frozen=True)
class ActiveRequestParams:
    """``active-request-scorer``: at most ``idle_threshold`` in flight scores 1.0."""

    idle_threshold: int = 0
    max_busy_score: float = 1.0


@dataclass(frozen=True)
class TokenLoadParams:
    """``token-load-scorer``: in-flight tokens at ``queue_threshold_tokens`` score 0."""

    queue_threshold_tokens: int = 4_194_304


@dataclass(frozen=True)
class LoadAwareParams:
    """``load-aware-scorer``: ``threshold`` waiting requests score 0."""

    threshold: int = 128


def _producer(params: Params) -> LoadConfig:
    producer = params.text("prefixMatchInfoProducerName", "")  # epp_config checks it names a declared producer
    params.boolean("syncCrossReplicaState", True)  # one replica here: nothing to synchronize
    cap = params.integer("maxEstimatedOutputTokens", 0) if params.has("maxEstimatedOutputTokens") else None
    return LoadConfig(0.0, add_estimated_output_tokens=params.boolean("addEstimatedOutputTokens", False),
                      output_ratio=params.number("outputRatio", 1.5), max_estimated_output_tokens=cap,
                      prefix_producer="" if producer == APPROX_PRODUCER else producer)


def _active_request(params: Params) -> ActiveRequestParams:
    params.text("requestTimeout", "")  # deprecated and ignored, as in llm-d
    params.text("inFlightLoadProducerName", "")
    return ActiveRequestParams(params.integer("idleThreshold", 0), params.number("maxBusyScore", 1.0, maximum=1.0))


def _token_load(params: Params) -> TokenLoadParams:
    params.text("inFlightLoadProducerName", "")
    return TokenLoadParams(params.integer("queueThresholdTokens", 4_194_304, minimum=1))


def _load_aware(params: Params) -> LoadAwareParams:
    return LoadAwareParams(params.integer("threshold", 128, minimum=1))


register(PRODUCER, PluginType(Category.PRODUCER, (
    "addEstimatedOutputTokens", "outputRatio", "maxEstimatedOutputTokens", "prefixMatchInfoProducerName",
    "syncCrossReplicaState"), _producer))
register(ACTIVE_REQUEST, PluginType(Category.SCORER, (
    "idleThreshold", "maxBusyScore", "requestTimeout", "inFlightLoadProducerName"), _active_request))
register(TOKEN_LOAD, PluginType(Category.SCORER, ("queueThresholdTokens", "inFlightLoadProducerName"), _token_load))
register(RUNNING_REQUESTS, PluginType(Category.SCORER))
register(LOAD_AWARE, PluginType(Category.SCORER, ("threshold",), _load_aware))


def producer_config(plugins: Mapping[str, Plugin]) -> LoadConfig:
    """The producer's parameters from an ``EndpointPickerConfig``'s plugins (weights: its profiles)."""
    for plugin in plugins.values():
        if plugin.type == PRODUCER and isinstance(plugin.params, LoadConfig):
            return replace(plugin.params, producer_name=plugin.name)
    return LoadConfig(0.0)


def output_cap(body: Mapping[str, Any]) -> int | None:
    """The client's own output limit (``max_tokens`` and its per-API names), when it set one."""
    for key in _OUTPUT_CAPS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def estimated_output(config: LoadConfig, prompt_tokens: int, client_cap: int | None) -> int:
    """round(prompt x outputRatio), capped by the client's limit and ``maxEstimatedOutputTokens``."""
    if prompt_tokens <= 0:
        return 0
    estimate = round(prompt_tokens * config.output_ratio)
    for cap in (client_cap, config.max_estimated_output_tokens):
        if cap is not None and cap < estimate:
            estimate = cap
    return estimate


def uncached_tokens(prompt_tokens: int, matched_blocks: int, block_tokens: int, total_blocks: int) -> int:
    """Prompt tokens the endpoint must compute, as the reference's ``uncachedInputTokens``: the
    prompt's indexed blocks it lacks, each counted whole (a short tail block too), and the tokens
    beyond the indexed blocks; the whole prompt when nothing was indexed."""
    if total_blocks <= 0 or block_tokens <= 0:
        return max(0, prompt_tokens)
    indexed = total_blocks * block_tokens
    return max(0, indexed - matched_blocks * block_tokens) + max(0, prompt_tokens - indexed)


Group = tuple[str, int]
"""A request's fairness id (as the client sent it) and priority: the in-flight metrics' labels."""


class _Counter:
    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0


class _EndpointCounter(_Counter):
    """An endpoint's counts, and the same split by :data:`Group` (``[requests, tokens]``, a list: no
    call to make one). A group goes when its last request does, so a client's fairness ids cost
    memory only while its requests are in flight."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[Group, list[int]] = {}


class Ticket:
    """One dispatched request's share of its endpoint's counters (and its group's); each release happens once."""

    __slots__ = ("_counter", "_group", "_key", "_on_release", "_requests", "_tokens", "address", "prompt_tokens")

    def __init__(self, counter: _EndpointCounter, key: Group, address: str, prompt_tokens: int, output_tokens: int,
                 on_release: InflightLoad) -> None:
        self._counter = counter
        self._key = key
        self.address = address
        self.prompt_tokens = prompt_tokens
        self._tokens = tokens = prompt_tokens + output_tokens
        self._requests = 1
        self._on_release = on_release
        counter.requests += 1
        counter.tokens += tokens
        group = counter.groups.get(key)
        if group is None:
            group = counter.groups[key] = [1, tokens]
        else:
            group[0] += 1
            group[1] += tokens
        self._group = group

    @property
    def released(self) -> bool:
        """True once the request itself has been released (its tokens then are too)."""
        return not self._requests

    def release_prompt(self) -> None:
        """The first response chunk came: prefill is done, the prompt tokens go."""
        give = min(self.prompt_tokens, self._tokens)
        self.prompt_tokens = 0
        if give:
            self._tokens -= give
            self._counter.tokens = max(0, self._counter.tokens - give)
            self._group[1] -= give  # exactly what its tickets added: never below 0

    def release(self) -> None:
        """The response ended or the stream was aborted: everything goes (idempotent)."""
        counter, group = self._counter, self._group
        if self._tokens:
            counter.tokens = max(0, counter.tokens - self._tokens)
            group[1] -= self._tokens
            self._tokens = self.prompt_tokens = 0
        if self._requests:
            self._requests = 0
            counter.requests = max(0, counter.requests - 1)
            group[0] -= 1
            if not group[0]:  # the group is in the map while it has a request (forget() drops them all)
                del counter.groups[self._key]
            self._on_release.released += 1


class InflightLoad:
    """Per-endpoint in-flight requests and tokens, as the picker dispatched them, also per :data:`Group`."""

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config or LoadConfig()
        self._counters: dict[str, _EndpointCounter] = {}
        self.released = 0  # requests released so far (flow control wakes on a change)

    def dispatch(self, address: str, uncached_prompt_tokens: int, *, prompt_tokens: int = 0,
                 client_output_cap: int | None = None, group: Group = ("", 0)) -> Ticket:
        """Count a request of ``group`` sent to ``address`` (its uncached prompt tokens, and its estimated
        output tokens with ``addEstimatedOutputTokens``, from the whole prompt)."""
        counter = self._counters.get(address)
        if counter is None:
            counter = self._counters[address] = _EndpointCounter()
        output = 0
        if self.config.add_estimated_output_tokens:
            output = estimated_output(self.config, prompt_tokens or uncached_prompt_tokens, client_output_cap)
        return Ticket(counter, group, address, max(0, uncached_prompt_tokens), output, self)

    def requests(self, address: str) -> int:
        counter = self._counters.get(address)
        return counter.requests if counter is not None else 0

    def request_counts(self, addresses: Iterable[str]) -> dict[str, int]:
        """``requests(address)`` of each of ``addresses``, in one pass."""
        counters = self._counters
        return {a: c.requests if (c := counters.get(a)) is not None else 0 for a in addresses}

    def tokens(self, address: str) -> int:
        counter = self._counters.get(address)
        return counter.tokens if counter is not None else 0

    def groups(self, address: str) -> list[tuple[Group, int, int]]:
        """``address``'s groups with a request in flight: each with its requests and tokens."""
        counter = self._counters.get(address)
        if counter is None:
            return []
        return [(key, requests, tokens) for key, (requests, tokens) in counter.groups.items()]

    def total_requests(self) -> int:
        return sum(c.requests for c in self._counters.values())

    def forget(self, keep: Sequence[str]) -> None:
        """Drop the counters of endpoints no longer listed (a ticket still out releases its orphan)."""
        wanted = set(keep)
        for address in [a for a in self._counters if a not in wanted]:
            del self._counters[address]

    def dump_state(self) -> dict[str, object]:
        """The ``inflight-load-producer``'s ``DumpState``: each endpoint's requests and tokens in
        flight, the busiest (requests + tokens) ``MAX_LISTED`` (100); ``truncated`` when more."""
        counters = self._counters
        loads = {a: c.requests + c.tokens for a, c in counters.items()}
        return {"endpoints": [{"endpoint": identity(a), "requests": counters[a].requests, "tokens": counters[a].tokens}
                              for a in busiest(loads)],
                "totalEndpoints": len(counters), "maxEndpoints": MAX_LISTED, "truncated": len(counters) > MAX_LISTED}


def active_request_scores(params: ActiveRequestParams, counts: Mapping[str, int]) -> dict[str, float]:
    """Idle (<= ``idleThreshold``) scores 1.0; busier ones (max - n) / max x ``maxBusyScore``."""
    busiest = max(counts.values(), default=0)
    return {a: 1.0 if n <= params.idle_threshold else (busiest - n) / busiest * params.max_busy_score
            for a, n in counts.items()}


def token_load_score(params: TokenLoadParams, tokens: int) -> float:
    """1 - min(1, tokens / ``queueThresholdTokens``); 1.0 with nothing in flight."""
    if tokens <= 0:
        return 1.0
    return 1.0 - min(tokens, params.queue_threshold_tokens) / params.queue_threshold_tokens


def running_requests_scores(metrics: Mapping[str, EndpointMetrics]) -> dict[str, float]:
    """(max - running) / (max - min) over the candidates; all 1.0 when they are equal."""
    running = {a: m.running for a, m in metrics.items()}
    low, high = min(running.values(), default=0.0), max(running.values(), default=0.0)
    return {a: 1.0 if high == low else (high - r) / (high - low) for a, r in running.items()}


def load_aware_score(params: LoadAwareParams, waiting: float) -> float:
    """0.5 with an empty queue, falling linearly to 0 at ``threshold`` waiting requests."""
    if waiting <= 0:
        return 0.5
    return 0.5 * (1.0 - min(waiting, params.threshold) / params.threshold)


# The scorers' parameters where a profile gives none (frozen: one instance serves every pick).
_ACTIVE_REQUEST_DEFAULTS = ActiveRequestParams()
_TOKEN_LOAD_DEFAULTS = TokenLoadParams()
_LOAD_AWARE_DEFAULTS = LoadAwareParams()


# Scorer functions as the scheduler calls them: (scheduler, request, candidates, fresh metrics, params).
# In-flight scorers score every candidate (the counts are the picker's own, never stale); the
# metric scorers only those with fresh metrics, like the other metric scorers.
def _active_request_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                           fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    config = params if isinstance(params, ActiveRequestParams) else _ACTIVE_REQUEST_DEFAULTS
    return active_request_scores(config, scheduler.inflight.request_counts([s.endpoint.address for s in candidates]))


def _token_load_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                       fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    config = params if isinstance(params, TokenLoadParams) else _TOKEN_LOAD_DEFAULTS
    own = scheduler.uncached_tokens(request, [s.endpoint.address for s in candidates])
    return {a: token_load_score(config, scheduler.inflight.tokens(a) + tokens) for a, tokens in own.items()}


def _running_requests_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                             fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    return running_requests_scores(fresh) if fresh else {}


def _load_aware_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                       fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    config = params if isinstance(params, LoadAwareParams) else _LOAD_AWARE_DEFAULTS
    return {a: load_aware_score(config, m.waiting) for a, m in fresh.items()}


LOAD_SCORERS = {ACTIVE_REQUEST: _active_request_scorer, TOKEN_LOAD: _token_load_scorer,
                RUNNING_REQUESTS: _running_requests_scorer, LOAD_AWARE: _load_aware_scorer}


def prompt_tokens(prompt_bytes: int, chars_per_token: int) -> int:
    """The prompt's token estimate without a tokenizer: its bytes / ``charsPerToken``, rounded up."""
    return math.ceil(prompt_bytes / chars_per_token) if prompt_bytes > 0 else 0
