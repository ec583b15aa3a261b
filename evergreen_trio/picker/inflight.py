"""In-flight load, sans-IO: what the picker itself dispatched, and the scorers that read it.

Scraped metrics lag by up to a scrape interval, so a burst routed between two scrapes sees the
same numbers for every pick. :class:`InflightLoad` counts, per endpoint, the requests the picker
dispatched and not yet seen finish, and their uncached prompt tokens, as llm-d-router's
``inflight-load-producer`` does: +1 request and the request's tokens on dispatch; the tokens go
at the first response chunk (prefill is done) unless ``addEstimatedOutputTokens``, and the
request at the response's end of stream or when the stream is aborted (client gone, Envoy reset,
picker error). A :class:`Ticket` releases each part at most once, and onto the counter it
incremented, so an endpoint removed and re-added meanwhile is not driven negative.

The scorers (llm-d's semantics, one weight each in :class:`LoadConfig`):
``active-request-scorer`` (in-flight requests), ``token-load-scorer`` (in-flight tokens plus this
request's uncached tokens, against ``queueThresholdTokens``), ``running-requests-size-scorer``
(the scraped running count) and ``load-aware-scorer`` (the scraped waiting count, 0.5 at most).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from evergreen_trio.picker.checks import integer, number
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError

PRODUCER = "inflight-load-producer"
ACTIVE_REQUEST = "active-request-scorer"
TOKEN_LOAD = "token-load-scorer"
RUNNING_REQUESTS = "running-requests-size-scorer"
LOAD_AWARE = "load-aware-scorer"
# Plugin type -> the LoadConfig weight field it sets.
SCORERS = {ACTIVE_REQUEST: "active_request", TOKEN_LOAD: "token_load", RUNNING_REQUESTS: "running_requests",
           LOAD_AWARE: "load_aware"}
# The OpenAI fields that cap a request's output, by API.
_OUTPUT_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True)
class LoadConfig:
    """The in-flight producer's parameters and the load scorers' weights (0 = off) and parameters."""

    active_request: float = 2.0  # our default profile counts in-flight requests (docs/picker.md)
    token_load: float = 0.0
    running_requests: float = 0.0
    load_aware: float = 0.0
    idle_threshold: int = 0
    max_busy_score: float = 1.0
    queue_threshold_tokens: int = 4_194_304
    load_aware_threshold: int = 128
    add_estimated_output_tokens: bool = False
    output_ratio: float = 1.5
    max_estimated_output_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        """Whether any scorer reads the load (the tracker counts regardless: flow control may)."""
        return bool(self.active_request or self.token_load or self.running_requests or self.load_aware)


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, "true or false", value)
    return value


def plugin_values(kind: str, parameters: Mapping[str, Any], path: str) -> dict[str, Any]:
    """:class:`LoadConfig` fields from one plugin's ``parameters``; unknown keys are a ConfigError.

    ``path`` names the parameters mapping (``...plugins[2].parameters``).
    """
    values: dict[str, Any] = {}
    allowed: tuple[str, ...] = ()
    for key, value in parameters.items():
        where = f"{path}.{key}"
        if kind == PRODUCER:
            allowed = ("addEstimatedOutputTokens", "outputRatio", "maxEstimatedOutputTokens",
                       "prefixMatchInfoProducerName", "syncCrossReplicaState")
            if key == "addEstimatedOutputTokens":
                values["add_estimated_output_tokens"] = _bool(value, where)
            elif key == "outputRatio":
                values["output_ratio"] = number(value, where)
            elif key == "maxEstimatedOutputTokens":
                values["max_estimated_output_tokens"] = integer(value, where, minimum=0)
            elif key == "syncCrossReplicaState":
                _bool(value, where)  # one replica here: nothing to synchronize
            elif key == "prefixMatchInfoProducerName":
                if not isinstance(value, str):
                    raise ConfigError(where, "a plugin name", value)
            else:
                break
        elif kind == ACTIVE_REQUEST:
            allowed = ("idleThreshold", "maxBusyScore", "requestTimeout", "inFlightLoadProducerName")
            if key == "idleThreshold":
                values["idle_threshold"] = integer(value, where, minimum=0)
            elif key == "maxBusyScore":
                score = number(value, where)
                if score > 1.0:
                    raise ConfigError(where, "a number in [0, 1]", value)
                values["max_busy_score"] = score
            elif key in ("requestTimeout", "inFlightLoadProducerName"):  # deprecated / one producer here
                if not isinstance(value, str):
                    raise ConfigError(where, "a string", value)
            else:
                break
        elif kind == TOKEN_LOAD:
            allowed = ("queueThresholdTokens", "inFlightLoadProducerName")
            if key == "queueThresholdTokens":
                values["queue_threshold_tokens"] = integer(value, where, minimum=1)
            elif key == "inFlightLoadProducerName":
                if not isinstance(value, str):
                    raise ConfigError(where, "a string", value)
            else:
                break
        elif kind == LOAD_AWARE:
            allowed = ("threshold",)
            if key != "threshold":
                break
            values["load_aware_threshold"] = integer(value, where, minimum=1)
        else:  # running-requests-size-scorer has no parameters
            break
    else:
        return values
    unknown = next(k for k in parameters if k not in allowed)
    expected = f"one of {sorted(allowed)}" if allowed else "no parameters"
    raise ConfigError(f"{path}.{unknown}", expected, unknown)


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


def uncached_tokens(prompt_tokens: int, indexed_blocks: int, matched_blocks: int, block_tokens: int) -> int:
    """Prompt tokens the endpoint must compute: the indexed blocks it lacks plus the unindexed tail."""
    indexed = indexed_blocks * block_tokens
    return max(0, indexed - matched_blocks * block_tokens) + max(0, prompt_tokens - indexed)


class _Counter:
    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0


class Ticket:
    """One dispatched request's share of its endpoint's counters; each release happens once."""

    __slots__ = ("_counter", "_on_release", "_requests", "_tokens", "address", "prompt_tokens")

    def __init__(self, counter: _Counter, address: str, prompt_tokens: int, output_tokens: int,
                 on_release: InflightLoad) -> None:
        self._counter = counter
        self.address = address
        self.prompt_tokens = prompt_tokens
        self._tokens = prompt_tokens + output_tokens
        self._requests = 1
        self._on_release = on_release
        counter.requests += 1
        counter.tokens += self._tokens

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

    def release(self) -> None:
        """The response ended or the stream was aborted: everything goes (idempotent)."""
        if self._tokens:
            self._counter.tokens = max(0, self._counter.tokens - self._tokens)
            self._tokens = self.prompt_tokens = 0
        if self._requests:
            self._requests = 0
            self._counter.requests = max(0, self._counter.requests - 1)
            self._on_release.released += 1


class InflightLoad:
    """Per-endpoint in-flight requests and tokens, as the picker dispatched them."""

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config or LoadConfig()
        self._counters: dict[str, _Counter] = {}
        self.released = 0  # requests released so far (flow control wakes on a change)

    def dispatch(self, address: str, uncached_prompt_tokens: int, *, prompt_tokens: int = 0,
                 client_output_cap: int | None = None) -> Ticket:
        """Count a request sent to ``address`` (its uncached prompt tokens, and its estimated output
        tokens with ``addEstimatedOutputTokens``, from the whole prompt)."""
        counter = self._counters.get(address)
        if counter is None:
            counter = self._counters[address] = _Counter()
        output = 0
        if self.config.add_estimated_output_tokens:
            output = estimated_output(self.config, prompt_tokens or uncached_prompt_tokens, client_output_cap)
        return Ticket(counter, address, max(0, uncached_prompt_tokens), output, self)

    def requests(self, address: str) -> int:
        counter = self._counters.get(address)
        return counter.requests if counter is not None else 0

    def tokens(self, address: str) -> int:
        counter = self._counters.get(address)
        return counter.tokens if counter is not None else 0

    def total_requests(self) -> int:
        return sum(c.requests for c in self._counters.values())

    def forget(self, keep: Sequence[str]) -> None:
        """Drop the counters of endpoints no longer listed (a ticket still out releases its orphan)."""
        wanted = set(keep)
        for address in [a for a in self._counters if a not in wanted]:
            del self._counters[address]


def active_request_scores(config: LoadConfig, counts: Mapping[str, int]) -> dict[str, float]:
    """Idle (<= ``idleThreshold``) scores 1.0; busier ones (max - n) / max x ``maxBusyScore``."""
    busiest = max(counts.values(), default=0)
    return {a: 1.0 if n <= config.idle_threshold else (busiest - n) / busiest * config.max_busy_score
            for a, n in counts.items()}


def token_load_score(config: LoadConfig, tokens: int) -> float:
    """1 - min(1, tokens / ``queueThresholdTokens``); 1.0 with nothing in flight."""
    if tokens <= 0:
        return 1.0
    return 1.0 - min(tokens, config.queue_threshold_tokens) / config.queue_threshold_tokens


def running_requests_scores(metrics: Mapping[str, EndpointMetrics]) -> dict[str, float]:
    """(max - running) / (max - min) over the candidates; all 1.0 when they are equal."""
    running = {a: m.running for a, m in metrics.items()}
    low, high = min(running.values(), default=0.0), max(running.values(), default=0.0)
    return {a: 1.0 if high == low else (high - r) / (high - low) for a, r in running.items()}


def load_aware_score(config: LoadConfig, waiting: float) -> float:
    """0.5 with an empty queue, falling linearly to 0 at ``threshold`` waiting requests."""
    if waiting <= 0:
        return 0.5
    return 0.5 * (1.0 - min(waiting, config.load_aware_threshold) / config.load_aware_threshold)


def add_load_scores(config: LoadConfig, load: InflightLoad, result: dict[str, float],
                    fresh: Mapping[str, EndpointMetrics], request_tokens: Mapping[str, int],
                    timings: dict[str, float]) -> None:
    """Add each enabled load scorer's weighted score to ``result`` (candidate address -> score).

    In-flight scorers score every candidate (the counts are the picker's own, never stale); the
    metric scorers only those with fresh metrics, like the other metric scorers.
    ``request_tokens`` is this request's uncached prompt tokens per candidate; ``timings`` gets
    seconds per scorer type.
    """
    started = time.perf_counter()
    if config.active_request:
        scores = active_request_scores(config, {a: load.requests(a) for a in result})
        for address, score in scores.items():
            result[address] += config.active_request * score
        timings[ACTIVE_REQUEST], started = time.perf_counter() - started, time.perf_counter()
    if config.token_load:
        for address in result:
            tokens = load.tokens(address) + request_tokens.get(address, 0)
            result[address] += config.token_load * token_load_score(config, tokens)
        timings[TOKEN_LOAD], started = time.perf_counter() - started, time.perf_counter()
    if config.running_requests and fresh:
        for address, score in running_requests_scores(fresh).items():
            result[address] += config.running_requests * score
        timings[RUNNING_REQUESTS], started = time.perf_counter() - started, time.perf_counter()
    if config.load_aware:
        for address, m in fresh.items():
            result[address] += config.load_aware * load_aware_score(config, m.waiting)
        timings[LOAD_AWARE] = time.perf_counter() - started


def prompt_tokens(prompt_bytes: int, chars_per_token: int) -> int:
    """The prompt's token estimate without a tokenizer: its bytes / ``charsPerToken``, rounded up."""
    return math.ceil(prompt_bytes / chars_per_token) if prompt_bytes > 0 else 0
