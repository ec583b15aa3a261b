"""``burst-prefix-cache-producer``: llm-d-router's assign tests and config checks, invariants of the
assignment, the window, the scorer reading it, the ext_proc stream parked for its window, bad
parameters through the command, and a started picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio.picker.burst_prefix import (
    BURST_PREFIX_PRODUCER,
    UNLIMITED,
    BurstEntry,
    BurstParams,
    BurstWindow,
    Replica,
    assign,
)
from evergreen_trio.picker.burst_shell import seal_windows
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import DESTINATION, ExtProcStream, Picker
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler
from tests.picker.test_processor import A, B, C, make_picker, request_body, request_headers, set_headers

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
import trio.lowlevel
from picker_requests import Answer, ext_proc, serve_fake_engine

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
P = "EndpointPickerConfig.plugins[0].parameters"


def replicas(*names: str) -> tuple[Replica, ...]:
    return tuple(Replica(name) for name in names)


def group(n: int, prefix: Sequence[int], pods: tuple[Replica, ...]) -> list[BurstEntry]:
    return [BurstEntry(tuple(prefix), pods) for _ in range(n)]


def counts(entries: Sequence[BurstEntry]) -> dict[str | None, int]:
    return dict(Counter(e.assigned for e in entries))


FOUR = replicas("pod1", "pod2", "pod3", "pod4")
TWO = replicas("pod1", "pod2")


# -- llm-d-router's assign tests (burstprefix/assign_test.go) ----------------------------------------


def test_unlimited_colocates_whole_group() -> None:
    entries = group(8, [1, 2, 3], FOUR)
    assign(entries, UNLIMITED, 0, False)
    assert counts(entries) == {"pod1": 8}


@pytest.mark.parametrize(("k", "expected"), [(2, {"pod1": 2, "pod2": 2, "pod3": 2, "pod4": 2}),
                                             (4, {"pod1": 4, "pod2": 4})])  # fills one replica before spilling
def test_cap_spreads_and_fills_before_spilling(k: int, expected: dict[str, int]) -> None:
    entries = group(8, [1, 2, 3], FOUR)
    assign(entries, k, 0, False)
    assert counts(entries) == expected


def test_singleton_and_empty_prefix_get_no_affinity() -> None:
    single = group(1, [1, 2, 3], TWO)
    assign(single, UNLIMITED, 0, False)
    empty = group(2, [], TWO)
    assign(empty, UNLIMITED, 0, False)
    assert [e.assigned for e in (*single, *empty)] == [None, None, None]


def test_distinct_groups_spread_across_replicas() -> None:
    a, b = group(8, [1, 2, 3], FOUR), group(8, [9, 9, 9], FOUR)
    assign([*a, *b], UNLIMITED, 0, False)
    assert counts(a) == {"pod1": 8} and counts(b) == {"pod2": 8}


def test_shared_prefix_families_colocate_within_fair_share() -> None:
    x1, x2 = group(2, [1, 2, 3], TWO), group(2, [1, 2, 4], TWO)
    y1, y2 = group(2, [7, 8, 5], TWO), group(2, [7, 8, 6], TWO)
    assign([*x1, *x2, *y1, *y2], UNLIMITED, 2, False)
    assert x1[0].assigned == x2[0].assigned and y1[0].assigned == y2[0].assigned
    assert x1[0].assigned != y1[0].assigned
    assert counts([*x1, *x2, *y1, *y2]) == {"pod1": 4, "pod2": 4}


def test_fair_share_spreads_prefix_sharing_groups() -> None:
    entries = [e for last in (3, 4, 5, 6) for e in group(2, [1, 2, last], FOUR)]
    assign(entries, UNLIMITED, 2, False)
    assert counts(entries) == {"pod1": 2, "pod2": 2, "pod3": 2, "pod4": 2}


def test_singleton_attaches_to_overlapping_group() -> None:
    gx, sx = group(2, [1, 2, 3], TWO), group(1, [1, 2, 8], TWO)
    gy, sy = group(2, [7, 8, 5], TWO), group(1, [7, 8, 9], TWO)
    assign([*gx, *sx, *gy, *sy], UNLIMITED, 2, False)
    assert gx[0].assigned == gx[1].assigned == sx[0].assigned
    assert gy[0].assigned == sy[0].assigned
    assert counts([*gx, *sx, *gy, *sy]) == {"pod1": 3, "pod2": 3}


def test_lone_singleton_gets_no_affinity() -> None:
    g, lone = group(2, [1, 2, 3], TWO), group(1, [5, 5, 5], TWO)
    assign([*g, *lone], UNLIMITED, 2, False)
    assert lone[0].assigned is None and g[0].assigned == g[1].assigned is not None


def test_overlapping_singletons_colocate_without_groups() -> None:
    entries = [e for last in (3, 4, 5, 6) for e in group(1, [1, 2, last], TWO)]
    assign(entries, UNLIMITED, 2, False)
    assert counts(entries) == {"pod1": 2, "pod2": 2}


def test_shared_prefix_below_threshold_does_not_colocate() -> None:
    x1, x2 = group(2, [1, 2, 3], TWO), group(2, [1, 2, 4], TWO)
    y1, y2 = group(2, [7, 8, 5], TWO), group(2, [7, 8, 6], TWO)
    assign([*x1, *x2, *y1, *y2], UNLIMITED, 3, False)
    assert x1[0].assigned != x2[0].assigned
    assert counts([*x1, *x2, *y1, *y2]) == {"pod1": 4, "pod2": 4}


def test_single_replica_places_everything() -> None:
    one = replicas("pod1")
    entries = [*group(4, [1, 2, 3], one), *group(4, [9, 9, 9], one)]
    assign(entries, UNLIMITED, 2, False)
    assert counts(entries) == {"pod1": 8}


def test_balance_by_tokens_spreads_large_prefix() -> None:
    def units() -> tuple[list[BurstEntry], list[BurstEntry], list[BurstEntry]]:
        return group(2, [1, 2, 3, 4], TWO), group(2, [5], TWO), group(2, [6], TWO)

    long, short1, short2 = units()
    assign([*long, *short1, *short2], UNLIMITED, 0, False)
    assert long[0].assigned == short2[0].assigned
    long, short1, short2 = units()
    assign([*long, *short1, *short2], UNLIMITED, 0, True)
    assert long[0].assigned != short1[0].assigned and short1[0].assigned == short2[0].assigned


def test_balance_by_tokens_discounts_shared_prefix() -> None:
    a1, a2, a3 = (group(2, [*range(1, 10), last], TWO) for last in (10, 11, 12))
    assign([*a1, *a2, *a3], UNLIMITED, 9, True)
    assert a1[0].assigned == a2[0].assigned == a3[0].assigned


def test_overflow_guard_balances_beyond_cap() -> None:
    entries = group(8, [1, 2, 3], TWO)
    assign(entries, 2, 0, False)
    assert counts(entries) == {"pod1": 4, "pod2": 4}


def test_running_requests_break_load_ties() -> None:
    pods = (Replica("pod1", running=5), Replica("pod2", running=1))
    entries = group(2, [1], pods)
    assign(entries, UNLIMITED, 0, False)
    assert counts(entries) == {"pod2": 2}


# -- invariants ---------------------------------------------------------------------------------

prefixes = st.lists(st.sampled_from([(), (1,), (1, 2), (1, 2, 3), (1, 2, 4), (7, 8), (7, 8, 9), (5,)]),
                    max_size=40)


@given(prefixes, st.integers(1, 5), st.sampled_from([UNLIMITED, 1, 2, 3]), st.integers(0, 3), st.booleans())
def test_assignment_invariants(keys: list[tuple[int, ...]], pod_count: int, k: int, colocate: int,
                               by_tokens: bool) -> None:
    pods = replicas(*(f"pod{i}" for i in range(pod_count)))
    entries = [BurstEntry(key, pods) for key in keys]
    assign(entries, k, colocate, by_tokens)
    names = {p.address for p in pods}
    sizes = Counter(keys)
    for entry in entries:
        if not entry.hashes or (sizes[entry.hashes] == 1 and colocate == 0):
            assert entry.assigned is None  # no prefix, or nothing shared: no affinity
        if sizes[entry.hashes] >= 2 and entry.hashes:
            assert entry.assigned in names  # an identical group is always placed
        assert entry.assigned is None or entry.assigned in names
    for key, size in sizes.items():
        members = Counter(e.assigned for e in entries if e.hashes == key)
        if not key:
            continue
        if size >= 2 and k == UNLIMITED:
            assert len(members) == 1  # a whole group on one replica
        if size >= 2 and k != UNLIMITED and size <= k * pod_count:
            assert max(members.values()) <= k  # the per-replica cap holds while it can
    again = [BurstEntry(key, pods) for key in keys]
    assign(again, k, colocate, by_tokens)
    assert [e.assigned for e in again] == [e.assigned for e in entries]  # deterministic


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 4))
def test_identical_groups_balance_by_requests_within_one_group(sizes: list[int], pod_count: int) -> None:
    """Whole groups (no cap) go to the least loaded replica in turn: no replica exceeds another by
    more than the largest group."""
    pods = replicas(*(f"pod{i}" for i in range(pod_count)))
    entries = [e for i, size in enumerate(sizes) for e in group(size + 1, [100 + i], pods)]
    assign(entries, UNLIMITED, 0, False)
    loads = Counter(e.assigned for e in entries)
    totals = [loads.get(p.address, 0) for p in pods]
    assert max(totals) - min(totals) <= max(sizes) + 1


# -- the parameters (plugin_test.go's TestNew_RejectsInvalidConfig, and the README's table) ----------


def burst_params(parameters: str) -> object:
    entry = f"{{type: {BURST_PREFIX_PRODUCER}, name: b, parameters: {{{parameters}}}}}"
    config = parse_config(HEAD + f"plugins:\n- {entry}\n", cluster_pool="pool")
    assert config.epp is not None
    return config.epp.plugins["b"].params


def test_defaults_and_values() -> None:
    assert burst_params("") == BurstParams(100, UNLIMITED, 64, 0, 0, 1000, "requests")
    params = burst_params("windowDurationMs: 10000, maxPerReplica: 2, blockSizeTokens: 16, maxPrefixTokensToMatch: 64,"
                          " minColocateBlocks: 3, maxBatchSize: -1, balanceBy: tokens")
    assert params == BurstParams(10000, 2, 16, 64, 3, UNLIMITED, "tokens")
    assert isinstance(params, BurstParams) and params.max_blocks == 4
    assert burst_params("balanceBy: ''") == BurstParams()  # empty: requests


@pytest.mark.parametrize(("parameters", "field"), [
    ("windowDurationMs: 0", "windowDurationMs"),
    ("windowDurationMs: 10001", "windowDurationMs"),
    ("maxPerReplica: 0", "maxPerReplica"),
    ("maxPerReplica: -2", "maxPerReplica"),
    ("blockSizeTokens: 0", "blockSizeTokens"),
    ("maxPrefixTokensToMatch: -1", "maxPrefixTokensToMatch"),
    ("blockSizeTokens: 64, maxPrefixTokensToMatch: 63", "maxPrefixTokensToMatch"),
    ("minColocateBlocks: -1", "minColocateBlocks"),
    ("maxBatchSize: 0", "maxBatchSize"),
    ("balanceBy: bogus", "balanceBy"),
    ("windowDurationMs: '100'", "windowDurationMs"),
    ("window: 100", "window"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        burst_params(parameters)
    assert caught.value.field == f"{P}.{field}"


def test_the_scorer_names_a_declared_producer_and_one_burst_producer_runs() -> None:
    scorer = "- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: %s}}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + "plugins:\n" + scorer % "burst", cluster_pool="p")
    assert caught.value.field == f"{P}.prefixMatchInfoProducerName"
    parse_config(HEAD + "plugins:\n" + scorer % "approx-prefix-cache-producer", cluster_pool="p")
    parse_config(HEAD + f"plugins:\n{scorer % 'burst'}- {{type: {BURST_PREFIX_PRODUCER}, name: burst}}\n",
                 cluster_pool="p")
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {{type: {BURST_PREFIX_PRODUCER}, name: a}}\n"
                            f"- {{type: {BURST_PREFIX_PRODUCER}, name: b}}\n", cluster_pool="p")
    assert caught.value.field == "EndpointPickerConfig.plugins[1].parameters"


def test_registered_alpha_producer() -> None:
    assert BURST_PREFIX_PRODUCER in ALPHA_TYPES
    assert PLUGIN_TYPES[BURST_PREFIX_PRODUCER].category is Category.PRODUCER


@pytest.mark.parametrize(("parameters", "field"), [("{windowDurationMs: 20000}", "windowDurationMs"),
                                                   ("{maxPerReplica: 0}", "maxPerReplica"),
                                                   ("{balanceBy: weights}", "balanceBy")])
def test_a_bad_parameter_is_one_line_and_exit_2_from_the_command(parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: {BURST_PREFIX_PRODUCER}, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"{P}.{field}: expected" in line, line


# -- the window ---------------------------------------------------------------------------------


def test_the_window_opens_seals_and_opens_anew() -> None:
    now = [10.0]
    opened: list[float] = []
    window = BurstWindow("b", BurstParams(window_ms=50, max_batch_size=2), lambda: now[0],
                         on_open=lambda: opened.append(now[0]))
    sealed: list[str | None] = []
    first = window.join([1, 2], TWO, lambda e: sealed.append(e.assigned))
    second = window.join([1, 2], TWO, lambda e: sealed.append(e.assigned))
    assert first is not None and second is not None and window.deadline == pytest.approx(10.05)
    assert window.join([1, 2], TWO, lambda e: sealed.append(e.assigned)) is None  # maxBatchSize: no wait
    assert window.seal() == [first, second] and sealed == ["pod1", "pod1"]
    assert window.deadline is None and window.entries == [] and opened == [10.0]
    now[0] = 11.0
    assert window.join([3], TWO, lambda e: sealed.append(e.assigned)) is not None
    assert opened == [10.0, 11.0] and window.deadline == pytest.approx(11.05)
    window.seal()
    assert sealed[-1] is None  # alone in its window: no affinity


async def test_the_shell_seals_each_window_on_time(nursery: trio.Nursery) -> None:
    window = BurstWindow("b", BurstParams(window_ms=30), trio.current_time)
    nursery.start_soon(seal_windows, window)
    await trio.lowlevel.checkpoint()
    for prefix in ([1, 2], [3, 4]):
        done = trio.Event()
        got: list[str | None] = []

        def sealed(entry: BurstEntry, got: list[str | None] = got, done: trio.Event = done) -> None:
            got.append(entry.assigned)
            if len(got) == 2:
                done.set()

        window.join(prefix, TWO, sealed)
        window.join(prefix, TWO, sealed)
        with trio.fail_after(5):
            await done.wait()
        assert got == ["pod1", "pod1"]


# -- the scorer reads the window's assignment --------------------------------------------------

def burst_epp(parameters: str = "blockSizeTokens: 4", flow: str = "", more: str = "") -> str:
    """A config document with a burst producer and a profile scoring by it (and by queue)."""
    return f"""---
{HEAD}{flow}plugins:
- {{type: {BURST_PREFIX_PRODUCER}, name: burst, parameters: {{{parameters}}}}}
- {{type: prefix-cache-scorer, name: by-burst, parameters: {{prefixMatchInfoProducerName: burst}}}}
- {{type: queue-scorer}}
{more}schedulingProfiles:
- {{name: default, plugins: [{{pluginRef: by-burst, weight: 3}}, {{pluginRef: queue-scorer}}]}}
"""


SCORED = burst_epp()


def test_the_prefix_scorer_scores_the_assigned_replica_only() -> None:
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}', '{B}', '{C}']}}\n" + SCORED)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address, waiting in ((A, 0), (B, 4), (C, 8)):
        snapshot.update(address, EndpointMetrics(waiting=waiting))
    scheduler = Scheduler(config, snapshot, random.Random(1))
    attribute = {("PrefixCacheMatchInfo", "burst"): f"16@{C}"}
    assert scheduler.schedule(PickRequest("m", 0, attributes=attribute)).scores == {A: 1.0, B: 0.5, C: 3.0}
    assert scheduler.schedule(PickRequest("m", 0)).scores == {A: 1.0, B: 0.5, C: 0.0}


# -- the ext_proc stream waits for its window ---------------------------------------------------


def burst_picker(extra: str = SCORED) -> Picker:
    return make_picker(extra, metrics=[EndpointMetrics()] * 3)


def stream_for(picker: Picker, prompt: str) -> tuple[ExtProcStream, list[ep.ProcessingResponse]]:
    stream = picker.new_stream()
    stream.on_message(request_headers())
    replies = stream.on_message(request_body(json.dumps({"model": "plain", "prompt": prompt}).encode()))
    return stream, list(replies)


def destination(replies: Sequence[ep.ProcessingResponse]) -> str:
    return set_headers(replies[0].request_headers.response.header_mutation)[DESTINATION]


def test_streams_park_until_the_window_seals_then_go_where_it_assigned() -> None:
    picker = burst_picker()
    window = picker.burst
    assert window is not None
    prompt = "shared prompt " * 8
    streams = [stream_for(picker, prompt) for _ in range(4)] + [stream_for(picker, "another one " * 8)]
    assert all(replies == [] and stream.parked for stream, replies in streams)
    woken: list[int] = []
    for i, (stream, _) in enumerate(streams):
        stream.on_unpark = lambda i=i: woken.append(i)
    window.seal()
    assert woken == [0, 1, 2, 3, 4]
    picks = [destination(stream.resume()) for stream, _ in streams]
    assert set(picks[:4]) == {A}  # the group, on the least loaded replica (then the fewest running, the name)
    assert picks[4] in (A, B, C)  # alone: no affinity, the queue scorer decides


def test_a_full_window_routes_at_once_and_an_aborted_stream_is_left_out() -> None:
    picker = burst_picker(burst_epp("blockSizeTokens: 4, maxBatchSize: 1"))
    first, replies = stream_for(picker, "p" * 64)
    assert replies == []
    second, replies = stream_for(picker, "p" * 64)
    assert destination(replies) in (A, B, C) and not second.parked
    first.on_abort()
    assert picker.burst is not None
    picker.burst.seal()
    assert first.resume() == []


def test_flow_control_dispatches_then_the_window_holds_it() -> None:
    flow = "featureGates: [flowControl]\nflowControl:\n  saturationDetector: {pluginRef: concurrency-detector}\n"
    detector = "- {type: concurrency-detector, parameters: {maxConcurrency: 4}}\n"
    picker = burst_picker(burst_epp(flow=flow, more=detector))
    assert picker.flow is not None and picker.burst is not None
    streams = [stream_for(picker, "q" * 64) for _ in range(2)]
    assert all(replies == [] and stream.parked for stream, replies in streams)
    woken: list[int] = []
    for i, (stream, _) in enumerate(streams):
        stream.on_unpark = lambda i=i: woken.append(i)
    picker.flow.poll()
    assert woken == []  # dispatched by flow control, waiting in the window
    picker.burst.seal()
    assert woken == [0, 1]
    assert len({destination(stream.resume()) for stream, _ in streams}) == 1


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


async def test_a_started_picker_colocates_a_burst(nursery: trio.Nursery, tmp_path: Path) -> None:
    engines = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(3)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: burst, endpoints: {json.dumps(engines)}}}\n"
                      + burst_epp("blockSizeTokens: 4, windowDurationMs: 1000"))
    args = ["--config", str(config), "--allow-experimental-plugins=true", "--refresh-metrics-interval", "50ms",
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        for prompt in ("a shared system prompt " * 10, "another shared prompt " * 10):
            body = json.dumps({"model": "sim-model", "prompt": prompt}).encode()
            answers: list[Answer] = []

            async def one(body: bytes = body, answers: list[Answer] = answers) -> None:
                answers.append(await trio.to_thread.run_sync(ext_proc, picker.grpc, body))

            async with trio.open_nursery() as burst:
                for _ in range(6):
                    burst.start_soon(one)
            assert {a.status for a in answers} == {200}
            assert len({a.endpoint for a in answers}) == 1, answers
