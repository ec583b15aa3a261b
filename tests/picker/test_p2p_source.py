"""``p2p-source-producer`` (llm-d-router Alpha): the reference's test tables
(``requestcontrol/dataproducer/p2psource/producer_test.go``) on the sans-IO core, properties of the
choice and the header, the scheduler's hook, the ext_proc stream's header mutation, the command's
bad input, and a started picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.p2p_source import (
    MAX_REQUEST_ID_BYTES,
    P2P_SOURCE_PRODUCER,
    P2PSourceParams,
    Peer,
    choose_source,
    computing_endpoint,
    source_header,
    spread_fraction,
)
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.routing_headers import KV_CACHE_SOURCE_HEADER
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler
from tests.picker.test_processor import A, B, C, make_picker, request_body, request_headers, set_headers

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import PROCESS, serve_fake_engine

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"
BLOCK = 16  # the reference's testBlockSize
DEFAULT = P2PSourceParams()


def peer(address: str, blocks: int, waiting: float = 0.0) -> Peer:
    """The reference's ``endpoint``/``endpointWithLoad``: ``blocks`` cached blocks at port 8080."""
    return Peer(f"{address}:8080", blocks * BLOCK, BLOCK, waiting)


def produce(peers: Sequence[Peer], request_id: str) -> Peer | None:
    return choose_source(peers, spread_fraction(request_id))


def header(params: P2PSourceParams, best: Peer | None, profiles: dict[str, list[Peer]],
           primary: str = "decode") -> str | None:
    """The reference's PreRequest on a result of ``profiles`` (each profile's picks)."""
    picks = {name: [p.address for p in peers] for name, peers in profiles.items()}
    computing = computing_endpoint(params, picks, picks.get(primary, []))
    cached = {p.address: p.cached_tokens for peers in profiles.values() for p in peers}
    return source_header(params, best, computing, cached.get(computing or "", 0))


def declared(parameters: str) -> object:
    entry = f"{{type: {P2P_SOURCE_PRODUCER}, name: p2p, parameters: {{{parameters}}}}}"
    config = parse_config(HEAD + f"plugins:\n- {entry}\n- {{type: queue-scorer}}\n", cluster_pool="p")
    assert config.epp is not None
    return config.epp.plugins["p2p"].params


# -- the factory --------------------------------------------------------------------------------


def test_factory_defaults_wires_config_and_the_prefill_profile_name() -> None:
    assert declared("") == P2PSourceParams("", 1, "prefill")
    assert declared("prefixMatchInfoProducerName: approx-prefix-cache-producer, minCachedTokenDelta: 33") == \
        P2PSourceParams("", 33, "prefill")
    assert declared("prefillProfileName: P") == P2PSourceParams(prefill_profile="P")
    assert declared("prefillProfileName: ''") == P2PSourceParams()  # empty: the default, as the reference


@pytest.mark.parametrize(("parameters", "field"), [
    ("minCachedTokenDelta: 0", "minCachedTokenDelta"),
    ("minCachedTokenDelta: -3", "minCachedTokenDelta"),
    ("minCachedTokenDelta: '2'", "minCachedTokenDelta"),
    ("prefillProfileName: 7", "prefillProfileName"),
    ("prefixMatchInfoProducerName: precise-prefix-cache-producer", "prefixMatchInfoProducerName"),
    ("blockSize: 16", "blockSize"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        declared(parameters)
    assert caught.value.field == f"{P}.{field}"


def test_the_producer_named_may_be_a_declared_burst_producer() -> None:
    config = parse_config(HEAD + f"""plugins:
- {{type: {P2P_SOURCE_PRODUCER}, name: p2p, parameters: {{prefixMatchInfoProducerName: burst}}}}
- {{type: burst-prefix-cache-producer, name: burst}}
""", cluster_pool="p")
    assert config.epp is not None and config.epp.plugins["p2p"].params == P2PSourceParams(producer="burst")
    with pytest.raises(ConfigError) as caught:
        declared("prefixMatchInfoProducerName: burst")  # no such producer declared
    assert caught.value.field == f"{P}.prefixMatchInfoProducerName"


def test_registered_alpha_producer() -> None:
    assert P2P_SOURCE_PRODUCER in ALPHA_TYPES
    assert PLUGIN_TYPES[P2P_SOURCE_PRODUCER].category is Category.PRODUCER


@pytest.mark.parametrize(("parameters", "field"), [("{minCachedTokenDelta: 0}", "minCachedTokenDelta"),
                                                   ("{prefillProfileName: [a]}", "prefillProfileName")])
def test_a_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: {P2P_SOURCE_PRODUCER}, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line


# -- Produce: the reference's tables ------------------------------------------------------------


def test_produce_stashes_the_best_match_peer() -> None:
    best = produce([peer("10.0.0.1", 1), peer("10.0.0.2", 3)], "req-stash")
    assert best is not None and (best.address, best.cached_tokens) == ("10.0.0.2:8080", 48)


def test_produce_without_cached_blocks_stashes_nothing() -> None:
    assert produce([peer("10.0.0.1", 0), peer("10.0.0.2", 0)], "req-nocache") is None
    assert produce([], "req-none") is None


def test_produce_missing_match_info_is_zero_and_nil_metrics_are_neutral() -> None:
    best = produce([Peer("10.0.0.9:8080", 0, 0), peer("10.0.0.2", 2)], "req-bare")
    assert best is not None and best.address == "10.0.0.2:8080"
    best = produce([peer("10.0.0.1", 1), peer("10.0.0.2", 3)], "req-nilmetrics")
    assert best is not None and best.address == "10.0.0.2:8080"


def test_produce_ipv6_best_match_is_bracketed() -> None:
    address = Endpoint("fd00::9", 8080).address
    best = produce([Peer(address, 2 * BLOCK, BLOCK)], "req-ipv6-produce")
    assert best is not None and best.address == "[fd00::9]:8080"


def picks(peers: Sequence[Peer], ids: Sequence[str]) -> Counter[str]:
    chosen = [produce(peers, request_id) for request_id in ids]
    return Counter(p.address for p in chosen if p is not None)


def test_produce_shares_by_inverse_queue_weight() -> None:
    # Weights: pod-a 1/13, pod-b 1/3, pod-c 1/8.
    got = picks([peer("10.0.0.1", 3, 12), peer("10.0.0.2", 3, 2), peer("10.0.0.3", 3, 7)],
                [f"req-{i}" for i in range(400)])
    assert got["10.0.0.2:8080"] > got["10.0.0.3:8080"] > got["10.0.0.1:8080"] > 0, got


def test_produce_near_tie_does_not_herd() -> None:
    got = picks([peer("10.0.0.1", 3, 0), peer("10.0.0.2", 3, 1)], [f"near-{i}" for i in range(600)])
    assert got["10.0.0.1:8080"] > got["10.0.0.2:8080"] > 600 / 6, got


def test_produce_beyond_the_band_wins_over_idle() -> None:
    best = produce([peer("10.0.0.1", 5, 20), peer("10.0.0.2", 3, 0)], "req-strict")
    assert best is not None and (best.address, best.cached_tokens) == ("10.0.0.1:8080", 5 * BLOCK)


def test_produce_one_block_short_shares_by_queue_with_its_own_count() -> None:
    peers = [peer("10.0.0.1", 4, 20), peer("10.0.0.2", 3, 0)]  # weights 1/21 and 1
    chosen = [produce(peers, f"band-{i}") for i in range(400)]
    assert all(p is not None and p.cached_tokens == (3 if p.address == "10.0.0.2:8080" else 4) * BLOCK
               for p in chosen)
    got = Counter(p.address for p in chosen if p is not None)
    assert got["10.0.0.2:8080"] > got["10.0.0.1:8080"] > 0, got


def test_produce_equal_queues_spread_by_request_id_deterministically() -> None:
    peers = [peer("10.0.0.1", 3), peer("10.0.0.2", 3), peer("10.0.0.3", 3)]
    assert len(picks(peers, [f"req-{i}" for i in range(64)])) == 3
    assert produce(peers, "req-7") == produce(peers, "req-7")


# -- PreRequest: the reference's tables ---------------------------------------------------------


def test_pre_request_sets_the_header_when_the_best_out_caches_the_decode_pod() -> None:
    best = Peer("10.0.0.2:8080", 48, BLOCK)
    assert header(DEFAULT, best, {"decode": [peer("10.0.0.1", 1)]}) == "10.0.0.2:8080"


def test_pre_request_delta_below_threshold_sets_none() -> None:
    best = Peer("10.0.0.2:8080", 32, BLOCK)
    assert header(P2PSourceParams(min_cached_token_delta=17), best, {"decode": [peer("10.0.0.1", 1)]}) is None


def test_pre_request_best_is_the_chosen_pod_sets_none() -> None:
    best = Peer("10.0.0.1:8080", 32, BLOCK)
    assert header(DEFAULT, best, {"decode": [peer("10.0.0.1", 2)]}) is None


def test_pre_request_under_pd_the_prefill_pod_computes_the_prefix() -> None:
    profiles = {"decode": [peer("10.0.0.1", 0)], "prefill": [peer("10.0.0.2", 3)]}
    assert header(DEFAULT, Peer("10.0.0.2:8080", 48, BLOCK), profiles) is None  # the best is the prefill pod
    profiles = {"decode": [peer("10.0.0.1", 0)], "prefill": [peer("10.0.0.2", 1)]}
    assert header(DEFAULT, Peer("10.0.0.3:8080", 64, BLOCK), profiles) == "10.0.0.3:8080"  # a third pod
    profiles = {"decode": [peer("10.0.0.1", 0)], "P": [peer("10.0.0.2", 3)]}
    assert header(P2PSourceParams(prefill_profile="P"), Peer("10.0.0.2:8080", 48, BLOCK), profiles) is None
    assert header(DEFAULT, Peer("10.0.0.2:8080", 48, BLOCK), profiles) == "10.0.0.2:8080"  # P is not prefill


def test_pre_request_without_a_stash_or_a_pick_sets_none() -> None:
    assert header(DEFAULT, None, {"decode": [peer("10.0.0.1", 0)]}) is None
    assert header(DEFAULT, Peer("10.0.0.2:8080", 48, BLOCK), {"decode": []}) is None


def test_pre_request_ipv6_header_is_bracketed() -> None:
    best = Peer(Endpoint("fd00::2", 8080).address, 48, BLOCK)
    assert header(DEFAULT, best, {"decode": [Peer("[fd00::1]:8080", BLOCK, BLOCK)]}) == "[fd00::2]:8080"


# -- properties ---------------------------------------------------------------------------------


def test_spread_fraction_is_fnv1a_32_over_2_to_the_32() -> None:
    # FNV-1a 32-bit test vectors (Go's hash/fnv agrees).
    for text, value in (("", 0x811C9DC5), ("a", 0xE40C292C), ("foobar", 0xBF9CF968)):
        assert spread_fraction(text) == value / 2**32
    # A long id hashes its first MAX_REQUEST_ID_BYTES bytes (bounded CPU per request).
    long = "r" * MAX_REQUEST_ID_BYTES
    assert spread_fraction(long + "x" * 60_000) == spread_fraction(long) != spread_fraction(long[:-1])


peers_strategy = st.lists(st.builds(
    Peer, st.sampled_from([f"10.0.0.{i}:8080" for i in range(8)]), st.integers(0, 4096),
    st.sampled_from([1, 16, 64]), st.one_of(st.floats(0, 1e6), st.just(float("nan")), st.integers(-5, 50))),
    max_size=8)


@given(peers_strategy, st.floats(0.0, 1.0, exclude_max=True), st.floats(0.0, 1.0, exclude_max=True))
def test_the_choice_is_in_the_band_and_moves_forward_with_the_coordinate(
        peers: list[Peer], low: float, high: float) -> None:
    low, high = sorted((low, high))
    first, second = choose_source(peers, low), choose_source(peers, high)
    cached = [p for p in peers if p.cached_tokens > 0]
    if not cached:
        assert first is None and second is None
        return
    most = max(p.cached_tokens for p in cached)
    band = [p for p in cached if p.cached_tokens + p.block_tokens >= most]
    assert first in band and second in band
    assert band.index(first) <= band.index(second)


@given(st.text(max_size=64), st.integers(0, 4))
def test_a_request_id_always_maps_to_the_same_peer(request_id: str, count: int) -> None:
    peers = [peer(f"10.0.0.{i}", 3) for i in range(count)]
    assert 0.0 <= spread_fraction(request_id) < 1.0
    assert produce(peers, request_id) == produce(peers, request_id)


@given(st.builds(Peer, st.sampled_from(["a:1", "b:1"]), st.integers(0, 200), st.just(BLOCK)),
       st.sampled_from(["a:1", "b:1", None]), st.integers(0, 200), st.integers(1, 100))
def test_the_header_never_names_the_computing_pod_and_always_leads_by_the_delta(
        source: Peer, computing: str | None, computing_cached: int, delta: int) -> None:
    value = source_header(P2PSourceParams(min_cached_token_delta=delta), source, computing, computing_cached)
    if value is not None:
        assert value == source.address != computing and source.cached_tokens - computing_cached >= delta


# -- the scheduler's hook -----------------------------------------------------------------------

P2P = f"""{HEAD}plugins:
- {{type: {P2P_SOURCE_PRODUCER}, name: p2p, parameters: {{minCachedTokenDelta: 1}}}}
- {{type: queue-scorer}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: queue-scorer}}]}}
"""


def scheduler(waiting: Sequence[float] = (0, 4, 8), extra: str = P2P) -> Scheduler:
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}', '{B}', '{C}']}}\n" + extra)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address, queue in zip((A, B, C), waiting, strict=True):
        snapshot.update(address, EndpointMetrics(waiting=queue))
    return Scheduler(config, snapshot, random.Random(1))


def test_a_declared_producer_makes_the_picker_hash_prompts() -> None:
    assert scheduler().config.uses_prefix
    plain = P2P.replace(f"- {{type: {P2P_SOURCE_PRODUCER}, name: p2p, parameters: {{minCachedTokenDelta: 1}}}}\n", "")
    assert not scheduler(extra=plain).config.uses_prefix


def test_the_schedule_names_the_peer_caching_the_prompt() -> None:
    sched = scheduler()
    hashes = [11, 12, 13, 14]
    sched.prefix.add(C, hashes)
    schedule = sched.schedule(PickRequest("m", 0, hashes, headers={"x-request-id": "r1"}))
    assert schedule.endpoints[0] == A and schedule.request_headers == {KV_CACHE_SOURCE_HEADER: C}
    block = sched.prefix_geometry()[0]
    assert sched.kv_picks[0][2] == {C: 4 * block}
    sched.prefix.add(A, hashes)  # the pick holds it too: nothing to pull
    assert sched.schedule(PickRequest("m", 0, hashes)).request_headers == {}
    assert sched.schedule(PickRequest("m", 0)).request_headers == {}  # no prompt hashes: no source


def test_under_pd_the_prefill_pick_is_compared() -> None:
    pd = P2P.replace("schedulingProfiles:\n- {name: default, plugins: [{pluginRef: queue-scorer}]}\n", """\
- {type: disagg-profile-handler, parameters: {deciders: {prefill: always}}}
- {type: always-disagg-pd-decider, name: always}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: queue-scorer}]}
- {name: prefill, plugins: [{pluginRef: queue-scorer}]}
""")
    sched = scheduler(extra=pd)
    hashes = [21, 22]
    sched.prefix.add(A, hashes)
    schedule = sched.schedule(PickRequest("m", 0, hashes, prompt_bytes=4000))
    assert schedule.profiles.get("prefill") == [A] and KV_CACHE_SOURCE_HEADER not in schedule.request_headers


def test_a_burst_producer_can_supply_the_matches() -> None:
    burst = P2P.replace("parameters: {minCachedTokenDelta: 1}",
                        "parameters: {prefixMatchInfoProducerName: burst}").replace(
        "- {type: queue-scorer}\n", "- {type: queue-scorer}\n- {type: burst-prefix-cache-producer, name: burst}\n")
    sched = scheduler(extra=burst)
    schedule = sched.schedule(PickRequest("m", 0, attributes={("PrefixCacheMatchInfo", "burst"): f"128@{B}"}))
    assert schedule.endpoints[0] == A and schedule.request_headers == {KV_CACHE_SOURCE_HEADER: B}
    assert sched.schedule(PickRequest("m", 0)).request_headers == {}


# -- the ext_proc stream ------------------------------------------------------------------------


def routed_headers(picker: Picker, prompt: str, extra: Sequence[tuple[str, str]]) -> ep.HeaderMutation:
    """The header mutation of a streamed request's decision (it rides on the headers' reply)."""
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=extra))
    replies = stream.on_message(request_body(json.dumps({"model": "plain", "prompt": prompt}).encode()))
    return replies[0].request_headers.response.header_mutation


def test_the_stream_sets_the_header_and_removes_a_forged_one() -> None:
    picker = make_picker(P2P)
    forged = [(KV_CACHE_SOURCE_HEADER, "evil:1234"), ("x-request-id", "abc")]
    prompt = "a long shared system prompt " * 20
    first = routed_headers(picker, prompt, forged)
    assert set_headers(first)[DESTINATION] == A and KV_CACHE_SOURCE_HEADER not in set_headers(first)
    assert KV_CACHE_SOURCE_HEADER in first.remove_headers  # nothing cached anywhere yet: the forgery goes
    picker.snapshot.update(A, EndpointMetrics(waiting=50))  # A, holding the prompt now, is busy
    second = routed_headers(picker, prompt, forged)
    assert set_headers(second)[DESTINATION] == B and set_headers(second)[KV_CACHE_SOURCE_HEADER] == A
    assert KV_CACHE_SOURCE_HEADER not in second.remove_headers


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


def upstream(port: int, prompt: str, extra: list[tuple[str, str]]) -> ep.HeaderMutation:
    """One buffered request through the ext_proc port: the header mutation upstream (blocking)."""
    pairs = [(":path", "/v1/completions"), (":method", "POST"), ("content-type", "application/json"), *extra]
    head = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])))
    body = ep.ProcessingRequest(request_body=ep.HttpBody(
        body=json.dumps({"model": "m", "prompt": prompt}).encode(), end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        replies = list(call(iter([head, body]), timeout=10))
    (mutation,) = [r.request_body.response.header_mutation for r in replies
                   if r.request_body.response.header_mutation.set_headers]
    return mutation


async def test_a_started_picker_names_the_peer_holding_the_prompt(nursery: trio.Nursery, tmp_path: Path) -> None:
    engines = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(2)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: p2p, endpoints: {json.dumps(engines)}}}\n" + HEAD + f"""plugins:
- {{type: {P2P_SOURCE_PRODUCER}}}
- {{type: random-picker}}
schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: random-picker}}]}}
""")
    forged = [(KV_CACHE_SOURCE_HEADER, "evil:1234")]
    prompt = "a shared system prompt " * 20
    async with picker_process(["--config", str(config), "--allow-experimental-plugins=true",
                               "--refresh-metrics-interval", "50ms", *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(10):
            while True:  # until the first scrapes are in (503 before)
                try:
                    first = await trio.to_thread.run_sync(upstream, picker.grpc, prompt, forged)
                    break
                except ValueError:
                    await trio.sleep(0.05)
        holder = set_headers(first)[DESTINATION]
        assert KV_CACHE_SOURCE_HEADER in first.remove_headers and KV_CACHE_SOURCE_HEADER not in set_headers(first)
        for _ in range(64):  # the random picker sends one elsewhere soon (2**-64 odds it never does)
            mutation = await trio.to_thread.run_sync(upstream, picker.grpc, prompt, forged)
            headers = set_headers(mutation)
            if headers[DESTINATION] != holder:
                assert headers[KV_CACHE_SOURCE_HEADER] == holder
                break
            assert KV_CACHE_SOURCE_HEADER not in headers and KV_CACHE_SOURCE_HEADER in mutation.remove_headers
        else:
            raise AssertionError("the random picker never chose the other endpoint")
