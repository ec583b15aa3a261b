"""The ``predicted-latency-producer``'s prefix and encoder-cache features from the producers its
``prefixMatchInfoProducerName`` and ``encoderCacheMatchInfoProducerName`` name, as llm-d-router's
required data keys: the rows it asks predictions for, its training entries, and the config-time
errors for a producer that is not there."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from picker_cli import run_cli
from test_latency_client import FakePredictor
from test_processor import A, B, C, Mode, make_picker, request_body, request_headers, response_body, response_headers
from test_processor import set_headers as header_map

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.kvevents import BlockStored
from evergreen_trio.picker.latency import ProducerParams, ScorerParams
from evergreen_trio.picker.latency_wire import Prediction, PredictionRow
from evergreen_trio.picker.mm_cache import MM_PRODUCER, MediaProducerParams
from evergreen_trio.picker.processor import DESTINATION
from evergreen_trio.picker.request import parse_body
from evergreen_trio.picker.scheduler import PickRequest
from evergreen_trio.picker.token_producer import DEFAULT_PRODUCER, tokenize

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
PROFILE = """schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}, {pluginRef: max-score-picker}]
"""
CAT, DOG = "https://example.com/cat.png", "https://example.com/dog.png"


def epp(producer: str, extra: str = "", scorer: str = "{}") -> str:
    return (HEAD + "plugins:\n" + extra + f"- {{type: predicted-latency-producer, parameters: {producer}}}\n"
            f"- {{type: latency-scorer, parameters: {scorer}}}\n- {{type: max-score-picker}}\n" + PROFILE)


def chat_with(*urls: str) -> bytes:
    parts = [{"type": "text", "text": "what is this?"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return json.dumps({"model": "plain", "messages": [{"role": "user", "content": parts}]}).encode()


def ask(picker: Any, path: str, body: bytes, slo: str = "") -> tuple[Any, list[PredictionRow], Any]:
    """A request (its TTFT and TPOT SLO ``slo`` ms, if any) through a stream until it parks for
    its predictions: (stream, rows by A, B, C, done)."""
    fake = FakePredictor()
    picker.start_predict = fake
    stream = picker.new_stream()
    extra = [("x-llm-d-slo-ttft-ms", slo), ("x-llm-d-slo-tpot-ms", slo)] if slo else []
    stream.on_message(request_headers(path, request_mode=Mode.BUFFERED, extra=extra))
    assert stream.on_message(request_body(body)) == [] and stream.parked
    ((rows, done),) = fake.asked
    return stream, rows, done


def routed_to(stream: Any) -> str:
    (decision,) = stream.resume()
    return str(header_map(decision.request_body.response.header_mutation)[DESTINATION])


# -- the encoder-cache features ------------------------------------------------------------------


def test_encoder_features_on_add_the_default_producer_and_off_need_none() -> None:
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\n" + epp("{useEncoderCacheFeatures: true}"))
    assert config.epp is not None
    assert config.epp.plugins[MM_PRODUCER].params == MediaProducerParams()  # made, as the reference's default
    assert config.epp.plugins["predicted-latency-producer"].params.encoder_producer == MM_PRODUCER
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\n"
                          + epp("{encoderCacheMatchInfoProducerName: nobody}"))  # ignored while off
    assert config.epp is not None and MM_PRODUCER not in config.epp.plugins
    assert config.epp.plugins["predicted-latency-producer"].params == ProducerParams()


def test_a_request_s_images_and_those_each_endpoint_encoded_are_its_features() -> None:
    picker = make_picker(epp("{streamingMode: true, useEncoderCacheFeatures: true}"),
                         [EndpointMetrics(kv_usage=0.5)] * 3)
    stream, rows, done = ask(picker, "/v1/chat/completions", chat_with(CAT, DOG))
    assert [(r.encoder_input_size, r.encoder_matched_size) for r in rows] == [(2, 0)] * 3
    done(None)  # no predictions: the composite fallback routes, and the images are now encoded there
    first = routed_to(stream)
    stream, rows, done = ask(picker, "/v1/chat/completions", chat_with(CAT, "https://example.com/eel.png"), "100")
    held = {a: r.encoder_matched_size for a, r in zip((A, B, C), rows, strict=True)}
    assert held == {a: 1 if a == first else 0 for a in (A, B, C)} and {r.encoder_input_size for r in rows} == {2}
    done([Prediction(10, 1) if a == first else Prediction(900, 1) for a in (A, B, C)])
    assert routed_to(stream) == first
    ticks = itertools.count(1)
    picker.snapshot.clock = lambda: next(ticks) / 100  # 10 ms a read: a TTFT and a TPOT above 0
    stream.on_message(response_headers("text/event-stream"))
    for end in (False, False, True):
        stream.on_message(response_body(b"data: {}\n\n", end=end))
    producer = next(iter(picker.latency.values()))
    ttft, tpot = producer.pending[-2:]
    # The TTFT entry carries the target's encoder sizes; the reference's TPOT entry carries none.
    assert (ttft.row.encoder_input_size, ttft.row.encoder_matched_size) == (2, 1)
    assert (tpot.row.encoder_input_size, tpot.row.encoder_matched_size) == (0, 0) and tpot.actual_tpot_ms > 0


def test_encoder_features_off_send_zeros_whatever_the_media_cache_holds() -> None:
    picker = make_picker(epp("{streamingMode: true}", extra=f"- {{type: {MM_PRODUCER}}}\n"))
    for _ in range(2):
        stream, rows, done = ask(picker, "/v1/chat/completions", chat_with(CAT))
        assert {(r.encoder_input_size, r.encoder_matched_size) for r in rows} == {(0, 0)}
        done(None)
        routed_to(stream)


# -- the prefix share ----------------------------------------------------------------------------

PRECISE = "- {type: token-producer}\n- {type: precise-prefix-cache-producer, name: events}\n"


def test_the_prefix_share_is_the_named_precise_producer_s() -> None:
    picker = make_picker(epp("{prefixMatchInfoProducerName: events}", extra=PRECISE), [EndpointMetrics()] * 3)
    body = json.dumps({"model": "plain", "prompt": "the same long document " * 40}).encode()
    tokens, _ = tokenize(DEFAULT_PRODUCER, "/v1/completions", parse_body("/v1/completions", body), {})
    assert tokens is not None
    ids = tuple(tokens.prompts[0].token_ids())
    cache = picker.scheduler.plugin_states["events"]
    cache.events.apply(A, "plain", BlockStored((1, 2), 0, ids[:32], 16, "GPU"))
    picker.scheduler.prefix.add(B, tuple(range(10_000)))  # the approximate index is not read
    total = len(ids) // 16
    _, rows, _ = ask(picker, "/v1/completions", body)
    assert [r.prefix_cache_score for r in rows] == [pytest.approx(2 / total), 0.0, 0.0]


def test_the_match_info_of_each_producer_kind() -> None:
    burst = "- {type: burst-prefix-cache-producer, name: burst}\n"
    picker = make_picker(epp("{prefixMatchInfoProducerName: burst}", extra=burst))
    scheduler = picker.scheduler
    assigned = PickRequest("plain", 0, hashes=(1, 2), attributes={("PrefixCacheMatchInfo", "burst"): f"128@{B}"})
    # the whole prompt's blocks (its default 64 tokens each) on B; alone in its window: no replica
    assert scheduler.prefix_match_info(assigned, [A, B], "burst") == ({B: 2}, 2, 64)
    unassigned = PickRequest("plain", 0, hashes=(1, 2), attributes={("PrefixCacheMatchInfo", "burst"): "128@"})
    assert scheduler.prefix_match_info(unassigned, [A, B], "burst") == ({}, 2, 64)
    assert scheduler.prefix_match_info(PickRequest("plain", 0, hashes=(1, 2)), [A, B], "burst") == ({}, 0, 64)
    block = scheduler.prefix_geometry()[0]
    assert scheduler.prefix_match_info(assigned, [A, B], "", {A: 1}) == ({A: 1}, 2, block)  # the approximate index


def test_the_scorer_s_composite_reads_its_named_producer() -> None:
    burst = "- {type: burst-prefix-cache-producer, name: burst}\n"
    picker = make_picker(epp("{predictInProduce: false}", extra=burst,
                             scorer="{prefixMatchInfoProducerName: burst, compositeKVWeight: 0, "
                                    "compositeQueueWeight: 0}"), [EndpointMetrics()] * 3)
    request = PickRequest("plain", 0, attributes={("PrefixCacheMatchInfo", "burst"): f"64@{C}"})
    schedule = picker.scheduler.schedule(request, 1)
    assert schedule.endpoints == [C] and schedule.scores[C] > schedule.scores[A]


@pytest.mark.parametrize("name", ["", "approx-prefix-cache-producer"])
def test_the_approximate_producer_is_the_default(name: str) -> None:
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\n" + epp(
        f"{{prefixMatchInfoProducerName: '{name}'}}", scorer=f"{{prefixMatchInfoProducerName: '{name}'}}"))
    assert config.epp is not None
    assert config.epp.plugins["predicted-latency-producer"].params.prefix_producer == ""
    assert config.epp.plugins["latency-scorer"].params == ScorerParams()


# -- a producer that is not there ----------------------------------------------------------------


@pytest.mark.parametrize(("producer", "scorer", "field"), [
    ("{prefixMatchInfoProducerName: nobody}", "{}", "plugins[0].parameters.prefixMatchInfoProducerName"),
    ("{}", "{prefixMatchInfoProducerName: nobody}", "plugins[1].parameters.prefixMatchInfoProducerName"),
    ("{useEncoderCacheFeatures: true, encoderCacheMatchInfoProducerName: nobody}", "{}",
     "plugins[0].parameters.encoderCacheMatchInfoProducerName"),
    ("{useEncoderCacheFeatures: true, encoderCacheMatchInfoProducerName: latency-scorer}", "{}",
     "plugins[0].parameters.encoderCacheMatchInfoProducerName"),
])
def test_a_missing_required_producer_is_one_line_and_exit_2(tmp_path: Path, producer: str, scorer: str,
                                                              field: str) -> None:
    text = f"pool: {{name: t, endpoints: ['{A}']}}\n" + epp(producer, scorer=scorer)
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert caught.value.field.endswith(field)
    path = tmp_path / "picker.yaml"
    path.write_text(text)
    result = run_cli(["--config", str(path)])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert field in result.stderr


# -- the TPOT entry's load features --------------------------------------------------------------


@pytest.mark.parametrize("gone", [False, True])
def test_the_tpot_entry_has_the_target_s_kv_and_queue_at_its_end(gone: bool) -> None:
    """As the reference refreshes them at each token; the TTFT entry keeps the scheduled ones
    (and the TPOT entry too when the endpoint left the pool meanwhile)."""
    picker = make_picker(epp("{streamingMode: true}"), [EndpointMetrics(kv_usage=0.5, waiting=1)] * 3)
    stream, _, done = ask(picker, "/v1/completions", json.dumps({"model": "plain", "prompt": "hi"}).encode(), "100")
    done([Prediction(10, 1)] * 3)
    target = routed_to(stream)
    ticks = itertools.count(1)
    picker.snapshot.clock = lambda: next(ticks) / 100
    stream.on_message(response_headers("text/event-stream"))
    stream.on_message(response_body(b"data: {}\n\n", end=False))
    picker.snapshot.update(target, EndpointMetrics(kv_usage=0.9, waiting=7))
    if gone:
        picker.snapshot.set_endpoints([s.endpoint for a, s in picker.snapshot.states.items() if a != target])
    for end in (False, True):
        stream.on_message(response_body(b"data: {}\n\n", end=end))
    ttft, tpot = next(iter(picker.latency.values())).pending
    assert (ttft.row.kv_cache_percentage, ttft.row.num_request_waiting) == (0.5, 1)
    assert (tpot.row.kv_cache_percentage, tpot.row.num_request_waiting) == ((0.5, 1) if gone else (0.9, 7))
    assert tpot.actual_tpot_ms > 0 and tpot.row.num_tokens_generated == 0
