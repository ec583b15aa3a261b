"""vLLM's KV events: llm-d-router's vllm_adapter_test.go and pool tables ported, hostile payloads,
and the producer's config through `evergreen-trio picker` (one line, exit 2)."""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from picker_cli import run_cli

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.kvblock import KVBlockIndex, PodEntry, TokenProcessor, TokenProcessorConfig
from evergreen_trio.picker.kvevents import (
    BLOCKS_PER_STEP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    KVEventIndexer,
    decode_batch,
    parse_frames,
    parse_topic,
)
from evergreen_trio.picker.precise_prefix import PreciseParams, PrecisePrefixCache, precise_caches
from evergreen_trio.picker.routing_headers import KV_CACHE_SOURCE_HEADER
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Schedule, Scheduler
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_ids

msgpack = pytest.importorskip("msgpack", reason="needs msgpack (extra picker): pip install 'evergreen-trio[picker]'")


def _batch(*events: Any) -> bytes:
    """A batch at a fixed time (the parameter ids must be the same in every xdist worker)."""
    return msgpack.packb([1_700_000_000.5, list(events), None], use_bin_type=True)


def test_topics_and_frames() -> None:
    assert parse_topic("kv@pod-1@model-a") == ("pod-1", "model-a") and parse_topic("pod") == ("pod", "")
    assert parse_frames([b"kv@p@m", (7).to_bytes(8, "big"), b"x"]) == ("kv@p@m", 7, b"x")
    for frames in ([b"t", b"1234"], [b"t", b"1234", b"x"], [b"t", b"\0" * 8, b"x" * (5 << 20)]):
        with pytest.raises(KVEventError):
            parse_frames(frames)


def test_positional_events_with_and_without_trailing_fields() -> None:
    events = decode_batch(_batch(
        ["BlockStored", [1, b"\x01\x02"], None, [1, 2, 3, 4], 4],
        ["BlockStored", [3], 2, [5, 6], 2, 7, "CPU", "lora-a", [["mm"], None], 0, "full_attention", 128, "extra"],
        ["BlockRemoved", [1, 2], "GPU", 1, "more"], ["BlockRemoved", [9]], ["AllBlocksCleared"]))
    assert events == [BlockStored((1, 258), 0, (1, 2, 3, 4), 4),
                      BlockStored((3,), 2, (5, 6), 2, "CPU", "lora-a", (("mm",), None), 0, "full_attention"),
                      BlockRemoved((1, 2), "GPU", 1), BlockRemoved((9,)), AllBlocksCleared()]


def test_map_encoded_events() -> None:
    events = decode_batch(_batch({"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                                  "token_ids": [1, 2], "block_size": 2, "medium": "GPU"},
                                 {"type": "BlockRemoved", "block_hashes": [5]}, {"type": "AllBlocksCleared"}))
    assert events == [BlockStored((5,), 0, (1, 2), 2, "GPU"), BlockRemoved((5,)), AllBlocksCleared()]


@pytest.mark.parametrize(("payload", "says"), [
    (b"", "failed to decode"), (b"\xc1", "failed to decode"), (msgpack.packb({"a": 1}), "not an array"),
    (_batch(["Unknown"]), "unknown vLLM event tag"), (_batch([]), "no tag"), (_batch([1]), "not a string"),
    (_batch("x"), "neither an array nor a map"), (_batch({"block_hashes": []}), "'type' tag"),
    (_batch(["BlockStored", [1], None, [1]]), "at least 5 fields"),
    (_batch(["BlockStored", "x", None, [1], 1]), "block_hashes: not an array"),
    (_batch(["BlockStored", [1.5], None, [1], 1]), "unsupported hash type float"),
    (_batch(["BlockStored", [b""], None, [1], 1]), "empty"),
    (_batch(["BlockStored", [1], None, ["a"], 1]), "token_ids"),
    (_batch(["BlockStored", [1], None, [1], 1, None, 5]), "medium"),
    (_batch(["BlockStored", [1], None, [1], 1, None, None, None, [1]]), "extra_keys[]"),
    (_batch(["BlockStored", [1], None, [1], 1, None, None, None, None, -1]), "negative"),
    (_batch(["BlockRemoved"]), "at least 2 fields"), (_batch(["BlockRemoved", [1], "GPU", "x"]), "group_idx"),
    (msgpack.packb([0, [["AllBlocksCleared"]] * 5000]), "5000 events"),
    (msgpack.packb([0, [["BlockRemoved", list(range(300_000))]]]), "failed to decode"),
])
def test_malformed_batches_are_one_typed_error(payload: bytes, says: str) -> None:
    with pytest.raises(KVEventError, match=None) as caught:
        decode_batch(payload)
    assert says in str(caught.value) and "\n" not in str(caught.value)


@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_kv_event_error(payload: bytes) -> None:
    with contextlib.suppress(KVEventError):
        decode_batch(payload)


def _indexer(block: int = 4) -> KVEventIndexer:
    return KVEventIndexer(KVBlockIndex(), TokenProcessor(TokenProcessorConfig(block)))


def test_stored_blocks_chain_from_their_parent_and_removal_uses_engine_hashes() -> None:
    indexer = _indexer()
    keys = indexer.processor.block_keys(list(range(12)), "m")
    indexer.apply("a:1", "m", BlockStored((101, 102), 0, tuple(range(8)), 4))
    indexer.apply("a:1", "m", BlockStored((103,), 102, tuple(range(8, 12)), 4, "CPU"))
    assert indexer.index.lookup(keys) == {keys[0]: [PodEntry("a:1", "gpu")], keys[1]: [PodEntry("a:1", "gpu")],
                                          keys[2]: [PodEntry("a:1", "cpu")]}
    indexer.apply("a:1", "m", BlockStored((104,), 999, (1, 2, 3, 4), 4))  # an unknown parent: skipped
    assert indexer.skipped == 1
    indexer.apply("a:1", "m", BlockRemoved((102,), "GPU"))
    assert keys[1] not in indexer.index.lookup(keys)
    indexer.apply("a:1", "m", BlockStored((101,), 0, (), 4, "cpu"))  # offloaded: a location-only store
    assert PodEntry("a:1", "cpu") in indexer.index.lookup(keys[:1])[keys[0]]
    indexer.apply("a:1", "m", AllBlocksCleared())
    assert indexer.index.lookup(keys) == {}


def test_the_lora_name_the_salt_and_hma_groups() -> None:
    indexer = _indexer()
    indexer.apply("a:1", "base", BlockStored((1,), 0, (1, 2, 3, 4), 4, lora_name="lora"))
    assert indexer.index.lookup(indexer.processor.block_keys([1, 2, 3, 4], "lora"))
    salted = indexer.processor.block_keys([5, 6, 7, 8], "m", [("salt",)])
    indexer.apply("a:1", "m", BlockStored((2,), 0, (5, 6, 7, 8), 4, extra_keys=(("salt",),)))
    assert indexer.index.lookup(salted)
    indexer.apply("a:1", "m", BlockStored((3,), 0, (9, 9, 9, 9), 4, group=1, kind="sliding_window"))
    indexer.apply("a:1", "m", BlockRemoved((2,), group=1))
    indexer.apply("a:1", "m", BlockStored((4,), 0, (9, 9, 9, 9), 4, extra_keys=()))  # extras of no block
    assert indexer.skipped == 3 and indexer.index.lookup(salted)


def _request(tokens: list[int], salt: str = "") -> PickRequest:
    return PickRequest("m", 0, tokens=TokenizedPrompt((pack_ids(tokens),), salt))


def test_the_producer_matches_and_seeds_speculative_entries_for_their_ttl() -> None:
    cache = PrecisePrefixCache(PreciseParams(speculative=True, speculative_ttl_s=2.0))
    tokens = list(range(64))
    cache.events.apply("a:1", "m", BlockStored(tuple(range(2)), 0, tuple(tokens[:32]), 16))
    found = cache.match(_request(tokens), 0.0)
    assert found.total == 4 and found.matched == {"a:1": 2.0}
    assert cache.match(_request(tokens, "salt"), 0.0).matched == {}  # a salted prompt: another chain
    request = _request(tokens)
    cache.scheduled(request, Schedule(["b:2"], profiles={"prefill": ["c:3"]}), 10.0)
    assert cache.match(_request(tokens), 11.0).matched == {"a:1": 2.0, "b:2": 4.0, "c:3": 4.0}
    assert cache.match(_request(tokens), 12.0).matched == {"a:1": 2.0}


CONFIG = """pool: {name: p, endpoints: ['127.0.0.1:8000']}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: token-producer}
- {type: precise-prefix-cache-producer, parameters: %s}
- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: prefix-cache-scorer}]}
"""
P = "EndpointPickerConfig.plugins[1].parameters"
BAD = [
    ("{tokenProcessorConfig: {blockSize: -5}}", f"{P}.tokenProcessorConfig.blockSizeTokens"),
    ("{tokenProcessorConfig: {hashAlgorithm: xxhash}}", f"{P}.tokenProcessorConfig.hashAlgorithm"),
    ("{tokenProcessorConfig: {blockSizeTokenz: 3}}", f"{P}.tokenProcessorConfig.blockSizeTokenz"),
    ("{indexerConfig: {tokenizersPoolConfig: {}}}", f"{P}.indexerConfig.tokenizersPoolConfig"),
    ("{indexerConfig: {kvBlockIndexConfig: {redisConfig: {address: x}}}}",
     f"{P}.indexerConfig.kvBlockIndexConfig.redisConfig"),
    ("{indexerConfig: {kvBlockIndexConfig: {inMemoryConfig: {size: 0}}}}",
     f"{P}.indexerConfig.kvBlockIndexConfig.inMemoryConfig.size"),
    ("{kvEventsConfig: {engineType: sglang}}", f"{P}.kvEventsConfig.engineType"),
    ("{kvEventsConfig: {engineType: trt}}", f"{P}.kvEventsConfig.engineType"),
    ("{kvEventsConfig: {zmqEndpoint: 'http://x'}}", f"{P}.kvEventsConfig.zmqEndpoint"),
    ("{kvEventsConfig: {podDiscoveryConfig: {socketPort: 70000}}}",
     f"{P}.kvEventsConfig.podDiscoveryConfig.socketPort"),
    ("{kvEventsConfig: {podDiscoveryConfig: {replaySocketPort: 5558}}}",
     f"{P}.kvEventsConfig.podDiscoveryConfig.replaySocketPort"),
    ("{speculativeTTL: soon}", f"{P}.speculativeTTL"),
    ("{speculativeIndexing: 1}", f"{P}.speculativeIndexing"),
]


@pytest.mark.parametrize(("parameters", "field"), BAD)
def test_bad_parameters_name_their_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(CONFIG % parameters)
    assert caught.value.field == field, caught.value


@pytest.mark.parametrize(("module", "package"), [("zmq", "pyzmq"), ("msgpack", "msgpack")])
def test_a_config_using_the_producer_without_its_package_names_the_package(
        module: str, package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # its import then raises ImportError
    with pytest.raises(ConfigError) as caught:
        parse_config(CONFIG % "{}")
    assert caught.value.field == P and package in str(caught.value)


def test_the_reference_parameters_load() -> None:
    config = parse_config(CONFIG % "{tokenProcessorConfig: {blockSize: 64, hashSeed: s}, indexerConfig: "
                          "{kvBlockIndexConfig: {enableMetrics: true, inMemoryConfig: {size: 1000}}}, "
                          "speculativeIndexing: true, speculativeTTL: 500ms}")
    assert config.epp is not None
    params = config.epp.plugins["precise-prefix-cache-producer"].params
    assert isinstance(params, PreciseParams)
    assert (params.tokens.block_size_tokens, params.index_size, params.speculative_ttl_s) == (64, 1000, 0.5)


def test_a_scorer_naming_an_undeclared_producer_and_a_legacy_scorer_with_two_producers_fail() -> None:
    with pytest.raises(ConfigError, match="prefixMatchInfoProducerName"):
        parse_config(CONFIG.replace("prefixMatchInfoProducerName: precise-prefix-cache-producer",
                                    "prefixMatchInfoProducerName: nowhere") % "{}")
    two = (CONFIG % "{}").replace("schedulingProfiles:", "- {type: precise-prefix-cache-producer, name: second}\n"
                                  "- {type: precise-prefix-cache-scorer}\nschedulingProfiles:")
    with pytest.raises(ConfigError, match="one precise-prefix-cache-producer"):
        parse_config(two)


def test_each_bad_parameter_is_one_line_and_exit_2_from_the_command(tmp_path: Any) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(CONFIG % "{kvEventsConfig: {engineType: sglang}}")
    result = run_cli(["--config", str(path)])
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "engineType" in result.stderr


def _scheduler(plugins: str, profile: str) -> Scheduler:
    config = parse_config(f"""pool: {{name: p, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: token-producer}}
{plugins}- {{type: queue-scorer}}
schedulingProfiles:
- {{name: default, plugins: [{profile}, {{pluginRef: queue-scorer, weight: 1}}]}}
""")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address, waiting in (("10.0.0.1:8000", 3), ("10.0.0.2:8000", 0)):
        snapshot.update(address, EndpointMetrics(waiting=waiting))
    return Scheduler(config, snapshot, random.Random(1))


@pytest.mark.parametrize(("plugins", "profile"), [
    ("- {type: precise-prefix-cache-producer}\n"
     "- {type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}}\n",
     "{pluginRef: prefix-cache-scorer, weight: 2}"),
    ("- {type: precise-prefix-cache-scorer}\n", "{pluginRef: precise-prefix-cache-scorer, weight: 2}"),
    ("- {type: precise-prefix-cache-producer, name: events}\n- {type: precise-prefix-cache-scorer}\n",
     "{pluginRef: precise-prefix-cache-scorer, weight: 2}"),
], ids=["producer-and-scorer", "legacy-scorer", "legacy-scorer-beside-a-producer"])
def test_the_scorer_routes_to_the_endpoint_holding_the_prompts_blocks(plugins: str, profile: str) -> None:
    scheduler = _scheduler(plugins, profile)
    tokens = list(range(64))
    assert scheduler.pick(_request(tokens)) == ["10.0.0.2:8000"]  # nothing cached: the shorter queue
    caches = precise_caches(scheduler.plugin_states)
    assert len(caches) == 1  # a legacy scorer beside a producer reads that one; nothing feeds its own
    next(iter(caches.values())).events.apply("10.0.0.1:8000", "m", BlockStored((1, 2, 3, 4), 0, tuple(tokens), 16))
    assert scheduler.pick(_request(tokens)) == ["10.0.0.1:8000"]


_FIELD = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.binary(max_size=40),
                   st.lists(st.one_of(st.none(), st.integers(0, 2**32), st.text(max_size=4),
                                      st.lists(st.text(max_size=4), max_size=2)), max_size=40))
_HASHES = st.lists(st.integers(0, 20), max_size=6)
_STORED = st.builds(lambda hashes, parent, tokens, size, extra, group, kind: [
    "BlockStored", hashes, parent, tokens, size, None, None, None, extra, group, kind],
    _HASHES, st.one_of(st.none(), st.integers(0, 20)), st.lists(st.integers(0, 9), max_size=40),
    st.integers(-1, 8), st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(st.text(max_size=2), max_size=2)),
                                                      max_size=6)),
    st.one_of(st.none(), st.integers(0, 2)), st.one_of(st.none(), st.sampled_from(["full_attention", "mamba"])))
_EVENT = st.one_of(_STORED, st.builds(lambda h, g: ["BlockRemoved", h, None, g], _HASHES,
                                      st.one_of(st.none(), st.integers(0, 2))),
                   st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
                             st.lists(_FIELD, max_size=12)).map(lambda t: [t[0], *t[1]]))


@given(st.lists(_EVENT, max_size=8))
@example([["BlockStored", [1], None, [1, 2, 3, 4], 4, None, None, None, []]])  # extra keys of no block
def test_any_decoded_batch_applies_without_raising_and_the_index_stays_bounded(events: list[Any]) -> None:
    try:
        decoded = decode_batch(_batch(*events))
    except KVEventError:
        return
    indexer = KVEventIndexer(KVBlockIndex(size=4, pods_per_key=2), TokenProcessor(TokenProcessorConfig(4)))
    for event in decoded:
        indexer.apply("a:1", "m", event)
        assert len(indexer.index) <= 4


def test_a_long_stored_event_is_hashed_in_slices_with_the_same_keys() -> None:
    tokens = tuple(range(4 * (BLOCKS_PER_STEP * 2 + 3)))
    indexer = _indexer()
    steps = list(indexer.steps("a:1", "m", BlockStored(tuple(range(len(tokens) // 4)), 0, tokens, 4)))
    assert len(steps) == 2
    keys = indexer.processor.block_keys(tokens, "m")
    assert len(indexer.index.lookup(keys)) == len(keys) == BLOCKS_PER_STEP * 2 + 3


def test_a_p2p_source_producer_pulls_from_a_precise_producers_cpu_tier() -> None:
    """The reference's p2psource with per-tier match info: a source serves a pull from its leading
    CPU-tier blocks only; the computing pod's own blocks count in any tier."""
    config = parse_config("""pool: {name: p, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: token-producer}
- {type: precise-prefix-cache-producer, name: events}
- {type: p2p-source-producer, parameters: {prefixMatchInfoProducerName: events}}
- {type: queue-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: queue-scorer}]}
""")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address, waiting in (("10.0.0.1:8000", 3), ("10.0.0.2:8000", 0)):  # the queue picks 10.0.0.2
        snapshot.update(address, EndpointMetrics(waiting=waiting))
    scheduler = Scheduler(config, snapshot, random.Random(1))
    (cache,) = precise_caches(scheduler.plugin_states).values()
    tokens = list(range(64))

    def source() -> str | None:
        schedule = scheduler.schedule(_request(tokens))
        assert schedule.endpoints == ["10.0.0.2:8000"]
        return schedule.request_headers.get(KV_CACHE_SOURCE_HEADER)

    cache.events.apply("10.0.0.1:8000", "m", BlockStored((1, 2, 3, 4), 0, tuple(tokens), 16, "GPU"))
    assert source() is None  # held on its GPU only: nothing to pull
    cache.events.apply("10.0.0.1:8000", "m", BlockStored((1, 2), 0, tuple(tokens[:32]), 16, "CPU"))
    assert source() == "10.0.0.1:8000"  # two CPU-tier blocks (32 tokens) over none on the pick
    cache.events.apply("10.0.0.2:8000", "m", BlockStored((5, 6), 0, tuple(tokens[:32]), 16, "GPU"))
    assert source() is None  # the pick holds as many, in any tier: no lead
