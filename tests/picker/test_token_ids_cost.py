"""Token ids from a client's body or a vLLM render reply are checked and packed in C loops: a
render reply at its cap holds millions of ids and a client's body up to 262,144 (its JSON item
cap), and the per-id Python loops stalled the event loop (a 64 MiB render reply: 15 s; a million
ids through the estimate backend: 0.68 s). The checks keep the semantics of the loops they replaced
(hypothesis, against those loops as models), and a started picker routes a body of ids at the item
cap, then the next request."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from test_disagg_headers import serve_fake_engine
from test_token_producer import first_route, upstream

from evergreen_trio.picker.processor import DESTINATION
from evergreen_trio.picker.token_estimate import Estimator, estimate, pack_ids
from evergreen_trio.picker.token_ids import uint32_ids
from evergreen_trio.picker.vllm_render import (
    COMPLETIONS_RENDER,
    RenderCall,
    RenderError,
    VllmRender,
    render_call,
    render_reply,
)

ITEMS = st.one_of(st.integers(-2, 2**33), st.integers(0, 2**32 - 1), st.booleans(), st.none(), st.text(max_size=2),
                  st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 2**32).map(float))


def _strict_model(value: object) -> list[int] | None:
    """The loop ``uint32_ids`` replaced for render replies and pre-tokenized vLLM prompts."""
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32
                                                 for i in value):
        return value
    return None


def _go_model(value: object) -> list[int] | None:
    """The loop it replaced for the estimate backend (integral floats taken, as Go's decoder does)."""
    if isinstance(value, list) and value and all(
            isinstance(i, int | float) and not isinstance(i, bool) and not math.isnan(i) and not math.isinf(i)
            and i == int(i) and 0 <= i < 2**32 for i in value):
        return [int(i) for i in value]
    return None


@given(st.lists(ITEMS, max_size=6) | st.lists(st.integers(0, 2**32 - 1), max_size=6))
def test_uint32_ids_takes_what_the_per_id_loops_took(value: list[Any]) -> None:
    strict, go = uint32_ids(value), uint32_ids(value, integral_floats=True)
    assert (None if strict is None else list(strict)) == _strict_model(value)
    assert (None if go is None else list(go)) == _go_model(value)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50))
def test_pack_ids_is_little_endian_uint32(ids: list[int]) -> None:
    packed = pack_ids(ids)
    assert b"".join(packed.segments) == b"".join(i.to_bytes(4, "little") for i in ids)  # type: ignore[arg-type]
    assert packed.token_ids() == ids


@contextmanager
def _python_calls() -> Iterator[list[int]]:
    """Python frames entered (generator resumptions too) while the block runs."""
    count = [0]

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(hook)
    try:
        yield count
    finally:
        sys.setprofile(None)


IDS = list(range(100_000))
REPLY = json.dumps([{"token_ids": IDS}]).encode()


@pytest.mark.parametrize("name, run", [
    ("estimate backend, pre-tokenized completions",
     lambda: estimate(Estimator(), "completions", {"prompt": IDS}, {})),
    ("vllm backend, pre-tokenized completions",
     lambda: render_call(VllmRender("m", "127.0.0.1", 8000), "completions", {"prompt": IDS})),
    ("vllm render reply",
     lambda: render_reply(RenderCall(COMPLETIONS_RENDER, b"", 1.0), 200, REPLY, {})),
])
def test_a_hundred_thousand_ids_cost_no_python_loop(name: str, run: Callable[[], Any]) -> None:
    with _python_calls() as calls:
        tokens = run()
    assert tokens.token_count == len(IDS), name
    assert calls[0] < 200, f"{name}: {calls[0]} Python calls for {len(IDS)} ids"


@pytest.mark.parametrize("ids", [[1, True], [1, -1], [1, 2**32], [1, 2.0], [1, "2"]])
def test_a_render_reply_with_a_bad_id_is_a_render_error(ids: list[Any]) -> None:
    with pytest.raises(RenderError, match="uint32"):
        render_reply(RenderCall(COMPLETIONS_RENDER, b"", 1.0), 200, json.dumps([{"token_ids": ids}]).encode(), {})


async def test_a_started_picker_routes_a_body_of_ids_at_the_item_cap_then_the_next(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    engine = f"127.0.0.1:{await nursery.start(serve_fake_engine)}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool:
  name: ids
  endpoints: ['{engine}']
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: token-producer}}
- {{type: queue-scorer}}
""")
    hostile = b'{"model": "m", "prompt": [' + b",".join([b"7"] * 262_000) + b"]}"  # at the JSON item cap
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(30):
            routed = await first_route(picker.grpc, hostile, "/v1/completions")
            assert routed[DESTINATION] == engine
            plain = await trio.to_thread.run_sync(upstream, picker.grpc, b'{"model": "m", "prompt": "hi"}',
                                                  "/v1/completions")
        assert plain[DESTINATION] == engine
