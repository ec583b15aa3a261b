"""Header-driven picker inputs over a real socket: ``agent-identity``, ``session-id-producer`` (and the
``session_id`` session affinity that reads them), ``header-profile-handler``,
``header-based-testing-filter`` and session affinity's encoded token, with hostile values sent by
grpcio, as Envoy, to a running picker's ext_proc port.

Each request's answer is checked against a model of the reference (llm-d-router: header keys in
lower case, the last of a repeated header wins, values trimmed as Go's ``strings.TrimSpace`` trims
their bytes, names compared byte for byte), then a well-formed request is served on the same
connection (a new stream) and on a new one. Values: at and over the ext_proc message cap, repeated
thousands of times, bytes that are no UTF-8, controls, NUL, empty, naming no profile, endpoint or
session, and a flood of new session and agent ids: session affinity's bindings and, under flow
control, program-aware-fairness's programs (an agent identity is a fairness id) stay bounded.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st
from picker_requests import LEGIT_BODY, channel, ext_proc, headers_message, serve_fake_engine, wait_routable

from evergreen_trio.picker import PickerPorts, parse_config, run_picker, runtime
from evergreen_trio.picker.config import PickerConfig
from evergreen_trio.picker.gotext import GO_SPACE
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.session import MAX_SESSION_KEY_CHARS, SessionAffinity

STAGE, SID, TENANT, SELECTION, TOKEN = "x-stage", "x-sid", "x-tenant", "test-epp-endpoint-selection", "x-session-token"
AGENT_HEADERS = (TENANT, "x-claude-code-session-id", "x-session-affinity", "session-id", "session_id")
PROFILES = ("decode", "pinned", "décode")  # one name is no ASCII: matched by its UTF-8 bytes
KNOWN = b"known-session"  # bound to the busy endpoint before the requests
BODY_CAP = 4096  # the ext_proc message cap is this and 64 KiB (runtime.wire_limits)
Pairs = Sequence[tuple[str, bytes]]


def config(idle: str, busy: str) -> PickerConfig:
    """Two endpoints on one host; ``decode`` pins sessions (x-sid, else the agent identity),
    ``pinned`` keeps what the test header names, ``décode`` follows a session token."""
    return parse_config(f"""pool:
  name: headers
  endpoints: ['{idle}', '{busy}']
extProc: {{maxRequestBodyBytes: {BODY_CAP}, maxResponseBodyBytes: {BODY_CAP}}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: agent-identity, parameters: {{additionalSessionHeaders: [X-Tenant]}}}}
- {{type: session-id-producer, name: sid, parameters: {{headerName: X-Sid}}}}
- {{type: header-profile-handler, parameters: {{headerName: X-Stage}}}}
- {{type: queue-scorer}}
- {{type: header-based-testing-filter, name: only}}
- type: session-affinity-filter
  name: pin
  parameters:
    strategy: session_id
    sessionIdConfig: {{sources: [{{attribute: SessionIDDataKey, producer: sid}}, {{attribute: agent-identity}}]}}
- {{type: session-affinity-scorer, name: token}}
schedulingProfiles:
- {{name: decode, plugins: [{{pluginRef: pin}}, {{pluginRef: queue-scorer}}]}}
- {{name: pinned, plugins: [{{pluginRef: only}}, {{pluginRef: queue-scorer}}]}}
- {{name: décode, plugins: [{{pluginRef: token, weight: 2}}, {{pluginRef: queue-scorer}}]}}
""")


@dataclass
class Running:
    """A picker over an idle and a busy engine, its session_id state, and the model's bindings."""

    ports: PickerPorts
    idle: str
    busy: str
    cap: int  # the largest ext_proc message the port takes
    sessions: SessionAffinity
    bindings: dict[bytes, str] = field(default_factory=dict)

    def token(self, address: str) -> bytes:
        return base64.b64encode(address.encode())


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[Picker]:
    """The Picker each run_picker makes, to read its plugins' state."""
    pickers: list[Picker] = []

    class Recorded(Picker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pickers.append(self)

    monkeypatch.setattr(runtime, "Picker", Recorded)
    return pickers


async def start(nursery: trio.Nursery, cfg: PickerConfig) -> PickerPorts:
    ports: PickerPorts = await nursery.start(partial(run_picker, cfg, grpc_port=0, health_port=0, metrics_port=0))
    await wait_routable(ports.grpc)
    return ports


@pytest.fixture
async def picker(nursery: trio.Nursery, made: list[Picker]) -> Running:
    idle = f"127.0.0.1:{await nursery.start(serve_fake_engine, 0)}"
    busy = f"127.0.0.1:{await nursery.start(serve_fake_engine, 8)}"
    cfg = config(idle, busy)
    ports = await start(nursery, cfg)
    (running_picker,) = made
    with trio.fail_after(10):
        while len(running_picker.snapshot.ready_states()) < 2:  # noqa: ASYNC110 (the scrapers' state)
            await trio.sleep(0.02)
    sessions = running_picker.scheduler.plugin_states["pin"]
    assert isinstance(sessions, SessionAffinity)
    sessions.bindings[KNOWN.decode()] = (busy, running_picker.snapshot.clock())
    return Running(ports, idle, busy, runtime.wire_limits(cfg).max_message_bytes, sessions, {KNOWN: busy})


# -- the model: what llm-d-router answers ----------------------------------------------------------

SPACE_RUNES = [space.encode() for space in GO_SPACE]


def go_trim(raw: bytes) -> bytes:
    """``strings.TrimSpace``: whole UTF-8 encoded space runes off each end."""
    while (rune := next((r for r in SPACE_RUNES if raw.startswith(r)), None)) is not None:
        raw = raw[len(rune):]
    while (rune := next((r for r in SPACE_RUNES if raw.endswith(r)), None)) is not None:
        raw = raw[: -len(rune)]
    return raw


def selected(running: Running, header: bytes | None) -> str | None:
    """The testing filter's pick: the first item naming an endpoint (a bare IP names the host's
    last one, here the busy one); queue-scorer has one endpoint left of the host."""
    named = {running.idle: running.idle, running.busy: running.busy, "127.0.0.1": running.busy,
             f"[127.0.0.1]:{running.busy.rsplit(':', 1)[1]}": running.busy}
    for item in (header or b"").split(b","):
        endpoint = named.get(go_trim(item).decode("latin-1"))
        if endpoint is not None:
            return endpoint
    return None


def expected(running: Running, pairs: Pairs) -> tuple[int, str | None]:
    """The reference's answer to a request with ``pairs``: a status and the endpoint routed to.
    Updates the model's session bindings as the picker's own."""
    headers = {name.lower(): value for name, value in pairs}  # the last of a repeated header wins
    stage = go_trim(headers.get(STAGE, b""))
    try:
        profile = stage.decode() if stage else "decode"
    except UnicodeDecodeError:
        return 429, None
    if profile not in PROFILES:
        return 429, None
    identity = next((headers[h] for h in AGENT_HEADERS if headers.get(h)), b"")  # first non-empty, untrimmed
    session = go_trim(headers.get(SID, b"")) or go_trim(identity)
    if profile == "decode":
        endpoint: str | None = running.bindings.get(session, running.idle) if session else running.idle
    elif profile == "pinned":
        endpoint = selected(running, headers.get(SELECTION))
    else:  # Go's base64 skips CR and LF; the token (weight 2) outweighs the busy endpoint's queue
        token = headers.get(TOKEN, b"").replace(b"\r", b"").replace(b"\n", b"")
        endpoint = running.busy if token == running.token(running.busy) else running.idle
    if endpoint is None:
        return 429, None  # the filters kept none
    if session:
        running.bindings.setdefault(session, endpoint)
    return 200, endpoint


def legit_served(connection: grpc.Channel, port: int, idle: str) -> None:
    """A well-formed request is routed to ``idle`` on ``connection`` (a new stream) and on a new
    connection to ``port``."""
    for target in (connection, port):
        got = ext_proc(target, LEGIT_BODY)
        assert (got.status, got.endpoint) == (200, idle), got


def answer(connection: grpc.Channel, pairs: Pairs | Mapping[str, str]) -> tuple[int, str | None]:
    got = ext_proc(connection, LEGIT_BODY, list(pairs.items()) if isinstance(pairs, Mapping) else pairs)
    return got.status, got.endpoint


# -- hostile values: a property over one running picker -------------------------------------------

PADDING = [b" ", b"\t", b"\r\n", "\u00a0".encode(), "\u3000".encode(), b"\x1f", b"\x85", b"\xa0", b"\x00"]


def hostile_requests(running: Running) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    """Requests whose profile, session id, agent identities, endpoint selection and token each come
    (or not) with a hostile value, then repeats of any header: values are names the picker knows
    wrapped in spaces Go trims and bytes it does not, arbitrary bytes (no UTF-8, NUL, controls),
    empty, and comma lists of them."""
    meaningful = [*(p.encode() for p in PROFILES), b"prefill", b"DECODE", KNOWN, running.idle.encode(),
                  running.busy.encode(), b"127.0.0.1", b"10.1.2.3:8000", running.token(running.busy),
                  running.token(running.busy)[:8] + b"\r\n" + running.token(running.busy)[8:],
                  running.token(running.idle), b"!!notbase64", b""]
    pad = st.lists(st.sampled_from(PADDING), max_size=3).map(b"".join)
    core = st.one_of(st.sampled_from(meaningful), st.binary(max_size=24))
    one = st.builds(lambda before, value, after: before + value + after, pad, core, pad)
    value = st.one_of(one, st.lists(one, min_size=2, max_size=4).map(b",".join))
    names = st.sampled_from([STAGE, SID, *AGENT_HEADERS, SELECTION, TOKEN, "X-Stage", "X-SID"])
    return st.builds(
        lambda first, agents, repeats: [(k, v) for k, v in first if v is not None] + agents + repeats,
        st.tuples(*(st.tuples(st.just(name), st.none() | value) for name in (STAGE, SID, SELECTION, TOKEN))),
        st.lists(st.tuples(st.sampled_from(AGENT_HEADERS), value), max_size=2),
        st.lists(st.tuples(names, value), max_size=4))


def edge_requests(running: Running) -> list[list[tuple[str, bytes]]]:
    """Where Go's reading of a header differs from Python's, and what it answers."""
    busy, token = running.busy.encode(), running.token(running.busy)
    return [
        [(STAGE, b"decode\x1f")],  # a separator is no space to Go: no profile, 429
        [(STAGE, b"\x85pinned"), (SELECTION, busy)],  # nor a lone 0x85 byte: 429
        [(STAGE, "\u00a0pinned\u3000".encode()), (SELECTION, busy)],  # UTF-8 encoded spaces are: busy
        [(STAGE, "décode".encode()), (TOKEN, token)],  # a non-ASCII name, by its UTF-8 bytes: busy
        [(STAGE, "décode".encode("latin-1"))],  # the same text in other bytes names nothing: 429
        [(STAGE, b"\x00")],
        [(STAGE, b"pinned"), (STAGE, b"nope")],  # the last wins: 429
        [(STAGE, b"pinned"), (SELECTION, b"\x1f127.0.0.1")],  # 429
        [(STAGE, b"pinned"), (SELECTION, b" 10.1.2.3 ,\t127.0.0.1 ")],  # busy
        [(STAGE, "décode".encode()), (TOKEN, token[:8] + b"\r\n" + token[8:])],  # Go's base64 skips CR LF
        [(SID, KNOWN + b"\x1f")],  # another session: idle
        [(SID, "\u00a0".encode() + KNOWN + b"\t")],  # the known one: busy
        [("x-claude-code-session-id", b" "), ("session-id", KNOWN)],  # a blank identity still wins: idle
        [(STAGE, b""), (SID, b""), ("session_id", b"")],  # empty: decode, no session
    ]


async def test_hostile_header_values_get_the_references_answer_and_the_port_serves_on(picker: Running) -> None:
    requests = hostile_requests(picker)

    def check() -> None:
        with channel(picker.ports.grpc) as connection:

            @settings(max_examples=50)
            @given(requests)
            def one_request(sent: list[tuple[str, bytes]]) -> None:
                assert answer(connection, sent) == expected(picker, sent)
                legit_served(connection, picker.ports.grpc, picker.idle)

            for case in edge_requests(picker):
                one_request = example(case)(one_request)
            one_request()

    await trio.to_thread.run_sync(check)


# -- values at and over the message cap --------------------------------------------------------


def at_cap(running: Running, pairs: list[tuple[str, bytes]], index: int, filler: bytes, extra: int = 0) -> Pairs:
    """``pairs`` with ``filler`` repeated before pair ``index``'s value until the request_headers
    message is exactly the port's cap (plus ``extra`` bytes)."""
    def sized(count: int) -> list[tuple[str, bytes]]:
        padded = list(pairs)
        name, value = padded[index]
        padded[index] = (name, (filler * (count // len(filler) + 1))[:count] + value)
        return padded

    count = 0
    while (size := headers_message(sized(count)).ByteSize()) != running.cap + extra:
        count += running.cap + extra - size
    return sized(count)


@pytest.mark.parametrize(("label", "pairs", "filler", "want"), [
    ("profile-naming-none", [(STAGE, b"")], b"z", "429"),
    ("profile-after-spaces", [(STAGE, b"pinned"), (SELECTION, b"127.0.0.1")], b" ", "busy"),
    ("session-id", [(SID, b"s")], b"s", "idle"),
    ("agent-identity", [("x-claude-code-session-id", b"a")], b"a", "idle"),
    ("selection-of-empty-items", [(SELECTION, b"127.0.0.1"), (STAGE, b"pinned")], b",", "busy"),
    ("selection-blank", [(SELECTION, b""), (STAGE, b"pinned")], b" ", "429"),
    ("token-not-an-endpoint", [(TOKEN, b""), (STAGE, "décode".encode())], b"A", "idle"),
])
async def test_a_value_at_the_message_cap_is_answered_and_one_byte_over_is_resource_exhausted(
        picker: Running, caplog: pytest.LogCaptureFixture, label: str, pairs: list[tuple[str, bytes]],
        filler: bytes, want: str) -> None:
    """At the cap the plugins answer as for any value (a bound session's key stays short, the
    refusal's log line too); a byte over, the port refuses the message RESOURCE_EXHAUSTED."""
    caplog.set_level(logging.INFO, "evergreen_trio.picker")

    def check() -> None:
        with channel(picker.ports.grpc) as connection:
            full = at_cap(picker, pairs, 0, filler)
            status = {"429": (429, None), "idle": (200, picker.idle), "busy": (200, picker.busy)}[want]
            assert expected(picker, full) == status
            assert answer(connection, full) == status
            with pytest.raises(grpc.RpcError) as refused:
                answer(connection, at_cap(picker, pairs, 0, filler, extra=1))
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            legit_served(connection, picker.ports.grpc, picker.idle)

    await trio.to_thread.run_sync(check)
    assert all(len(key) <= MAX_SESSION_KEY_CHARS for key in picker.sessions.bindings)
    assert all(len(r.getMessage()) < 1024 for r in caplog.records), label


async def test_two_thousand_repeated_headers_the_last_wins(picker: Running) -> None:
    """2,000 session ids and profile names in one request: the last of each counts, as the
    reference's header map keeps it."""
    sids = [(SID, f"repeated-{i}".encode()) for i in range(2000)]

    def check() -> None:
        with channel(picker.ports.grpc) as connection:
            pinned = [*sids, (STAGE, b"nope"), (STAGE, b"pinned"), (SELECTION, picker.busy.encode())]
            assert answer(connection, pinned) == expected(picker, pinned) == (200, picker.busy)
            assert answer(connection, {SID: "repeated-1999"}) == (200, picker.busy)  # the last was bound
            assert answer(connection, {SID: "repeated-0"}) == (200, picker.idle)
            assert answer(connection, [*sids[:5], (STAGE, b"pinned"), (STAGE, b"nope")]) == (429, None)
            legit_served(connection, picker.ports.grpc, picker.idle)

    await trio.to_thread.run_sync(check)


async def test_a_flood_of_new_session_and_agent_ids_keeps_the_bindings_bounded(picker: Running) -> None:
    """300 new 2 KiB ids (session ids and agent identities in turn) with the bound lowered to 100:
    the plugin keeps 100 bindings under short keys, the newest; the oldest is forgotten."""
    picker.sessions.max_bindings = 100
    first = "first-" + "f" * 2048

    def check() -> None:
        with channel(picker.ports.grpc) as connection:
            assert answer(connection, {SID: first, STAGE: "pinned", SELECTION: picker.busy}) == (200, picker.busy)
            assert answer(connection, {SID: first}) == (200, picker.busy)  # bound
            for i in range(300):
                header = SID if i % 2 else "x-claude-code-session-id"
                assert answer(connection, {header: f"{i:04d}" + "x" * 2048}) == (200, picker.idle)
            last = "0299" + "x" * 2048
            assert answer(connection, {SID: last, STAGE: "pinned", SELECTION: picker.busy}) == (200, picker.busy)
            assert answer(connection, {SID: last}) == (200, picker.idle)  # bound to its first pick
            assert answer(connection, {SID: first}) == (200, picker.idle)  # evicted: bound anew
            legit_served(connection, picker.ports.grpc, picker.idle)

    await trio.to_thread.run_sync(check)
    assert len(picker.sessions.bindings) == 100
    assert all(len(key) <= MAX_SESSION_KEY_CHARS for key in picker.sessions.bindings)


FLOW = """pool: {{name: flow, endpoints: ['{idle}']}}
extProc: {{observeResponses: false}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- {{type: queue-scorer}}
- {{type: agent-identity}}
- {{type: program-aware-fairness, name: fair}}
flowControl:
  defaultPriorityBand: {{fairnessPolicyRef: fair}}
"""


async def test_a_flood_of_agent_ids_keeps_flow_controls_programs_bounded(nursery: trio.Nursery,
                                                                          made: list[Picker]) -> None:
    """With flow control an agent identity is the request's fairness id, a program-aware-fairness
    program: 300 new ones with the bound lowered to 100 leave the 100 most recent; identities that
    are no fairness id (NUL, 300 chars, no ASCII, blank) queue in default-flow."""
    idle = f"127.0.0.1:{await nursery.start(serve_fake_engine, 0)}"
    ports = await start(nursery, parse_config(FLOW.format(idle=idle)))
    (running_picker,) = made
    assert running_picker.flow is not None
    fair = running_picker.flow.queue.programs["fair"]
    fair.max_programs = 100

    def check() -> None:
        with channel(ports.grpc) as connection:
            for i in range(300):
                assert answer(connection, {"x-claude-code-session-id": f"agent-{i:04d}"}) == (200, idle)
            for hostile in (b"\x00", b"a" * 300, "\u00e9".encode(), b" \t"):
                assert answer(connection, [("x-claude-code-session-id", hostile)]) == (200, idle)
            legit_served(connection, ports.grpc, idle)

    await trio.to_thread.run_sync(check)
    assert len(fair.programs) == 100
    assert "agent-0299" in fair.programs and "agent-0000" not in fair.programs and "default-flow" in fair.programs
