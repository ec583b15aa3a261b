"""The Trio shell of the latency predictor client: bulk predictions, coalesced, and training flushes.

:class:`LatencyPredictorClient` runs two tasks in the picker's nursery, as the reference's
``Predictor`` runs its goroutines:

* the coalescer: predictions asked for within ``LATENCY_COALESCE_WINDOW_MS`` (1 ms) of the
  first one go as one ``POST /predict/bulk/strict`` (to a prediction server drawn at random),
  at most ``LATENCY_MAX_CONCURRENT_DISPATCHES`` (36) calls at a time, and each asker gets its
  own rows' predictions back;
* the refresh: at once and every ``LATENCY_METRICS_INTERVAL_SEC`` (60 s), a prediction server's
  ``GET /status`` and the training server's ``GET /model/download/info``: the model they serve
  (:func:`~evergreen_trio.picker.latency_wire.current_model`), logged when it changes. As in the
  reference, nothing waits for it: predictions are asked for whatever it says;
* the flush: every ``LATENCY_FLUSH_INTERVAL_SEC`` (1 s) the producers' buffered training
  entries, sampled down to ``LATENCY_MAX_SAMPLE_SIZE`` (1000), go in one
  ``POST /add_training_data_bulk`` to the training server, and once more when the picker stops
  (the reference's ``Stop``), shielded for at most :data:`FINAL_FLUSH_S` (or the HTTP timeout).

Every call is one HTTP/1.1 connection (h11 over Trio) under ``LATENCY_HTTP_TIMEOUT_SEC`` (10 s)
with a bounded reply. A failed prediction calls back with None: the request is routed without
predictions (``latency-scorer``'s composite fallback). A failure logs one warning per episode
(the next success logs that the predictor is back).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from evergreen_trio._http import HttpPostError, get_once, post_once
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.latency import PredictedLatency, PredictionsDone
from evergreen_trio.picker.latency_wire import (
    BULK_STRICT_PATH,
    MAX_REPLY_BYTES,
    MAX_REPORT_BYTES,
    MODEL_INFO_PATH,
    STATUS_PATH,
    TRAINING_PATH,
    ModelReport,
    Prediction,
    PredictionRow,
    PredictorConfig,
    PredictorError,
    Server,
    current_model,
    decode_bulk_strict,
    decode_model_report,
    encode_bulk,
    encode_training,
    sample_training,
)

log = logging.getLogger(__name__)

_MAX_TRAINING_REPLY = 64 * 1024
_QUEUED = 1024  # predictions waiting for the coalescer at most, as the reference's channel
FINAL_FLUSH_S = 2.0
"""The stopping picker's last training flush waits this long at most (a SIGTERM'd pod has ~30 s)."""


async def post_json(server: Server, path: str, body: bytes, timeout_s: float, max_reply: int) -> tuple[int, bytes]:
    """``(status, body)`` of ``POST path`` on ``server``; PredictorError on a timeout, a refused or
    lost connection, a malformed reply, or one over ``max_reply`` bytes."""
    try:
        return await post_once(server.host, server.port, path, body, timeout_s=timeout_s, max_body=max_reply)
    except HttpPostError as exc:
        raise PredictorError(str(exc)) from None


async def get_report(server: Server, path: str, timeout_s: float) -> ModelReport:
    """``GET path`` on ``server``, decoded; PredictorError as :func:`post_json`, or for the reply."""
    try:
        status, body = await get_once(server.host, server.port, path, timeout_s=timeout_s, max_body=MAX_REPORT_BYTES)
    except HttpPostError as exc:
        raise PredictorError(str(exc)) from None
    return decode_model_report(status, body, f"GET {server.url}{path}")


@dataclass
class _Asked:
    rows: Sequence[PredictionRow]
    done: PredictionsDone


class _Episode:
    """One warning when a kind of call starts failing, one info line when it works again."""

    def __init__(self, what: str) -> None:
        self.what, self.failing = what, False

    def failed(self, error: str) -> None:
        if not self.failing:
            self.failing = True
            log.warning("picker.latency_%s_failed error=%s (logged once until it works again)", self.what,
                        peer_text(error, 300))

    def worked(self) -> None:
        if self.failing:
            self.failing = False
            log.info("picker.latency_%s_recovered", self.what)


class LatencyPredictorClient:
    """Predictions and training for the declared ``predicted-latency-producer`` plugins."""

    def __init__(self, config: PredictorConfig, producers: Sequence[PredictedLatency],
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.producers = list(producers)
        self.rng = rng or random.Random()
        self._send, self._receive = trio.open_memory_channel[_Asked](_QUEUED)
        self._nursery: trio.Nursery | None = None
        self._limiter = trio.CapacityLimiter(config.max_concurrent_dispatches)
        self.predictions = _Episode("prediction")
        self.training = _Episode("training")
        self.status = _Episode("status")
        self.model_info = _Episode("model_info")
        self.reports: dict[str, ModelReport] = {}  # the last good reply of each refresh call, by path
        self.model: ModelReport | None = None  # what the reports say together (None: no refresh yet)
        self.bulk_calls = 0  # prediction calls made (a test counts the coalescing)
        self.trained = 0  # training entries the training server accepted

    def start(self, rows: Sequence[PredictionRow], done: PredictionsDone) -> None:
        """Ask for ``rows``' predictions (the processor's StartPredict); ``done`` is called from a
        task, later: with None at once for rows the reference refuses or a full queue."""
        problem = self._refusal(rows)
        if problem is None:
            try:
                self._send.send_nowait(_Asked(rows, done))
                return
            except trio.WouldBlock:
                problem = f"{_QUEUED} prediction calls already waiting"
        self.predictions.failed(problem)
        assert self._nursery is not None, "start() before run()"
        self._nursery.start_soon(_call, done, None)

    def _refusal(self, rows: Sequence[PredictionRow]) -> str | None:
        if not rows:
            return "no prediction requests provided"
        if len(rows) > self.config.max_bulk_size:
            return f"too many requests: {len(rows)} (max: {self.config.max_bulk_size})"
        for i, row in enumerate(rows):
            problem = row.problem()
            if problem is not None:
                return f"validation failed for request {i}: {problem}"
        return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The coalescer and the training flush until cancelled, then a last flush (the
        reference's Stop), shielded from the cancel for at most :data:`FINAL_FLUSH_S`."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._coalesce)
                nursery.start_soon(self._flush_forever)
                nursery.start_soon(self._refresh_forever)
                task_status.started()
        finally:
            bound = min(self.config.http_timeout_s, FINAL_FLUSH_S)
            with trio.move_on_after(bound, shield=True) as last:
                await self.flush()
            if last.cancelled_caught:
                log.warning("picker.latency_final_flush_timeout after=%gs (the buffered training entries are lost)",
                            bound)

    async def _coalesce(self) -> None:
        assert self._nursery is not None
        window, most = self.config.coalesce_window_s, self.config.max_coalesced_rows
        async for first in self._receive:
            batch, rows = [first], len(first.rows)
            with trio.move_on_after(window):
                while not most or rows < most:
                    asked = await self._receive.receive()
                    batch.append(asked)
                    rows += len(asked.rows)
            self._nursery.start_soon(self._dispatch, batch)

    async def _dispatch(self, batch: list[_Asked]) -> None:
        rows = [row for asked in batch for row in asked.rows]
        timeout = self.config.http_timeout_s
        try:
            with trio.move_on_after(timeout) as waited:  # a free dispatch slot, within the timeout too
                await self._limiter.acquire()
            if waited.cancelled_caught:
                raise PredictorError(f"no free prediction call slot within {timeout:g}s "
                                     f"({self.config.max_concurrent_dispatches} in flight)")
            try:
                server = self.rng.choice(self.config.predictions)
                self.bulk_calls += 1
                status, data = await post_json(server, BULK_STRICT_PATH, encode_bulk(rows), timeout, MAX_REPLY_BYTES)
            finally:
                self._limiter.release()
            predictions = decode_bulk_strict(status, data, len(rows))
        except PredictorError as exc:
            self.predictions.failed(str(exc))
            for asked in batch:
                asked.done(None)
            return
        self.predictions.worked()
        start = 0
        for asked in batch:
            asked.done(predictions[start:start + len(asked.rows)])
            start += len(asked.rows)

    async def _flush_forever(self) -> None:
        while True:
            await trio.sleep(self.config.flush_interval_s)
            await self.flush()

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await trio.sleep(self.config.metrics_interval_s)

    async def refresh(self) -> None:
        """Ask for the servers' reports (the reference's refreshServerStatus and refreshModelInfo);
        a failed call keeps its last good report. Logs the current model when it changes."""
        calls = ((self.status, self.rng.choice(self.config.predictions), STATUS_PATH),
                 (self.model_info, self.config.training, MODEL_INFO_PATH))
        for episode, server, path in calls:
            try:
                self.reports[path] = await get_report(server, path, self.config.http_timeout_s)
            except PredictorError as exc:
                episode.failed(str(exc))
                continue
            episode.worked()
        if not self.reports:
            return
        model = current_model(self.reports.get(STATUS_PATH), self.reports.get(MODEL_INFO_PATH))
        if model != self.model:
            self.model = model
            log.info("picker.latency_predictor_model model_type=%s objective=%s quantile=%g ready=%s",
                     peer_text(model.model_type, 64), peer_text(model.objective_type, 64), model.quantile, model.ready)

    async def flush(self) -> None:
        """Send the producers' buffered training entries (sampled), one call."""
        entries = [entry for producer in self.producers for entry in producer.take_training()]
        if not entries:
            return
        entries = sample_training(entries, self.config.max_sample_size, self.rng)
        try:
            status, data = await post_json(self.config.training, TRAINING_PATH, encode_training(entries),
                                           self.config.http_timeout_s, _MAX_TRAINING_REPLY)
        except PredictorError as exc:
            self.training.failed(str(exc))
            return
        if status != 202:
            self.training.failed(f"POST {self.config.training.url}{TRAINING_PATH} answered {status}: "
                                 f"{data[:200].decode('utf-8', 'replace')}")
            return
        self.training.worked()
        self.trained += len(entries)


async def _call(done: PredictionsDone, predictions: list[Prediction] | None) -> None:
    done(predictions)
