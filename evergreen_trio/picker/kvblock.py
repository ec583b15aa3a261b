"""llm-d-router's precise KV-block keys and index (``pkg/kvcache/kvblock``), sans-IO.

:class:`TokenProcessor` turns a prompt's token ids into a chain of block keys as the reference's
``chunkedTokenDatabase`` does: full blocks of ``blockSizeTokens`` only, each key hashing its
parent key, the block's tokens and the block's extra keys (multimodal identifiers, the cache
salt), the chain seeded with ``hashSeed`` and the model name. ``cbor-fnv`` (the default) is
FNV-64a over the canonical CBOR of ``[parent, tokens, extra]``; ``xxh64`` one XXH64 digest over
the parent (8 bytes LE), the tokens (4 bytes LE each) and each extra string behind its 8-byte LE
length. :class:`KVBlockIndex` is the reference's in-memory index: an LRU of request keys, each
with an LRU of the :class:`PodEntry` holding it, and an LRU from the engines' block hashes to
request keys (what ``BlockRemoved`` names). :func:`longest_prefix_scores` is its
``LongestPrefixScorer``. No I/O, no Trio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import fnv_c
import xxhash

from evergreen_trio.picker.token_estimate import MultiModalFeature
from evergreen_trio.picker.token_ids import little_endian_uint32

DEFAULT_BLOCK_SIZE = 16
HASH_CBOR_FNV, HASH_XXH64 = "cbor-fnv", "xxh64"
HASH_ALGORITHMS = (HASH_CBOR_FNV, HASH_XXH64)
DEFAULT_INDEX_SIZE = 1_000_000
"""Request keys the in-memory index holds by default (the reference's 10^8 would be tens of GB here)."""
DEFAULT_PODS_PER_KEY = 10
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8}
MEMO_BLOCKS = 1 << 14
"""Block hashes a token processor remembers (shared prompt prefixes are hashed once, not per request)."""
SPECULATIVE_TIER = "speculative"
"""The tier speculative entries count under in a match's per-tier breakdown (attrprefix.SpeculativeTierKey)."""

_CBOR_NULL = b"\xf6"
_CBOR_HASH_KEY = b"\x64Hash"  # the text "Hash": a Go MMHash struct's one field, as CBOR map key

# Per block: the extra keys (MM identifiers, the cache salt) that taint its hash; None: none.
BlockExtras = tuple[str, ...] | None


fnv64a: Callable[[bytes], int] = fnv_c.fnv1a_64
"""FNV-1a 64 of ``data``, in C (fnv-c): a prompt's blocks are hashed on the event loop, and the
per-byte Python loop cost 1.3 of 2.1 ms a novel 4,096-token prompt."""


def _cbor_head(major: int, value: int) -> bytes:
    """A canonical (shortest) CBOR head: major type ``major`` with argument ``value``."""
    top = major << 5
    if value < 24:
        return bytes((top | value,))
    for code, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes((top | code,)) + value.to_bytes(size, "big")
    raise ValueError(f"CBOR argument too large: {value}")


def _cbor_text(text: str) -> bytes:
    data = text.encode()
    return _cbor_head(3, len(data)) + data


@lru_cache(maxsize=1 << 16)
def _cbor_token(token: int) -> bytes:
    """One uint32 token id's canonical CBOR (remembered: a prompt's tokens are mostly a vocabulary's
    common ones, and a block's encoding is then one C join of remembered pieces)."""
    if token < 24:
        return bytes((token,))
    if token < 256:
        return bytes((24, token))
    if token < 65536:
        return bytes((25, token >> 8, token & 255))
    return b"\x1a" + token.to_bytes(4, "big")


def _cbor_tokens(tokens: Sequence[int]) -> bytes:
    """An array of uint32 token ids."""
    return _cbor_head(4, len(tokens)) + b"".join(map(_cbor_token, tokens))


def _cbor_extras(extras: BlockExtras) -> bytes:
    """A Go ``[]MMHash`` as fxamacker/cbor's canonical mode writes it: null when nil, else an array
    of one-field maps ``{"Hash": s}``."""
    if not extras:
        return _CBOR_NULL
    return _cbor_head(4, len(extras)) + b"".join(b"\xa1" + _CBOR_HASH_KEY + _cbor_text(e) for e in extras)


@dataclass(frozen=True)
class TokenProcessorConfig:
    """``tokenProcessorConfig``: block size in tokens, the hash seed, the hash algorithm."""

    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = ""
    hash_algorithm: str = HASH_CBOR_FNV


class TokenProcessor:
    """Token ids -> block keys, as the reference's ``TokensToKVBlockKeys``."""

    def __init__(self, config: TokenProcessorConfig) -> None:
        if config.block_size_tokens <= 0:
            raise ValueError(f"blockSizeTokens must be greater than 0, got {config.block_size_tokens}")
        if config.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"unsupported hashAlgorithm {config.hash_algorithm!r}: accepted values are "
                             f"{HASH_CBOR_FNV!r} and {HASH_XXH64!r}")
        self.block_size = config.block_size_tokens
        self._xxh64 = config.hash_algorithm == HASH_XXH64
        seed = config.hash_seed.encode()
        self._init_hash = xxhash.xxh64_intdigest(seed) if self._xxh64 else fnv64a(seed)
        self._model_hashes: dict[str, int] = {}
        self._memo: dict[tuple[int, tuple[int, ...], BlockExtras], int] = {}

    def _hash(self, parent: int, tokens: Sequence[int] | None, extras: BlockExtras) -> int:
        if self._xxh64:
            parts = [parent.to_bytes(8, "little"), little_endian_uint32(tokens or ())]
            for extra in extras or ():
                data = extra.encode()
                parts += (len(data).to_bytes(8, "little"), data)
            return xxhash.xxh64_intdigest(b"".join(parts))
        tokens_cbor = _CBOR_NULL if tokens is None else _cbor_tokens(tokens)
        return fnv64a(b"\x83" + _cbor_head(0, parent) + tokens_cbor + _cbor_extras(extras))

    def init_hash(self, model: str) -> int:
        """The chain's seed for ``model``: the seed hash with the model name as the extra."""
        cached = self._model_hashes.get(model)
        if cached is None:
            if self._xxh64:
                cached = self._hash(self._init_hash, None, (model,))
            else:
                cached = fnv64a(b"\x83" + _cbor_head(0, self._init_hash) + _CBOR_NULL + _cbor_text(model))
            if len(self._model_hashes) < 1024:  # model names come from requests and events: bounded
                self._model_hashes[model] = cached
        return cached

    def block_keys(self, tokens: Sequence[int], model: str, extras: Sequence[BlockExtras] | None = None,
                   parent: int = 0) -> list[int]:
        """The keys of ``tokens``' full blocks (uint32 ids: a token producer's, or an event's
        masked as it is read), chained from ``parent`` (0: the model's seed).
        ``extras``, when given, has one entry per full block (ValueError otherwise)."""
        size = self.block_size
        count = len(tokens) // size
        if count == 0:
            return []
        if extras is not None and len(extras) != count:
            raise ValueError(f"extraFeatures length {len(extras)} does not match token chunk count {count} "
                             f"(blockSizeTokens={size}, tokens={len(tokens)})")
        previous = parent or self.init_hash(model)
        keys = []
        memo = self._memo
        for i in range(count):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            extra = extras[i] if extras is not None else None
            key = (previous, chunk, extra)
            found = memo.get(key)
            if found is None:
                found = memo[key] = self._hash(previous, chunk, extra)
                if len(memo) > MEMO_BLOCKS:
                    del memo[next(iter(memo))]
            previous = found
            keys.append(previous)
        return keys


def block_extras(features: Sequence[MultiModalFeature], block_size: int, token_count: int) -> list[BlockExtras] | None:
    """Per-block multimodal identifiers (``ComputeBlockExtraFeatures``): each full block lists the
    hash of every item whose placeholders overlap it, by item start; None without features. Each
    item is added to the blocks it spans, not each block checked against every item: a render's
    4096 items over a million tokens took seconds that way."""
    items = sorted(((f.offset, f.offset + f.length, f.hash) for f in features), key=lambda item: item[0])
    if not items or block_size <= 0 or token_count <= 0:
        return None
    count = token_count // block_size
    found: list[list[str] | None] = [None] * count
    for first, last, digest in items:
        # The blocks it overlaps: first < (block + 1) * block_size and last > block * block_size.
        for block in range(max(first // block_size, 0), min((last - 1) // block_size + 1, count)):
            hashes = found[block]
            if hashes is None:
                found[block] = [digest]
            else:
                hashes.append(digest)
    return [None if hashes is None else tuple(hashes) for hashes in found]


def fold_cache_salt(extras: list[BlockExtras] | None, salt: str, block_count: int) -> list[BlockExtras] | None:
    """The cache salt appended to block 0's extras, after its multimodal hashes (vLLM puts it in
    block 0's ``extra_keys``); unchanged without a salt or a full block."""
    if not salt or block_count == 0:
        return extras
    extras = list(extras) if extras is not None else [None] * block_count
    extras[0] = (*(extras[0] or ()), salt)
    return extras


def multimodal_blocks(features: Sequence[MultiModalFeature], block_size: int) -> list[int]:
    """The sorted block indices any feature's placeholders span."""
    blocks = {i for f in features if f.length > 0
              for i in range(f.offset // block_size, (f.offset + f.length - 1) // block_size + 1)}
    return sorted(blocks)


@dataclass(frozen=True)
class PodEntry:
    """Who holds a block: the endpoint (``host:port``), its device tier, whether the entry is a
    speculative one (seeded by a routing decision, not yet confirmed by an event), and the vLLM
    KV-cache group (-1: none)."""

    pod: str
    tier: str = ""
    speculative: bool = False
    group: int = -1


def engine_to_request(engine_keys: Sequence[int], request_keys: Sequence[int]) -> dict[int, list[int]]:
    """Each engine key's request keys, distributed by the lengths' ratio (1:1, many:1 or 1:many)."""
    mapping: dict[int, list[int]] = {}
    if not engine_keys or not request_keys:
        return mapping
    n = max(len(engine_keys), len(request_keys))
    for i in range(n):
        mapping.setdefault(engine_keys[i * len(engine_keys) // n], []).append(request_keys[i * len(request_keys) // n])
    return mapping


def _touch(lru: dict[int, object], key: int) -> None:
    """Mark ``key`` most recently used (a dict keeps insertion order: re-insert it last)."""
    lru[key] = lru.pop(key)


class KVBlockIndex:
    """The reference's ``InMemoryIndex``: at most ``size`` request keys (least recently used
    evicted first), each with at most ``pods_per_key`` entries (the same), and at most ``size``
    engine keys mapped to their request keys."""

    def __init__(self, size: int = DEFAULT_INDEX_SIZE, pods_per_key: int = DEFAULT_PODS_PER_KEY) -> None:
        if size <= 0 or pods_per_key <= 0:
            raise ValueError(f"index size and podCacheSize must be > 0, got {size} and {pods_per_key}")
        self.size, self.pods_per_key = size, pods_per_key
        self._data: dict[int, dict[PodEntry, None]] = {}
        self._engine: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def lookup(self, request_keys: Sequence[int], pods: Iterable[str] = ()) -> dict[int, list[PodEntry]]:
        """Each key's entries (only those of ``pods`` when given): a missing key is skipped, a key
        with no entries ends the search (the chain breaks there)."""
        wanted = frozenset(pods)
        result: dict[int, list[PodEntry]] = {}
        data = self._data
        for key in request_keys:
            entries = data.get(key)
            if entries is None:
                continue
            if not entries:
                break
            _touch(data, key)  # type: ignore[arg-type]
            matched = [e for e in entries if not wanted or e.pod in wanted]
            if matched:
                result[key] = matched
        return result

    def add(self, engine_keys: Sequence[int] | None, request_keys: Sequence[int], entries: Sequence[PodEntry]) -> None:
        """Record ``entries`` on every request key, and (unless None: speculative entries) each
        engine key's request keys."""
        if not request_keys or not entries:
            return
        if engine_keys is not None:
            for engine_key, keys in engine_to_request(engine_keys, request_keys).items():
                self._engine.pop(engine_key, None)
                self._engine[engine_key] = keys
                if len(self._engine) > self.size:
                    del self._engine[next(iter(self._engine))]
        data = self._data
        for key in request_keys:
            holders = data.pop(key, None)
            if holders is None:
                holders = {}
            data[key] = holders
            for entry in entries:
                holders.pop(entry, None)
                holders[entry] = None
                if len(holders) > self.pods_per_key:
                    del holders[next(iter(holders))]
            if len(data) > self.size:
                del data[next(iter(data))]

    def evict_engine_key(self, engine_key: int, entries: Sequence[PodEntry]) -> None:
        """Remove ``entries`` from the request keys of ``engine_key``; the mapping goes once all are empty."""
        keys = self._engine.get(engine_key)
        if keys is None:
            return
        for key in keys:
            self.evict_request_key(key, entries)
        if not any(self._data.get(key) for key in keys):
            del self._engine[engine_key]

    def evict_request_key(self, key: int, entries: Sequence[PodEntry]) -> None:
        """Remove ``entries`` from ``key``; the key goes once it has none."""
        holders = self._data.get(key)
        if holders is None:
            return
        for entry in entries:
            holders.pop(entry, None)
        if not holders:
            del self._data[key]

    def request_key(self, engine_key: int) -> int | None:
        """The last request key ``engine_key`` maps to (a parent block's), None when unknown."""
        keys = self._engine.get(engine_key)
        return keys[-1] if keys else None

    def clear(self, pod: str) -> None:
        """Remove every entry of ``pod`` (all tiers); the engine-key mappings stay (they self-heal)."""
        for key in list(self._data):
            holders = self._data[key]
            for entry in [e for e in holders if e.pod == pod]:
                del holders[entry]
            if not holders:
                del self._data[key]


def longest_prefix_scores(keys: Sequence[int], key_pods: Mapping[int, Sequence[PodEntry]],
                          weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS) -> dict[str, float]:
    """Per pod, the summed tier weight (the best tier's per block; 1.0 for an unknown tier) of the
    leading blocks it holds without a gap (``LongestPrefixScorer``)."""
    if not keys:
        return {}

    def best(entries: Sequence[PodEntry]) -> dict[str, float]:
        out: dict[str, float] = {}
        for entry in entries:
            weight = weights.get(entry.tier, 1.0)
            if weight > out.get(entry.pod, float("-inf")):
                out[entry.pod] = weight
        return out

    scores = best(key_pods.get(keys[0], ()))
    active = set(scores)
    for key in keys[1:]:
        if not active:
            break
        current = best(key_pods.get(key, ()))
        for pod in list(active):
            if pod in current:
                scores[pod] += current[pod]
            else:
                active.discard(pod)
    return scores


def matched_blocks(keys: Sequence[int], key_pods: Mapping[int, Sequence[PodEntry]], pod: str) -> int:
    """The leading blocks ``pod`` holds in any tier, counted until its first gap."""
    count = 0
    for key in keys:
        if not any(e.pod == pod for e in key_pods.get(key, ())):
            break
        count += 1
    return count


def matched_blocks_by_tier(keys: Sequence[int], key_pods: Mapping[int, Sequence[PodEntry]],
                           pod: str) -> dict[str, int]:
    """Per tier, the leading blocks ``pod`` holds in that tier until the tier's first gap
    (speculative entries count under :data:`SPECULATIVE_TIER`)."""
    counts: dict[str, int] = {}
    alive: set[str] | None = None
    for key in keys:
        tiers = {SPECULATIVE_TIER if e.speculative else e.tier for e in key_pods.get(key, ()) if e.pod == pod}
        alive = tiers if alive is None else alive & tiers
        if not alive:
            break
        for tier in alive:
            counts[tier] = counts.get(tier, 0) + 1
    return counts
