"""llm-d-router's prefix block hashes (``requestcontrol/dataproducer/prefixhash``), sans-IO.

A request's tokens (its token producer's: the ``estimate`` backend's byte packing unless a
``token-producer`` is declared) are cut per prompt into blocks of ``block_tokens`` tokens, the
shorter tail block too. A block's id is the xxhash64 of its token ids as little-endian uint32s;
its hash is the xxhash64 of the id and then the previous hash (8 bytes each, little endian), and
the chain starts from the xxhash64 of the target model followed by the request's ``cache_salt``.
So a hash names the prompt's whole prefix up to its block, a model or a salt of its own shares no
hash with another, and each prompt of a multi-prompt request starts a chain of its own (the estimate
backend packs a completions batch past its ``MAX_PROMPTS`` as one). At most ``max_blocks`` blocks
are hashed per prompt.
"""

from __future__ import annotations

import struct
from itertools import pairwise

import xxhash

from evergreen_trio.picker.parsers.gojson import text as go_text
from evergreen_trio.picker.token_estimate import Placeholders, PromptTokens, TokenizedPrompt
from evergreen_trio.picker.token_ids import BYTES_PER_TOKEN

_PAIR = struct.Struct("<QQ")
_hash = xxhash.xxh64_intdigest


class BlockHashes(tuple[int, ...]):
    """A multi-prompt request's block hashes: its prompts' chains one after another, ``starts``
    where each chain after the first begins (a one-prompt request's are a plain tuple)."""

    starts: tuple[int, ...] = ()

    def chains(self) -> list[tuple[int, int]]:
        """Each prompt's chain as (start, end) offsets."""
        bounds = (0, *self.starts, len(self))
        return list(pairwise(bounds))


def token_bytes(prompt: PromptTokens, limit: int) -> bytes:
    """The prompt's first ``limit`` token ids, each as 4 little-endian bytes (placeholder runs
    written out only as far as the limit)."""
    budget = limit * BYTES_PER_TOKEN
    parts: list[bytes] = []
    for segment in prompt.segments:
        if budget <= 0:
            break
        if isinstance(segment, Placeholders):
            part = segment.token.to_bytes(4, "little") * min(segment.count, budget // BYTES_PER_TOKEN)
        else:
            part = segment[:budget]
        parts.append(part)
        budget -= len(part)
    return b"".join(parts)


def chain_hashes(seed: int, data: bytes, block_bytes: int) -> list[int]:
    """The hash chain over ``data`` cut into ``block_bytes`` blocks (the tail block too)."""
    hashes = []
    previous = seed
    for start in range(0, len(data), block_bytes):
        previous = _hash(_PAIR.pack(_hash(data[start : start + block_bytes]), previous))
        hashes.append(previous)
    return hashes


def block_hashes(model: str, tokens: TokenizedPrompt | None, block_tokens: int,
                 max_blocks: int | None) -> tuple[int, ...]:
    """The request's block hashes for its target ``model`` (None ``max_blocks``: every block);
    none without tokens or with a block size or cap below 1, as the reference's ``GetBlockHashes``.
    A request of several prompts gets :class:`BlockHashes` (its chains marked), one a plain tuple."""
    if tokens is None or block_tokens <= 0 or (max_blocks is not None and max_blocks <= 0):
        return ()
    seed_text = model + tokens.cache_salt  # Go writes the model's bytes, then the salt's
    seed = _hash(seed_text.encode() if seed_text.isascii() else go_text(seed_text).encode())
    block_bytes = block_tokens * BYTES_PER_TOKEN
    if len(tokens.prompts) == 1:  # the common case: one chain
        prompt = tokens.prompts[0]
        segments = prompt.segments
        if len(segments) == 1 and isinstance(segments[0], bytes):  # text only
            data = segments[0] if max_blocks is None else segments[0][: max_blocks * block_bytes]
        else:
            data = token_bytes(prompt, prompt.token_count if max_blocks is None else max_blocks * block_tokens)
        return tuple(chain_hashes(seed, data, block_bytes))
    hashes: list[int] = []
    starts: list[int] = []
    for prompt in tokens.prompts:
        limit = prompt.token_count if max_blocks is None else max_blocks * block_tokens
        chain = chain_hashes(seed, token_bytes(prompt, limit), block_bytes)
        if chain:
            if hashes:
                starts.append(len(hashes))
            hashes += chain
    if not starts:
        return tuple(hashes)
    result = BlockHashes(hashes)
    result.starts = tuple(starts)
    return result
