"""llm-d-router's predicted-latency plugin family, sans-IO (ebab68792).

``predicted-latency-producer`` (``requestcontrol/dataproducer/predictedlatency``): for each
request, one row of features per candidate (KV usage, waiting queue, the in-flight requests and
prefill tokens the picker counts, prompt tokens, prefix-cache share, the pod's role) sent as one
bulk call to the latency predictor (:mod:`evergreen_trio.picker.latency_client`); each candidate's
predicted TTFT/TPOT becomes a :class:`LatencyInfo`, with its headroom under the request's SLO
headers (``x-llm-d-slo-ttft-ms``, ``x-llm-d-slo-tpot-ms``, or their older ``x-slo-*`` names).
After the pick the request joins its endpoint's running queue (the tightest TPOT SLO running
there caps a newcomer's TPOT headroom); its response's first token (``streamingMode``) or end
gives a TTFT training entry, and a streamed response's end an average-TPOT one.

``latency-scorer`` (``scheduling/scorer/latency``): scores by headroom (strategies ``least`` and
``most``, idle preference and deficit buckets when every candidate misses its SLO, range
re-normalization); without predictions (predictor down or slow) a composite of free KV, relative
queue and prefix share.

``slo-headroom-tier-filter`` (``scheduling/filter/sloheadroomtier``): keeps the candidates with
non-negative headroom on both latencies, or with probability ``epsilonExploreNeg`` the others.

``latency-slo-admitter`` (``requestcontrol/admitter/latencyslo``): refuses a sheddable request
with an SLO header when predictions exist and no candidate is valid, idle or cold.

Everything here is plain data and functions; the Trio shell does the HTTP.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.latency_wire import MAX_PENDING_TRAINING, Prediction, PredictionRow, TrainingEntry
from evergreen_trio.picker.mm_cache import MM_PRODUCER
from evergreen_trio.picker.plugin_state import MAX_LISTED, busiest, finite, identity
from evergreen_trio.picker.plugins import APPROX_PRODUCER, Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

PredictionsDone = Callable[[list[Prediction] | None], None]
"""Called once with one prediction per row, in order, or None when the call failed."""
StartPredict = Callable[[Sequence[PredictionRow], PredictionsDone], None]
"""Asks the predictor for rows' predictions (the runtime's client); never calls back before it returns."""
Observe = Callable[[str, "LatencyRequest", str, float], None]
"""(producer name, request, kind, value): a metric observation (:mod:`~evergreen_trio.picker.latency_metrics`)."""
EncoderMatch = tuple[int, Mapping[str, int]]
"""A request's media items and, by endpoint address, how many of them its encoder cache likely holds."""

PRODUCER = "predicted-latency-producer"
SCORER = "latency-scorer"
TIER_FILTER = "slo-headroom-tier-filter"
ADMITTER = "latency-slo-admitter"
TTFT_SLO_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")  # the current name first, then the deprecated one
TPOT_SLO_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
PREFILL_PROFILE = "prefill"  # the reference's ExperimentalDefaultPrefillProfile
_W_MAX = 100  # the scorer's integer weight scale (wMax; minWeight is 0)
_EPS = 1e-9
_COLD_KV = 0.02  # the admitter's "cold" endpoint: KV usage below this
_NO_VALID = "no valid endpoint available to serve the request"
_MAX_MS = 1e15  # a headroom's bound (some 31,000 years)


# -- parameters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerParams:
    """``predicted-latency-producer``'s parameters (``samplingMean`` and
    ``maxDecodeTokenSamplesForPrediction`` are read and ignored, as the reference ignores them).
    ``prefix_producer``: whose prefix matches give the prefix share ("" the approximate index, else
    a declared precise or burst producer); ``encoder_producer``: the ``mm-embeddings-cache-producer``
    whose matches give the encoder features ("": ``useEncoderCacheFeatures`` off, both 0)."""

    slo_buffer_factor: float = 1.0
    context_ttl_s: float = 300.0  # 0: running requests never expire
    streaming_mode: bool = False
    endpoint_role_label: str = ""
    predict_in_produce: bool = True
    prefix_producer: str = ""
    encoder_producer: str = ""


def _prefix_producer(params: Params) -> str:
    """``prefixMatchInfoProducerName``: "" for the approximate producer (epp_config checks that
    another name is a declared precise or burst producer, as the reference's required key is)."""
    name = params.text("prefixMatchInfoProducerName", "")
    return "" if name == APPROX_PRODUCER else name


def _producer_params(params: Params) -> ProducerParams:
    params.number("samplingMean", 1000.0)
    params.integer("maxDecodeTokenSamplesForPrediction", 0)
    params.text("inFlightLoadProducerName", "")
    # On, the reference requires the named producer's match info (mm_cache adds the default one).
    encoder = params.text("encoderCacheMatchInfoProducerName", "") or MM_PRODUCER
    encoder = encoder if params.boolean("useEncoderCacheFeatures", False) else ""
    # The reference refuses sloBufferFactor <= 0; a zero buffer would make every TPOT invalid.
    factor = params.number("sloBufferFactor", 1.0)
    if factor <= 0:
        raise ConfigError(params.where("sloBufferFactor"), "a number > 0", factor)
    # Go decodes a time.Duration from JSON as integer nanoseconds (a string like "5m" fails there too).
    ttl = params.integer("contextTTL", 300 * 10**9, maximum=2**63 - 1) / 1e9
    return ProducerParams(factor, ttl, params.boolean("streamingMode", False),
                          params.text("endpointRoleLabel", ""), params.boolean("predictInProduce", True),
                          _prefix_producer(params), encoder)


@dataclass(frozen=True)
class ScorerParams:
    """``latency-scorer``'s parameters; ``producer``: whose predictions it reads, ``prefix_producer``:
    whose prefix matches its composite fallback reads (as :class:`ProducerParams`)."""

    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    strategy: str = "least"
    composite_kv_weight: float = 1.0
    composite_queue_weight: float = 1.0
    composite_prefix_weight: float = 1.0
    producer: str = PRODUCER
    prefix_producer: str = ""


def _producer_ref(params: Params) -> str:
    return params.text("latencyPredictionInfoProducerName", "") or PRODUCER


def _scorer_params(params: Params) -> ScorerParams:
    return ScorerParams(params.number("ttftWeight", 0.8), params.number("tpotWeight", 0.2),
                        params.text("headroomSelectionStrategy", "least", choices=("least", "most")),
                        params.number("compositeKVWeight", 1.0), params.number("compositeQueueWeight", 1.0),
                        params.number("compositePrefixWeight", 1.0), _producer_ref(params), _prefix_producer(params))


@dataclass(frozen=True)
class TierFilterParams:
    """``slo-headroom-tier-filter``: how often a mixed set explores the negative tier."""

    epsilon_explore_neg: float = 0.01
    producer: str = PRODUCER


def _tier_filter_params(params: Params) -> TierFilterParams:
    return TierFilterParams(params.number("epsilonExploreNeg", 0.01, maximum=1.0), _producer_ref(params))


@dataclass(frozen=True)
class AdmitterParams:
    """``latency-slo-admitter``: whose predictions it reads."""

    producer: str = PRODUCER


# -- the producer's per-request state -----------------------------------------------------------


@dataclass(frozen=True)
class LatencyInfo:
    """One candidate's prediction under the request's SLOs (the reference's ``LatencyPredictionInfo``):
    headroom = SLO - predicted (ms; negative misses it), and the requests this picker runs there."""

    ttft_valid: bool
    tpot_valid: bool
    ttft_headroom: float
    tpot_headroom: float
    ttft: float
    tpot: float
    dispatched: int = 0

    @property
    def valid(self) -> bool:
        return self.ttft_valid and self.tpot_valid


def header_float(headers: Mapping[str, str], names: Sequence[str]) -> float:
    """The first of ``names`` present, as a float: 0 when absent or not a number, as the reference
    logs and goes on, and also for NaN or an infinity (which Go parses, and which would make every
    headroom NaN here)."""
    for name in names:
        if name in headers:
            try:
                value = float(headers[name])
            except ValueError:
                return 0.0
            return value if math.isfinite(value) else 0.0
    return 0.0


@dataclass
class LatencyRequest:
    """One request's producer context: its SLOs, each candidate's features and prediction, and
    after the pick what training needs (times in the pool clock's seconds, latencies in ms)."""

    owner: PredictedLatency
    key: int
    ttft_slo: float
    tpot_slo: float
    rows: dict[str, PredictionRow]
    infos: dict[str, LatencyInfo] = field(default_factory=dict)
    model: str = ""  # the client's model and the target model (metric labels)
    target_model: str = ""
    target: str | None = None
    prefill: str | None = None
    predicted_ttft: float = 0.0
    predicted_tpot: float = 0.0
    dispatched_at: float = 0.0
    last_token_at: float = 0.0
    tokens: int = 0
    ttft: float = 0.0
    avg_tpot: float = 0.0
    done: bool = False


class _RunningQueue:
    """The requests running on one endpoint by TPOT SLO, the tightest first (the reference's
    ``requestPriorityQueue``): a heap with lazy removal."""

    def __init__(self) -> None:
        self.slos: dict[int, tuple[float, float]] = {}  # key -> (tpot SLO, added at)
        self._heap: list[tuple[float, int]] = []

    def add(self, key: int, tpot_slo: float, now: float) -> bool:
        """False for a negative or NaN SLO or a key already queued, as the reference refuses them."""
        if not tpot_slo >= 0 or key in self.slos:
            return False
        self.slos[key] = (tpot_slo, now)
        heapq.heappush(self._heap, (tpot_slo, key))
        return True

    def remove(self, key: int) -> None:
        self.slos.pop(key, None)
        heap = self._heap
        while heap and heap[0][1] not in self.slos:
            heapq.heappop(heap)
        if len(heap) > 2 * len(self.slos) + 16:  # removed keys deep in the heap: rebuild it
            self._heap = [(slo, k) for k, (slo, _) in self.slos.items()]
            heapq.heapify(self._heap)

    def min_slo(self) -> float:
        """The tightest TPOT SLO running here (0 when none runs)."""
        return self._heap[0][0] if self.slos else 0.0

    def expire(self, before: float) -> None:
        """Drop requests added before ``before`` (the reference's context TTL eviction)."""
        for key in [k for k, (_, added) in self.slos.items() if added < before]:
            self.remove(key)


class PredictedLatency:
    """One declared ``predicted-latency-producer``: the running queues, the training buffer, and
    the pure steps of a request's life (the scheduler's PluginState; the shell calls the rest)."""

    def __init__(self, params: object) -> None:
        assert isinstance(params, ProducerParams)
        self.params = params
        self.name = PRODUCER  # its plugin name (the picker sets it)
        self.observe: Observe | None = None  # the runtime's metrics
        self.metrics_of: Callable[[str], EndpointMetrics | None] = _no_metrics  # an endpoint's latest (the picker's)
        self.running: dict[str, _RunningQueue] = {}
        self.pending: list[TrainingEntry] = []  # for the shell's flush task
        self.dropped = 0  # training entries dropped because the buffer was full
        self._keys = itertools.count(1)

    # Produce --------------------------------------------------------------------------------

    def begin(self, headers: Mapping[str, str], candidates: Sequence[EndpointState], matches: Mapping[str, int],
              total_blocks: int, input_tokens: int, inflight_requests: Mapping[str, int],
              inflight_tokens: Mapping[str, int], encoder: EncoderMatch = (0, {})) -> LatencyRequest:
        """A request's context: its SLO headers and each candidate's features (the reference's
        Produce before its bulk call). ``matches``: leading prompt blocks each candidate holds, of
        ``total_blocks`` (its ``prefix_producer``'s); ``inflight_*``: what the picker has in flight
        on each; ``encoder``: the request's media items and those each candidate's encoder cache
        likely holds (its ``encoder_producer``'s)."""
        role = self.params.endpoint_role_label
        items, held = max(0, encoder[0]), encoder[1]
        rows: dict[str, PredictionRow] = {}
        for state in candidates:
            address = state.endpoint.address
            metrics = state.metrics or EndpointMetrics()
            prefix = matches.get(address, 0) / total_blocks if total_blocks > 0 else 0.0
            rows[address] = PredictionRow(
                kv_cache_percentage=_unit(metrics.kv_usage), input_token_length=max(0, input_tokens),
                num_request_waiting=_count(metrics.waiting),
                num_request_running=max(0, inflight_requests.get(address, 0)),
                num_tokens_generated=1, prefix_cache_score=_unit(prefix),
                # The reference clamps a match above the request's items rather than drop the row.
                encoder_input_size=items, encoder_matched_size=min(items, max(0, held.get(address, 0))),
                pod_type=state.endpoint.label_map.get(role, "") if role else "",  # the pod's role
                prefill_tokens_in_flight=max(0, inflight_tokens.get(address, 0)))
        return LatencyRequest(self, next(self._keys), header_float(headers, TTFT_SLO_HEADERS),
                              header_float(headers, TPOT_SLO_HEADERS), rows)

    def wants_predictions(self, request: LatencyRequest) -> bool:
        return self.params.predict_in_produce and bool(request.rows)

    def predicted(self, request: LatencyRequest, predictions: Sequence[Prediction] | None,
                  seconds: float | None = None) -> None:
        """Turn the bulk call's answer (one per row, in order; None: it failed) into each
        candidate's :class:`LatencyInfo`; a failed call leaves none (the scorer falls back).
        ``seconds``: how long the call took (a metric)."""
        if predictions is None or len(predictions) != len(request.rows):
            request.infos = {}
            return
        request.infos = {address: self.info(request, address, prediction)
                         for address, prediction in zip(request.rows, predictions, strict=True)}
        if seconds is not None:
            self._observe(request, "ttft_prediction_duration", seconds)
            self._observe(request, "tpot_prediction_duration", seconds)

    def _observe(self, request: LatencyRequest, kind: str, value: float) -> None:
        if self.observe is not None and value >= 0:
            self.observe(self.name, request, kind, value)

    def info(self, request: LatencyRequest, address: str, prediction: Prediction) -> LatencyInfo:
        """validatePrediction and the TPOT neutralization: TPOT counts only in streaming mode,
        and never on a prefill pod."""
        queue = self.running.get(address)
        ttft_headroom = request.ttft_slo - prediction.ttft_ms
        ttft_ok = prediction.ttft_ms < request.ttft_slo
        tpot_ok, tpot_headroom = True, 0.0
        params = self.params
        row = request.rows.get(address)
        prefill = row is not None and row.pod_type == "prefill"
        if params.streaming_mode and not prefill:
            buffered = request.tpot_slo * params.slo_buffer_factor
            running_min = queue.min_slo() if queue is not None else 0.0
            if running_min > 0:
                buffered = min(buffered, running_min * params.slo_buffer_factor)
            tpot_ok = prediction.tpot_ms < buffered
            tpot_headroom = buffered - prediction.tpot_ms
        return LatencyInfo(ttft_ok, tpot_ok, _bounded(ttft_headroom), _bounded(tpot_headroom), prediction.ttft_ms,
                           prediction.tpot_ms, len(queue.slos) if queue is not None else 0)

    # PreRequest -----------------------------------------------------------------------------

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """The pick is made: the request runs on its endpoint (its running queue learns its TPOT
        SLO) and its clock starts."""
        context = next((c for c in request.latency.values() if c.owner is self), None)
        if context is None or not schedule.endpoints:
            return
        target = schedule.endpoints[0]
        prefill = schedule.profiles.get(PREFILL_PROFILE) or []
        context.target, context.prefill = target, prefill[0] if prefill else None
        queue = self.running.setdefault(target, _RunningQueue())
        if self.params.context_ttl_s > 0:
            queue.expire(now - self.params.context_ttl_s)
        queue.add(context.key, context.tpot_slo, now)
        stored = context.infos.get(context.prefill or target)
        context.predicted_ttft = stored.ttft if stored is not None else 0.0
        context.dispatched_at = context.last_token_at = now

    # ResponseBody ---------------------------------------------------------------------------

    def on_chunk(self, context: LatencyRequest, now: float, end: bool) -> None:
        """A response body message at ``now`` (``end``: the last): TTFT on the first streamed
        chunk or at the end, an average TPOT at a streamed response's end."""
        if context.target is None or context.done:
            return
        streaming = self.params.streaming_mode
        if context.tokens == 0:  # the reference tests ttft == 0, which a sub-millisecond first token also passes
            if streaming and not end:
                self._first_token(context, now)
        else:
            context.tokens += 1
            context.last_token_at = now
        if not end:
            return
        if not streaming:
            self._first_token(context, now)
        if context.ttft > 0:
            self._observe(context, "ttft", context.ttft / 1000)
            self._observe(context, "predicted_ttft", context.predicted_ttft / 1000)
            if context.ttft_slo > 0:
                self._observe(context, "ttft_slo_violation", float(context.ttft > context.ttft_slo))
        if context.ttft > 0 and context.tokens > 1:
            e2e_ms = (now - context.dispatched_at) * 1000
            context.avg_tpot = (e2e_ms - context.ttft) / (context.tokens - 1)
        if context.avg_tpot > 0:
            self._observe(context, "tpot", context.avg_tpot / 1000)
            self._observe(context, "predicted_tpot", context.predicted_tpot / 1000)
            if context.tpot_slo > 0:
                self._observe(context, "tpot_slo_violation", float(context.avg_tpot > context.tpot_slo))
            row = context.rows.get(context.target)
            if row is not None:
                self._train(TrainingEntry(self._tpot_features(row, context.target), 0.0, context.avg_tpot, now))
        self.finished(context)

    def _tpot_features(self, row: PredictionRow, target: str) -> PredictionRow:
        """The TPOT entry's features: the target's KV usage and waiting queue now (the reference
        refreshes them at each token; the scheduled ones when the endpoint is gone), with neither a
        prefix share nor encoder sizes, as the reference's."""
        latest = self.metrics_of(target)
        if latest is not None:
            row = replace(row, kv_cache_percentage=_unit(latest.kv_usage), num_request_waiting=_count(latest.waiting))
        return replace(row, num_tokens_generated=0, prefix_cache_score=0.0, encoder_input_size=0,
                       encoder_matched_size=0)

    def _first_token(self, context: LatencyRequest, now: float) -> None:
        context.ttft = (now - context.dispatched_at) * 1000
        context.tokens = 1
        context.last_token_at = now
        if self.params.streaming_mode:
            stored = context.infos.get(context.target or "")
            context.predicted_tpot = stored.tpot if stored is not None else 0.0
        row = context.rows.get(context.prefill or context.target or "")
        if row is not None and context.ttft >= 0:
            self._train(TrainingEntry(replace(row, num_tokens_generated=0), context.ttft, 0.0, now))

    def _train(self, entry: TrainingEntry) -> None:
        if len(self.pending) >= MAX_PENDING_TRAINING:
            self.dropped += 1
            return
        self.pending.append(entry)

    def take_training(self) -> list[TrainingEntry]:
        """The buffered training entries, emptied (the shell's flush)."""
        entries, self.pending = self.pending, []
        return entries

    def finished(self, context: LatencyRequest) -> None:
        """The request is over (its end, or the stream gone): it leaves its endpoint's queue."""
        if context.done:
            return
        context.done = True
        queue = self.running.get(context.target or "")
        if queue is not None:
            queue.remove(context.key)
            if not queue.slos:
                del self.running[context.target or ""]

    def dump_state(self) -> dict[str, object]:
        """The reference's ``DumpState``: per endpoint its running requests and their tightest TPOT
        SLO (0 when not finite), the busiest ``MAX_LISTED`` (100), ``truncated`` when more; and
        ``trackedRequests``, the requests running over all endpoints (the reference counts its
        request contexts, which also hold the ones not yet scheduled)."""
        running = {address: len(queue.slos) for address, queue in self.running.items()}
        return {"endpoints": [{"endpoint": identity(a), "runningRequests": running[a],
                               "minTpotSlo": finite(self.running[a].min_slo())} for a in busiest(running)],
                "totalEndpoints": len(running), "maxEndpoints": MAX_LISTED, "truncated": len(running) > MAX_LISTED,
                "trackedRequests": sum(running.values())}


def _no_metrics(address: str) -> EndpointMetrics | None:
    return None


def _bounded(ms: float) -> float:
    """A headroom within +-1e15 ms: a huge SLO header times the buffer factor is finite, so the
    scorer's ranges are too."""
    return min(_MAX_MS, max(-_MAX_MS, ms))


def _unit(value: float) -> float:
    """``value`` in [0, 1] (a NaN scrape counts 0)."""
    return min(1.0, max(0.0, value)) if value == value else 0.0


def _count(value: float) -> int:
    return int(value) if math.isfinite(value) and value > 0 else 0


def producers(plugins: Mapping[str, Plugin]) -> list[str]:
    """The names of the declared ``predicted-latency-producer`` plugins."""
    return [name for name, p in plugins.items() if p.type == PRODUCER]


# -- latency-scorer -----------------------------------------------------------------------------


def _normalized(a: float, b: float) -> tuple[float, float]:
    total = a + b
    return (1.0, 0.0) if total <= 0 else (a / total, b / total)


def _headrooms(info: LatencyInfo | None) -> tuple[float, float]:
    return (info.ttft_headroom, info.tpot_headroom) if info is not None else (0.0, 0.0)


def _score_bucket(params: ScorerParams, bucket: Sequence[tuple[str, LatencyInfo | None]], scores: dict[str, float],
                  force_least: bool) -> None:
    """Normalize |headroom| within ``bucket`` and blend the two latencies (the reference's scoreBucket)."""
    alpha, beta = _normalized(params.ttft_weight, params.tpot_weight)
    pairs = [_headrooms(info) for _, info in bucket]
    ttfts = [abs(ttft) for ttft, _ in pairs]
    tpots = [abs(tpot) for _, tpot in pairs]
    min_ttft, min_tpot = min(ttfts), min(tpots)
    ttft_range, tpot_range = max(ttfts) - min_ttft, max(tpots) - min_tpot
    if ttft_range <= _EPS < tpot_range:
        alpha, beta = 0.0, 1.0
    elif tpot_range <= _EPS < ttft_range:
        alpha, beta = 1.0, 0.0
    most = params.strategy == "most" and not force_least
    for (address, _), ttft, tpot in zip(bucket, ttfts, tpots, strict=True):
        n_ttft = (ttft - min_ttft) / ttft_range if ttft_range > _EPS else 0.5
        n_tpot = (tpot - min_tpot) / tpot_range if tpot_range > _EPS else 0.5
        combined = alpha * n_ttft + beta * n_tpot
        weight = int((combined if most else 1.0 - combined) * _W_MAX) + 1
        # The reference's framework clamps a score above 1 (weight 101) to 1 (enforceScoreRange).
        scores[address] = min(1.0, weight / _W_MAX)


def headroom_scores(params: ScorerParams, infos: Mapping[str, LatencyInfo | None]) -> dict[str, float]:
    """Scores in [0, 1] by headroom (the reference's Score past its composite fallback); a
    candidate without a prediction counts as positive headroom 0, as the reference's does."""
    scores = dict.fromkeys(infos, 0.0)
    negative = [(a, i) for a, i in infos.items() if i is not None and (i.ttft_headroom < 0 or i.tpot_headroom < 0)]
    if len(negative) < len(infos):
        refused = {a for a, _ in negative}
        _score_bucket(params, [(a, i) for a, i in infos.items() if a not in refused], scores, False)
        return scores
    idle = [(a, i) for a, i in negative if i is not None and i.dispatched == 0]
    if idle:
        _score_bucket(params, idle, scores, True)
        return scores
    tpot_only = [(a, i) for a, i in negative if _headrooms(i)[0] >= 0]
    ttft_only = [(a, i) for a, i in negative if _headrooms(i)[0] < 0 <= _headrooms(i)[1]]
    both = [(a, i) for a, i in negative if _headrooms(i)[0] < 0 and _headrooms(i)[1] < 0]
    for bucket in (tpot_only, ttft_only, both):
        if bucket:
            _score_bucket(params, bucket, scores, True)
            break
    return scores


def composite_scores(params: ScorerParams, metrics: Mapping[str, EndpointMetrics],
                     prefix: Mapping[str, float]) -> dict[str, float]:
    """The fallback without predictions: weighted free KV, relative queue and prefix share."""
    wkv, wq, wpref = params.composite_kv_weight, params.composite_queue_weight, params.composite_prefix_weight
    total = wkv + wq + wpref
    if total <= 0:
        wkv, wq, wpref, total = 1.0, 0.0, 0.0, 1.0
    wkv, wq, wpref = wkv / total, wq / total, wpref / total
    max_queue = max((_count(m.waiting) for m in metrics.values()), default=0)
    scores = {}
    for address, m in metrics.items():
        queue = (max_queue - _count(m.waiting)) / max_queue if max_queue > 0 else 1.0
        composite = wkv * (1.0 - _unit(m.kv_usage)) + wq * queue + wpref * prefix.get(address, 0.0)
        scores[address] = min(1.0, max(0.0, math.floor(_W_MAX * composite + 0.5) / _W_MAX))  # Go's math.Round
    return scores


def request_infos(request: PickRequest, producer: str) -> dict[str, LatencyInfo]:
    context = request.latency.get(producer) if request.latency else None
    return context.infos if context is not None else {}


def _prefix_shares(scheduler: Scheduler, request: PickRequest, addresses: Sequence[str],
                   producer: str) -> dict[str, float]:
    matches, total, _ = scheduler.prefix_match_info(request, addresses, producer)
    return {a: m / total for a, m in matches.items()} if total else {}


def _latency_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                    fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    assert isinstance(params, ScorerParams)
    infos = request_infos(request, params.producer)
    addresses = [s.endpoint.address for s in candidates]
    if any(a in infos for a in addresses):
        return headroom_scores(params, {a: infos.get(a) for a in addresses})
    metrics = {s.endpoint.address: s.metrics or EndpointMetrics() for s in candidates}
    return composite_scores(params, metrics, _prefix_shares(scheduler, request, addresses, params.prefix_producer))


# -- slo-headroom-tier-filter -------------------------------------------------------------------


def tier_filter(params: TierFilterParams, candidates: Sequence[str], infos: Mapping[str, LatencyInfo],
                draw: float) -> list[str]:
    """The candidates kept: the positive tier (non-negative headroom on both latencies), or with
    ``draw`` below ``epsilonExploreNeg`` the others (those without a prediction among them)."""
    positive = [a for a in candidates if a in infos and infos[a].ttft_headroom >= 0 and infos[a].tpot_headroom >= 0]
    if len(candidates) <= 1 or not positive or len(positive) == len(candidates):
        return list(candidates)  # one candidate, no prediction, one tier: nothing to choose
    kept = set(positive)
    negative = [a for a in candidates if a not in kept]
    return negative if draw < params.epsilon_explore_neg else positive


def _tier_filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                 params: object) -> list[EndpointState]:
    assert isinstance(params, TierFilterParams)
    infos = request_infos(request, params.producer)
    addresses = [s.endpoint.address for s in candidates]
    positive = sum(1 for a in addresses if a in infos and infos[a].ttft_headroom >= 0 and infos[a].tpot_headroom >= 0)
    # Drawn only for a mixed set, as the reference draws, so other plugins' sequence stays the same.
    draw = scheduler.rng.random() if 0 < positive < len(addresses) and len(addresses) > 1 else 1.0
    kept = set(tier_filter(params, addresses, infos, draw))
    return [s for s in candidates if s.endpoint.address in kept]


# -- latency-slo-admitter -----------------------------------------------------------------------


def slo_denial(priority: int, headers: Mapping[str, str], metrics: Sequence[EndpointMetrics | None],
               infos: Sequence[LatencyInfo | None]) -> str | None:
    """Why a request is refused (None: admitted): only a sheddable one (priority < 0) with an SLO
    header, when some candidate has a prediction and none is valid, idle (nothing running) or
    cold (KV usage under 2%). ``metrics`` and ``infos``: each candidate's, in the same order."""
    if priority >= 0:
        return None
    if not (header_float(headers, TTFT_SLO_HEADERS) > 0 or header_float(headers, TPOT_SLO_HEADERS) > 0):
        return None
    if all(info is None for info in infos):
        return None
    for m, info in zip(metrics, infos, strict=True):
        m = m or EndpointMetrics()
        if m.kv_usage < _COLD_KV or m.running == 0 or (info is not None and info.valid):
            return None
    return _NO_VALID


def admit_latency(admitters: Sequence[AdmitterParams], request: PickRequest,
                  candidates: Sequence[EndpointState]) -> None:
    """Run the declared ``latency-slo-admitter`` plugins; RequestError 500 as the other admitters'."""
    metrics = [s.metrics for s in candidates]
    for admitter in admitters:
        infos = request_infos(request, admitter.producer)
        predicted = [infos.get(s.endpoint.address) for s in candidates]
        reason = slo_denial(request.priority, request.headers, metrics, predicted)
        if reason is not None:
            raise RequestError(500, f"request cannot be admitted: {reason}")


def declared_latency_admitters(plugins: Sequence[Plugin]) -> list[AdmitterParams]:
    return [p.params for p in plugins if isinstance(p.params, AdmitterParams)]


# -- registration -------------------------------------------------------------------------------

_PRODUCER_KEYS = ("samplingMean", "maxDecodeTokenSamplesForPrediction", "sloBufferFactor", "contextTTL",
                  "streamingMode", "endpointRoleLabel", "predictInProduce", "prefixMatchInfoProducerName",
                  "inFlightLoadProducerName", "useEncoderCacheFeatures", "encoderCacheMatchInfoProducerName")
register(PRODUCER, PluginType(Category.PRODUCER, _PRODUCER_KEYS, _producer_params))
register(SCORER, PluginType(Category.SCORER, (
    "ttftWeight", "tpotWeight", "headroomSelectionStrategy", "compositeKVWeight", "compositeQueueWeight",
    "compositePrefixWeight", "latencyPredictionInfoProducerName", "prefixMatchInfoProducerName"), _scorer_params))
register(TIER_FILTER, PluginType(Category.FILTER, ("epsilonExploreNeg", "latencyPredictionInfoProducerName"),
                                 _tier_filter_params))
register(ADMITTER, PluginType(Category.ADMITTER, ("latencyPredictionInfoProducerName",),
                              lambda params: AdmitterParams(_producer_ref(params))))

LATENCY_SCORERS = {SCORER: _latency_scorer}
LATENCY_FILTERS = {TIER_FILTER: _tier_filter}
LATENCY_STATES = {PRODUCER: PredictedLatency}
