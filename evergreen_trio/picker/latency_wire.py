"""The llm-d latency predictor's wire, sans-IO (llm-d-router ebab68792 ``latencypredictorclient``).

What the ``predicted-latency-producer`` sends its predictor and reads back, with the client's
settings from the environment (``PREDICTION_SERVER_URL``, ``TRAINING_SERVER_URL`` and the
``LATENCY_*`` knobs, as the reference's ``ConfigFromEnv``):

* ``POST /predict/bulk/strict`` on a prediction server: ``{"requests": [row, ...]}`` ->
  ``{"predictions": [{"ttft_ms", "tpot_ms", ...}, ...], ...}``, one prediction per row in order;
* ``POST /add_training_data_bulk`` on the training server: ``{"entries": [entry, ...]}`` -> 202;
* ``GET /status`` on a prediction server and ``GET /model/download/info`` on the training server:
  the model type, objective and quantile they serve (:class:`ModelReport`, the reference's
  ``ServerStatusResponse`` and ``ModelInfo``), which :func:`current_model` combines as the
  reference's ``GetCurrentModelType``/``GetCurrentQuantile``/``GetCurrentObjectiveType``.

A reply is a peer's bytes: :func:`decode_bulk_strict` refuses anything but a JSON object holding
exactly one finite, non-negative ``ttft_ms``/``tpot_ms`` pair per row (NaN and infinities
included), and :func:`decode_model_report` anything but an object whose fields have their types,
with a :class:`PredictorError` naming what was wrong.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

from evergreen_trio.picker.errors import ConfigError

log = logging.getLogger(__name__)

BULK_STRICT_PATH = "/predict/bulk/strict"
TRAINING_PATH = "/add_training_data_bulk"
STATUS_PATH = "/status"
MODEL_INFO_PATH = "/model/download/info"
MAX_REPORT_BYTES = 64 * 1024
"""A ``/status`` or ``/model/download/info`` reply's size limit (the real ones are ~400 bytes)."""
_MAX_NAME = 64  # a model or objective type's length at most (the real ones: "bayesian_ridge", "quantile")
MAX_REPLY_BYTES = 4 * 1024 * 1024
"""A prediction reply's size limit: ~200 bytes a row, 100 rows a bulk call, ample margin."""
MAX_PENDING_TRAINING = 100_000
"""Training entries buffered between flushes at most (the oldest go first past it)."""


class PredictorError(Exception):
    """A prediction or training call failed: refused, timed out, or answered with something wrong."""


@dataclass(frozen=True)
class Server:
    """One predictor server's ``host``, ``port`` and the URL it came from."""

    host: str
    port: int
    url: str


def parse_server(url: str, where: str) -> Server:
    """``http://host[:port]`` -> :class:`Server`; ConfigError naming ``where`` otherwise."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port or 80
    except ValueError:
        raise ConfigError(where, "an http://host:port URL", url) from None
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(where, "an http://host:port URL", url)
    return Server(parts.hostname, port, url.strip())


@dataclass(frozen=True)
class PredictorConfig:
    """The reference's client ``Config``: where the servers are, the training flush, the coalescing."""

    training: Server = Server("localhost", 8000, "http://localhost:8000")
    predictions: tuple[Server, ...] = (Server("localhost", 8001, "http://localhost:8001"),)
    max_sample_size: int = 1000
    flush_interval_s: float = 1.0
    http_timeout_s: float = 10.0
    max_bulk_size: int = 100
    coalesce_window_s: float = 0.001
    max_coalesced_rows: int = 0
    max_concurrent_dispatches: int = 36
    metrics_interval_s: float = 60.0


def _env_int(env: Mapping[str, str], name: str, default: int, low: int, high: int | None = None) -> int:
    """The reference keeps the default for a value it cannot read; we also say so, once, in the log."""
    text = env.get(name, "")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        log.warning("picker.latency_env_ignored %s=%r (want an integer >= %d%s; using %d)", name, text[:64], low,
                    f" and <= {high}" if high is not None else "", default)
        return default
    return value


def config_from_env(env: Mapping[str, str]) -> PredictorConfig:
    """The client settings the environment gives (the reference's ``ConfigFromEnv``); a server URL
    that is not ``http://host:port`` is a ConfigError naming its variable."""
    default = PredictorConfig()
    training = default.training
    if env.get("TRAINING_SERVER_URL"):
        training = parse_server(env["TRAINING_SERVER_URL"], "TRAINING_SERVER_URL")
    predictions = default.predictions
    if env.get("PREDICTION_SERVER_URL"):
        predictions = tuple(parse_server(u, "PREDICTION_SERVER_URL") for u in env["PREDICTION_SERVER_URL"].split(","))
    return PredictorConfig(
        training, predictions,
        max_sample_size=_env_int(env, "LATENCY_MAX_SAMPLE_SIZE", default.max_sample_size, 1),
        flush_interval_s=float(_env_int(env, "LATENCY_FLUSH_INTERVAL_SEC", 1, 1)),
        http_timeout_s=float(_env_int(env, "LATENCY_HTTP_TIMEOUT_SEC", 10, 1)),
        max_bulk_size=_env_int(env, "LATENCY_MAX_BULK_SIZE", default.max_bulk_size, 1, 100),
        coalesce_window_s=_env_int(env, "LATENCY_COALESCE_WINDOW_MS", 1, 0) / 1000,
        max_coalesced_rows=_env_int(env, "LATENCY_MAX_COALESCED_ROWS", 0, 0),
        max_concurrent_dispatches=_env_int(env, "LATENCY_MAX_CONCURRENT_DISPATCHES", 36, 1),
        metrics_interval_s=float(_env_int(env, "LATENCY_METRICS_INTERVAL_SEC", 60, 1)),
    )


@dataclass(frozen=True)
class PredictionRow:
    """One endpoint's features for a prediction (the reference's ``PredictionRequest``)."""

    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    num_tokens_generated: int
    prefix_cache_score: float
    encoder_input_size: int = 0
    encoder_matched_size: int = 0
    pod_type: str = ""
    prefill_tokens_in_flight: int = 0
    decode_tokens_in_flight: int = 0

    def problem(self) -> str | None:
        """What the reference's ``ValidatePredictionRequest`` refuses in this row (None: nothing)."""
        if not 0.0 <= self.kv_cache_percentage <= 1.0:
            return f"kv_cache_percentage must be between 0.0 and 1.0, got {self.kv_cache_percentage}"
        if not 0.0 <= self.prefix_cache_score <= 1.0:
            return f"prefix_cache_score must be between 0.0 and 1.0, got {self.prefix_cache_score}"
        for name in ("input_token_length", "num_request_waiting", "num_request_running", "num_tokens_generated",
                     "encoder_input_size", "prefill_tokens_in_flight", "decode_tokens_in_flight"):
            if getattr(self, name) < 0:
                return f"{name} must be non-negative, got {getattr(self, name)}"
        if not 0 <= self.encoder_matched_size <= self.encoder_input_size:
            return (f"encoder_matched_size must be between 0 and encoder_input_size ({self.encoder_input_size}), "
                    f"got {self.encoder_matched_size}")
        return None

    def as_json(self) -> dict[str, object]:
        fields = asdict(self)
        if not self.pod_type:  # the reference's omitempty
            del fields["pod_type"]
        return fields


@dataclass(frozen=True)
class TrainingEntry:
    """One observed latency with the features it was seen under (the reference's ``TrainingEntry``)."""

    row: PredictionRow
    actual_ttft_ms: float
    actual_tpot_ms: float
    timestamp: float  # Unix seconds

    def as_json(self) -> dict[str, object]:
        fields = self.row.as_json()
        fields["actual_ttft_ms"] = self.actual_ttft_ms
        fields["actual_tpot_ms"] = self.actual_tpot_ms
        fields["timestamp"] = datetime.fromtimestamp(self.timestamp, UTC).isoformat()
        return fields


@dataclass(frozen=True)
class Prediction:
    """One endpoint's predicted time to first token and time per output token, in ms."""

    ttft_ms: float
    tpot_ms: float


def encode_bulk(rows: Sequence[PredictionRow]) -> bytes:
    """The ``/predict/bulk/strict`` request body for ``rows``."""
    return json.dumps({"requests": [r.as_json() for r in rows]}, separators=(",", ":")).encode()


def encode_training(entries: Sequence[TrainingEntry]) -> bytes:
    """The ``/add_training_data_bulk`` request body for ``entries``."""
    return json.dumps({"entries": [e.as_json() for e in entries]}, separators=(",", ":")).encode()


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _latency(item: object, i: int, key: str) -> float:
    value = item.get(key) if isinstance(item, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PredictorError(f"predictions[{i}].{key}: expected a finite number >= 0, got {str(value)[:32]}")
    return float(value)


def _reply_json(status: int, body: bytes, what: str, limit: int) -> object:
    """A predictor server's 200 reply of at most ``limit`` bytes, as JSON (NaN and infinities
    refused, every number a float: an integer of 400 digits would fail ``math.isfinite`` with
    OverflowError); PredictorError naming ``what`` otherwise."""
    if status != 200:
        raise PredictorError(f"{what} answered {status}: {body[:200].decode('utf-8', 'replace')}")
    if len(body) > limit:
        raise PredictorError(f"{what}: reply larger than {limit} bytes")
    try:
        return json.loads(body, parse_constant=_refuse_constant, parse_int=float)
    except (ValueError, RecursionError) as exc:
        raise PredictorError(f"{what}: reply is not JSON: {str(exc)[:100]}") from None


def decode_bulk_strict(status: int, body: bytes, rows: int) -> list[Prediction]:
    """The ``rows`` predictions of a ``/predict/bulk/strict`` reply, in order; PredictorError for a
    non-200 status, a body that is not the expected JSON, a count other than ``rows``, or a
    latency that is not a finite number >= 0."""
    doc = _reply_json(status, body, "bulk prediction", MAX_REPLY_BYTES)
    predictions = doc.get("predictions") if isinstance(doc, dict) else None
    if not isinstance(predictions, list):
        raise PredictorError("bulk prediction reply: expected an object with a predictions list")
    if len(predictions) != rows:
        raise PredictorError(f"bulk prediction reply: expected {rows} predictions, got {len(predictions)}")
    return [Prediction(_latency(item, i, "ttft_ms"), _latency(item, i, "tpot_ms"))
            for i, item in enumerate(predictions)]


@dataclass(frozen=True)
class ModelReport:
    """What one server says of the models it serves: a prediction server's ``/status`` (``ready``:
    its ``is_ready``) or the training server's ``/model/download/info`` (``ready`` None). An
    absent objective is "", an absent quantile 0, as Go decodes them. :func:`current_model`
    combines the two into one."""

    model_type: str
    objective_type: str
    quantile: float
    ready: bool | None = None


def _text_field(doc: dict[str, object], key: str, what: str) -> str:
    value = doc.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > _MAX_NAME:
        raise PredictorError(f"{what}: {key}: expected a string of at most {_MAX_NAME} characters, "
                             f"got {str(value)[:32]}")
    return value


def decode_model_report(status: int, body: bytes, what: str) -> ModelReport:
    """A ``/status`` or ``/model/download/info`` reply (``what`` names it in errors); PredictorError
    for a non-200 status, a body over :data:`MAX_REPORT_BYTES` or not a JSON object, a type or
    objective that is not a short string, a quantile that is not a finite number, or an
    ``is_ready`` that is not a boolean."""
    doc = _reply_json(status, body, what, MAX_REPORT_BYTES)
    if not isinstance(doc, dict):
        raise PredictorError(f"{what}: expected a JSON object")
    quantile = doc.get("quantile", 0.0)
    if quantile is None:
        quantile = 0.0
    if isinstance(quantile, bool) or not isinstance(quantile, int | float) or not math.isfinite(quantile):
        raise PredictorError(f"{what}: quantile: expected a finite number, got {str(quantile)[:32]}")
    ready = doc.get("is_ready")
    if ready is not None and not isinstance(ready, bool):
        raise PredictorError(f"{what}: is_ready: expected a boolean, got {str(ready)[:32]}")
    return ModelReport(_text_field(doc, "model_type", what), _text_field(doc, "objective_type", what),
                       float(quantile), ready)


def current_model(status: ModelReport | None, info: ModelReport | None) -> ModelReport:
    """The model the predictor serves, as the reference's ``GetCurrentModelType``,
    ``GetCurrentQuantile`` and ``GetCurrentObjectiveType`` read the last reports (None: none yet):
    the prediction server's first, then the training server's (quantile 0.9 and objective
    "quantile" when neither says); ``ready`` the prediction server's."""
    model_type = status.model_type if status is not None else info.model_type if info is not None else ""
    quantile = next((r.quantile for r in (status, info) if r is not None and r.quantile > 0), 0.9)
    objective = next((r.objective_type for r in (status, info) if r is not None and r.objective_type), "quantile")
    return ModelReport(model_type, objective, quantile, status.ready if status is not None else None)


def sample_training(entries: Sequence[TrainingEntry], max_size: int, rng: random.Random) -> list[TrainingEntry]:
    """At most ``max_size`` of ``entries``, TTFT, TPOT and other entries in their proportions (the
    reference's ``randomSample``: the largest kind takes the rounding remainder)."""
    if len(entries) <= max_size:
        return list(entries)
    kinds: list[list[TrainingEntry]] = [[], [], []]
    for entry in entries:
        kinds[0 if entry.actual_ttft_ms > 0 else 1 if entry.actual_tpot_ms > 0 else 2].append(entry)
    sizes = [int(len(kind) / len(entries) * max_size) for kind in kinds]
    remaining = max_size - sum(sizes)
    largest = max(range(3), key=lambda k: (len(kinds[k]), -k))
    sizes[largest] += remaining
    result: list[TrainingEntry] = []
    for kind, size in zip(kinds, sizes, strict=True):
        if size > 0 and kind:
            result.extend(kind if len(kind) <= size else rng.sample(kind, size))
    return result
