"""The approximate prefix cache's block hashes as llm-d-router's ``prefixhash`` computes them:
the reference's own test tables, properties of the chain, requests through the picker (the
review's pairs), hostile inputs, and a started picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.prefix_hash import BlockHashes, block_hashes, chain_hashes, token_bytes
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.scheduler import PrefixIndex
from evergreen_trio.picker.token_estimate import Placeholders, PromptTokens, TokenizedPrompt, pack_ids, pack_text
from tests.picker.test_parsers import parsers_config
from tests.picker.test_processor import make_picker, request_body, request_headers

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import Answer, ext_proc, serve_fake_engine

MAX = 2048  # the reference tests' cap: large enough not to truncate any prompt here


def ids(*prompts: list[int], salt: str = "") -> TokenizedPrompt:
    return TokenizedPrompt(tuple(pack_ids(p) for p in prompts), salt)


def text(prompt: str, salt: str = "") -> TokenizedPrompt:
    return TokenizedPrompt((pack_text(prompt),), salt)


def reference_chain(model: str, salt: str, tokens: list[int], block: int) -> list[int]:
    """GetBlockHashes written out from hashing.go: xxhash64 over the uint32 block, then over
    (block id, previous) in little endian, seeded with xxhash64(model + salt)."""
    previous = xxhash.xxh64_intdigest((model + salt).encode())
    out = []
    for start in range(0, len(tokens), block):
        chunk = tokens[start : start + block]
        block_id = xxhash.xxh64_intdigest(struct.pack(f"<{len(chunk)}I", *chunk))
        previous = xxhash.xxh64_intdigest(block_id.to_bytes(8, "little") + previous.to_bytes(8, "little"))
        out.append(previous)
    return out


# -- the reference's tables (prefixhash/hashing_test.go) ---------------------------------------


@pytest.mark.parametrize(("tokens", "block", "blocks"), [
    (list(range(1, 9)), 4, 2),  # EvenSplit
    (list(range(1, 11)), 4, 3),  # TrailingPartialBlock
    ([], 4, 0),  # EmptyTokens
    ([1, 2, 3], 0, 0),  # NonPositiveBlockSize
])
def test_blocks_from_tokens(tokens: list[int], block: int, blocks: int) -> None:
    hashes = block_hashes("m", ids(tokens) if tokens else TokenizedPrompt(()), block, MAX)
    assert len(hashes) == blocks
    if blocks:
        assert list(hashes) == reference_chain("m", "", tokens, block)


@pytest.mark.parametrize(("tokens", "blocks"), [
    (ids(list(range(1, 11))), 3),  # TokenizedRequest
    (None, 0),  # MissingTokenizedRequest
    (TokenizedPrompt(()), 0),  # EmptyTokenIDs
])
def test_get_block_hashes(tokens: TokenizedPrompt | None, blocks: int) -> None:
    assert len(block_hashes("", tokens, 4, MAX)) == blocks


def test_cache_salt_changes_every_hash() -> None:
    plain = block_hashes("m", ids([1, 2, 3, 4]), 2, MAX)
    salted = block_hashes("m", ids([1, 2, 3, 4], salt="salt"), 2, MAX)
    assert len(plain) == len(salted) == 2 and plain != salted
    assert list(salted) == reference_chain("m", "salt", [1, 2, 3, 4], 2)


@pytest.mark.parametrize(("prompts", "per_prompt"), [
    ([[1, 2, 3, 4], [5, 6, 7, 8]], [2, 2]),  # TwoPrompts
    ([[1, 2, 3], [4, 5], [6]], [2, 1, 1]),  # ThreePromptsUnevenLengths
    ([[1, 2], [], [3, 4]], [1, 1]),  # EmptyPromptSkipped
])
def test_multi_prompt_chains(prompts: list[list[int]], per_prompt: list[int]) -> None:
    hashes = block_hashes("model", ids(*prompts), 2, MAX)
    assert [end - start for start, end in hashes.chains()] == per_prompt


def test_each_prompt_starts_its_own_chain() -> None:
    multi, single = block_hashes("model", ids([1, 2], [3, 4]), 2, MAX), block_hashes("model", ids([1, 2, 3, 4]), 2, MAX)
    assert multi[0] == single[0]  # the same model seed and first block
    assert multi[1] != single[1]  # [3, 4] chains from the seed, not from the first prompt
    assert multi[1] == reference_chain("model", "", [3, 4], 2)[0]


def test_block_ids_hash_the_tokens() -> None:
    assert chain_hashes(7, struct.pack("<2I", 1, 2), 8) == chain_hashes(7, struct.pack("<2I", 1, 2), 8)
    assert chain_hashes(7, struct.pack("<2I", 1, 2), 8) != chain_hashes(7, struct.pack("<2I", 1, 3), 8)
    assert chain_hashes(7, b"", 8) == []


def test_multi_prompt_matches_sum_each_prompts_greedy_match() -> None:
    index = PrefixIndex(100)
    first = block_hashes("m", ids([1, 2, 3, 4], [5, 6, 7, 8]), 2, MAX)
    index.add("a", first)
    assert index.matches(first, ["a", "b"]) == {"a": 4, "b": 0}
    # The first prompt differs in its first block, the second matches: the reference sums 0 + 2.
    other = block_hashes("m", ids([9, 9, 3, 4], [5, 6, 7, 8]), 2, MAX)
    assert index.matches(other, ["a"]) == {"a": 2}
    assert index.matches(list(other), ["a"]) == {"a": 0}  # one flat chain: greedy stops at once


# -- properties -------------------------------------------------------------------------------

BLOCK = 64
BLOCK_BYTES = BLOCK * 4
prompts = st.text(min_size=1, max_size=2000)


@given(st.integers(1, 4), st.data(), prompts, prompts)
def test_a_shared_prefix_shares_its_leading_hashes(count: int, data: st.DataObject, tail_a: str, tail_b: str) -> None:
    size = count * BLOCK_BYTES  # whole blocks of ASCII text
    prefix = data.draw(st.text(alphabet="abcdefgh \n", min_size=size, max_size=size))
    a, b = block_hashes("m", text(prefix + tail_a), BLOCK, MAX), block_hashes("m", text(prefix + tail_b), BLOCK, MAX)
    assert a[:count] == b[:count] and len(a) > count and len(b) > count


@given(prompts, st.text(max_size=40), st.text(max_size=40))
def test_different_salts_share_no_hash(prompt: str, salt_a: str, salt_b: str) -> None:
    a, b = block_hashes("m", text(prompt, salt_a), BLOCK, MAX), block_hashes("m", text(prompt, salt_b), BLOCK, MAX)
    assert len(a) == len(b) >= 1
    assert (a == b) if salt_a == salt_b else not set(a) & set(b)


@given(st.integers(1, 5), st.integers(1, BLOCK_BYTES - 1), st.data())
def test_the_tail_block_changes_only_the_last_hash(full: int, tail: int, data: st.DataObject) -> None:
    head = "h" * (full * BLOCK_BYTES)
    tail_a = data.draw(st.text(alphabet="abc", min_size=tail, max_size=tail))
    tail_b = data.draw(st.text(alphabet="abc", min_size=tail, max_size=tail).filter(lambda t: t != tail_a))
    a, b = block_hashes("m", text(head + tail_a), BLOCK, MAX), block_hashes("m", text(head + tail_b), BLOCK, MAX)
    assert len(a) == len(b) == full + 1
    assert a[:full] == b[:full] and a[full] != b[full]


@given(st.integers(1, 50), st.integers(1, 200_000), st.integers(1, 64))
def test_the_count_is_bounded_by_the_cap_and_the_prompt(max_blocks: int, tokens: int, block: int) -> None:
    prompt = PromptTokens((b"abcd" * min(tokens, 1000), Placeholders(7, tokens)))
    hashes = block_hashes("m", TokenizedPrompt((prompt,)), block, max_blocks)
    assert len(hashes) == min(max_blocks, -(-prompt.token_count // block))
    assert len(token_bytes(prompt, max_blocks * block)) <= max_blocks * block * 4


@settings(max_examples=30)
@given(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=12), min_size=1, max_size=5), st.integers(1, 5))
def test_hashes_equal_the_reference_chains_prompt_by_prompt(prompt_ids: list[list[int]], block: int) -> None:
    hashes = block_hashes("model", ids(*prompt_ids), block, MAX)
    assert list(hashes) == [h for p in prompt_ids for h in reference_chain("model", "", p, block)]


# -- through the picker: the review's request pairs --------------------------------------------

PREFIX_ONLY = "scheduler: {weights: {queue: 0, kv-cache: 0, prefix-cache: 1}}"
EPP_HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def picker() -> Picker:
    return make_picker(PREFIX_ONLY, metrics=[EndpointMetrics()] * 3)


def second_match(first: dict[str, object], second: dict[str, object],
                 path: str = "/v1/chat/completions") -> tuple[int, int]:
    """Route ``first`` then ``second``: the blocks of the second the first's endpoint holds, of its total."""
    p = picker()
    endpoint = p.route(path, {}, json.dumps(first).encode(), None).endpoints[0]
    route = p.route(path, {}, json.dumps(second).encode(), None)
    return p.scheduler.prefix_matches.get(endpoint, 0), len(route.hashes)


def chat(*messages: object, **extra: object) -> dict[str, object]:
    return {"model": "plain", "messages": list(messages), **extra}


def user(content: object) -> dict[str, object]:
    return {"role": "user", "content": content}


def test_a_shared_prefix_with_different_tails_matches_its_full_blocks() -> None:
    shared = "s" * 300
    first, second = ({"model": "plain", "prompt": shared + tail * 20} for tail in "ab")
    assert second_match(first, second, "/v1/completions") == (1, 2)  # 80 tokens: a block of 64 and the tail


def test_a_short_repeated_prompt_gets_affinity() -> None:
    prompt = {"model": "plain", "prompt": "What is the capital city of France?..."}
    assert len(prompt["prompt"]) == 38
    assert second_match(prompt, prompt, "/v1/completions") == (1, 1)


def test_tenants_with_different_cache_salts_share_nothing() -> None:
    assert second_match(chat(user("x" * 600), cache_salt="a"), chat(user("x" * 600), cache_salt="b")) == (0, 3)
    assert second_match(chat(user("x" * 600), cache_salt="a"), chat(user("x" * 600), cache_salt="a")) == (3, 3)


def test_images_are_hashed_as_placeholders() -> None:
    def with_image(url: str) -> dict[str, object]:
        return chat(user([{"type": "text", "text": "t" * 1000},
                          {"type": "image_url", "image_url": {"url": url}}]))

    # 1004 bytes of text = 251 tokens, then 225 placeholders (640x360 / 1024): 8 blocks, the 4th mixed.
    assert second_match(with_image("https://x/1.png"), with_image("https://x/2.png")) == (3, 8)


def test_tools_lead_the_stream() -> None:
    def with_tool(name: str) -> dict[str, object]:
        return chat(user("x" * 600), tools=[{"type": "function", "function": {"name": name}}])

    # [{"type":"function","function":{"name":"a"}}] (45 bytes: 12 tokens), then "user" and 600 bytes.
    assert second_match(with_tool("a"), with_tool("b")) == (0, 3)


def test_pre_tokenized_generate_bodies_carry_their_salt() -> None:
    p = make_picker(EPP_HEAD + parsers_config("vllmhttp-parser", "sglanghttp-parser"), metrics=[EndpointMetrics()] * 3)
    body = {"model": "plain", "token_ids": list(range(100))}
    plain = p.route("/inference/v1/generate", {}, json.dumps(body).encode(), None).hashes
    salted = p.route("/inference/v1/generate", {}, json.dumps({**body, "cache_salt": "t"}).encode(), None).hashes
    assert list(plain) == reference_chain("plain", "", list(range(100)), 64)
    assert list(salted) == reference_chain("plain", "t", list(range(100)), 64)
    sglang = p.route("/generate", {}, json.dumps({"input_ids": list(range(100)), "extra_key": "t"}).encode(), None)
    assert list(sglang.hashes) == reference_chain("", "t", list(range(100)), 64)


def test_the_block_size_is_raised_to_64_tokens_and_zero_caps_hash_every_block() -> None:
    p = make_picker(EPP_HEAD + """plugins:
- {type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 16, maxPrefixTokensToMatch: 0,
                                                   maxPrefixBlocksToMatch: 0}}
- {type: prefix-cache-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: prefix-cache-scorer}]}
""", metrics=[EndpointMetrics()] * 3)
    assert p.scheduler.prefix_geometry() == (64, None)
    route = p.route("/v1/completions", {}, json.dumps({"model": "plain", "prompt": "p" * 256 * 3000}).encode(), None)
    assert len(route.hashes) == 3000


def test_the_vllm_backends_rendered_tokens_are_hashed_once_rendered() -> None:
    p = make_picker(EPP_HEAD + """plugins:
- {type: token-producer, parameters: {modelName: plain, vllm: {url: 'http://127.0.0.1:1'}}}
- {type: prefix-cache-scorer}
schedulingProfiles:
- {name: default, plugins: [{pluginRef: prefix-cache-scorer}]}
""", metrics=[EndpointMetrics()] * 3)
    renders: list[Callable[[TokenizedPrompt | None], None]] = []
    p.start_render = lambda call, body, done: renders.append(done)
    routes = []
    for tokens in (ids(list(range(100)), salt="t"), None):
        stream = p.new_stream()
        stream.on_message(request_headers("/v1/chat/completions"))
        stream.on_message(request_body(json.dumps(chat(user("hello"), cache_salt="t")).encode()))
        assert stream.route is None  # parked for the render
        renders[-1](tokens)
        assert stream.route is not None
        routes.append(stream.route.hashes)
    assert list(routes[0]) == reference_chain("plain", "t", list(range(100)), 64)
    assert routes[1] == ()  # a failed render: no tokens, no hashes (as the reference)


# -- hostile inputs ---------------------------------------------------------------------------


def test_a_huge_prompt_hashes_at_most_the_cap() -> None:
    p = picker()
    max_blocks = p.scheduler.prefix_geometry()[1]
    assert max_blocks is not None
    route = p.route("/v1/completions", {}, json.dumps({"model": "plain", "prompt": "z" * (8 << 20)}).encode(), None)
    assert len(route.hashes) == max_blocks


def test_a_huge_cache_salt_and_many_images_are_bounded() -> None:
    p = picker()
    max_blocks = p.scheduler.prefix_geometry()[1]
    salt = "s" * (4 << 20)
    route = p.route("/v1/chat/completions", {}, json.dumps(chat(user("x"), cache_salt=salt)).encode(), None)
    assert list(route.hashes) == reference_chain("plain", salt, list(pack_text("userx").token_ids()), 64)
    images = [{"type": "image_url", "image_url": {"url": f"https://x/{i}.png"}} for i in range(10_000)]
    route = p.route("/v1/chat/completions", {}, json.dumps(chat(user(images))).encode(), None)
    assert len(route.hashes) == max_blocks  # 2.25M placeholder tokens: only the capped prefix is written out


def test_only_a_multi_prompt_request_marks_its_chains() -> None:
    assert type(block_hashes("m", text("abc"), 64, 1)) is tuple
    assert isinstance(block_hashes("m", ids([1], [2]), 64, 1), BlockHashes)
    assert type(block_hashes("m", ids([1], []), 64, 1)) is tuple  # one chain after all
    assert block_hashes("m", text("abc"), 64, 0) == () and block_hashes("m", text("abc"), 0, 5) == ()


# -- a started picker, grpcio as Envoy ---------------------------------------------------------


async def hit_ratios(port: int) -> tuple[float, float]:
    """The prefix hit ratio histogram's sum and count."""
    page = (await trio.to_thread.run_sync(httpx.get, f"http://127.0.0.1:{port}/metrics")).text
    name = "inference_extension_prefix_indexer_hit_ratio"
    values = {x.split()[0]: float(x.split()[-1]) for x in page.splitlines() if x.startswith(name)}
    return values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)


async def test_a_started_picker_isolates_tenants_and_remembers_short_prompts(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    engines = [f"127.0.0.1:{await nursery.start(serve_fake_engine)}" for _ in range(3)]
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: salted, endpoints: {json.dumps(engines)}}}\n{PREFIX_ONLY}\n")
    async with picker_process(["--config", str(config), "--refresh-metrics-interval", "50ms",
                               *EPHEMERAL_PORTS]) as running:
        await wait_health("127.0.0.1", running.health, "readiness")

        async def send(body: dict[str, object], path: str = "/v1/chat/completions") -> Answer:
            return await trio.to_thread.run_sync(lambda: ext_proc(running.grpc, json.dumps(body).encode(), path=path))

        async def ratios_reach(total: float, count: int) -> None:
            with trio.fail_after(10):
                while await hit_ratios(running.metrics) != (total, count):  # noqa: ASYNC110 (a peer's state)
                    await trio.sleep(0.05)

        tenant_a = chat(user("the same long system prompt " * 40), cache_salt="tenant-a")
        tenant_b = {**tenant_a, "cache_salt": "tenant-b"}
        first = await send(tenant_a)
        assert (await send(tenant_a)).endpoint == first.endpoint
        await ratios_reach(1.0, 2)  # the repeat matched all its blocks
        await send(tenant_b)
        await ratios_reach(1.0, 3)  # the other tenant matched none of them
        short = {"model": "plain", "prompt": "What is the capital city of France?..."}
        where = await send(short, "/v1/completions")
        assert (await send(short, "/v1/completions")).endpoint == where.endpoint
        await ratios_reach(2.0, 5)  # a 38-byte prompt is one (tail) block: the repeat matched it
