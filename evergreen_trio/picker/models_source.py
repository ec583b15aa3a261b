"""``models-data-source`` and ``models-data-extractor``, sans-IO, as llm-d-router's (ebab68792,
``datalayer/source/models``, ``datalayer/extractor/models``): each endpoint's ``/v1/models`` is
polled and its list of served models kept on the endpoint (:attr:`EndpointState.models
<evergreen_trio.picker.scheduler.EndpointState.models>`), where nothing in the reference reads it
yet. The Trio loop is :mod:`evergreen_trio.picker.models_poll`.

A source polls only when ``dataLayer.sources`` lists it with a ``models-data-extractor`` (the
reference polls a listed source without one too, and drops what it read). It GETs ``path``
(default ``/v1/models``) on the host and port the metrics are scraped from, every ``interval``
(default: the pool's scrape interval; the reference rounds it to a multiple of its base tick),
over http or, with ``scheme: https``, over TLS as ``metrics-data-source`` does (the certificate
not verified unless ``insecureSkipVerify: false``; ``caCertPath``, ``clientCertPath``,
``clientKeyPath``).

The body is decoded as Go's ``encoding/json`` decodes it into the reference's ``ModelResponse``
(:mod:`evergreen_trio.picker.parsers.gojson`): ``{"object": ..., "data": [{"id", "object",
"created", "owned_by", "parent"}]}``, member names case-insensitive, other members ignored, a
member of the wrong JSON type failing the whole body, ``null`` for a zero value. Hostile-input
bounds the reference lacks: a body over :data:`MAX_MODELS_BYTES` or a list over
:data:`MAX_MODELS` models fails. A failed poll (unreachable, not 200, too slow, bad JSON) keeps
the endpoint's last list and the endpoint serving, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evergreen_trio.picker.errors import ModelsError, RequestError
from evergreen_trio.picker.parsers import gojson
from evergreen_trio.picker.plugins import Category, Params, PluginType, TlsOptions, http_source, register

MODELS_DATA_SOURCE = "models-data-source"
MODELS_DATA_EXTRACTOR = "models-data-extractor"
DEFAULT_PATH = "/v1/models"
MAX_MODELS_BYTES = 256 * 1024
MAX_MODELS = 1024
_JSON_SPACE = b" \t\r\n"


@dataclass(frozen=True)
class ModelsSource:
    """``models-data-source``: the path polled, how often (None: the pool's scrape interval), and
    over https its TLS options (None: plain http)."""

    path: str = DEFAULT_PATH
    interval_s: float | None = None
    tls: TlsOptions | None = None


@dataclass(frozen=True)
class ModelData:
    """One model an endpoint serves, as its ``/v1/models`` lists it (Go's zero values when absent)."""

    id: str
    object: str = ""
    created: int = 0
    owned_by: str = ""
    parent: str = ""


_MODEL = gojson.struct("ModelData", id=gojson.string, object=gojson.string,
                       created=gojson.integer(-(2**63), 2**63 - 1, "int64"), owned_by=gojson.string,
                       parent=gojson.string)
_RESPONSE = gojson.struct("ModelResponse", object=gojson.string, data=gojson.slice_of(_MODEL))


def _model(fields: dict[str, Any] | None) -> ModelData:
    fields = fields or {}

    def text(name: str) -> str:
        return gojson.text(fields.get(name) or "")

    return ModelData(text("id"), text("object"), fields.get("created") or 0, text("owned_by"), text("parent"))


def parse_models(body: bytes) -> tuple[ModelData, ...]:
    """The models a ``/v1/models`` body lists; :class:`ModelsError` when it does not decode."""
    if len(body) > MAX_MODELS_BYTES:
        raise ModelsError(f"expected a /v1/models body of at most {MAX_MODELS_BYTES} bytes, got {len(body)}")
    if body.strip(_JSON_SPACE) == b"null":  # Go decodes null into the zero ModelResponse
        return ()
    try:
        doc = gojson.load(body, float64=False)[0]
        response = _RESPONSE(doc, "ModelResponse") or {}
    except RequestError as exc:
        raise ModelsError(f"expected a /v1/models JSON object: {exc.message}") from None
    except gojson.Mismatch as exc:
        raise ModelsError(f"expected a /v1/models JSON object: {exc}") from None
    except RecursionError:
        raise ModelsError("expected a /v1/models JSON object: nested too deeply") from None
    listed = response.get("data") or []
    if len(listed) > MAX_MODELS:
        raise ModelsError(f"expected at most {MAX_MODELS} models, got {len(listed)}")
    return tuple(_model(fields) for fields in listed)


def _models_source(params: Params) -> ModelsSource:
    from evergreen_trio.picker.config import parse_duration  # config imports the plugin registry

    path, tls = http_source(params, DEFAULT_PATH, "models are read")
    interval = params.text("interval", "")
    return ModelsSource(path, parse_duration(interval, params.where("interval")) if interval else None, tls)


register(MODELS_DATA_SOURCE, PluginType(
    Category.DATA_SOURCE, ("scheme", "path", "insecureSkipVerify", "caCertPath", "clientCertPath", "clientKeyPath",
                           "interval"), _models_source))
register(MODELS_DATA_EXTRACTOR, PluginType(Category.EXTRACTOR))
