"""Request attributes read from headers, sans-IO: ``agent-identity`` and ``session-id-producer``
with llm-d-router's semantics (``requestcontrol/requestheader/agentidentity``,
``requestcontrol/dataproducer/sessionid``).

An attribute is keyed as the reference's ``DataKey``: (data type, producer name).

- ``agent-identity`` stores the first non-empty header among ``additionalSessionHeaders`` (lower
  cased, in order) then ``x-claude-code-session-id``, ``x-session-affinity``, ``session-id``,
  ``session_id`` under ``("agent-identity", "")``; with flow control, a request without a fairness
  header is queued under that identity.
- ``session-id-producer`` stores the trimmed value of ``headerName`` (a request header) or of the
  cookie ``cookieName`` in the ``cookie`` header (exactly one is set) under
  ``("SessionIDDataKey", <plugin name>)``; nothing when it is absent or blank. Trimmed as Go's
  ``strings.TrimSpace`` trims the raw bytes (:func:`~evergreen_trio.picker.gotext.trim_space`).

Session affinity's ``sessionIdConfig.sources`` read them as ``attribute`` (and ``producer``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from evergreen_trio.picker.checks import sequence
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.flow_control.key import DEFAULT_FAIRNESS_ID, FAIRNESS_HEADERS, fairness_id, first_header
from evergreen_trio.picker.gotext import header_text, trim_space
from evergreen_trio.picker.guards import OTHER_MODEL as OVERFLOW_LABEL
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

AGENT_IDENTITY = "agent-identity"
SESSION_ID_PRODUCER = "session-id-producer"
SESSION_ID_DATA_TYPE = "SessionIDDataKey"

AttributeKey = tuple[str, str]
"""(data type, producer name): the reference's ``DataKey``."""

AGENT_IDENTITY_KEY: AttributeKey = (AGENT_IDENTITY, "")
DEFAULT_AGENT_HEADERS = ("x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")


@dataclass(frozen=True)
class AgentIdentityParams:
    """The headers checked, in order: the additional ones, then the defaults (all lower case)."""

    headers: tuple[str, ...] = DEFAULT_AGENT_HEADERS


def _agent_identity(params: Params) -> AgentIdentityParams:
    where = params.where("additionalSessionHeaders")
    listed = params.raw.get("additionalSessionHeaders")
    extras = []
    for i, header in enumerate(sequence(listed or [], where)):
        if not isinstance(header, str):
            raise ConfigError(f"{where}[{i}]", "a string", header)
        extras.append(header.lower())  # empty and repeated names stay, as the reference's: "" matches nothing
    return AgentIdentityParams((*extras, *DEFAULT_AGENT_HEADERS))


@dataclass(frozen=True)
class SessionIdProducerParams:
    """Exactly one of ``header`` (lower case) and ``cookie`` is set."""

    header: str = ""
    cookie: str = ""


def _session_id_producer(params: Params) -> SessionIdProducerParams:
    header = params.text("headerName", "").strip().lower()
    cookie = params.text("cookieName", "").strip()
    if bool(header) == bool(cookie):
        raise ConfigError(params.path, "exactly one of headerName or cookieName", dict(params.raw))
    return SessionIdProducerParams(header, cookie)


def cookie_value(header: str, name: str) -> str:
    """The value of cookie ``name`` in a ``cookie`` header ("" when absent): pairs split on ";",
    each trimmed and cut at its first "="; the first pair named ``name`` (its bytes) wins."""
    if not header or not name:
        return ""
    for pair in header.split(";"):
        key, eq, value = trim_space(pair).partition("=")
        if eq and header_text(key) == name:
            return value
    return ""


def request_attributes(plugins: Iterable[Plugin], headers: Mapping[str, str]) -> dict[AttributeKey, str]:
    """The attributes the declared ``agent-identity`` and ``session-id-producer`` plugins give a
    request with ``headers`` (names in lower case)."""
    attributes: dict[AttributeKey, str] = {}
    for plugin in plugins:
        params = plugin.params
        if isinstance(params, AgentIdentityParams):
            found = next((v for h in params.headers if (v := headers.get(h, ""))), "")
            if found:
                attributes[AGENT_IDENTITY_KEY] = found
        elif isinstance(params, SessionIdProducerParams):
            raw = headers.get(params.header, "") if params.header else cookie_value(headers.get("cookie", ""),
                                                                                    params.cookie)
            if value := trim_space(raw):
                attributes[(SESSION_ID_DATA_TYPE, plugin.name)] = value
    return attributes


register(AGENT_IDENTITY, PluginType(Category.OTHER, ("additionalSessionHeaders",), _agent_identity))
register(SESSION_ID_PRODUCER, PluginType(Category.PRODUCER, ("headerName", "cookieName"), _session_id_producer))


def flow_fairness_id(headers: Mapping[str, str], attributes: Mapping[AttributeKey, str]) -> str:
    """The request's fairness id as the reference's director derives it: the fairness header when
    it is set (RequestError 400 when invalid), else the agent identity, else ``default-flow``.
    An identity that is no valid fairness id (see :func:`fairness_id`) queues in ``default-flow``
    rather than failing a request for a session header it did not mean as a flow key."""
    if trim_space(first_header(headers, FAIRNESS_HEADERS) or ""):
        return fairness_id(headers)
    try:
        return fairness_id({FAIRNESS_HEADERS[0]: attributes.get(AGENT_IDENTITY_KEY, "")})
    except RequestError:
        return DEFAULT_FAIRNESS_ID


def fairness_label(headers: Mapping[str, str], attributes: Mapping[AttributeKey, str]) -> str:
    """The fairness id the metrics label a request with when flow control is off: as
    :func:`flow_fairness_id`, but a fairness header flow control would refuse is ``other`` (the
    metrics' overflow value) instead of a 400."""
    try:
        return flow_fairness_id(headers, attributes)
    except RequestError:
        return OVERFLOW_LABEL
