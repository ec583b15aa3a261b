"""``mm-embeddings-cache-producer`` and ``mm-embeddings-cache-scorer``: llm-d-router's test tables,
the LRU's bounds as properties, hostile bodies, the scheduler, the command's bad input, and a
started picker driven by grpcio as Envoy."""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.mm_cache import (
    MAX_MEDIA_ITEMS,
    MAX_MEDIA_PARTS,
    MAX_TRACKED_ENDPOINTS,
    MM_PRODUCER,
    SWEEP_SECONDS,
    MediaCache,
    MediaProducerParams,
    MediaScorerParams,
    content_hash,
    lru_capacity,
    media_items,
    media_scores,
)
from evergreen_trio.picker.plugins import PLUGIN_TYPES
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Schedule, Scheduler

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import MiB, ext_proc, serve_fake_engine

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
CAT, DOG = "https://example.com/cat.png", "https://example.com/dog.png"


def chat(*parts: object, text: str = "what is this?") -> dict[str, object]:
    """A chat completions body with one user message of ``parts`` (and a text part)."""
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def _plugins(text: str) -> dict[str, object]:
    config = parse_config(HEAD + "plugins:\n" + text, cluster_pool="pool")
    assert config.epp is not None
    return {name: plugin.params for name, plugin in config.epp.plugins.items()}


def _request(*items: bytes) -> PickRequest:
    return PickRequest("m", 0, media=items)


# -- llm-d-router's tests (dataproducer/multimodal/producer_test.go before and at ebab68792) --------


def test_lru_capacity_from_cache_size_mb() -> None:
    assert [lru_capacity(mb) for mb in (4, 2048, 0, -5, 1)] == [2, 1024, 2048, 2048, 1]


def test_factories() -> None:
    assert _plugins("- {type: mm-embeddings-cache-producer, name: mm-producer, parameters: "
                    "{cacheSizeInMBPerServer: 4}}\n")["mm-producer"] == MediaProducerParams(2)
    assert _plugins("- {type: mm-embeddings-cache-producer}\n")[MM_PRODUCER] == MediaProducerParams(2048)
    for name in ("mm-embeddings-cache-producer", "mm-embeddings-cache-scorer"):
        assert name in PLUGIN_TYPES


def test_items_from_structured_chat() -> None:
    """TestExtractMMItemsFromStructuredChat: a repeated image counts once; a video is another item."""
    body = chat(image(CAT), image(CAT), {"type": "video_url", "video_url": {"url": "https://example.com/cat.mp4"}})
    assert media_items(body) == (content_hash("image_url", CAT), content_hash("video_url", "https://example.com/cat.mp4"))
    assert content_hash("image_url", CAT) == hashlib.sha256(b"image_url\x00" + CAT.encode()).digest()


def test_items_from_structured_chat_audio() -> None:
    body = chat({"type": "input_audio", "input_audio": {"format": "wav", "data": "base64-audio"}})
    assert media_items(body) == (content_hash("input_audio", "wav:base64-audio"),)


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "a plain string"}]},
    {"model": "m", "prompt": "no messages"},
    {"model": "m", "messages": "not a list"},
    {"model": "m", "messages": [7, None, {"content": [1, "x", {"image_url": "not an object"},
                                                      {"image_url": {"url": 3}}, {"image_url": {"url": ""}},
                                                      {"input_audio": {"data": ""}}]}]},
])
def test_bodies_without_media_have_no_items(body: dict[str, object]) -> None:
    assert media_items(body) == ()


def test_produce_matches_several_pods_and_the_schedule_updates_placement() -> None:
    """TestProduceMatchesMultiplePodsAndPreRequestUpdatesPlacement."""
    cache = MediaCache(MediaProducerParams())
    a, c = b"hash-a", b"hash-c"
    for pod in ("pod-a", "pod-b"):
        cache.scheduled(_request(a), Schedule([pod]), 0.0)
    assert media_scores(cache, (a, c), ["pod-a", "pod-b", "pod-c"]) == {"pod-a": 0.5, "pod-b": 0.5, "pod-c": 0.0}
    cache.scheduled(_request(a, c), Schedule(["pod-c"]), 0.0)
    assert media_scores(cache, (a, c), ["pod-a", "pod-c"]) == {"pod-a": 0.5, "pod-c": 1.0}


def test_lru_eviction() -> None:
    cache = MediaCache(MediaProducerParams(lru_capacity(4)))
    for item in (b"hash-1", b"hash-2", b"hash-3"):
        cache.scheduled(_request(item), Schedule(["pod-a"]), 0.0)
    assert [cache.held("pod-a", [item]) for item in (b"hash-1", b"hash-2", b"hash-3")] == [0, 1, 1]


def test_stale_pod_cleanup() -> None:
    cache = MediaCache(MediaProducerParams())
    cache.scheduled(_request(b"hash-a"), Schedule(["pod-a", "pod-b"]), 0.0)
    cache.sweep({"pod-a"}, 0.0)
    assert cache.sizes() == {"pod-a": 1}
    cache.scheduled(_request(b"hash-a"), Schedule(["pod-b"]), 1.0)
    cache.sweep({"pod-a"}, 1.0)  # swept at most once per interval
    assert cache.sizes() == {"pod-a": 1, "pod-b": 1}
    cache.sweep({"pod-a"}, SWEEP_SECONDS)
    assert cache.sizes() == {"pod-a": 1}


def test_the_scorer_gives_0_without_items_or_producer() -> None:
    cache = MediaCache(MediaProducerParams())
    cache.scheduled(_request(b"x"), Schedule(["pod-a"]), 0.0)
    assert media_scores(cache, (), ["pod-a"]) == {"pod-a": 0.0}
    assert media_scores(None, (b"x",), ["pod-a"]) == {"pod-a": 0.0}
    cache.scheduled(_request(), Schedule(["pod-b"]), 0.0)  # a request without media teaches nothing
    assert cache.sizes() == {"pod-a": 1}


def test_the_scorer_reads_its_named_producer_or_the_default_one_made_for_it() -> None:
    made = _plugins("- {type: mm-embeddings-cache-scorer}\n")
    assert made == {"mm-embeddings-cache-scorer": MediaScorerParams(), MM_PRODUCER: MediaProducerParams()}
    named = _plugins("- {type: mm-embeddings-cache-producer, name: mm, parameters: {cacheSizeInMBPerServer: 8}}\n"
                     "- {type: mm-embeddings-cache-scorer, parameters: {producerName: mm}}\n")
    assert named == {"mm": MediaProducerParams(4), "mm-embeddings-cache-scorer": MediaScorerParams("mm")}
    with pytest.raises(ConfigError, match=r"plugins\[1\]\.parameters\.producerName"):
        _plugins("- {type: queue-scorer, name: mm}\n"
                 "- {type: mm-embeddings-cache-scorer, parameters: {producerName: mm}}\n")


# -- invariants ---------------------------------------------------------------------------------

_ITEMS = st.lists(st.binary(min_size=1, max_size=2), max_size=6)


@given(st.integers(1, 4), st.lists(st.tuples(_ITEMS, st.lists(st.sampled_from("abcde"), max_size=3)), max_size=30),
       _ITEMS)
def test_the_lru_never_exceeds_its_bound_and_scores_stay_in_0_1(
        capacity: int, sent: list[tuple[list[bytes], list[str]]], asked: list[bytes]) -> None:
    cache = MediaCache(MediaProducerParams(capacity))
    for items, endpoints in sent:
        cache.scheduled(_request(*dict.fromkeys(items)), Schedule(endpoints), 0.0)
        assert all(size <= capacity for size in cache.sizes().values())
    unique = tuple(dict.fromkeys(asked))
    scores = media_scores(cache, unique, list("abcdef"))
    assert all(0.0 <= s <= 1.0 for s in scores.values()) and scores["f"] == 0.0
    if sent and unique and set(unique) <= set(sent[-1][0]) and len(set(sent[-1][0])) <= capacity:
        assert all(scores[e] == 1.0 for e in sent[-1][1])  # the last placement is held in full


def test_the_endpoints_tracked_are_bounded() -> None:
    cache = MediaCache(MediaProducerParams(1))
    for i in range(MAX_TRACKED_ENDPOINTS + 10):
        cache.scheduled(_request(b"x"), Schedule([f"10.0.{i // 250}.{i % 250}:8000"]), 0.0)
    assert len(cache.sizes()) == MAX_TRACKED_ENDPOINTS and "10.0.0.0:8000" not in cache.sizes()


@given(st.lists(st.sampled_from([image(CAT), image(DOG), "text", {"type": "text", "text": "x"}]), max_size=20))
def test_items_are_distinct_and_in_first_seen_order(parts: list[object]) -> None:
    items = media_items(chat(*parts))
    expected = [content_hash("image_url", p["image_url"]["url"]) for p in parts  # type: ignore[index]
                if isinstance(p, dict) and "image_url" in p]
    assert items == tuple(dict.fromkeys(expected))


# -- hostile bodies -----------------------------------------------------------------------------


def test_many_parts_and_items_are_read_up_to_their_bounds() -> None:
    many_images = chat(*(image(f"https://example.com/{i}.png") for i in range(10 * MAX_MEDIA_ITEMS)))
    assert len(media_items(many_images)) == MAX_MEDIA_ITEMS
    late = chat(*([{"type": "text", "text": "x"}] * MAX_MEDIA_PARTS), image(CAT))
    assert media_items(late) == ()  # past the parts read
    messages = {"model": "m", "messages": [{"role": "user", "content": "x"}] * MAX_MEDIA_PARTS
                + [{"role": "user", "content": [image(CAT)]}]}
    assert media_items(messages) == ()  # a message counts as a part
    started = time.process_time()
    assert media_items({"model": "m", "messages": [{"content": [image(CAT)] * 1_000_000}]}) == (
        content_hash("image_url", CAT),)
    million_messages = {"model": "m", "messages": [{"content": []}] * 1_000_000}
    assert media_items(million_messages) == ()
    assert time.process_time() - started < 5  # a bounded walk, not a million (generous: shared CI cores)


def test_a_huge_data_url_is_one_item() -> None:
    data = "data:image/png;base64," + "A" * (8 * MiB)
    assert media_items(chat(image(data), image(data))) == (content_hash("image_url", data),)
    assert media_items(chat(image("\ud800 lone surrogate"))) == (content_hash("image_url", "\ud800 lone surrogate"),)


# -- through the scheduler ----------------------------------------------------------------------

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
ROUTING = """plugins:
- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: 4}}
- {type: mm-embeddings-cache-scorer}
- {type: queue-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: mm-embeddings-cache-scorer, weight: 4}, {pluginRef: queue-scorer}]}
"""


def test_a_repeated_image_follows_its_endpoint_until_evicted() -> None:
    config = parse_config(f"pool: {{name: p, endpoints: ['{A}', '{B}', '{C}']}}\n---\n" + HEAD + ROUTING)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for address in (A, B, C):
        snapshot.update(address, EndpointMetrics(waiting=0))
    scheduler = Scheduler(config, snapshot, random.Random(7))
    cat, dog, cow = (content_hash("image_url", u) for u in (CAT, DOG, "cow"))
    first = scheduler.pick(_request(cat))[0]
    snapshot.update(first, EndpointMetrics(waiting=5))  # busier now, still its cache wins (4 x 1.0 > 1.0)
    assert all(scheduler.pick(_request(cat)) == [first] for _ in range(5))
    assert scheduler.schedule(_request(cat)).scores[first] == 4.0
    for item in (dog, cow):  # capacity 2: cat is evicted from the first pod's LRU
        scheduler.plugin_states[MM_PRODUCER].scheduled(_request(item), Schedule([first]), 0.0)
    assert scheduler.pick(_request(cat)) != [first]


# -- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize(("plugins", "field"), [
    ("- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: bad}}",
     "plugins[0].parameters.cacheSizeInMBPerServer"),
    ("- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: 1.5}}",
     "plugins[0].parameters.cacheSizeInMBPerServer"),
    ("- {type: mm-embeddings-cache-producer, parameters: {cacheSizeInMBPerServer: 9223372036854775808}}",
     "plugins[0].parameters.cacheSizeInMBPerServer"),
    ("- {type: mm-embeddings-cache-producer, parameters: {cacheSize: 4}}", "plugins[0].parameters.cacheSize"),
    ("- {type: mm-embeddings-cache-scorer, parameters: {producerName: 3}}", "plugins[0].parameters.producerName"),
    ("- {type: mm-embeddings-cache-scorer, parameters: {producerName: nope}}", "plugins[0].parameters.producerName"),
    ("- {type: mm-embeddings-cache-scorer, parameters: {weight: 2}}", "plugins[0].parameters.weight"),
])
def test_each_bad_parameter_is_one_line_and_exit_2(plugins: str, field: str) -> None:
    result = run_cli(["--pool-name", "p", "--config-text", HEAD + "plugins:\n" + plugins + "\n"])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"EndpointPickerConfig.{field}: expected" in line, line


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


async def test_a_started_picker_sends_an_image_back_where_it_was_encoded(nursery: trio.Nursery,
                                                                         tmp_path: Path) -> None:
    engines = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(4)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: mm, endpoints: {json.dumps(engines)}}}\n---\n" + HEAD
                      + ROUTING)
    args = ["--config", str(config), "--refresh-metrics-interval", "50ms", *EPHEMERAL_PORTS]

    def send(body: dict[str, object] | bytes) -> tuple[int, str | None]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = ext_proc(picker.grpc, data, path="/v1/chat/completions")
        return answer.status, answer.endpoint

    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(10):
            while (first := await trio.to_thread.run_sync(send, chat(image(CAT))))[0] != 200:  # noqa: ASYNC110
                await trio.sleep(0.05)
        for _ in range(6):
            assert await trio.to_thread.run_sync(send, chat(image(CAT))) == first
        hostile = [
            chat(*(image(f"https://example.com/{i}.png") for i in range(50_000))),
            chat(image("data:image/png;base64," + "A" * (4 * MiB))),
            {"model": "m", "messages": [{"role": "user", "content": [image(CAT)] * 100_000}]},
            b'{"model":"m","messages":[{"content":[{"image_url":' + b'{"url":' * 5000 + b"1" + b"}" * 5001 + b"]}]}",
        ]
        for body in hostile:
            status, _ = await trio.to_thread.run_sync(send, body)
            assert status in (200, 400, 413)
        assert await trio.to_thread.run_sync(send, chat(image(CAT))) == first  # still serving, still placed
