"""In-flight load: the tracker, llm-d's load scorers, their config, and release on every stream path."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, ExtProcError
from evergreen_trio.picker.flow_control.key import FAIRNESS_HEADERS
from evergreen_trio.picker.inflight import (
    ActiveRequestParams,
    Group,
    InflightLoad,
    LoadAwareParams,
    LoadConfig,
    TokenLoadParams,
    active_request_scores,
    estimated_output,
    load_aware_score,
    output_cap,
    running_requests_scores,
    token_load_score,
    uncached_tokens,
)
from evergreen_trio.picker.kvevents import BlockStored
from evergreen_trio.picker.precise_prefix import precise_caches
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.request import parse_body
from evergreen_trio.picker.scheduler import PickRequest
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_ids
from evergreen_trio.picker.token_producer import DEFAULT_PRODUCER, tokenize
from tests.picker.test_grpc_wire import PATH, Peer
from tests.picker.test_processor import (
    A,
    B,
    C,
    make_picker,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)

EPP = """
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
{producer}
- type: active-request-scorer
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: active-request-scorer, weight: 5}}
  - {{pluginRef: queue-scorer, weight: 1}}
"""


def load_picker(producer: str = "") -> Picker:
    return make_picker(EPP.format(producer=producer), metrics=[EndpointMetrics()] * 3)


def test_ticket_releases_once_and_onto_the_counter_it_incremented() -> None:
    load = InflightLoad()
    ticket = load.dispatch(A, 100)
    assert (load.requests(A), load.tokens(A)) == (1, 100)
    ticket.release_prompt()
    ticket.release_prompt()
    assert (load.requests(A), load.tokens(A)) == (1, 0)
    ticket.release()
    ticket.release()
    assert (load.requests(A), load.tokens(A), load.released) == (0, 0, 1)
    orphan = load.dispatch(B, 10)
    load.forget([A])  # B left the pool, then came back
    fresh = load.dispatch(B, 5)
    orphan.release()
    assert (load.requests(B), load.tokens(B)) == (1, 5)
    fresh.release()
    assert load.total_requests() == 0


groups = st.tuples(st.sampled_from(["", "tenant-a", "tenant-b"]), st.integers(-1, 1))


@given(st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(0, 10_000), st.sampled_from("pre"), groups),
                max_size=40))
def test_counters_never_go_negative_and_return_to_zero(steps: list[tuple[str, int, str, Group]]) -> None:
    load = InflightLoad(LoadConfig(add_estimated_output_tokens=True))
    tickets = []
    for address, tokens, action, group in steps:
        tickets.append(load.dispatch(address, tokens, prompt_tokens=tokens, client_output_cap=tokens // 3, group=group))
        victim = tickets[tokens % len(tickets)]
        if action == "p":
            victim.release_prompt()
        elif action == "r":
            victim.release()
        if action == "e":
            load.forget([a for a in (A, B, C) if a != address])
        assert all(load.requests(a) >= 0 and load.tokens(a) >= 0 for a in (A, B, C))
        for a in (A, B, C):  # the groups split the endpoint's counts, and only groups in flight are kept
            split = load.groups(a)
            assert sum(r for _, r, _ in split) == load.requests(a) and sum(t for _, _, t in split) == load.tokens(a)
            assert all(r > 0 for _, r, _ in split)
    for ticket in tickets:
        ticket.release()
    assert all(load.requests(a) == 0 == load.tokens(a) and not load.groups(a) for a in (A, B, C))


def test_the_picker_counts_a_request_under_its_fairness_id_and_priority() -> None:
    assert load_picker("  name: my-load").scheduler.inflight.config.producer_name == "my-load"  # a metrics label
    picker = load_picker()
    assert picker.scheduler.inflight.config.producer_name == "inflight-load-producer"
    route = picker.route("/v1/completions", {FAIRNESS_HEADERS[0]: "tenant-a"}, b'{"model":"plain","prompt":"hi"}', None)
    ((group, requests, tokens),) = picker.scheduler.inflight.groups(route.endpoints[0])
    assert (group, requests) == (("tenant-a", 0), 1) and tokens > 0
    assert route.load is not None
    route.load.release()
    assert picker.scheduler.inflight.groups(route.endpoints[0]) == []


def test_scorers_follow_llm_d() -> None:
    idle = ActiveRequestParams(idle_threshold=1, max_busy_score=0.5)
    assert active_request_scores(idle, {A: 0, B: 1, C: 4}) == {A: 1.0, B: 1.0, C: 0.0}
    assert active_request_scores(ActiveRequestParams(), {A: 2, B: 4}) == {A: 0.5, B: 0.0}
    tokens = TokenLoadParams(1000)
    assert [token_load_score(tokens, t) for t in (0, 250, 1000, 5000)] == [1.0, 0.75, 0.0, 0.0]
    assert running_requests_scores({A: EndpointMetrics(running=2), B: EndpointMetrics(running=6)}) == {A: 1.0, B: 0.0}
    assert running_requests_scores({A: EndpointMetrics(running=3), B: EndpointMetrics(running=3)}) == {A: 1.0, B: 1.0}
    assert [load_aware_score(LoadAwareParams(10), w) for w in (0, 5, 10, 50)] == [0.5, 0.25, 0.0, 0.0]
    assert estimated_output(LoadConfig(), 100, None) == 150
    assert estimated_output(LoadConfig(max_estimated_output_tokens=40), 100, 60) == 40
    assert output_cap({"max_completion_tokens": 7}) == 7 and output_cap({"max_tokens": True}) is None


def test_active_request_scorer_spreads_a_burst_between_scrapes() -> None:
    picker = load_picker()
    picks = [picker.route("/v1/completions", {}, b'{"model":"plain","prompt":"same"}', None).endpoints[0]
             for _ in range(30)]
    assert {picks.count(a) for a in (A, B, C)} == {10}
    assert picker.scheduler.inflight.total_requests() == 30


def test_token_load_scorer_counts_this_requests_uncached_tokens() -> None:
    picker = make_picker("""
scheduler: {weights: {queue: 0, kv-cache: 0, prefix-cache: 1, token-load: 5}, prefixBlockTokens: 4, charsPerToken: 1}
""", metrics=[EndpointMetrics()] * 3)
    load = picker.scheduler.inflight
    load.dispatch(A, 4_000_000)
    request = PickRequest("plain", 0, hashes=(), prompt_bytes=10)
    assert picker.scheduler.uncached_tokens(request, [A, B]) == {A: 10, B: 10}
    assert picker.scheduler.pick(request)[0] != A


def test_dispatch_counts_request_and_uncached_tokens_until_first_chunk_then_end() -> None:
    picker = load_picker()
    load = picker.scheduler.inflight
    stream = picker.new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "p" * 400}).encode()))
    address = set_headers(head.request_headers.response.header_mutation)[DESTINATION]
    assert (load.requests(address), load.tokens(address)) == (1, 100)  # 400 bytes / 4 chars per token
    stream.on_message(response_headers("text/event-stream"))
    assert load.tokens(address) == 100
    stream.on_message(response_body(b'data: {"choices":[{"text":"a"}]}\n\n', end=False))
    assert (load.requests(address), load.tokens(address)) == (1, 0)
    stream.on_message(response_body(b"data: [DONE]\n\n", end=True))
    assert load.requests(address) == 0


def test_estimated_output_tokens_stay_until_the_end() -> None:
    picker = load_picker("  parameters: {addEstimatedOutputTokens: true, outputRatio: 0.5}")
    load = picker.scheduler.inflight
    stream = picker.new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "p" * 400, "max_tokens": 30}).encode()))
    (address,) = [a for a in (A, B, C) if load.requests(a)]
    assert load.tokens(address) == 100 + 30
    stream.on_message(response_headers("text/event-stream"))
    stream.on_message(response_body(b"data: x\n\n", end=False))
    assert load.tokens(address) == 130
    stream.on_message(response_body(b"", end=True))
    assert (load.requests(address), load.tokens(address)) == (0, 0)


@pytest.mark.parametrize("ending", ["on_end", "on_abort", "protocol_error", "headers_end", "unobserved"])
def test_every_stream_ending_releases_the_load(ending: str) -> None:
    picker = load_picker() if ending != "unobserved" else make_picker(
        "extProc: {observeResponses: false}\n" + EPP.format(producer=""))
    stream = picker.new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(b'{"model":"plain","prompt":"hello"}'))
    load = picker.scheduler.inflight
    assert load.total_requests() == (0 if ending == "unobserved" else 1)
    if ending == "on_end":
        stream.on_end()
    elif ending == "on_abort":
        stream.on_abort()
    elif ending == "protocol_error":
        with pytest.raises(ExtProcError):
            stream.on_message(response_body(b"x"))  # a body before response headers
        stream.on_abort()  # what the wire does with the failed stream
    elif ending == "headers_end":
        stream.on_message(response_headers(end=True))
    assert load.total_requests() == 0


class Holder:
    """A processor that holds a unit until its stream completes or is aborted."""

    held = 0

    def __init__(self) -> None:
        self.finished = False
        Holder.held += 1

    def on_message(self, message: BytesValue) -> Sequence[BytesValue]:
        if message.value == b"fail":
            raise KeyError("bug")
        self.finished = message.value == b"stop"
        if self.finished:
            Holder.held -= 1
        return [message]

    def on_end(self) -> Sequence[BytesValue]:
        Holder.held -= 1
        return []

    def on_abort(self) -> None:
        Holder.held -= 1


@pytest.mark.parametrize("ending", ["stop", "end", "reset", "fail", "goaway", "lost"])
def test_wire_calls_on_abort_exactly_once_on_every_other_ending(ending: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from evergreen_trio._grpc import server_wire as grpc_wire

    monkeypatch.setattr(Holder, "held", 0)
    peer = Peer()
    peer.server.methods = {PATH: grpc_wire.SyncBidiMethod(PATH, BytesValue, Holder)}
    stream = peer.open()
    peer.send(stream, b"a")
    assert Holder.held == 1
    if ending in ("stop", "fail"):
        peer.send(stream, ending.encode())
    elif ending == "end":
        peer.send(stream, end=True)
    elif ending == "reset":
        peer.client.reset_stream(stream)
        peer.pump()
    elif ending == "goaway":
        peer.server.close("shutting down")
    else:
        peer.server.abort_streams()
    assert Holder.held == 0
    peer.server.abort_streams()
    assert Holder.held == 0


@pytest.mark.parametrize(("yaml", "field"), [
    ("- type: inflight-load-producer\n  parameters: {addEstimatedOutputTokens: maybe}", "addEstimatedOutputTokens"),
    ("- type: inflight-load-producer\n  parameters: {outputRatio: -1}", "outputRatio"),
    ("- type: inflight-load-producer\n  parameters: {maxEstimatedOutputTokens: -5}", "maxEstimatedOutputTokens"),
    ("- type: inflight-load-producer\n  parameters: {outputRatioo: 1}", "outputRatioo"),
    ("- type: inflight-load-producer\n  parameters: {prefixMatchInfoProducerName: 3}", "prefixMatchInfoProducerName"),
    ("- type: inflight-load-producer\n  parameters: {syncCrossReplicaState: sometimes}", "syncCrossReplicaState"),
    ("- type: active-request-scorer\n  parameters: {inFlightLoadProducerName: [a]}", "inFlightLoadProducerName"),
    ("- type: token-load-scorer\n  parameters: {inFlightLoadProducerName: 1}", "inFlightLoadProducerName"),
    ("- type: active-request-scorer\n  parameters: {idleThreshold: -1}", "idleThreshold"),
    ("- type: active-request-scorer\n  parameters: {maxBusyScore: 1.5}", "maxBusyScore"),
    ("- type: active-request-scorer\n  parameters: {requestTimeout: 5}", "requestTimeout"),
    ("- type: token-load-scorer\n  parameters: {queueThresholdTokens: 0}", "queueThresholdTokens"),
    ("- type: token-load-scorer\n  parameters: {queueThreshold: 10}", "queueThreshold"),
    ("- type: load-aware-scorer\n  parameters: {threshold: zero}", "threshold"),
    ("- type: running-requests-size-scorer\n  parameters: {anything: 1}", "anything"),
    ("- type: load-aware-scorer\n  parameters: {threshold: 0}", "threshold"),
])
def test_bad_load_plugin_parameters_name_the_field(yaml: str, field: str) -> None:
    text = f"""pool: {{name: t, endpoints: ['{A}']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
{yaml}
- type: queue-scorer
"""
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.field.endswith(f"parameters.{field}")


def test_plain_weights_and_their_bad_values() -> None:
    weights = "active-request: 2, token-load: 1, running-requests: 1, load-aware: 3"
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\nscheduler: {{weights: {{{weights}}}}}")
    load = config.scheduler.load
    assert (load.active_request, load.token_load, load.running_requests, load.load_aware) == (2, 1, 1, 3)
    for key in ("active-request", "token-load", "running-requests", "load-aware"):
        with pytest.raises(ConfigError, match=rf"scheduler\.weights\.{key}"):
            parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\nscheduler: {{weights: {{{key}: -2}}}}")
        with pytest.raises(ConfigError, match=rf"scheduler\.weights\.{key}"):
            parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\nscheduler: {{weights: {{{key}: high}}}}")


@pytest.mark.parametrize(("prompt", "matched", "block", "total", "uncached"), [
    (5, 1, 4, 2, 4),  # TestUncachedInputTokens_Overestimate: the indexed blocks' 4 over the estimate's 5
    (8, 1, 4, 2, 4),  # the precise-producer table: indexed 8, matched 4
    (100, 3, 16, 7, 64),  # a short tail block counts whole: 7 blocks of 16 indexed, 3 matched
    (130, 2, 16, 7, 80 + 18),  # past the indexed blocks (a capped match): the rest counts too
    (50, 0, 16, 0, 50), (50, 9, 0, 4, 50),  # nothing indexed: the whole prompt
    (10, 4, 4, 3, 0),  # more matched than indexed (a stale index): never below 0
])
def test_uncached_tokens_are_the_references_uncached_input_tokens(
        prompt: int, matched: int, block: int, total: int, uncached: int) -> None:
    assert uncached_tokens(prompt, matched, block, total) == uncached


PREFIX_EPP = """
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
  parameters: {producer}
- type: approx-prefix-cache-producer
{precise}- type: prefix-cache-scorer
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: prefix-cache-scorer, weight: 1}}
  - {{pluginRef: active-request-scorer, weight: 5}}
"""
CHAT = {"model": "plain", "messages": [{"role": "system", "content": "be brief " * 20},
                                       {"role": "user", "content": "x" * 305}], "tools": [{"type": "function"}]}


def test_in_flight_tokens_are_the_auto_added_producers_tokens_and_whole_indexed_blocks() -> None:
    """As the reference, whose in-flight load producer requires the token producer's tokens (the
    framework adds the estimate one): the roles and tools count, and the blocks the prompt was
    hashed in count whole (its short tail block too) on an endpoint that holds none."""
    picker = make_picker(PREFIX_EPP.format(producer="{}", precise=""), metrics=[EndpointMetrics()] * 3)
    body = json.dumps(CHAT).encode()
    tokens, _ = tokenize(DEFAULT_PRODUCER, "/v1/chat/completions", parse_body("/v1/chat/completions", body), {})
    assert tokens is not None
    route = picker.route("/v1/chat/completions", {}, body, None)
    block = picker.scheduler.prefix_geometry()[0]
    assert tokens.token_count % block and len(route.hashes) * block > tokens.token_count  # a short tail block
    assert picker.scheduler.inflight.tokens(route.endpoints[0]) == len(route.hashes) * block
    assert picker.scheduler.inflight.tokens(route.endpoints[0]) != math.ceil(len("system" + "be brief " * 20
                                                                                + "user" + "x" * 305) / 4)


def test_in_flight_load_discounts_by_the_precise_producer_it_names() -> None:
    picker = make_picker(PREFIX_EPP.format(
        producer="{prefixMatchInfoProducerName: events}",
        precise="- {type: token-producer}\n- {type: precise-prefix-cache-producer, name: events}\n"),
        metrics=[EndpointMetrics()] * 3)
    (cache,) = precise_caches(picker.scheduler.plugin_states).values()
    request = PickRequest("plain", 0, tokens=TokenizedPrompt((pack_ids(list(range(70))),)))
    cache.events.apply(A, "plain", BlockStored((1, 2), 0, tuple(range(32)), 16, "GPU"))
    cache.events.apply(B, "plain", BlockStored((3,), 0, tuple(range(16)), 16, "CPU"))
    # 4 full blocks of 16 indexed, 6 tokens past them; A holds 2 (weight 1 each), B 1 at 0.8: int(0.8) = 0
    assert picker.scheduler.uncached_tokens(request, [A, B, C]) == {A: 2 * 16 + 6, B: 4 * 16 + 6, C: 4 * 16 + 6}


def test_in_flight_load_discounts_by_the_burst_producer_it_names() -> None:
    """The burst producer's match info, as the reference's: every indexed block on the replica its
    window assigned, none elsewhere, and the blocks counted whole everywhere once its window sealed
    (alone in a window: no replica, still whole blocks); a request not in a window: its tokens."""
    burst = "- {type: burst-prefix-cache-producer, name: burst, parameters: {blockSizeTokens: 16}}\n"
    picker = make_picker(PREFIX_EPP.format(producer="{prefixMatchInfoProducerName: burst}", precise=burst),
                         metrics=[EndpointMetrics()] * 3)
    window = picker.burst
    assert window is not None
    tokens = TokenizedPrompt((pack_ids(list(range(70))),))  # 4 blocks of 16 indexed, 6 tokens past them
    entries = [window.join((1, 2, 3, 4), picker.burst_replicas(None), lambda _: None) for _ in range(2)]
    alone = window.join((9, 8, 7, 6), picker.burst_replicas(None), lambda _: None)
    window.seal()
    assert entries[0] is not None and alone is not None and alone.assigned is None
    assigned = entries[0].assigned
    request = PickRequest("plain", 0, tokens=tokens, attributes=window.match_attribute(entries[0]))
    others = {a: 4 * 16 + 6 for a in (A, B, C) if a != assigned}
    assert picker.scheduler.uncached_tokens(request, [A, B, C]) == {assigned: 6, **others}
    request = PickRequest("plain", 0, tokens=TokenizedPrompt((pack_ids(list(range(60))),)),
                          attributes=window.match_attribute(alone))
    assert picker.scheduler.uncached_tokens(request, [A, B]) == {A: 4 * 16, B: 4 * 16}  # its short tail whole
    assert picker.scheduler.uncached_tokens(PickRequest("plain", 0, tokens=tokens), [A]) == {A: 70}


def test_a_prefix_producer_name_without_match_info_discounts_nothing() -> None:
    picker = load_picker("  parameters: {prefixMatchInfoProducerName: nobody}")
    request = PickRequest("plain", 0, hashes=(1, 2, 3), prompt_bytes=400)
    picker.scheduler.prefix.add(A, (1, 2, 3))
    assert picker.scheduler.uncached_tokens(request, [A, B]) == {A: 100, B: 100}
