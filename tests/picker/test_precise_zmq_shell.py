"""The precise prefix cache's Trio shell in process: a pyzmq PUB socket publishes to
:func:`subscribe_endpoint` (garbage, a flood, then good events); the subscriber warns once, keeps
serving, leaves other tasks their turns, and forgets the endpoint when cancelled."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.lowlevel

from evergreen_trio.picker.config import Endpoint
from evergreen_trio.picker.kvblock import PodEntry
from evergreen_trio.picker.kvevents_zmq import bound_subscribers, endpoint_subscribers, subscribe_endpoint
from evergreen_trio.picker.precise_prefix import KVEventsConfig, PreciseParams, PrecisePrefixCache

zmq = pytest.importorskip("zmq", reason="needs pyzmq (extra picker): pip install 'evergreen-trio[picker]'")
msgpack = pytest.importorskip("msgpack", reason="needs msgpack (extra picker): pip install 'evergreen-trio[picker]'")

TOKENS = tuple(range(32))


def _stored(seq: int) -> list[bytes]:
    event = ["BlockStored", [1, 2], None, list(TOKENS), 16]
    return [b"kv@ignored@m", seq.to_bytes(8, "big"), msgpack.packb([0.0, [event]])]


async def test_garbage_and_floods_are_dropped_with_one_warning_and_good_events_land(
        caplog: pytest.LogCaptureFixture) -> None:
    cache = PrecisePrefixCache(PreciseParams())
    keys = cache.processor.block_keys(TOKENS, "m")
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    endpoint = Endpoint("127.0.0.1", 8000)
    ticks = 0

    async def ticker() -> None:  # another task: it must get turns while the subscriber reads
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    try:
        with caplog.at_level(logging.DEBUG, "evergreen_trio.picker.kvevents_zmq"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscribe_endpoint, endpoint, [cache], port, "kv@")
                nursery.start_soon(ticker)
                with trio.fail_after(10):
                    seq = 0
                    while not cache.index.lookup(keys):
                        for _ in range(200):  # a flood of bad messages around the good one
                            publisher.send_multipart([b"kv@x@m", b"\0" * 8, b"\xc1garbage"])
                        publisher.send_multipart([b"kv@x@m", b"short"])
                        publisher.send_multipart(_stored(seq))
                        seq += 1
                        await trio.sleep(0.05)
                assert cache.index.lookup(keys) == {k: [PodEntry("127.0.0.1:8000", "gpu")] for k in keys}
                nursery.cancel_scope.cancel()
    finally:
        publisher.close(0)
        context.term()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "picker.kv_events_dropped" in warnings[0].getMessage()
    assert ticks > 10
    assert cache.index.lookup(keys) == {}  # the endpoint left: its entries went with it


def test_subscribers_group_producers_by_port_and_filter() -> None:
    first = PrecisePrefixCache(PreciseParams())
    second = PrecisePrefixCache(PreciseParams(events=KVEventsConfig(socket_port=6000)))
    bound = PrecisePrefixCache(PreciseParams(events=KVEventsConfig(zmq_endpoint="tcp://*:5557",
                                                                   discover_pods=False)))
    caches = {"a": first, "b": second, "c": bound}
    ports = [getattr(task, "keywords", {})["socket_port"] for task in endpoint_subscribers(caches)]
    assert ports == [5557, 6000]
    assert bound_subscribers(caches) == {"tcp://*:5557": ([bound], "kv@")}
