"""The sans-IO engine, driven by a fake clock: queueing, prefix cache, LoRA slots, KV accounting."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimRequestError
from evergreen_trio.sim.model import BlockManager, Emission, Engine, SimRequest, block_hashes, reply_words

PREFIX = "You are a helpful assistant. " * 40  # 1160 chars = 290 tokens


class Clock:
    """Drives an engine step by step with model time, never sleeping."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.now = 0.0

    def step(self) -> tuple[float | None, list[Emission]]:
        duration = self.engine.start_step(self.now)
        if duration is None:
            return None, []
        self.now += duration
        return duration, self.engine.finish_step(self.now)

    def drain(self) -> list[Emission]:
        out: list[Emission] = []
        while True:
            duration, emissions = self.step()
            if duration is None:
                return out
            out += emissions


def request(rid: str, prompt: str = "hello", max_tokens: int = 4, lora: str | None = None) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens, lora)


def test_every_request_gets_exactly_max_tokens_then_usage() -> None:
    engine = Engine(SimConfig())
    clock = Clock(engine)
    engine.add(request("a", max_tokens=3), 0.0)
    engine.add(request("b", max_tokens=5), 0.0)
    emissions = clock.drain()
    for rid, count in (("a", 3), ("b", 5)):
        mine = [e for e in emissions if e.request_id == rid]
        assert [e.index for e in mine] == list(range(count))
        assert mine[0].first and not any(e.first for e in mine[1:])
        assert all(e.usage is None for e in mine[:-1])
        assert mine[-1].usage is not None and mine[-1].usage.completion_tokens == count
    assert engine.blocks.used == 0 and not engine.busy


def test_queueing_when_the_batch_is_full() -> None:
    engine = Engine(SimConfig(max_batch=2))
    for rid in "abc":
        engine.add(request(rid), 0.0)
    engine.start_step(0.0)
    assert (engine.stats().running, engine.stats().waiting) == (2, 1)
    emissions = engine.finish_step(1.0)
    assert {e.request_id for e in emissions} == {"a", "b"}


def test_queueing_when_the_kv_cache_is_full() -> None:
    config = SimConfig(kv_blocks=10, max_model_len=160, default_max_tokens=8)
    engine = Engine(config)
    engine.add(request("a", "x" * 4 * 100, max_tokens=20), 0.0)  # 120 tokens = 8 blocks
    engine.add(request("b", "y" * 4 * 40, max_tokens=8), 0.0)  # 48 tokens = 3 blocks
    engine.start_step(0.0)
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (1, 1)
    assert stats.kv_usage == pytest.approx(0.8)
    clock = Clock(engine)
    clock.now = 1.0
    engine.finish_step(clock.now)
    finished = [e.request_id for e in clock.drain() if e.usage is not None]
    assert finished == ["a", "b"]


def test_a_cached_prefix_skips_its_prefill() -> None:
    config = SimConfig(prefill_us_per_token=1000.0, decode_ms_per_token=1.0)
    engine = Engine(config)
    clock = Clock(engine)
    engine.add(request("cold", PREFIX + "first question"), 0.0)
    cold, _ = clock.step()
    clock.drain()
    engine.add(request("warm", PREFIX + "second question"), clock.now)
    warm, _ = clock.step()
    last = next(e for e in clock.drain() if e.usage is not None)
    assert cold is not None and warm is not None
    cached_blocks = len(PREFIX) // config.block_chars
    assert last.usage is not None and last.usage.cached_tokens == cached_blocks * config.block_size
    saved = cached_blocks * config.block_size * config.prefill_us_per_token / 1e6
    assert cold - warm == pytest.approx(saved, rel=0.02)
    assert engine.counters.prefix_hits == last.usage.cached_tokens


def test_the_prefix_cache_is_per_model_and_adapter() -> None:
    engine = Engine(SimConfig(lora_adapters=("x",)))
    clock = Clock(engine)
    engine.add(request("base", PREFIX), 0.0)
    clock.drain()
    engine.add(request("lora", PREFIX, lora="x"), clock.now)
    (done,) = [e for e in clock.drain() if e.usage is not None]
    assert done.usage is not None and done.usage.cached_tokens == 0


def test_a_fully_cached_prompt_still_prefills_one_token() -> None:
    config = SimConfig()
    prompt = "z" * config.block_chars * 3
    assert len(block_hashes(prompt, "m", config)) == 2


def test_lora_adapters_beyond_max_loras_wait_and_later_requests_pass() -> None:
    engine = Engine(SimConfig(lora_adapters=("a", "b", "c"), max_loras=2, lora_load_ms=100.0, decode_ms_per_token=1.0))
    engine.add(request("1", lora="a"), 0.0)
    engine.add(request("2", lora="b"), 0.0)
    engine.add(request("3", lora="c"), 0.0)
    engine.add(request("4", lora="a"), 0.0)
    duration = engine.start_step(0.0)
    stats = engine.stats()
    assert stats.running_loras == ("a", "b") and stats.waiting_loras == ("c",)
    assert stats.running == 3  # request 4 shares the running adapter a
    assert duration is not None and duration >= 0.2  # two adapter loads
    assert engine.counters.lora_loads == 2


def test_a_loaded_adapter_costs_no_load_the_second_time() -> None:
    engine = Engine(SimConfig(lora_adapters=("a",), lora_load_ms=100.0, decode_ms_per_token=1.0))
    clock = Clock(engine)
    engine.add(request("1", lora="a", max_tokens=1), 0.0)
    first, _ = clock.step()
    engine.add(request("2", lora="a", max_tokens=1), clock.now)
    second, _ = clock.step()
    assert first is not None and second is not None and first - second == pytest.approx(0.1)


def test_decode_slows_with_the_batch() -> None:
    config = SimConfig(decode_ms_per_token=10.0, decode_batch_factor=0.5, prefill_us_per_token=0.0)
    alone, crowded = Engine(config), Engine(config)
    alone.add(request("a"), 0.0)
    for rid in "abcde":
        crowded.add(request(rid), 0.0)
    assert alone.start_step(0.0) == pytest.approx(0.010)
    assert crowded.start_step(0.0) == pytest.approx(0.010 * (1 + 0.5 * 4))


def test_time_scale_multiplies_durations() -> None:
    slow = Engine(SimConfig(time_scale=10.0))
    fast = Engine(SimConfig())
    slow.add(request("a"), 0.0)
    fast.add(request("a"), 0.0)
    assert slow.start_step(0.0) == pytest.approx(10 * (fast.start_step(0.0) or 0.0))


def test_abort_releases_blocks_everywhere() -> None:
    engine = Engine(SimConfig(max_batch=1))
    engine.add(request("run"), 0.0)
    engine.add(request("wait"), 0.0)
    engine.start_step(0.0)
    assert engine.abort("run") and engine.abort("wait")
    assert not engine.abort("never")
    assert engine.finish_step(1.0) == []
    assert engine.blocks.used == 0 and not engine.busy


def test_limits_are_enforced() -> None:
    engine = Engine(SimConfig(max_model_len=100, max_waiting=1, kv_blocks=4, default_max_tokens=4))
    with pytest.raises(SimRequestError, match="maximum context length is 100") as too_long:
        engine.add(request("a", "x" * 400, max_tokens=10), 0.0)
    assert too_long.value.status == 400
    with pytest.raises(SimRequestError, match="needs 5 KV blocks") as too_big:
        engine.add(request("b", "x" * 4 * 70, max_tokens=10), 0.0)
    assert too_big.value.status == 400
    engine.add(request("c"), 0.0)
    with pytest.raises(SimRequestError, match="waiting queue is full") as full:
        engine.add(request("d"), 0.0)
    assert full.value.status == 503
    fresh = Engine(SimConfig())
    fresh.add(request("c"), 0.0)
    with pytest.raises(SimRequestError, match="already in use") as taken:
        fresh.add(request("c"), 0.0)
    assert taken.value.status == 409


def test_reply_text_is_deterministic_for_a_seed() -> None:
    assert reply_words("p", 1, 8) == reply_words("p", 1, 8)
    assert reply_words("p", 1, 8) != reply_words("p", 2, 8)


def test_step_calls_must_alternate() -> None:
    engine = Engine(SimConfig())
    with pytest.raises(RuntimeError):
        engine.finish_step(0.0)
    engine.add(request("a"), 0.0)
    engine.start_step(0.0)
    with pytest.raises(RuntimeError):
        engine.start_step(0.0)


workloads = st.lists(
    st.tuples(
        st.sampled_from(["", PREFIX[:300], PREFIX]),
        st.text(alphabet="abc ", max_size=200),
        st.integers(1, 12),
        st.sampled_from([None, "a", "b", "c"]),
        st.integers(0, 3),  # steps to run before the next arrival
        st.booleans(),  # abort this request right after the steps
    ),
    max_size=30,
)


@given(workloads, st.integers(1, 6), st.integers(24, 200), st.integers(1, 2))
def test_invariants_hold_for_any_workload(
    workload: list[tuple[str, str, int, str | None, int, bool]], max_batch: int, kv_blocks: int, max_loras: int
) -> None:
    """Batch, KV and LoRA limits are never exceeded; every request not aborted finishes with its tokens."""
    config = SimConfig(
        max_batch=max_batch, kv_blocks=kv_blocks, max_loras=max_loras, lora_adapters=("a", "b", "c"),
        max_model_len=16 * kv_blocks, default_max_tokens=8,
    )
    engine = Engine(config)
    clock = Clock(engine)
    expected: dict[str, int] = {}
    produced: dict[str, int] = {}

    def check_step() -> None:
        _, emissions = clock.step()
        stats = engine.stats()
        assert stats.running <= max_batch
        assert engine.blocks.used + engine.blocks.cached <= kv_blocks
        assert len(stats.running_loras) <= max_loras
        for emission in emissions:
            assert emission.index == produced.get(emission.request_id, 0)
            produced[emission.request_id] = emission.index + 1

    for index, (prefix, suffix, max_tokens, lora, steps, abort) in enumerate(workload):
        rid = str(index)
        prompt = prefix + suffix
        if math.ceil((len(prompt) / 4 + max_tokens) / 16) + 1 > kv_blocks:
            continue
        engine.add(request(rid, prompt, max_tokens, lora), clock.now)
        expected[rid] = max_tokens
        for _ in range(steps):
            check_step()
        if abort:
            engine.abort(rid)
            expected.pop(rid)
    for _ in range(10_000):
        if not engine.busy:
            break
        check_step()
    assert {rid: produced[rid] for rid in expected} == expected
    assert engine.blocks.used == 0


@given(st.lists(st.lists(st.integers(0, 20), max_size=8), max_size=20), st.integers(4, 30))
def test_block_manager_never_exceeds_its_blocks(prompts: list[list[int]], num_blocks: int) -> None:
    blocks = BlockManager(num_blocks)
    held: list[tuple[list[int], int]] = []
    for hashes in prompts:
        chain = [hash(tuple(hashes[: i + 1])) for i in range(len(hashes))]
        if blocks.fits(chain, 1):
            blocks.acquire(chain, 1)
            held.append((chain, 1))
        elif held:
            blocks.release(*held.pop(0))
        assert blocks.used + blocks.cached <= num_blocks
        assert blocks.cached_prefix(chain) <= len(chain)
    for chain, anonymous in held:
        blocks.release(chain, anonymous)
    assert blocks.used == 0
