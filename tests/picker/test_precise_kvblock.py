"""The precise prefix cache's block keys and index: llm-d-router's token_processor_test.go,
in_memory_test.go and kvblock_scorer tables, ported, with properties."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.kvblock import (
    HASH_XXH64,
    BlockExtras,
    KVBlockIndex,
    PodEntry,
    TokenProcessor,
    TokenProcessorConfig,
    _cbor_extras,
    _cbor_head,
    _cbor_tokens,
    block_extras,
    fnv64a,
    fold_cache_salt,
    longest_prefix_scores,
    matched_blocks,
    matched_blocks_by_tier,
)
from evergreen_trio.picker.token_estimate import MultiModalFeature

TOKENS = list(range(1, 513))


def _processor(size: int = 16, seed: str = "test-seed", algorithm: str = "cbor-fnv") -> TokenProcessor:
    return TokenProcessor(TokenProcessorConfig(size, seed, algorithm))


def test_fnv64a_and_canonical_cbor_vectors() -> None:
    assert fnv64a(b"") == 0xCBF29CE484222325 and fnv64a(b"a") == 0xAF63DC4C8601EC8C
    assert fnv64a(b"foobar") == 0x85944171F73967E8
    assert _cbor_head(0, 23) == b"\x17" and _cbor_head(0, 24) == b"\x18\x18" and _cbor_head(0, 256) == b"\x19\x01\x00"
    assert _cbor_head(0, 2**32) == b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"
    assert _cbor_tokens([1, 2, 1000]) == b"\x83\x01\x02\x19\x03\xe8"
    assert _cbor_extras(None) == b"\xf6" and _cbor_extras(("ab",)) == b"\x81\xa1\x64Hash\x62ab"


def test_the_first_key_is_fnv_over_the_cbor_of_parent_tokens_and_no_extra() -> None:
    processor = _processor(2, "")
    seed = fnv64a(b"")
    model = fnv64a(b"\x83" + _cbor_head(0, seed) + b"\xf6" + b"\x61m")
    assert processor.block_keys([7, 8], "m") == [fnv64a(b"\x83" + _cbor_head(0, model) + b"\x82\x07\x08\xf6")]


@pytest.mark.parametrize(("size", "tokens", "blocks"), [(8, 32, 4), (16, 32, 2), (256, 512, 2), (256, 300, 1),
                                                        (16, 8, 0), (16, 40, 2)])
@pytest.mark.parametrize("algorithm", ["cbor-fnv", HASH_XXH64])
def test_only_full_blocks_get_keys(size: int, tokens: int, blocks: int, algorithm: str) -> None:
    assert len(_processor(size, algorithm=algorithm).block_keys(TOKENS[:tokens], "test-model")) == blocks


@pytest.mark.parametrize("algorithm", ["cbor-fnv", HASH_XXH64])
def test_models_seeds_and_block_sizes_give_different_chains(algorithm: str) -> None:
    firsts = {_processor(algorithm=algorithm).block_keys(TOKENS[:16], m)[0]
              for m in ("gpt-4", "llama-2-7b", "", "a", "very-long-model-name-with-special-characters-123!@#")}
    assert len(firsts) == 5
    assert len({_processor(seed=s, algorithm=algorithm).block_keys(TOKENS[:16], "m")[0]
                for s in ("", "seed1", "seed2", "123456")}) == 4
    assert _processor(32, algorithm=algorithm).block_keys(TOKENS, "m")[0] != \
        _processor(16, algorithm=algorithm).block_keys(TOKENS, "m")[0]
    assert not set(_processor(256, algorithm=algorithm).block_keys(TOKENS, "m")) & \
        set(_processor(16, algorithm=algorithm).block_keys(TOKENS, "m"))


@pytest.mark.parametrize("algorithm", ["cbor-fnv", HASH_XXH64])
def test_extras_taint_the_chain_and_are_length_prefixed(algorithm: str) -> None:
    processor = _processor(algorithm=algorithm)
    plain = processor.block_keys(TOKENS[:32], "m")
    tainted = processor.block_keys(TOKENS[:32], "m", [("mm-hash-a",), None])
    assert plain[0] != tainted[0] and plain[1] != tainted[1]
    assert tainted[0] != processor.block_keys(TOKENS[:32], "m", [("mm-hash-b",), None])[0]
    assert processor.block_keys(TOKENS[:32], "m", [("ab", "c"), None])[0] != \
        processor.block_keys(TOKENS[:32], "m", [("abc",), None])[0]
    with pytest.raises(ValueError, match="does not match token chunk count"):
        processor.block_keys(TOKENS[:32], "m", [None])


@pytest.mark.parametrize(("size", "error"), [(0, "greater than 0, got 0"), (-5, "greater than 0, got -5")])
def test_bad_block_sizes_and_algorithms_are_refused(size: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        TokenProcessor(TokenProcessorConfig(size))
    with pytest.raises(ValueError, match="unsupported hashAlgorithm"):
        TokenProcessor(TokenProcessorConfig(16, "", "sha256"))


@given(st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=160), st.sampled_from(["cbor-fnv", HASH_XXH64]),
       st.integers(1, 9))
def test_a_chain_continues_from_any_of_its_keys(tokens: list[int], algorithm: str, cut: int) -> None:
    processor = _processor(algorithm=algorithm)
    keys = processor.block_keys(tokens, "m")
    cut = min(cut, len(keys))
    assert processor.block_keys(tokens[cut * 16 :], "m", parent=keys[cut - 1]) == keys[cut:]
    assert processor.block_keys(tokens, "m") == keys  # deterministic


def test_multimodal_extras_and_the_cache_salt() -> None:
    features = [MultiModalFeature("image", "h2", 20, 8), MultiModalFeature("image", "h1", 2, 4)]
    assert block_extras(features, 16, 40) == [("h1",), ("h2",)]
    assert block_extras([MultiModalFeature("image", "h", 10, 10)], 16, 40) == [("h",), ("h",)]
    assert fold_cache_salt(block_extras(features, 16, 40), "salt", 2) == [("h1", "salt"), ("h2",)]
    assert fold_cache_salt(None, "salt", 2) == [("salt",), None]
    assert fold_cache_salt(None, "salt", 0) is None and fold_cache_salt(None, "", 2) is None


def _extras_by_scan(features: list[MultiModalFeature], block_size: int, token_count: int) -> list[BlockExtras] | None:
    """``ComputeBlockExtraFeatures`` as the reference writes it: every block against every item."""
    items = sorted(((f.offset, f.offset + f.length, f.hash) for f in features), key=lambda item: item[0])
    if not items or block_size <= 0 or token_count <= 0:
        return None
    out: list[BlockExtras] = []
    for block in range(token_count // block_size):
        start, end = block * block_size, (block + 1) * block_size
        out.append(tuple(h for first, last, h in items if last > start and first < end) or None)
    return out


@given(st.lists(st.tuples(st.integers(-20, 80), st.integers(-10, 40)), max_size=6), st.integers(-1, 9),
       st.integers(-2, 100))
def test_multimodal_extras_are_the_references(spans: list[tuple[int, int]], block_size: int, tokens: int) -> None:
    features = [MultiModalFeature("image", f"h{i}", offset, length) for i, (offset, length) in enumerate(spans)]
    assert block_extras(features, block_size, tokens) == _extras_by_scan(features, block_size, tokens)


def test_multimodal_extras_cost_the_blocks_not_blocks_times_items() -> None:
    # A render's reply may hold 4096 items and millions of token ids: checking each block against
    # each item took 7 s of the event loop for this one request.
    features = [MultiModalFeature("image", f"h{i}", i * 16, 1) for i in range(4096)]
    started = time.perf_counter()
    extras = block_extras(features, 16, 2_000_000)
    assert time.perf_counter() - started < 1.0
    assert extras is not None and extras[4095] == ("h4095",) and extras[4096] is None


def test_the_index_is_lru_bounded_in_keys_and_pods_per_key() -> None:
    index = KVBlockIndex(size=2, pods_per_key=1)
    index.add([72735753], [79215516], [PodEntry("pod1", "gpu")])
    index.add([41341092], [12871930], [PodEntry("pod2", "gpu")])
    index.add([34012886], [69914638], [PodEntry("pod3", "cpu")])
    assert index.lookup([79215516, 12871930, 69914638]) == {12871930: [PodEntry("pod2", "gpu")],
                                                            69914638: [PodEntry("pod3", "cpu")]}
    index = KVBlockIndex(size=1, pods_per_key=2)
    index.add([28409753], [51374550], [PodEntry("pod1", "gpu"), PodEntry("pod2", "gpu"), PodEntry("pod3", "cpu")])
    assert index.lookup([51374550]) == {51374550: [PodEntry("pod2", "gpu"), PodEntry("pod3", "cpu")]}


def test_speculative_and_confirmed_entries_coexist_and_evict_apart() -> None:
    index = KVBlockIndex()
    speculative, confirmed = PodEntry("10.0.0.1:8080", speculative=True), PodEntry("10.0.0.1:8080")
    index.add(None, [22222222], [speculative])
    index.add([33333333], [22222222], [confirmed])
    assert index.lookup([22222222]) == {22222222: [speculative, confirmed]}
    index.evict_request_key(22222222, [speculative])
    assert index.lookup([22222222]) == {22222222: [confirmed]}
    index.evict_engine_key(33333333, [confirmed])
    assert index.lookup([22222222]) == {} and index.request_key(33333333) is None


def test_engine_keys_map_to_request_keys_by_ratio_and_clear_drops_one_pod() -> None:
    index = KVBlockIndex()
    index.add([1, 2, 3, 4], [10, 20], [PodEntry("a", "gpu")])  # many:1
    index.add([5], [30, 40], [PodEntry("b", "gpu")])  # 1:many
    assert [index.request_key(k) for k in (1, 2, 3, 4, 5)] == [10, 10, 20, 20, 40]
    index.add(None, [10], [PodEntry("b", "gpu")])
    index.clear("a")
    assert index.lookup([10, 20, 30]) == {10: [PodEntry("b", "gpu")], 30: [PodEntry("b", "gpu")]}


def test_longest_prefix_scores_weigh_tiers_and_stop_at_a_gap() -> None:
    pods = {1: [PodEntry("a", "gpu"), PodEntry("b", "cpu"), PodEntry("a", "cpu")],
            2: [PodEntry("a", "cpu"), PodEntry("b", "cpu")], 3: [PodEntry("b", "gpu")], 4: [PodEntry("a", "gpu")]}
    assert longest_prefix_scores([1, 2, 3, 4], pods) == {"a": 1.8, "b": 2.6}
    assert longest_prefix_scores([1, 2], pods, {"cpu": 0.5}) == {"a": 1.5, "b": 1.0}
    assert matched_blocks([1, 2, 3, 4], pods, "a") == 2 and matched_blocks([1, 2, 3, 4], pods, "b") == 3
    assert matched_blocks_by_tier([1, 2, 3], pods, "a") == {"gpu": 1, "cpu": 2}


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from("abc")), max_size=200), st.integers(1, 8))
def test_the_index_never_holds_more_than_its_bounds(adds: list[tuple[int, str]], size: int) -> None:
    index = KVBlockIndex(size=size, pods_per_key=2)
    for key, pod in adds:
        index.add([key + 1000], [key], [PodEntry(pod, "gpu")])
        assert len(index) <= size and len(index._engine) <= size
        assert all(len(v) <= 2 for v in index.lookup(range(31)).values())
