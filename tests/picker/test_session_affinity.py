"""Session affinity, sans-IO: ``session-affinity-scorer`` and ``session-affinity-filter`` with both
strategies (the cases of llm-d-router's own tests), the response header through the ext_proc
stream, and the parameters in an EndpointPickerConfig."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_processor import lb_metadata, request_body, request_headers, response_headers, set_headers

from evergreen_trio.picker.config import load_config, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Schedule
from evergreen_trio.picker.session import (
    MAX_SESSION_BINDINGS,
    MAX_SESSION_KEY_CHARS,
    SessionAffinity,
    SessionParams,
    decode_token,
    encode_token,
)

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
SESSION_ID = SessionParams(strategy="session_id")


def _request(session: str | None = None, **headers: str) -> PickRequest:
    if session is not None:
        headers["x-session-id"] = session
    return PickRequest("m", 0, headers=headers)


def _schedule(primary: str, **profiles: list[str]) -> Schedule:
    return Schedule([primary], None, {"decode": [primary], **profiles})


def _bind(state: SessionAffinity, session: str, address: str, now: float = 0.0) -> None:
    state.scheduled(_request(session), _schedule(address), now)


# -- encoded_endpoint_header --------------------------------------------------------------------


def test_encoded_token_pins_to_a_candidate_and_is_written_back() -> None:
    state = SessionAffinity(SessionParams())
    token = encode_token(B)
    assert token == base64.b64encode(B.encode()).decode()
    assert state.choose(_request(**{"x-session-token": token}), [A, B], 0.0) == B
    assert state.choose(_request(**{"x-session-token": token}), [A, C], 0.0) is None  # not a candidate
    assert state.choose(_request(**{"x-session-token": "%%not base64"}), [A, B], 0.0) is None
    assert state.choose(_request(), [A, B], 0.0) is None
    schedule = _schedule(C)
    state.scheduled(_request(), schedule, 0.0)
    assert schedule.response_headers == {"x-session-token": encode_token(C)}


def test_encoded_token_of_a_named_profile() -> None:
    state = SessionAffinity(SessionParams(token_header="x-prefill-token", profile="prefill"))
    schedule = _schedule(A, prefill=[B])
    state.scheduled(_request(), schedule, 0.0)
    assert schedule.response_headers == {"x-prefill-token": encode_token(B)}
    decode_only = _schedule(A)
    state.scheduled(_request(), decode_only, 0.0)  # no prefill pick: nothing written
    assert decode_only.response_headers == {}


@given(st.text())
def test_tokens_round_trip_and_any_text_decodes_without_error(text: str) -> None:
    assert decode_token(encode_token(text)) == text
    decode_token(text)


# -- session_id ---------------------------------------------------------------------------------


def test_session_id_first_bind_then_pins() -> None:
    state = SessionAffinity(SESSION_ID)
    assert state.choose(_request("s1"), [A, B], 0.0) is None  # unbound: no preference
    _bind(state, "s1", A)
    assert state.bindings["s1"][0] == A
    assert state.choose(_request("s1"), [A, B], 1.0) == A
    assert state.choose(_request("other"), [A, B], 1.0) is None
    assert state.choose(_request("s1"), [], 1.0) is None
    assert state.choose(_request(), [A, B], 1.0) is None  # no session id: abstain


def test_session_id_moves_only_on_a_genuine_absence() -> None:
    state = SessionAffinity(SESSION_ID)
    _bind(state, "s1", A)
    outvoted = _request("s1")
    assert state.choose(outvoted, [A, B], 1.0) == A
    state.scheduled(outvoted, _schedule(B), 1.0)  # another scorer won: the pin holds
    assert state.bindings["s1"][0] == A
    absent = _request("s1")
    assert state.choose(absent, [B], 2.0) is None
    state.scheduled(absent, _schedule(B), 2.0)
    assert state.bindings["s1"] == (B, 2.0)
    unscored = _request("s1")  # no presence record of its own: never a move
    state.scheduled(unscored, _schedule(C), 3.0)
    assert state.bindings["s1"] == (B, 2.0)


def test_session_id_sources_in_order_trimmed() -> None:
    state = SessionAffinity(SessionParams(strategy="session_id", sources=("x-a", ("agent-identity", ""), "x-b")))
    assert state.session_id(_request(**{"x-a": "  ", "x-b": " s2 "})) == "s2"
    assert state.session_id(_request(**{"x-a": "s1", "x-b": "s2"})) == "s1"
    assert state.session_id(PickRequest("m", 0, headers={"x-b": "s2"},
                                        attributes={("agent-identity", ""): " a1 "})) == "a1"
    assert state.session_id(_request()) == ""


def test_session_id_profile_name_binds_that_profiles_pick() -> None:
    state = SessionAffinity(SessionParams(strategy="session_id", profile="prefill"))
    state.scheduled(_request("s1"), _schedule(A), 0.0)  # decode only: nothing bound
    assert not state.bindings
    state.scheduled(_request("s1"), _schedule(A, prefill=[B]), 0.0)
    assert state.bindings["s1"][0] == B


def test_session_id_bindings_expire_at_the_sweep_after_the_ttl() -> None:
    state = SessionAffinity(SessionParams(strategy="session_id", ttl_s=60.0, sweep_s=10.0))
    state.choose(_request(), [A], 100.0)  # the sweeps start here: 110, 120, ...
    _bind(state, "s1", A, 105.0)
    _bind(state, "s2", B, 150.0)
    assert state.choose(_request("s1"), [A], 165.0) == A  # sweep at 160: unused 55 s
    _bind(state, "s2", B, 168.0)  # used again: refreshed
    assert state.choose(_request("s1"), [A], 171.0) is None  # sweep at 170: unused 65 s, dropped
    assert set(state.bindings) == {"s2"}
    assert state.choose(_request("s2"), [B], 228.5) == B  # sweep at 220: unused 52 s
    assert state.choose(_request("s2"), [B], 231.0) is None  # sweep at 230: 62 s


def test_session_id_bindings_are_bounded_least_recently_bound_first() -> None:
    """A flood of new session ids keeps MAX_SESSION_BINDINGS bindings: the least recently bound go."""
    state = SessionAffinity(SESSION_ID)
    for i in range(MAX_SESSION_BINDINGS + 100):
        _bind(state, f"s{i}", A, 1.0)
    assert len(state.bindings) == MAX_SESSION_BINDINGS
    assert "s99" not in state.bindings and "s100" in state.bindings
    _bind(state, "s100", A, 2.0)  # bound again: now the most recent
    _bind(state, "new", B, 2.0)
    assert "s100" in state.bindings and "s101" not in state.bindings
    assert state.choose(_request("s100"), [A, B], 2.0) == A and state.choose(_request("new"), [A, B], 2.0) == B


def test_a_long_session_id_is_bound_under_its_digest() -> None:
    state = SessionAffinity(SESSION_ID)
    long_ids = ["x" * 60_000, "x" * 59_999 + "y", "\x00\xff" * 1000]
    for session in long_ids:
        _bind(state, session, B)
    assert len(state.bindings) == 3
    assert all(len(key) <= MAX_SESSION_KEY_CHARS for key in state.bindings)
    assert all(state.choose(_request(session), [A, B], 1.0) == B for session in long_ids)
    assert state.choose(_request("x" * 59_998), [A, B], 1.0) is None


# -- through the scheduler and the ext_proc stream ----------------------------------------------

POOL = f"pool: {{endpoints: ['{A}', '{B}', '{C}']}}\nextProc: {{observeResponses: false}}\n"


def _picker(plugins: str) -> Picker:
    config = parse_config(POOL + HEAD + plugins)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint, queue in zip(config.pool.endpoints, (0, 4, 8), strict=True):
        snapshot.update(endpoint.address, EndpointMetrics(waiting=queue))
    return Picker(config, snapshot, rng=random.Random(6))


def _exchange(picker: Picker, headers: list[tuple[str, str]]) -> tuple[str, dict[str, str]]:
    """Route one request and answer its response headers: the destination and the headers set."""
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=headers))
    (head, *_) = stream.on_message(request_body(json.dumps({"model": "m", "prompt": "hi"}).encode()))
    destination = lb_metadata(head)[DESTINATION]
    if stream.finished:
        return destination, {}
    (reply,) = stream.on_message(response_headers())
    return destination, set_headers(reply.response_headers.response.header_mutation)


SCORER = """plugins:
- {type: queue-scorer}
- {type: session-affinity-scorer, name: session}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: queue-scorer}, {pluginRef: session, weight: 2}]}
"""


def test_the_scorer_writes_the_token_and_follows_it() -> None:
    picker = _picker(SCORER)
    first, written = _exchange(picker, [])
    assert first == A and written == {"x-session-token": encode_token(A)}
    # B's token outweighs its queue (weight 2 against the queue's 1); the response names B again.
    assert _exchange(picker, [("x-session-token", encode_token(B))]) == (B, {"x-session-token": encode_token(B)})
    assert _exchange(picker, [("x-session-token", "garbage")])[0] == A


def test_the_filter_pins_and_a_declared_but_unlisted_plugin_still_writes() -> None:
    picker = _picker("""plugins:
- {type: queue-scorer}
- {type: session-affinity-filter, name: pin}
- {type: session-affinity-scorer, name: unlisted, parameters: {encodedEndpointHeaderConfig: {header: X-Other}}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: pin}, {pluginRef: queue-scorer}]}
""")
    destination, written = _exchange(picker, [("x-session-token", encode_token(C))])
    assert destination == C and written == {"x-session-token": encode_token(C), "x-other": encode_token(C)}


def test_session_id_through_the_stream_writes_nothing_and_ends_early() -> None:
    picker = _picker("""plugins:
- {type: queue-scorer}
- {type: session-affinity-filter, name: pin, parameters: {strategy: session_id}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: pin}, {pluginRef: queue-scorer}]}
""")
    state = picker.scheduler.plugin_states["pin"]
    assert isinstance(state, SessionAffinity)
    state.bindings["s1"] = (C, 0.0)
    # observeResponses is off and no header is to be written: the stream ends at routing.
    assert _exchange(picker, [("x-session-id", "s1")]) == (C, {})
    assert _exchange(picker, [("x-session-id", "s2")]) == (A, {})
    assert state.bindings["s2"][0] == A


# -- EndpointPickerConfig -----------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "category"), [
    ("session-affinity-scorer", Category.SCORER), ("session-affinity-filter", Category.FILTER)])
def test_the_types_are_implemented(kind: str, category: Category) -> None:
    assert PLUGIN_TYPES[kind].category is category


def test_parameters_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(POOL + HEAD + """plugins:
- {type: session-affinity-scorer}
- type: session-affinity-filter
  name: by-id
  parameters:
    strategy: session_id
    profileName: prefill
    sessionIdConfig:
      sources: [{header: ' X-Conversation '}, {header: x-session-id}]
      evictionTtlSeconds: 30.5
      evictionSweepSeconds: 0
""")
    profile = load_config(path).scheduler.effective_profiles[0]
    assert profile.filters[0].params == SessionParams("session_id", "x-session-token",
                                                      ("x-conversation", "x-session-id"), 30.5, 10.0, "prefill")
    assert profile.scorers[0].plugin.params == SessionParams()


def test_the_session_id_checks_apply_to_that_strategy_only() -> None:
    text = HEAD + """plugins:
- type: session-affinity-scorer
  parameters:
    encodedEndpointHeaderConfig: {header: ''}
    sessionIdConfig: {sources: [{header: a, attribute: b}], evictionTtlSeconds: -1}
"""
    params = parse_config(text, cluster_pool="p").scheduler.effective_profiles[0].scorers[0].plugin.params
    assert isinstance(params, SessionParams) and params.token_header == "x-session-token"


P = "EndpointPickerConfig.plugins[0].parameters"


@pytest.mark.parametrize(("parameters", "field"), [
    ("{strategy: sticky}", f"{P}.strategy"),
    ("{strategy: ''}", f"{P}.strategy"),
    ("{strategy: session_id, sessionIdConfig: {sources: [{header: a, attribute: b}]}}",
     f"{P}.sessionIdConfig.sources[0]"),
    ("{strategy: session_id, sessionIdConfig: {sources: [{producer: p}]}}", f"{P}.sessionIdConfig.sources[0]"),
    ("{strategy: session_id, sessionIdConfig: {sources: [{attribute: 5}]}}",
     f"{P}.sessionIdConfig.sources[0].attribute"),
    ("{strategy: session_id, sessionIdConfig: {sources: {header: a}}}", f"{P}.sessionIdConfig.sources"),
    ("{strategy: session_id, sessionIdConfig: {evictionTtlSeconds: -5}}", f"{P}.sessionIdConfig.evictionTtlSeconds"),
    ("{strategy: session_id, sessionIdConfig: {evictionSweepSeconds: -1}}",
     f"{P}.sessionIdConfig.evictionSweepSeconds"),
    ("{sessionIdConfig: {ttl: 5}}", f"{P}.sessionIdConfig.ttl"),
    ("{encodedEndpointHeaderConfig: {header: 5}}", f"{P}.encodedEndpointHeaderConfig.header"),
    ("{profileName: [decode]}", f"{P}.profileName"),
    ("{sessionHeader: x}", f"{P}.sessionHeader"),
])
@pytest.mark.parametrize("kind", ["session-affinity-scorer", "session-affinity-filter"])
def test_bad_parameters_name_the_field(kind: str, parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {{type: {kind}, parameters: {parameters}}}\n", cluster_pool="p")
    assert caught.value.field == field, caught.value
