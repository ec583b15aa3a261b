"""agent-identity and session-id-producer (llm-d-router's requestheader/agentidentity and
dataproducer/sessionid), and session affinity reading their attributes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_session_affinity import HEAD, _exchange, _picker

from evergreen_trio.picker.attributes import (
    AGENT_IDENTITY_KEY,
    DEFAULT_AGENT_HEADERS,
    AgentIdentityParams,
    SessionIdProducerParams,
    cookie_value,
    flow_fairness_id,
    request_attributes,
)
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.plugins import Plugin
from evergreen_trio.picker.session import SessionAffinity, SessionParams

A, C = "10.0.0.1:8000", "10.0.0.3:8000"


def _plugins(text: str) -> list[Plugin]:
    return list(parse_config(HEAD + text, cluster_pool="p").epp.plugins.values())  # type: ignore[union-attr]


AGENT = _plugins("plugins:\n- {type: agent-identity}\n")


@pytest.mark.parametrize(("headers", "identity"), [
    ({"x-claude-code-session-id": "session-abc"}, "session-abc"),
    ({"x-session-affinity": "oc-session-1"}, "oc-session-1"),
    ({"session-id": "codex-session-1"}, "codex-session-1"),
    ({"session_id": "codex-legacy-1"}, "codex-legacy-1"),
    ({"session-id": "codex-new", "session_id": "codex-old"}, "codex-new"),
    ({"x-claude-code-session-id": "session-abc", "x-session-affinity": "oc"}, "session-abc"),
    ({"x-session-affinity": "oc-session-1", "session-id": "codex"}, "oc-session-1"),
    ({"x-claude-code-session-id": "", "session_id": "later"}, "later"),  # empty is no match
    ({"x-unrelated": "value"}, None),
    ({}, None),
])
def test_agent_identity_first_non_empty_header(headers: dict[str, str], identity: str | None) -> None:
    assert request_attributes(AGENT, headers).get(AGENT_IDENTITY_KEY) == identity


@pytest.mark.parametrize(("parameters", "headers"), [
    ("", DEFAULT_AGENT_HEADERS),
    ("{additionalSessionHeaders: []}", DEFAULT_AGENT_HEADERS),
    ("{additionalSessionHeaders: [x-custom-1, x-custom-2]}", ("x-custom-1", "x-custom-2", *DEFAULT_AGENT_HEADERS)),
    ("{additionalSessionHeaders: [X-Tenant-ID, X-User-Session]}",
     ("x-tenant-id", "x-user-session", *DEFAULT_AGENT_HEADERS)),
    ("{additionalSessionHeaders: ['', session-id]}", ("", "session-id", *DEFAULT_AGENT_HEADERS)),
])
def test_agent_identity_parameters(parameters: str, headers: tuple[str, ...]) -> None:
    suffix = f", parameters: {parameters}" if parameters else ""
    (plugin,) = _plugins(f"plugins:\n- {{type: agent-identity{suffix}}}\n")
    assert plugin.params == AgentIdentityParams(headers)


def test_an_additional_header_wins_over_the_defaults() -> None:
    plugins = _plugins("plugins:\n- {type: agent-identity, parameters: {additionalSessionHeaders: [x-tenant-id]}}\n")
    both = {"x-tenant-id": "tenant-42", "x-claude-code-session-id": "claude"}
    assert request_attributes(plugins, both) == {AGENT_IDENTITY_KEY: "tenant-42"}
    assert request_attributes(plugins, {"session-id": "c"}) == {AGENT_IDENTITY_KEY: "c"}


@pytest.mark.parametrize(("parameters", "params"), [
    ("{headerName: x-session-id}", SessionIdProducerParams(header="x-session-id")),
    ("{cookieName: llm-d-session}", SessionIdProducerParams(cookie="llm-d-session")),
    ("{headerName: ' X-Session-ID '}", SessionIdProducerParams(header="x-session-id")),
    ("{cookieName: ' Llm '}", SessionIdProducerParams(cookie="Llm")),  # cookie names keep their case
])
def test_session_id_producer_parameters(parameters: str, params: SessionIdProducerParams) -> None:
    (plugin,) = _plugins(f"plugins:\n- {{type: session-id-producer, parameters: {parameters}}}\n")
    assert plugin.params == params


P = "EndpointPickerConfig.plugins[0].parameters"


@pytest.mark.parametrize(("entry", "field"), [
    ("{type: session-id-producer}", P),
    ("{type: session-id-producer, parameters: {}}", P),
    ("{type: session-id-producer, parameters: {headerName: x, cookieName: y}}", P),
    ("{type: session-id-producer, parameters: {headerName: '', cookieName: ' '}}", P),
    ("{type: session-id-producer, parameters: {headerName: x, other: y}}", f"{P}.other"),
    ("{type: session-id-producer, parameters: {headerName: [x]}}", f"{P}.headerName"),
    ("{type: agent-identity, parameters: {additionalSessionHeaders: x-a}}", f"{P}.additionalSessionHeaders"),
    ("{type: agent-identity, parameters: {additionalSessionHeaders: [5]}}", f"{P}.additionalSessionHeaders[0]"),
    ("{type: agent-identity, parameters: {sessionHeaders: [x]}}", f"{P}.sessionHeaders"),
])
def test_bad_parameters_name_the_field(entry: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {entry}\n", cluster_pool="p")
    assert caught.value.field == field, caught.value


HEADER = _plugins("plugins:\n- {type: session-id-producer, name: sid, parameters: {headerName: x-session-id}}\n")
COOKIE = _plugins("plugins:\n- {type: session-id-producer, parameters: {cookieName: llm-d-session}}\n")


@pytest.mark.parametrize(("headers", "want"), [
    ({"x-session-id": "user-42"}, "user-42"),
    ({"x-session-id": "  user-42  "}, "user-42"),
    ({"other": "irrelevant"}, None),
    ({"x-session-id": ""}, None),
    ({"x-session-id": "   "}, None),
])
def test_session_id_producer_header_mode(headers: dict[str, str], want: str | None) -> None:
    # Published under the producer's own name, as the reference's key WithNonEmptyProducerName(name).
    assert request_attributes(HEADER, headers).get(("SessionIDDataKey", "sid")) == want


@pytest.mark.parametrize(("cookie", "want"), [
    ("llm-d-session=abc123", "abc123"),
    ("csrf=xyz; llm-d-session=abc123; theme=dark", "abc123"),
    ("csrf=xyz; theme=dark", None),
    ("", None),
    ("no-equals; llm-d-session=abc", "abc"),
    ("llm-d-session=", None),
    ("llm-d-session= abc123 ; other=v", "abc123"),
    ("llm-d-session=a=b", "a=b"),
    ("LLM-D-SESSION=x", None),
])
def test_session_id_producer_cookie_mode(cookie: str, want: str | None) -> None:
    attributes = request_attributes(COOKIE, {"cookie": cookie})
    assert attributes.get(("SessionIDDataKey", "session-id-producer")) == want


NAMES = st.text("abcxyz-", min_size=1)


@given(st.lists(st.tuples(NAMES, st.text("abc= ")), max_size=5), NAMES)
def test_a_cookie_is_its_first_pair_of_that_name(pairs: list[tuple[str, str]], name: str) -> None:
    header = "; ".join(f"{k}={v}" for k, v in pairs)
    # Each pair is trimmed before it is cut, so only a value's trailing spaces go.
    assert cookie_value(header, name) == next((v.rstrip() for k, v in pairs if k == name), "")


def test_fairness_id_from_the_header_then_the_agent_identity() -> None:
    identity = {AGENT_IDENTITY_KEY: "agent-7"}
    assert flow_fairness_id({"x-llm-d-inference-fairness-id": "tenant"}, identity) == "tenant"
    assert flow_fairness_id({"x-llm-d-inference-fairness-id": " "}, identity) == "agent-7"
    assert flow_fairness_id({}, identity) == "agent-7"
    assert flow_fairness_id({}, {}) == "default-flow"
    assert flow_fairness_id({}, {AGENT_IDENTITY_KEY: "has space"}) == "default-flow"
    with pytest.raises(RequestError):
        flow_fairness_id({"x-llm-d-inference-fairness-id": "x" * 300}, identity)


# -- session affinity reading the attributes ---------------------------------------------------


def test_session_sources_name_attributes_and_their_producer() -> None:
    (plugin,) = _plugins("""plugins:
- type: session-affinity-filter
  parameters:
    strategy: session_id
    sessionIdConfig:
      sources: [{attribute: agent-identity}, {attribute: SessionIDDataKey, producer: sid}, {header: X-A, producer: q}]
""")
    assert isinstance(plugin.params, SessionParams)
    assert plugin.params.sources == (("agent-identity", ""), ("SessionIDDataKey", "sid"), "x-a")


def test_session_affinity_follows_the_agent_identity_through_the_stream() -> None:
    picker = _picker("""plugins:
- {type: queue-scorer}
- {type: agent-identity}
- {type: session-id-producer, name: sid, parameters: {cookieName: s}}
- type: session-affinity-filter
  name: pin
  parameters:
    strategy: session_id
    sessionIdConfig: {sources: [{attribute: SessionIDDataKey, producer: sid}, {attribute: agent-identity}]}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: pin}, {pluginRef: queue-scorer}]}
""")
    state = picker.scheduler.plugin_states["pin"]
    assert isinstance(state, SessionAffinity)
    state.bindings["claude-1"] = (C, 0.0)
    state.bindings["cookie-1"] = (C, 0.0)
    assert _exchange(picker, [("x-claude-code-session-id", "claude-1")])[0] == C
    assert _exchange(picker, [("cookie", "s=cookie-1"), ("session-id", "new")])[0] == C
    assert _exchange(picker, [("session-id", "codex-1")])[0] == A
    assert state.bindings["codex-1"][0] == A

