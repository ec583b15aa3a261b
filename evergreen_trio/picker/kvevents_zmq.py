"""The Trio shell of the precise prefix cache: ZMQ SUB sockets reading vLLM's KV events.

:func:`subscribe_endpoint` runs while an endpoint is in the pool (the scrapers start and cancel it
with the endpoint's other per-endpoint tasks): it connects to ``tcp://<host>:<socketPort>`` and
feeds every batch to each :class:`~evergreen_trio.picker.precise_prefix.PrecisePrefixCache`,
with the endpoint as the pod; when it ends, the endpoint's entries go. :func:`subscribe_bound`
binds ``kvEventsConfig.zmqEndpoint`` for engines that connect (the topic then names the pod).
pyzmq is driven without threads: non-blocking receives, and ``wait_readable`` on the socket's
edge-triggered FD, checking ``zmq.EVENTS`` before each wait. A socket bounds its queue
(``RCVHWM``) and message size (``MAXMSGSIZE``); a bad message is one warning line per socket
(then debug lines), and the socket serves on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import trio

from evergreen_trio.picker.config import Endpoint
from evergreen_trio.picker.kvevents import MAX_PAYLOAD_BYTES, KVEventError, decode_batch, parse_frames, parse_topic
from evergreen_trio.picker.precise_prefix import PrecisePrefixCache

log = logging.getLogger(__name__)

RECEIVE_HWM = 64
"""Messages a socket queues unread at most (ZMQ drops newer ones for a SUB)."""
MESSAGES_PER_TURN = 16
"""Messages read before yielding to the other tasks (a flooding publisher cannot starve picks)."""
EVENTS_PER_CHECKPOINT = 64
LOCAL_SUBSCRIBER = "local-subscriber"  # the bound socket's name among the subscribers (the reference's)


def zmq_module() -> Any:
    """pyzmq, imported when a subscriber starts (the producer's parameters required it installed:
    ``precise_prefix._require_packages``)."""
    import zmq

    return zmq


def _socket(zmq: Any, topic_filter: str) -> Any:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic_filter.encode())
    return sock


class _Warned:
    """One warning line per socket for bad messages, debug lines after it."""

    def __init__(self, where: str) -> None:
        self.where, self.count = where, 0

    def __call__(self, error: Exception) -> None:
        self.count += 1
        level = logging.WARNING if self.count == 1 else logging.DEBUG
        log.log(level, "picker.kv_events_dropped source=%s error=%s%s", self.where, error,
                " (further drops are debug lines)" if self.count == 1 else "")


async def _read(zmq: Any, sock: Any, caches: Sequence[PrecisePrefixCache], pod: str | None, warn: _Warned) -> None:
    """Receive and apply messages until cancelled; ``pod`` None: the topic names it."""
    fd = sock.getsockopt(zmq.FD)
    while True:
        for _ in range(MESSAGES_PER_TURN):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            await _apply(frames, caches, pod, warn)
        else:
            await trio.lowlevel.checkpoint()
            continue
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the FD is edge-triggered: wait only when drained
            await trio.lowlevel.wait_readable(fd)


async def _apply(frames: Sequence[bytes], caches: Sequence[PrecisePrefixCache], pod: str | None,
                 warn: _Warned) -> None:
    try:
        topic, _, payload = parse_frames(frames)
        events = decode_batch(payload)
    except KVEventError as exc:
        warn(exc)
        return
    topic_pod, model = parse_topic(topic)
    for i, event in enumerate(events):
        for cache in caches:
            for _ in cache.events.steps(pod or topic_pod, model, event):  # a long event: other tasks run between slices
                await trio.lowlevel.checkpoint()
        if i % EVENTS_PER_CHECKPOINT == EVENTS_PER_CHECKPOINT - 1:
            await trio.lowlevel.checkpoint()


async def subscribe_endpoint(endpoint: Endpoint, caches: Sequence[PrecisePrefixCache], socket_port: int,
                             topic_filter: str) -> None:
    """Read ``endpoint``'s KV events until cancelled; then forget its entries."""
    zmq = zmq_module()
    sock = _socket(zmq, topic_filter)
    address = f"tcp://{Endpoint(endpoint.host, socket_port).address}"
    try:
        if ":" in endpoint.host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)  # ZMQ reconnects on its own while the publisher is away
        log.info("picker.kv_events_subscribed endpoint=%s zmq=%s", endpoint.address, address)
        for cache in caches:
            cache.subscribed(endpoint.address, True)
        await _read(zmq, sock, caches, endpoint.address, _Warned(address))
    finally:
        sock.close(0)
        for cache in caches:
            cache.subscribed(endpoint.address, False)
            cache.forget(endpoint.address)


async def subscribe_bound(address: str, caches: Sequence[PrecisePrefixCache], topic_filter: str) -> None:
    """Bind ``address`` for engines that connect to it, until cancelled."""
    zmq = zmq_module()
    sock = _socket(zmq, topic_filter)
    try:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            log.warning("picker.kv_events_bind_failed zmq=%s error=%s", address, exc)
            return
        log.info("picker.kv_events_bound zmq=%s", address)
        for cache in caches:
            cache.subscribed(LOCAL_SUBSCRIBER, True)
        await _read(zmq, sock, caches, None, _Warned(address))
    finally:
        sock.close(0)
        for cache in caches:
            cache.subscribed(LOCAL_SUBSCRIBER, False)


def endpoint_subscribers(caches: Mapping[str, PrecisePrefixCache]) -> list[Callable[[Endpoint], Awaitable[None]]]:
    """Per pool endpoint, one subscriber per (socket port, topic filter) of the producers that
    discover pods, feeding those producers."""
    groups: dict[tuple[int, str], list[PrecisePrefixCache]] = {}
    for cache in caches.values():
        events = cache.params.events
        if events.discover_pods:
            groups.setdefault((events.socket_port, events.topic_filter), []).append(cache)
    return [partial(subscribe_endpoint, caches=tuple(group), socket_port=port, topic_filter=topic)
            for (port, topic), group in groups.items()]


def bound_subscribers(caches: Mapping[str, PrecisePrefixCache]) -> dict[str, tuple[list[PrecisePrefixCache], str]]:
    """By ``zmqEndpoint``: the producers it feeds and its topic filter (the first producer's)."""
    bound: dict[str, tuple[list[PrecisePrefixCache], str]] = {}
    for cache in caches.values():
        events = cache.params.events
        if events.zmq_endpoint:
            bound.setdefault(events.zmq_endpoint, ([], events.topic_filter))[0].append(cache)
    return bound
