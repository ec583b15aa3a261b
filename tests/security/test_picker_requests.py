"""Issue 22, items 7-10: hostile requests through a running picker's ext_proc port (grpcio).

Each test checks the answer to the attack, that a legitimate request on another connection is
answered meanwhile (generous ceiling), and, where the attack is about memory, Python allocations
(tracemalloc peak). Precise stall and RSS figures: ``python -m benchmarks security``.
"""

from __future__ import annotations

import logging
import sys
import tracemalloc
from collections.abc import Callable
from functools import partial
from types import FrameType

import httpx
import pytest
import trio
from picker_requests import (
    LEGIT_BODY,
    LISTED,
    REWRITE,
    Answer,
    MiB,
    config_text,
    deep_objects_body,
    ext_proc,
    many_prompts_body,
    model_names,
    serve_fake_engine,
    surrogate_body,
    wait_routable,
)

from evergreen_trio.picker import PickerPorts, parse_config, run_picker
from evergreen_trio.picker.guards import MAX_MODEL_LABEL_PAIRS, MAX_UNLISTED_MODEL_LABELS, OTHER_MODEL

CEILING_S = 5.0


async def start(nursery: trio.Nursery, models: str = "") -> PickerPorts:
    engine = await nursery.start(serve_fake_engine)
    config = parse_config(config_text(engine, models))
    ports: PickerPorts = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0,
                                                     metrics_port=0))
    await wait_routable(ports.grpc)
    return ports


async def under_attack(ports: PickerPorts, attack: Callable[[], object]) -> tuple[object, float]:
    """Run ``attack`` in a thread while a legitimate request goes through another connection;
    return what the attack returned and the legitimate request's latency."""
    results: list[object] = []
    latency: list[float] = []

    async def legit() -> None:
        await trio.sleep(0.05)
        start = trio.current_time()
        assert (await trio.to_thread.run_sync(ext_proc, ports.grpc, LEGIT_BODY)).status == 200
        latency.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(legit)
        results.append(await trio.to_thread.run_sync(attack))
    assert latency and latency[0] < CEILING_S
    return results[0], latency[0]


async def scrape(ports: PickerPorts) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"http://127.0.0.1:{ports.metrics}/metrics")
    return response.text


async def test_unknown_model_names_fold_into_other_and_the_scrape_stays_small(nursery: trio.Nursery) -> None:
    """Item 7, no models configured: 300 unique 200-char names (and rewrites to as many more)
    give at most MAX_UNLISTED_MODEL_LABELS series each; the rest is ``other``."""
    ports = await start(nursery)
    names = model_names(300)

    def attack() -> list[int]:
        return [ext_proc(ports.grpc, f'{{"model":"{n}","prompt":"p"}}'.encode(), {REWRITE: n[::-1]}).status
                for n in names]

    statuses, _ = await under_attack(ports, attack)
    assert set(statuses) == {200}  # type: ignore[arg-type]
    text = await scrape(ports)
    routed = [line for line in text.splitlines() if line.startswith("inference_objective_request_total{")]
    assert len(routed) <= MAX_MODEL_LABEL_PAIRS + 1
    assert f'model_name="{OTHER_MODEL}"' in text
    models = {line.split('model_name="')[1].split('"')[0] for line in text.splitlines() if 'model_name="' in line}
    assert len(models) <= MAX_UNLISTED_MODEL_LABELS + 1
    assert len(text) < 512 * 1024, len(text)


async def test_unlisted_names_never_get_a_series_when_models_are_configured(nursery: trio.Nursery) -> None:
    """Item 7, models configured: unknown names get 404 and are counted under ``other``."""
    ports = await start(nursery, LISTED)
    answers = [await trio.to_thread.run_sync(ext_proc, ports.grpc, f'{{"model":"{n}","prompt":"p"}}'.encode())
               for n in model_names(20)]
    assert {a.status for a in answers} == {404}
    text = await scrape(ports)
    models = {line.split('model_name="')[1].split('"')[0] for line in text.splitlines() if 'model_name="' in line}
    assert models <= {"sim-model", "sim-lora", "internal-only-adapter", OTHER_MODEL}, models


async def test_scrapes_render_off_the_routing_thread(nursery: trio.Nursery) -> None:
    """Item 7: scrapes back to back while a legitimate request is routed."""
    ports = await start(nursery)

    async def scrapes() -> None:
        for _ in range(20):
            await scrape(ports)

    async with trio.open_nursery() as inner:
        inner.start_soon(scrapes)
        start_s = trio.current_time()
        assert (await trio.to_thread.run_sync(ext_proc, ports.grpc, LEGIT_BODY)).status == 200
        assert trio.current_time() - start_s < CEILING_S


@pytest.mark.parametrize("listed", [True, False], ids=["models-listed", "no-models"])
async def test_a_rewrite_header_is_honoured_only_to_an_allowed_target(nursery: trio.Nursery, listed: bool) -> None:
    """Item 8: with ``models`` configured a rewrite to another configured model is refused (as
    asking for it directly would be) and one to the model's own target is honoured; with no
    models configured (every name accepted anyway) a rewrite is honoured."""
    ports = await start(nursery, LISTED if listed else "")
    smuggled = await trio.to_thread.run_sync(ext_proc, ports.grpc, LEGIT_BODY, {REWRITE: "internal-only-adapter"})
    if listed:
        assert smuggled.status == 404, smuggled
        assert "not a target model" in smuggled.message
        allowed = await trio.to_thread.run_sync(ext_proc, ports.grpc, LEGIT_BODY, {REWRITE: "sim-lora"})
        assert allowed == Answer(200, "sim-lora")
        direct = await trio.to_thread.run_sync(ext_proc, ports.grpc, b'{"model":"internal-only-adapter","prompt":"p"}')
        assert direct.status == 200  # listed, so asking for it directly is allowed: only smuggling is not
    else:
        assert smuggled == Answer(200, "internal-only-adapter")


async def test_a_16_mib_body_of_empty_objects_is_refused_before_parsing(nursery: trio.Nursery) -> None:
    """Item 9: 413 without parsing (before: 580-630 ms on the only thread and +420-470 MiB)."""
    ports = await start(nursery)
    body = deep_objects_body()
    tracemalloc.start()
    try:
        answer, _ = await under_attack(ports, partial(ext_proc, ports.grpc, body))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(answer, Answer) and answer.status == 413, answer
    assert "MAX_BODY_JSON" in answer.message
    # The body itself is held a few times (wire buffer, stream buffer, its bytes, the counting copy).
    assert peak < 6 * len(body) + 16 * MiB, f"peak {peak / MiB:.1f} MiB"


async def test_a_lone_surrogate_with_a_rewrite_is_a_400_and_one_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 10: before, a 500 and a 28-line ERROR traceback per request."""
    ports = await start(nursery, LISTED)
    caplog.set_level(logging.INFO)
    for headers in ({REWRITE: "sim-lora"}, {}):  # rewritten, and routed as it is (prefix hashing)
        caplog.clear()
        answer, _ = await under_attack(ports, partial(ext_proc, ports.grpc, surrogate_body(), headers))
        assert isinstance(answer, Answer) and answer.status == 400, answer
        assert "lone surrogate" in answer.message
        refused = [r for r in caplog.records if "lone surrogate" in r.getMessage()]
        assert len(refused) == 1 and "\n" not in refused[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    # A surrogate pair (an emoji escaped by a Python client) is fine.
    pair = await trio.to_thread.run_sync(ext_proc, ports.grpc, b'{"model":"sim-model","prompt":"\\ud83d\\ude00"}',
                                         {REWRITE: "sim-lora"})
    assert pair == Answer(200, "sim-lora")


async def test_a_completions_body_of_many_prompts_is_routed_at_a_bounded_cost(nursery: trio.Nursery) -> None:
    """250,000 prompts of 2 bytes (1.5 MB): each was packed and hashed on its own (1.8 million
    Python calls, ~0.9 s of the routing thread, 10 s at the body cap); past MAX_PROMPTS the rest
    is one prompt. The request is routed, and a legitimate one is served meanwhile."""
    ports = await start(nursery)
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)  # this thread's: the picker's (the clients run in worker threads)
    try:
        answer, _ = await under_attack(ports, partial(ext_proc, ports.grpc, many_prompts_body()))
    finally:
        sys.setprofile(None)
    assert isinstance(answer, Answer) and answer.status == 200 and answer.endpoint, answer
    assert calls < 100_000, calls
