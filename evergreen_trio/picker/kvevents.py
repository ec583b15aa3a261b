"""vLLM's KV-cache events (llm-d-router's ``pkg/kvevents``), sans-IO: decoding and indexing.

A ZMQ message is three frames: the topic (``kv@<pod>@<model>``), an 8-byte big-endian sequence
number and a msgpack ``EventBatch``: ``[ts, [event, ...], data_parallel_rank?]``. Each event is a
tagged positional array (msgspec ``array_like``: ``["BlockStored", block_hashes, parent_hash,
token_ids, block_size, lora_id?, medium?, lora_name?, extra_keys?, group_idx?, kv_cache_spec_kind?,
kv_cache_spec_sliding_window?]``, ``["BlockRemoved", block_hashes, medium?, group_idx?]``,
``["AllBlocksCleared"]``), or since vLLM #42892 a map with those field names under ``type``.
:func:`decode_batch` reads one (peer bytes: bounded, every shape checked, one
:class:`KVEventError` naming what is wrong); :class:`KVEventIndexer` applies the events to a
:class:`~evergreen_trio.picker.kvblock.KVBlockIndex` as the reference's pool does: a stored
block's request keys are recomputed from its tokens (chained from its parent's request key), so
the engine's own hashes only name blocks for later removal.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from evergreen_trio.picker.kvblock import BlockExtras, KVBlockIndex, PodEntry, TokenProcessor

MAX_PAYLOAD_BYTES = 4 << 20
"""A message's payload at most (the subscriber's socket refuses longer ones too)."""
MAX_EVENTS = 4096
MAX_HASHES = 1 << 18
"""Block hashes, token ids and extra keys in one message, at most (each list: msgpack refuses longer ones)."""
MAX_GROUPS = 64
"""KV-cache groups remembered per endpoint."""
BLOCKS_PER_STEP = 256
"""Blocks a stored event hashes between two yields of :meth:`KVEventIndexer.steps`."""
BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
DEFAULT_TIER = "gpu"
INDEXABLE_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class KVEventError(ValueError):
    """A KV-event message that does not read as vLLM's (the message is dropped)."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int
    tokens: tuple[int, ...]
    block_size: int
    tier: str = ""
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group: int | None = None
    kind: str = ""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    tier: str = ""
    group: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def parse_topic(topic: str) -> tuple[str, str]:
    """(pod, model) of ``kv@<pod>@<model>``; (topic, "") for any other shape."""
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def parse_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """(topic, sequence, payload) of a message's three frames."""
    if len(frames) != 3 or len(frames[1]) < 8:
        raise KVEventError(f"expected 3 frames (topic, 8-byte sequence, payload), got {len(frames)}")
    if len(frames[2]) > MAX_PAYLOAD_BYTES:
        raise KVEventError(f"payload of {len(frames[2])} bytes (at most {MAX_PAYLOAD_BYTES})")
    return frames[0].decode("utf-8", "replace"), int.from_bytes(frames[1][:8], "big"), frames[2]


def _hash(value: object, what: str) -> int:
    """An engine block hash: an integer (as uint64) or bytes (the last 8, big endian)."""
    if isinstance(value, bool):
        raise KVEventError(f"{what}: unsupported hash type bool")
    if isinstance(value, int):
        return value & 0xFFFFFFFFFFFFFFFF
    if isinstance(value, bytes):
        if not value:
            raise KVEventError(f"{what}: hash byte string is empty")
        return int.from_bytes(value[-8:], "big")
    raise KVEventError(f"{what}: unsupported hash type {type(value).__name__}")


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventError(f"{what}: not an integer ({type(value).__name__})")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise KVEventError(f"{what}: not an array ({type(value).__name__})")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise KVEventError(f"{what}: not a string ({type(value).__name__})")
    return value


def _at(fields: Sequence[Any], i: int) -> Any:
    return fields[i] if i < len(fields) else None


def _group(value: object, what: str) -> int | None:
    if value is None:
        return None
    group = _int(value, what)
    if group < 0:
        raise KVEventError(f"{what}: negative value {group}")
    return group


def _stored(fields: Sequence[Any]) -> BlockStored:
    if len(fields) < 5:
        raise KVEventError(f"BlockStored: need at least 5 fields, got {len(fields)}")
    hashes = tuple(_hash(h, "BlockStored.block_hashes") for h in _list(fields[1], "BlockStored.block_hashes"))
    parent = 0 if fields[2] is None else _hash(fields[2], "BlockStored.parent_block_hash")
    tokens = tuple(_int(t, "BlockStored.token_ids") & 0xFFFFFFFF for t in _list(fields[3], "BlockStored.token_ids"))
    block_size = _int(fields[4], "BlockStored.block_size")
    if _at(fields, 5) is not None:
        _int(fields[5], "BlockStored.lora_id")
    tier = "" if _at(fields, 6) is None else _text(fields[6], "BlockStored.medium")
    lora = None if _at(fields, 7) is None else _text(fields[7], "BlockStored.lora_name")
    extra: tuple[tuple[Any, ...] | None, ...] | None = None
    if _at(fields, 8) is not None:
        extra = tuple(None if k is None else tuple(_list(k, "BlockStored.extra_keys[]"))
                      for k in _list(fields[8], "BlockStored.extra_keys"))
    group = _group(_at(fields, 9), "BlockStored.group_idx")
    kind = "" if _at(fields, 10) is None else _text(fields[10], "BlockStored.kv_cache_spec_kind")
    if _at(fields, 11) is not None:
        _int(fields[11], "BlockStored.kv_cache_spec_sliding_window")
    return BlockStored(hashes, parent, tokens, block_size, tier, lora, extra, group, kind)


def _removed(fields: Sequence[Any]) -> BlockRemoved:
    if len(fields) < 2:
        raise KVEventError(f"BlockRemoved: need at least 2 fields, got {len(fields)}")
    hashes = tuple(_hash(h, "BlockRemoved.block_hashes") for h in _list(fields[1], "BlockRemoved.block_hashes"))
    tier = "" if _at(fields, 2) is None else _text(fields[2], "BlockRemoved.medium")
    return BlockRemoved(hashes, tier, _group(_at(fields, 3), "BlockRemoved.group_idx"))


def _event(raw: object) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KVEventError(f"map-encoded event: its 'type' tag is {type(tag).__name__}, not a string")
        order = _STORED_FIELDS if tag == BLOCK_STORED else _REMOVED_FIELDS if tag == BLOCK_REMOVED else ()
        raw = [tag, *(raw.get(name) for name in order)]
    if not isinstance(raw, list):
        raise KVEventError(f"event is neither an array nor a map: {type(raw).__name__}")
    if not raw:
        raise KVEventError("malformed tagged union: no tag")
    tag = raw[0]
    if not isinstance(tag, str):
        raise KVEventError(f"event tag is not a string: {type(tag).__name__}")
    if tag == BLOCK_STORED:
        return _stored(raw)
    if tag == BLOCK_REMOVED:
        return _removed(raw)
    if tag == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    raise KVEventError(f"unknown vLLM event tag: {tag[:64]!r}")


def decode_batch(payload: bytes) -> list[KVEvent]:
    """A msgpack ``EventBatch``'s events; KVEventError for anything not in vLLM's shape (the
    whole batch then, as the reference drops it)."""
    import msgpack  # the picker extra's: imported only by a config with a precise prefix cache

    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False,
                                max_array_len=MAX_HASHES, max_map_len=64, max_str_len=1 << 16,
                                max_bin_len=1 << 10, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise KVEventError(f"failed to decode vLLM event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2:
        raise KVEventError("failed to decode vLLM event batch: not an array [ts, events, ...]")
    if isinstance(batch[0], bool) or not isinstance(batch[0], int | float):
        raise KVEventError(f"event batch timestamp is {type(batch[0]).__name__}, not a number")
    events = _list(batch[1], "event batch events")
    if len(events) > MAX_EVENTS:
        raise KVEventError(f"{len(events)} events in one batch (at most {MAX_EVENTS})")
    return [_event(e) for e in events]


def extras_from_keys(raw: Sequence[tuple[Any, ...] | None]) -> list[BlockExtras]:
    """Per engine block, the string identifiers of its ``extra_keys`` (``ParseRawExtraKeys``): a
    bare string (vLLM >= 0.18) or the string of a legacy ``[hash, offset]`` pair; others skipped."""
    out: list[BlockExtras] = []
    for keys in raw:
        found = [k if isinstance(k, str) else k[0] for k in keys or ()
                 if isinstance(k, str) or (isinstance(k, list) and k and isinstance(k[0], str))]
        out.append(tuple(found) or None)
    return out


def realign_extras(extras: list[BlockExtras], count: int) -> list[BlockExtras] | None:
    """Engine-block extras at the index's block granularity (``realignExtraFeatures``): replicated
    when engine blocks are larger, merged when smaller."""
    if count == 0:
        return None
    if not extras or len(extras) == count:
        return extras
    if len(extras) < count:
        return [extras[i * len(extras) // count] for i in range(count)]
    merged: list[list[str] | None] = [None] * count
    for i, extra in enumerate(extras):
        if extra:
            target = merged[i * count // len(extras)]
            if target is None:
                merged[i * count // len(extras)] = list(extra)
            else:
                target.extend(extra)
    return [tuple(m) if m else None for m in merged]


class KVEventIndexer:
    """Applies decoded events from one endpoint to the index (the reference pool's
    ``processEventBatch``); counts what it skipped."""

    def __init__(self, index: KVBlockIndex, processor: TokenProcessor) -> None:
        self.index, self.processor = index, processor
        self._groups: dict[tuple[str, int], str] = {}
        self.skipped = 0

    def forget(self, pod: str) -> None:
        """Drop everything of ``pod`` (it left the pool, or cleared its cache)."""
        self.index.clear(pod)
        for key in [k for k in self._groups if k[0] == pod]:
            del self._groups[key]

    def apply(self, pod: str, model: str, event: KVEvent) -> None:
        """Apply ``event`` of ``pod`` (whose topic named ``model``) at once."""
        for _ in self.steps(pod, model, event):
            pass

    def steps(self, pod: str, model: str, event: KVEvent) -> Iterator[None]:
        """Apply ``event``, yielding between slices of :data:`BLOCKS_PER_STEP` blocks hashed (a
        shell lets other tasks run at each yield: a long event does not stall the picks)."""
        if isinstance(event, BlockStored):
            yield from self._stored(pod, model, event)
        elif isinstance(event, BlockRemoved):
            self._removed(pod, event)
        else:
            self.forget(pod)

    def _entry(self, pod: str, tier: str, group: int | None) -> PodEntry:
        return PodEntry(pod, (tier or DEFAULT_TIER).lower(), group=-1 if group is None else group)

    def _stored(self, pod: str, model: str, event: BlockStored) -> Iterator[None]:
        kind = event.kind
        if event.group is not None:
            key = (pod, event.group)
            if not kind:
                kind = self._groups.get(key, "")
            elif key in self._groups or sum(1 for k in self._groups if k[0] == pod) < MAX_GROUPS:
                self._groups[key] = kind
            dense = (event.block_size > 0 and len(event.tokens) % event.block_size == 0
                     and len(event.tokens) // event.block_size == len(event.block_hashes))
            if kind not in INDEXABLE_KINDS or (event.tokens and not dense):
                self.skipped += 1
                return
        entry = self._entry(pod, event.tier, event.group)
        parent = 0
        if event.parent_hash:
            found = self.index.request_key(event.parent_hash)
            if found is None:  # its parent is not indexed: the chain cannot be rebuilt
                self.skipped += 1
                return
            parent = found
        extras = None
        if event.extra_keys is not None:
            extras = realign_extras(extras_from_keys(event.extra_keys), len(event.tokens) // self.processor.block_size)
        size = self.processor.block_size
        count = len(event.tokens) // size
        if extras is not None and len(extras) != count:  # extra_keys of no block (an empty list): the reference's error
            self.skipped += 1
            return
        request_keys: list[int] = []
        for first in range(0, count, BLOCKS_PER_STEP):
            last = min(first + BLOCKS_PER_STEP, count)
            request_keys += self.processor.block_keys(event.tokens[first * size : last * size],
                                                      event.lora_name or model,
                                                      extras[first:last] if extras is not None else None,
                                                      request_keys[-1] if request_keys else parent)
            if last < count:
                yield
        if request_keys:
            self.index.add(event.block_hashes, request_keys, (entry,))
            return
        if event.tokens or not event.block_hashes:
            return
        # A location-only store (an offload to another tier): the blocks' request keys, found by hash.
        resolved = dict.fromkeys(k for k in (self.index.request_key(h) for h in event.block_hashes) if k is not None)
        self.index.add(None, list(resolved), (entry,))

    def _removed(self, pod: str, event: BlockRemoved) -> None:
        if event.group is not None and self._groups.get((pod, event.group), "") not in INDEXABLE_KINDS:
            self.skipped += 1
            return
        entry = (self._entry(pod, event.tier, event.group),)
        for engine_key in event.block_hashes:
            self.index.evict_engine_key(engine_key, entry)
