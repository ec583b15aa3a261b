"""``mm-embeddings-cache-producer`` and ``mm-embeddings-cache-scorer``, sans-IO, as llm-d-router's
(``requestcontrol/dataproducer/multimodal``, ``scheduling/scorer/mmcacheaffinity``): send a
request to the endpoints that recently served the same images, videos or audio, whose encoder
cache likely still holds their embeddings.

The request's items are hashed from its OpenAI chat content parts, as the reference did before it
moved the work to its tokenizer (llm-d-router 727ef47d3^, ``itemsFromChat``): a part's
``image_url.url``, else ``video_url.url``, else ``input_audio`` (``format:data``), each the
SHA-256 of ``kind NUL identifier``; an item repeated in a request counts once. (At ebab68792 the
reference reads only a ``token-producer``'s multimodal features; no tokenizer runs here.) Only
``/v1/chat/completions`` bodies are read, at most :data:`MAX_MEDIA_PARTS` parts and
:data:`MAX_MEDIA_ITEMS` items each, so a body of a million parts costs a bounded walk.

The producer keeps, per endpoint, an LRU of the items sent there (the primary profile's picks, once
scheduled), ``cacheSizeInMBPerServer`` (4096; 0 or less: the default) / 2 MiB entries each, and
forgets the endpoints discovery dropped (every :data:`SWEEP_SECONDS`, and beyond
:data:`MAX_TRACKED_ENDPOINTS`). The scorer gives each candidate the share of the request's items
its LRU holds (0 for all without items). It reads the producer ``producerName`` names (default
``mm-embeddings-cache-producer``, made with default parameters when not declared, as the
reference's default producer); a name no producer has fails the config.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugin_state import MAX_LISTED, busiest, first_sorted, identity
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Schedule, Scheduler

MM_PRODUCER = "mm-embeddings-cache-producer"
MM_SCORER = "mm-embeddings-cache-scorer"
DEFAULT_CACHE_MB = 4096
BYTES_PER_ITEM = 2 * 1024 * 1024  # the reference's assumed size of one tracked item
MAX_MEDIA_PARTS = 4096
"""Content parts read per request; the rest are not looked at."""
MAX_MEDIA_ITEMS = 256
"""Distinct items kept per request."""
MAX_TRACKED_ENDPOINTS = 1024
"""Endpoints the producer remembers items for; past it, the one least recently sent an item goes."""
SWEEP_SECONDS = 120.0  # the reference's podCleanupInterval
_GO_INT = (-(2**63), 2**63 - 1)
_MEDIA_KINDS = ("image_url", "video_url")


def lru_capacity(cache_mb: int) -> int:
    """Entries per endpoint for a ``cacheSizeInMBPerServer`` budget (at least 1)."""
    return max(1, (cache_mb if cache_mb > 0 else DEFAULT_CACHE_MB) * 1024 * 1024 // BYTES_PER_ITEM)


def content_hash(kind: str, identifier: str) -> bytes:
    """An item's identity: SHA-256 of ``kind NUL identifier`` (the reference's ``contentHash``, as bytes)."""
    return hashlib.sha256(f"{kind}\0{identifier}".encode("utf-8", "surrogatepass")).digest()


def _url(block: Mapping[str, Any], kind: str) -> str:
    inner = block.get(kind)
    url = inner.get("url") if isinstance(inner, Mapping) else None
    return url if isinstance(url, str) else ""


def _item(block: Mapping[str, Any]) -> bytes | None:
    """A content part's item, tried in the reference's order; None for a part without media."""
    for kind in _MEDIA_KINDS:
        url = _url(block, kind)
        if url:
            return content_hash(kind, url)
    audio = block.get("input_audio")
    data = audio.get("data") if isinstance(audio, Mapping) else None
    if isinstance(data, str) and data:
        audio_format = audio.get("format") if isinstance(audio, Mapping) else None
        return content_hash("input_audio", f"{audio_format if isinstance(audio_format, str) else ''}:{data}")
    return None


def media_items(body: Mapping[str, Any]) -> tuple[bytes, ...]:
    """A chat completions body's distinct media items, in order (bounded: see the module)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ()
    items: dict[bytes, None] = {}
    budget = MAX_MEDIA_PARTS  # a message counts as one part at least
    for message in messages[:MAX_MEDIA_PARTS]:
        content = message.get("content") if isinstance(message, Mapping) else None
        blocks = content[:budget] if isinstance(content, list) else ()
        for block in blocks:
            item = _item(block) if isinstance(block, Mapping) else None
            if item is not None:
                items[item] = None
                if len(items) >= MAX_MEDIA_ITEMS:
                    return tuple(items)
        budget -= min(budget, max(1, len(blocks)))
        if not budget:
            break
    return tuple(items)


@dataclass(frozen=True)
class MediaProducerParams:
    """``mm-embeddings-cache-producer``: entries per endpoint."""

    capacity: int = lru_capacity(DEFAULT_CACHE_MB)


@dataclass(frozen=True)
class MediaScorerParams:
    """``mm-embeddings-cache-scorer``: the producer read, by plugin name."""

    producer: str = MM_PRODUCER


class MediaCache:
    """A producer's state: per endpoint address, an LRU of the items sent there."""

    def __init__(self, params: MediaProducerParams) -> None:
        self.capacity = params.capacity
        self._lrus: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()
        self._swept_at = float("-inf")

    def scheduled(self, request: PickRequest, schedule: Schedule, now: float) -> None:
        """The reference's PreRequest: the request's items are now on its primary profile's picks."""
        for address in schedule.endpoints if request.media else ():
            lru = self._lrus.get(address)
            if lru is None:
                lru = self._lrus[address] = OrderedDict()
                if len(self._lrus) > MAX_TRACKED_ENDPOINTS:
                    self._lrus.popitem(last=False)
            self._lrus.move_to_end(address)
            for item in request.media:
                lru[item] = None
                lru.move_to_end(item)
            while len(lru) > self.capacity:
                lru.popitem(last=False)

    def held(self, address: str, items: Sequence[bytes]) -> int:
        """How many of ``items`` ``address``'s LRU holds (a read: recency unchanged, as the reference's Contains)."""
        lru = self._lrus.get(address)
        return sum(item in lru for item in items) if lru else 0

    def sweep(self, live: Collection[str], now: float) -> None:
        """Forget the endpoints not in ``live``, at most once per :data:`SWEEP_SECONDS`."""
        if now - self._swept_at < SWEEP_SECONDS:
            return
        self._swept_at = now
        for address in [a for a in self._lrus if a not in live]:
            del self._lrus[address]

    def sizes(self) -> dict[str, int]:
        """Items held per endpoint (the reference's DumpState counts, without the hashes)."""
        return {address: len(lru) for address, lru in self._lrus.items()}

    def dump_state(self, known: Collection[str]) -> dict[str, object]:
        """The reference's ``DumpState``: the pool's endpoints (``known``) by name and the items
        held per endpoint, most first, each list the first ``MAX_LISTED`` (100); no item hashes."""
        sizes = self.sizes()
        return {"podList": first_sorted(known), "totalKnownPods": len(known),
                "pods": [{"pod": identity(a), "items": sizes[a]} for a in busiest(sizes)],
                "totalPods": len(sizes), "maxPods": MAX_LISTED}


def media_scores(cache: MediaCache | None, items: Sequence[bytes], addresses: Sequence[str]) -> dict[str, float]:
    """Each address's share of ``items`` its LRU holds, in [0, 1]; 0 for all without items or a cache."""
    if cache is None or not items:
        return dict.fromkeys(addresses, 0.0)
    return {address: cache.held(address, items) / len(items) for address in addresses}


def _producer(params: Params) -> MediaProducerParams:
    return MediaProducerParams(lru_capacity(params.integer("cacheSizeInMBPerServer", 0, minimum=_GO_INT[0],
                                                           maximum=_GO_INT[1])))


def encoder_match(cache: MediaCache | None, items: Sequence[bytes],
                  addresses: Sequence[str]) -> tuple[int, dict[str, int]]:
    """The reference's ``EncoderCacheMatchInfo`` sizes (each item of size 1, as its producer's):
    the request's items, and how many of them each address's LRU holds."""
    if cache is None or not items:
        return 0, {}
    return len(items), {address: cache.held(address, items) for address in addresses}


def _reader(params: object) -> tuple[str, str] | None:
    """(producer name, its parameter) of a plugin that reads a producer's matches: a scorer, or a
    ``predicted-latency-producer`` with ``useEncoderCacheFeatures`` (its ``encoder_producer``)."""
    if isinstance(params, MediaScorerParams):
        return params.producer, "producerName"
    encoder = getattr(params, "encoder_producer", "")
    return (encoder, "encoderCacheMatchInfoProducerName") if encoder else None


def with_default_producer(plugins: Mapping[str, Plugin], path: str) -> dict[str, Plugin]:
    """``plugins``, with the default producer added when a plugin reads it and it is not declared
    (as the reference creates a consumed key's default producer); ConfigError for a plugin naming
    another producer no declared one has. ``path``: the plugins list's, for the error."""
    result = dict(plugins)
    for i, plugin in enumerate(plugins.values()):
        reader = _reader(plugin.params)
        if reader is None:
            continue
        name, key = reader
        declared = result.get(name)
        if declared is not None and isinstance(declared.params, MediaProducerParams):
            continue
        if name != MM_PRODUCER or declared is not None:
            raise ConfigError(f"{path}[{i}].parameters.{key}", f"the name of a declared {MM_PRODUCER}", name)
        result[name] = Plugin(name, MM_PRODUCER, MediaProducerParams())
    return result


# -- in the scheduler ---------------------------------------------------------------------------


def _scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            fresh: Mapping[str, object], params: object) -> dict[str, float]:
    assert isinstance(params, MediaScorerParams)
    cache = scheduler.plugin_states.get(params.producer)
    if not isinstance(cache, MediaCache):
        cache = None
    elif request.media:
        cache.sweep(scheduler.snapshot.states, scheduler.snapshot.clock())
    return media_scores(cache, request.media, [s.endpoint.address for s in candidates])


def _media_cache(params: object) -> MediaCache:
    assert isinstance(params, MediaProducerParams)
    return MediaCache(params)


register(MM_PRODUCER, PluginType(Category.PRODUCER, ("cacheSizeInMBPerServer",), _producer))
register(MM_SCORER, PluginType(Category.SCORER, ("producerName",), lambda p: MediaScorerParams(
    p.text("producerName", "") or MM_PRODUCER)))

MEDIA_SCORERS = {MM_SCORER: _scorer}
MEDIA_STATES = {MM_PRODUCER: _media_cache}
