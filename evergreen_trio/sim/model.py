"""The sans-IO performance model of one vLLM-like server: batch, KV blocks, prefix cache, LoRA slots.

No I/O and no clock of its own: the caller passes ``now`` (seconds) into every call and
sleeps for the durations it gets back, so tests drive it with a fake clock.

A step works like vLLM's scheduler loop: admit waiting requests in arrival order while a
batch slot, KV blocks, the prefill token budget and a LoRA slot allow; the step lasts the
prefill of their uncached tokens, plus any adapter loads, plus one decode step whose cost
grows with the batch; at its end every running request has one more output token.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimRequestError

_WORDS = (
    " the", " a", " model", " token", " cache", " block", " trio", " nursery", " route", " prompt",
    " fast", " green", " tree", " river", " light", " stone", " cloud", " quiet", " bright", " server",
)


def count_tokens(text: str, config: SimConfig) -> int:
    """Tokens of ``text`` under the simulated tokenizer (at least one)."""
    return max(1, math.ceil(len(text) / config.chars_per_token))


def block_hashes(prompt: str, salt: str, config: SimConfig) -> list[int]:
    """Chained hashes of the prompt's full KV blocks, seeded with the model or adapter name.

    The block holding the last prompt token never counts: vLLM always computes at least
    one token, so a fully cached prompt still has one token to prefill. A lone surrogate
    (JSON's ``"\\ud800"``) is hashed as its code unit, as the render endpoints do.
    """
    full_blocks = (count_tokens(prompt, config) - 1) // config.block_size
    previous = xxhash.xxh64_intdigest(salt.encode())
    hashes = []
    for index in range(full_blocks):
        chunk = prompt[index * config.block_chars : (index + 1) * config.block_chars]
        previous = xxhash.xxh64_intdigest(chunk.encode("utf-8", "surrogatepass"), seed=previous)
        hashes.append(previous)
    return hashes


def reply_words(prompt: str, seed: int, count: int) -> list[str]:
    """A deterministic reply for (seed, prompt): ``count`` short words, one per token. Any ``str`` is a
    prompt: a lone surrogate is hashed as its code unit."""
    data = prompt.encode("utf-8", "surrogatepass")
    rng = random.Random(xxhash.xxh64_intdigest(data, seed=seed & 0xFFFF_FFFF_FFFF_FFFF))
    return [rng.choice(_WORDS) for _ in range(count)]


class BlockManager:
    """KV blocks with a block-hash prefix cache.

    Prompt blocks are named by their hash and shared by every running request with that
    prefix; when the last user lets go they stay cached, evictable in LRU order, until the
    space is needed. Blocks past the cached prompt prefix (the tail and the output) are
    anonymous.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._anonymous = 0

    @property
    def used(self) -> int:
        """Blocks held by running requests."""
        return len(self._refs) + self._anonymous

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix that no running request uses."""
        return len(self._evictable)

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are in the cache (in use or evictable)."""
        matched = 0
        for block in hashes:
            if block not in self._refs and block not in self._evictable:
                break
            matched += 1
        return matched

    def fits(self, hashes: Sequence[int], anonymous: int) -> bool:
        """Whether these blocks can be held now, evicting cached ones as needed."""
        fresh = sum(1 for block in set(hashes) if block not in self._refs)
        return self.used + fresh + anonymous <= self.num_blocks

    def acquire(self, hashes: Sequence[int], anonymous: int) -> None:
        """Hold the named blocks and ``anonymous`` more; call only after ``fits`` said yes."""
        for block in hashes:
            if block in self._refs:
                self._refs[block] += 1
                continue
            if block in self._evictable:
                del self._evictable[block]
            else:
                self._make_room(1)
            self._refs[block] = 1
        self._make_room(anonymous)
        self._anonymous += anonymous

    def release(self, hashes: Sequence[int], anonymous: int) -> None:
        """Let go of blocks taken by ``acquire``; a prefix's tail becomes evictable before its head."""
        self._anonymous -= anonymous
        for block in reversed(hashes):
            count = self._refs[block] - 1
            if count:
                self._refs[block] = count
            else:
                del self._refs[block]
                self._evictable[block] = None

    def _make_room(self, blocks: int) -> None:
        while self.used + len(self._evictable) + blocks > self.num_blocks and self._evictable:
            self._evictable.popitem(last=False)


@dataclass(frozen=True)
class SimRequest:
    """What the HTTP layer hands the model: a prompt and how many tokens to produce."""

    request_id: str
    prompt: str
    max_tokens: int
    lora: str | None = None


@dataclass(frozen=True)
class Usage:
    """Token counts, as the OpenAI ``usage`` object reports them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Timings:
    """When a finished request arrived, was scheduled, got its first token and finished (model seconds)."""

    arrival: float
    scheduled: float
    first_token: float
    finished: float


@dataclass(frozen=True)
class Emission:
    """One output token of one request, produced at the end of a step.

    ``usage`` and ``timings`` are set on the last token only; ``first`` on the first.
    """

    request_id: str
    index: int
    text: str
    first: bool
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Stats:
    """The gauges a metrics scrape reads."""

    waiting: int
    running: int
    kv_usage: float
    running_loras: tuple[str, ...]
    waiting_loras: tuple[str, ...]


@dataclass
class _Sequence:
    request: SimRequest
    arrival: float
    prompt_tokens: int
    hashes: list[int]
    anonymous: int = 0
    cached_tokens: int = 0
    scheduled: float = 0.0
    first_token: float = 0.0
    words: list[str] = field(default_factory=list)
    produced: int = 0


@dataclass
class Counters:
    """Monotonic totals since start, in tokens and requests."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: int = 0
    lora_loads: int = 0


class Engine:
    """One simulated server's scheduler state; see the module docstring for the step rules."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.kv_blocks)
        self.counters = Counters()
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[str, _Sequence] = {}
        self._loaded: OrderedDict[str, None] = OrderedDict()
        self._step_members: list[str] | None = None
        self._known: set[str] = set()

    def add(self, request: SimRequest, now: float) -> int:
        """Queue a request; returns its prompt token count.

        Raises SimRequestError 400 when it can never run here (too long for the model or
        the KV cache), 503 when the waiting queue is full, 409 when the id is taken.
        """
        config = self.config
        prompt_tokens = count_tokens(request.prompt, config)
        total = prompt_tokens + request.max_tokens
        if total > config.max_model_len:
            raise SimRequestError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens; the request asks for "
                f"{total} ({prompt_tokens} in the prompt, {request.max_tokens} to generate)",
            )
        if math.ceil(total / config.block_size) > config.kv_blocks:
            raise SimRequestError(
                400, f"the request needs {math.ceil(total / config.block_size)} KV blocks, the cache has "
                f"{config.kv_blocks}",
            )
        if len(self._waiting) >= config.max_waiting:
            raise SimRequestError(
                503, f"waiting queue is full ({config.max_waiting} requests)", error_type="ServiceUnavailableError"
            )
        if request.request_id in self._known:
            raise SimRequestError(409, f"request id {request.request_id!r} is already in use")
        salt = request.lora or config.model
        self._known.add(request.request_id)
        self._waiting.append(
            _Sequence(request, now, prompt_tokens, block_hashes(request.prompt, salt, config))
        )
        return prompt_tokens

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (the client went away); its blocks are released."""
        if request_id not in self._known:
            return False
        self._known.discard(request_id)
        sequence = self._running.pop(request_id, None)
        if sequence is not None:
            self.blocks.release(sequence.hashes, sequence.anonymous)
            return True
        for queued in self._waiting:
            if queued.request.request_id == request_id:
                self._waiting.remove(queued)
                break
        return True

    @property
    def busy(self) -> bool:
        """Whether a step would do anything."""
        return bool(self._running or self._waiting)

    def start_step(self, now: float) -> float | None:
        """Admit what fits and return how long this step takes (scaled seconds), or None when idle."""
        if self._step_members is not None:
            raise RuntimeError("start_step called twice without finish_step")
        prefill_tokens, loads = self._admit(now)
        if not self._running:
            return None
        self._step_members = list(self._running)
        config = self.config
        decode_ms = config.decode_ms_per_token * (1 + config.decode_batch_factor * (len(self._running) - 1))
        seconds = prefill_tokens * config.prefill_us_per_token / 1e6 + (loads * config.lora_load_ms + decode_ms) / 1e3
        return seconds * config.time_scale

    def finish_step(self, now: float) -> list[Emission]:
        """End the step begun by ``start_step``: one token for each request still running."""
        members, self._step_members = self._step_members, None
        if members is None:
            raise RuntimeError("finish_step called without start_step")
        emissions = []
        for request_id in members:
            sequence = self._running.get(request_id)
            if sequence is not None:
                emissions.append(self._emit(sequence, now))
        return emissions

    def stats(self) -> Stats:
        """The current gauges."""
        running = sorted({s.request.lora for s in self._running.values() if s.request.lora})
        waiting = sorted({s.request.lora for s in self._waiting if s.request.lora})
        return Stats(
            waiting=len(self._waiting),
            running=len(self._running),
            kv_usage=self.blocks.used / self.blocks.num_blocks,
            running_loras=tuple(running),
            waiting_loras=tuple(waiting),
        )

    def _admit(self, now: float) -> tuple[int, int]:
        config = self.config
        budget = config.max_batched_tokens
        prefill_tokens = 0
        loads = 0
        active_loras = {s.request.lora for s in self._running.values() if s.request.lora}
        for sequence in list(self._waiting):
            if len(self._running) >= config.max_batch:
                break
            lora = sequence.request.lora
            if lora and lora not in active_loras and len(active_loras) >= config.max_loras:
                continue  # LoRA-blocked requests wait; later ones with a running adapter may pass
            cached_blocks = self.blocks.cached_prefix(sequence.hashes)
            uncached = sequence.prompt_tokens - cached_blocks * config.block_size
            if prefill_tokens and prefill_tokens + uncached > budget:
                break
            total_blocks = math.ceil((sequence.prompt_tokens + sequence.request.max_tokens) / config.block_size)
            anonymous = total_blocks - len(sequence.hashes)
            if not self.blocks.fits(sequence.hashes, anonymous):
                break  # first come, first served: a request that does not fit holds the line
            self.blocks.acquire(sequence.hashes, anonymous)
            self._waiting.remove(sequence)
            sequence.anonymous = anonymous
            sequence.cached_tokens = cached_blocks * config.block_size
            sequence.scheduled = now
            sequence.words = reply_words(sequence.request.prompt, config.seed, sequence.request.max_tokens)
            self._running[sequence.request.request_id] = sequence
            prefill_tokens += uncached
            counters = self.counters
            counters.prefix_queries += sequence.prompt_tokens
            counters.prefix_hits += sequence.cached_tokens
            counters.prompt_tokens += sequence.prompt_tokens
            if lora:
                active_loras.add(lora)
                if lora in self._loaded:
                    self._loaded.move_to_end(lora)
                else:
                    loads += 1
                    counters.lora_loads += 1
                    self._loaded[lora] = None
                    self._evict_adapters(active_loras)
        return prefill_tokens, loads

    def _evict_adapters(self, active: set[str]) -> None:
        for adapter in list(self._loaded):
            if len(self._loaded) <= self.config.max_loras:
                return
            if adapter not in active:
                del self._loaded[adapter]

    def _emit(self, sequence: _Sequence, now: float) -> Emission:
        index = sequence.produced
        sequence.produced += 1
        self.counters.generation_tokens += 1
        first = index == 0
        if first:
            sequence.first_token = now
        request = sequence.request
        if sequence.produced < request.max_tokens:
            return Emission(request.request_id, index, sequence.words[index], first)
        del self._running[request.request_id]
        self._known.discard(request.request_id)
        self.blocks.release(sequence.hashes, sequence.anonymous)
        self.counters.finished += 1
        usage = Usage(sequence.prompt_tokens, sequence.produced, sequence.cached_tokens)
        timings = Timings(sequence.arrival, sequence.scheduled, sequence.first_token, now)
        return Emission(request.request_id, index, sequence.words[index], first, usage, timings)
