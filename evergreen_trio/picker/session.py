"""Session affinity, sans-IO: ``session-affinity-scorer`` and ``session-affinity-filter`` with
llm-d-router's semantics (ebab68792: ``scorer/sessionaffinity``, ``filter/sessionaffinity`` and
their shared ``util/sessionaffinity``).

Both types take the same parameters and pin a session to one endpoint, by one of two strategies:

- ``encoded_endpoint_header`` (the default): the response carries the picked endpoint, base64
  encoded, in ``encodedEndpointHeaderConfig.header`` (``x-session-token``); a request sending it
  back prefers that endpoint. Nothing is stored. The token names the endpoint by its address
  (the reference's names the pod as ``namespace/name``: each picker reads only its own tokens).
- ``session_id``: the client names its session in a header or a request attribute from
  ``agent-identity`` or ``session-id-producer`` (``sessionIdConfig.sources``, by default the header
  ``x-session-id``; the first non-blank one wins); the first pick of a session binds it to the
  endpoint, a binding unused for ``evictionTtlSeconds`` (300) goes at the next sweep (every
  ``evictionSweepSeconds``, 10), and a session moves only when its endpoint was not among the candidates.
  Session ids come from clients, so the bindings are bounded: at most :data:`MAX_SESSION_BINDINGS`
  per plugin (the least recently bound goes first, the one the TTL would drop first; the reference
  keeps every binding until its TTL), and an id longer than :data:`MAX_SESSION_KEY_CHARS` is bound
  under its SHA-256 digest.

The scorer gives the session's endpoint 1 and the others 0; the filter keeps the session's endpoint
alone when it is a candidate, else every candidate. ``profileName`` chooses whose pick is bound or
written back (default: the primary profile's). The states learn each schedule after it succeeds
and put the response header on the :class:`~evergreen_trio.picker.scheduler.Schedule`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.attributes import AttributeKey
from evergreen_trio.picker.checks import sequence
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.gotext import trim_space
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

SESSION_SCORER = "session-affinity-scorer"
SESSION_FILTER = "session-affinity-filter"
ENCODED_ENDPOINT_HEADER = "encoded_endpoint_header"
SESSION_ID = "session_id"
DEFAULT_TOKEN_HEADER = "x-session-token"
DEFAULT_SESSION_ID_HEADER = "x-session-id"
MAX_SESSION_BINDINGS = 65_536
"""session_id bindings one plugin keeps (a few hundred bytes each)."""
MAX_SESSION_KEY_CHARS = 256
"""A longer session id is bound under its digest: a binding costs the same whatever the header held."""


def normalize_header(name: str) -> str:
    """A configured header name as request headers are keyed: trimmed, lower case; empty is the default."""
    return name.strip().lower() or DEFAULT_TOKEN_HEADER


@dataclass(frozen=True)
class SessionParams:
    """One session affinity plugin's parameters, defaults applied (``sources``: a header name, or
    an attribute's (data type, producer) key)."""

    strategy: str = ENCODED_ENDPOINT_HEADER
    token_header: str = DEFAULT_TOKEN_HEADER
    sources: tuple[str | AttributeKey, ...] = (DEFAULT_SESSION_ID_HEADER,)
    ttl_s: float = 300.0
    sweep_s: float = 10.0
    profile: str = ""


def _session_params(params: Params) -> SessionParams:
    strategy = params.text("strategy", ENCODED_ENDPOINT_HEADER, choices=(ENCODED_ENDPOINT_HEADER, SESSION_ID))
    encoded = params.section("encodedEndpointHeaderConfig", ("header",))
    ids = params.section("sessionIdConfig", ("sources", "evictionTtlSeconds", "evictionSweepSeconds"))
    # The reference checks the session_id settings only under that strategy: read them, check them then.
    ttl = ids.number("evictionTtlSeconds", 0.0, minimum=-math.inf) or 300.0
    sweep = ids.number("evictionSweepSeconds", 0.0, minimum=-math.inf) or 10.0
    sources: list[str | AttributeKey] = []
    listed = ids.raw.get("sources")
    for i, raw in enumerate(sequence([] if listed is None else listed, ids.where("sources"))):
        source = Params(raw, ids.where(f"sources[{i}]"), "sources", ("header", "attribute", "producer"))
        header, attribute = source.text("header", ""), source.text("attribute", "")
        producer = source.text("producer", "")
        if strategy == SESSION_ID and bool(header) == bool(attribute):
            raise ConfigError(source.path, "exactly one of header or attribute", dict(source.raw))
        # The reference reads a source by its header when one is set (then the producer is unused).
        sources.append(normalize_header(header) if header else (attribute, producer))
    if strategy == SESSION_ID and ttl <= 0:
        raise ConfigError(ids.where("evictionTtlSeconds"), "> 0", ttl)
    if strategy == SESSION_ID and sweep <= 0:
        raise ConfigError(ids.where("evictionSweepSeconds"), "> 0", sweep)
    return SessionParams(strategy, normalize_header(encoded.text("header", "")),
                         tuple(sources) or (DEFAULT_SESSION_ID_HEADER,), ttl, sweep, params.text("profileName", ""))


def decode_token(token: str) -> str:
    """The endpoint a session token names; "" when there is none or it is not standard base64
    (Go's ``base64.StdEncoding``, which skips ``\\r`` and ``\\n``)."""
    token = token.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(token, validate=True).decode("utf-8", "replace") if token else ""
    except (binascii.Error, ValueError):
        return ""


def encode_token(address: str) -> str:
    return base64.b64encode(address.encode()).decode("ascii")


class SessionAffinity:
    """One declared session affinity plugin: its strategy, and the session_id bindings."""

    def __init__(self, params: object) -> None:
        assert isinstance(params, SessionParams)
        self.params = params
        # session id (its digest when long) -> (address, last used), least recently bound first
        self.bindings: dict[str | bytes, tuple[str, float]] = {}
        self.max_bindings = MAX_SESSION_BINDINGS
        # Whether the session's bound endpoint was a candidate, for the request last chosen for:
        # only a genuine absence moves a session.
        self._presence: tuple[PickRequest, bool] | None = None
        self._sweep_origin: float | None = None
        self._last_sweep = 0.0  # sweeps done since the origin

    def session_id(self, request: PickRequest) -> str:
        """The first non-blank value among the source headers and attributes (trimmed), else ""."""
        for source in self.params.sources:
            found = request.headers.get(source) if isinstance(source, str) else request.attributes.get(source)
            if value := trim_space(found or ""):
                return value
        return ""

    def choose(self, request: PickRequest, candidates: Sequence[str], now: float) -> str | None:
        """The candidate the request's session is pinned to, or None: no candidate, no session,
        an unbound one, or one bound to an endpoint that is not a candidate."""
        if self.params.strategy == ENCODED_ENDPOINT_HEADER:
            wanted = decode_token(request.headers.get(self.params.token_header, ""))
            return wanted if wanted and wanted in candidates else None
        self._sweep(now)
        session = self.session_id(request) if candidates else ""
        bound = self.bindings.get(_key(session), ("", 0.0))[0] if session else ""
        if not bound:
            return None
        present = bound in candidates
        self._presence = (request, present)
        return bound if present else None

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """Bind (session_id) or write back (encoded_endpoint_header) this profile's pick."""
        presence, self._presence = self._presence, None
        if self.params.profile:
            picks = schedule.profiles.get(self.params.profile) or []
            picked = picks[0] if picks else ""
        else:
            picked = schedule.endpoints[0]
        if self.params.strategy == ENCODED_ENDPOINT_HEADER:
            if picked:
                schedule.response_headers[self.params.token_header] = encode_token(picked)
            return
        self._sweep(now)
        session = self.session_id(request)
        if not session or not picked:
            return
        key = _key(session)
        bound = self.bindings.get(key)
        moved = presence is not None and presence[0] is request and not presence[1]
        if bound is None or bound[0] == picked or moved:
            self.bindings.pop(key, None)  # re-added last: the dict stays least recently bound first
            self.bindings[key] = (picked, now)
            while len(self.bindings) > self.max_bindings:
                del self.bindings[next(iter(self.bindings))]

    def _sweep(self, now: float) -> None:
        """Drop the bindings the reference's sweeper would have dropped by ``now``: it runs every
        ``sweep_s`` and drops a binding unused for more than ``ttl_s``. Bindings are read and
        written only as requests come, so one check at the last sweep time before ``now`` is the same."""
        if self._sweep_origin is None:
            self._sweep_origin = now
        sweeps = (now - self._sweep_origin) // self.params.sweep_s
        if not math.isfinite(sweeps):  # an interval so small the count overflows: it sweeps all the time
            at = now
        elif sweeps > self._last_sweep:
            self._last_sweep = sweeps
            at = self._sweep_origin + sweeps * self.params.sweep_s
        else:
            return
        for session in [s for s, (_, used) in self.bindings.items() if at - used > self.params.ttl_s]:
            del self.bindings[session]


def _key(session: str) -> str | bytes:
    """The bindings' key for ``session``: itself, or its digest when longer than MAX_SESSION_KEY_CHARS
    (bytes, so no id can name another's digest)."""
    if len(session) <= MAX_SESSION_KEY_CHARS:
        return session
    return hashlib.sha256(session.encode("utf-8", "surrogatepass")).digest()


def _choice(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            state: object) -> str | None:
    assert isinstance(state, SessionAffinity)
    return state.choose(request, [s.endpoint.address for s in candidates], scheduler.snapshot.clock())


def _session_scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                    fresh: Mapping[str, EndpointMetrics], state: object) -> dict[str, float]:
    chosen = _choice(scheduler, request, candidates, state)
    return {s.endpoint.address: 1.0 if s.endpoint.address == chosen else 0.0 for s in candidates}


def _session_filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                    state: object) -> list[EndpointState]:
    chosen = _choice(scheduler, request, candidates, state)
    return [s for s in candidates if s.endpoint.address == chosen] if chosen else list(candidates)


_PARAMETERS = ("strategy", "encodedEndpointHeaderConfig", "sessionIdConfig", "profileName")
register(SESSION_SCORER, PluginType(Category.SCORER, _PARAMETERS, _session_params))
register(SESSION_FILTER, PluginType(Category.FILTER, _PARAMETERS, _session_params))

SESSION_SCORERS = {SESSION_SCORER: _session_scorer}
SESSION_FILTERS = {SESSION_FILTER: _session_filter}
SESSION_STATES = {SESSION_SCORER: SessionAffinity, SESSION_FILTER: SessionAffinity}
