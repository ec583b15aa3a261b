"""The picker's CPU per routed request, in memory, in counts that do not drift (``python -m benchmarks.picker_calls``).

Drives the real :class:`~evergreen_trio._grpc.server_wire.GrpcWireConnection` serving the ext_proc
method as ``evergreen-trio picker`` builds it (the real ``Picker`` and ``PickerMetrics``, the
benchmark's config from :mod:`benchmarks.bench_picker`, several scraped endpoints) with the bytes
Envoy sends in FULL_DUPLEX_STREAMED: ``h2`` plays Envoy's HTTP/2 client (its HPACK, its flow
control, its WINDOW_UPDATEs), each stream carries the request headers Envoy forwards, a chat
completions body that ends the request, and, observing responses, the response headers (with
the served endpoint in ``envoy.lb`` metadata) and a JSON body with usage; each answered stream is
then reset, as Envoy resets it. Streams arrive ``--streams-per-read`` to a read, as Envoy's do
under load. Cases:

- ``routing``: ``extProc.observeResponses: false`` (the stream ends once routed);
- ``observed``: the default, the response read for usage;
- ``floor``: the benchmark's do-nothing processor (:mod:`benchmarks.noop_ext_proc`) on the same wire.

``--tracing RATIO`` runs the picker with ``--tracing``'s spans at that sampler ratio (kept in memory,
not exported: the export task's thread is not the request's cost).

Only the server's side is measured (the connection's ``receive_data`` and ``data_to_send``; the
h2 client and the endpoints' scrapes, one every ``SCRAPE_EVERY`` requests, are not): Python calls
and C calls per request (``sys.setprofile``), and process time per request (best of
``--repeats``, with the collection of the cyclic garbage each run leaves). ``--profile CASE``
prints cProfile's busiest functions of that case instead.
docs/picker.md ("CPU per request") quotes them.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, StreamEnded
from hyperframe.frame import RstStreamFrame

from benchmarks.bench_picker import PICKER_CONFIG
from benchmarks.noop_ext_proc import noop_method
from evergreen_trio._grpc.server_wire import GrpcWireConnection, Method
from evergreen_trio.picker import Picker, PoolSnapshot, parse_config, parse_engine_metrics
from evergreen_trio.picker.config import PickerConfig
from evergreen_trio.picker.processor import DESTINATION, LB_NAMESPACE, SERVED
from evergreen_trio.picker.runtime import PROCESS_PATH, ext_proc_method, picker_metrics, wire_limits

CASES = ("routing", "observed", "floor")
SCRAPE_EVERY = 32
"""Requests between two scrapes of one endpoint (in turn): ~3,000 requests/s, 4 endpoints, 50 ms apart."""
WARM_UP = 200
COUNTED = 400
"""Requests counted under the profile hook."""
CANCEL = 8  # the RST_STREAM code Envoy resets an answered ext_proc stream with

SYSTEM = ("You are a careful assistant for a small family restaurant. Answer in plain words, keep to the "
          "facts the guest gives, never invent dishes, prices or opening hours, and say so when the "
          "question is outside what you know. Summaries are two sentences at most. ")
REVIEW = ("Summarize the following review in two sentences: the soup was warm, the bread fresh, the "
          "service slow on a busy Friday night, and the dessert worth the wait.")
REQUEST_BODY = json.dumps({"model": "bench", "messages": [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": REVIEW}],
                           "max_tokens": 64, "temperature": 0.2}).encode()
RESPONSE_BODY = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Warm soup and fresh bread; slow service."}}],
    "usage": {"prompt_tokens": 96, "completion_tokens": 11, "total_tokens": 107},
}).encode()
# What Envoy's ext_proc client sends on each stream, and what it forwards of a request and a response.
GRPC_HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", PROCESS_PATH), (":authority", "picker"),
                ("content-type", "application/grpc"), ("te", "trailers")]
REQUEST_HEADERS = [(":authority", "127.0.0.1:10000"), (":path", "/v1/chat/completions"), (":method", "POST"),
                   (":scheme", "http"), ("content-type", "application/json"),
                   ("content-length", str(len(REQUEST_BODY))), ("x-forwarded-proto", "http")]
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/json"),
                    ("content-length", str(len(RESPONSE_BODY))), ("date", "Wed, 26 Nov 2025 12:00:00 GMT"),
                    ("server", "envoy"), ("x-envoy-upstream-service-time", "0")]
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def endpoint_metrics(index: int, scrape: int) -> str:
    """One endpoint's vLLM metrics page at its ``scrape``-th scrape: the numbers move a little between scrapes."""
    wave = (index * 7 + scrape) % 5
    return (f"vllm:num_requests_waiting {wave}\nvllm:num_requests_running {2 + index % 3}\n"
            f"vllm:kv_cache_usage_perc {0.2 + 0.1 * (wave % 4)}\n"
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1\n')


def _header_map(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
    headers = base_pb2.HeaderMap()
    for key, value in pairs:
        header = headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    return headers


def _grpc(message: ep.ProcessingRequest) -> bytes:
    data: bytes = message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def request_messages(request_id: int) -> bytes:
    """The first two messages of a stream, framed: the request headers (with the body modes), the body."""
    headers = ep.ProcessingRequest()
    headers.protocol_config.request_body_mode = FULL_DUPLEX
    headers.protocol_config.response_body_mode = FULL_DUPLEX
    headers.request_headers.headers.CopyFrom(_header_map(
        [*REQUEST_HEADERS, ("x-request-id", f"5f0c3a52-8d4e-4b8a-9c1e-{request_id:012x}")]))
    body = ep.ProcessingRequest()
    body.request_body.body = REQUEST_BODY
    body.request_body.end_of_stream = True
    return _grpc(headers) + _grpc(body)


def response_messages(destination: str) -> bytes:
    """The response's two messages, framed: its headers (``envoy.lb`` naming the endpoint that served), its body."""
    headers = ep.ProcessingRequest()
    headers.response_headers.headers.CopyFrom(_header_map(RESPONSE_HEADERS))
    lb = headers.metadata_context.filter_metadata[LB_NAMESPACE].fields
    lb[DESTINATION].string_value = destination
    lb[SERVED].string_value = destination
    body = ep.ProcessingRequest()
    body.response_body.body = RESPONSE_BODY
    body.response_body.end_of_stream = True
    return _grpc(headers) + _grpc(body)


def destination_of(replies: bytes) -> str:
    """The endpoint the first framed reply routes to (``envoy.lb`` dynamic metadata), "" if none."""
    if len(replies) < 5:
        return ""
    size = int.from_bytes(replies[1:5], "big")
    reply = ep.ProcessingResponse.FromString(replies[5 : 5 + size])
    lb = reply.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    return lb[DESTINATION].string_value if DESTINATION in lb else ""


class Meter:
    """Wraps the server's side of each read: ``start`` before, ``stop`` after."""

    def start(self) -> None:
        """Begin measuring."""

    def stop(self) -> None:
        """Stop measuring."""


class Timer(Meter):
    def __init__(self) -> None:
        self.seconds = 0.0
        self._since = 0.0

    def start(self) -> None:
        self._since = time.process_time()

    def stop(self) -> None:
        self.seconds += time.process_time() - self._since


class Calls(Meter):
    def __init__(self) -> None:
        self.counts = {"call": 0, "c_call": 0}

    def _count(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in self.counts:
            self.counts[event] += 1

    def start(self) -> None:
        sys.setprofile(self._count)

    def stop(self) -> None:
        sys.setprofile(None)


class Profiled(Meter):
    def __init__(self) -> None:
        self.profile = cProfile.Profile()

    def start(self) -> None:
        self.profile.enable()

    def stop(self) -> None:
        self.profile.disable()


class Bench:
    """One case: a picker (or the floor) behind a fresh connection, and an h2 client playing Envoy."""

    def __init__(self, case: str, endpoints: int, streams_per_read: int, seed: int = 1,
                 tracing: float | None = None) -> None:
        self.case, self.streams_per_read = case, streams_per_read
        addresses = [f"10.0.0.{i + 1}:8000" for i in range(endpoints)]
        self.config = config_for(addresses, observe=case == "observed")
        self.snapshot = PoolSnapshot(self.config.pool.endpoints, self.config.pool.staleness_threshold_s,
                                     time.monotonic)
        self.scrapes = 0
        for _ in addresses:
            self.scrape()
        method: Method
        if case == "floor":
            method = noop_method(addresses)
        else:
            self.picker = Picker(self.config, self.snapshot, rng=random.Random(seed))
            if tracing is not None:
                from evergreen_trio.picker.tracing import new_tracing  # the `tracing` extra
                from evergreen_trio.picker.tracing_env import TracingSettings

                self.picker.tracing = new_tracing(TracingSettings(ratio=tracing))
            self.metrics = picker_metrics(self.config)
            method = ext_proc_method(self.picker, self.metrics)
        self.server = GrpcWireConnection({PROCESS_PATH: method}, wire_limits(self.config))
        self.client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.client.local_settings.initial_window_size = 1 << 28  # Envoy's default stream window
        self.client.initiate_connection()
        self.client.increment_flow_control_window((1 << 28) - 65535)
        self.requests = 0
        self.pending: dict[int, bytearray] = {}  # replies of the streams still open, this round
        self.resets = b""
        self.served_bytes = 0
        self._feed(self.client.data_to_send(), Meter())

    def scrape(self) -> None:
        """Scrape the next endpoint in turn (a new metrics object, as a real scrape makes)."""
        states = list(self.snapshot.states)
        index = self.scrapes % len(states)
        self.snapshot.update(states[index], parse_engine_metrics("vllm", endpoint_metrics(index, self.scrapes)))
        self.scrapes += 1

    def _feed(self, data: bytes, meter: Meter) -> dict[int, bytearray]:
        """The server reads ``data``; the client reads its answer. Framed replies per stream that ended."""
        server = self.server
        meter.start()
        server.receive_data(data)
        while server.paused:
            server.resume()
        out = server.data_to_send()
        meter.stop()
        self.served_bytes += len(out)
        replies: dict[int, bytearray] = {}
        ended: dict[int, bytearray] = {}
        for event in self.client.receive_data(out):
            if isinstance(event, DataReceived):
                replies.setdefault(event.stream_id, bytearray()).extend(event.data)
                self.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if isinstance(event, StreamEnded):
                ended[event.stream_id] = replies.pop(event.stream_id, bytearray())
                self.resets += RstStreamFrame(event.stream_id, error_code=CANCEL).serialize()
        self.pending.update(replies)
        return ended

    def round(self, meter: Meter) -> None:
        """``streams_per_read`` requests: their request phase in one read, their responses (observing) in another."""
        client = self.client
        self.pending = {}
        ids = []
        for _ in range(self.streams_per_read):
            if self.requests % SCRAPE_EVERY == 0:
                self.scrape()
            self.requests += 1
            stream_id = client.get_next_available_stream_id()
            ids.append(stream_id)
            client.send_headers(stream_id, GRPC_HEADERS)
            client.send_data(stream_id, request_messages(self.requests))
        data, self.resets = self.resets + client.data_to_send(), b""
        ended = self._feed(data, meter)
        if self.case != "observed":
            return
        routed = {stream_id: bytes(self.pending.get(stream_id, b"")) for stream_id in ids if stream_id not in ended}
        for stream_id, replies in routed.items():
            client.send_data(stream_id, response_messages(destination_of(replies)))
        if routed:
            self._feed(client.data_to_send(), meter)

    def run(self, requests: int, meter: Meter) -> None:
        for _ in range(-(-requests // self.streams_per_read)):
            self.round(meter)
            if self.case != "floor" and self.picker.tracing is not None:  # the spans, dropped unmetered
                self.picker.tracing.buffer.spans.clear()


def config_for(addresses: list[str], *, observe: bool) -> PickerConfig:
    """The picker benchmark's config over ``addresses``."""
    return parse_config(PICKER_CONFIG.format(endpoints=", ".join(addresses), observe=str(observe).lower()))


def measure(case: str, *, requests: int, repeats: int, endpoints: int, streams_per_read: int,
            tracing: float | None = None) -> dict[str, float]:
    """Calls per request, then process time per request (best of ``repeats`` runs of ``requests``)."""
    bench = Bench(case, endpoints, streams_per_read, tracing=tracing)
    bench.run(WARM_UP, Meter())
    calls = Calls()
    counted = max(COUNTED // streams_per_read, 1) * streams_per_read
    bench.run(counted, calls)
    times = []
    for _ in range(repeats):
        timer = Timer()
        gc.collect()
        bench.run(requests, timer)
        timer.start()  # what the run left to the cyclic collector is its cost too (streams in cycles were)
        gc.collect()
        timer.stop()
        times.append(timer.seconds / requests * 1e6)
    return {"python_calls": calls.counts["call"] / counted, "c_calls": calls.counts["c_call"] / counted,
            "us": min(times)}


def profile(case: str, *, requests: int, endpoints: int, streams_per_read: int, lines: int,
            write: Callable[[str], object] = sys.stdout.write, tracing: float | None = None) -> None:
    bench = Bench(case, endpoints, streams_per_read, tracing=tracing)
    bench.run(WARM_UP, Meter())
    profiled = Profiled()
    bench.run(requests, profiled)
    stats = pstats.Stats(profiled.profile, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(lines)
    write(f"{requests} requests\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.picker_calls", description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"any of {', '.join(CASES)} (default: all)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per timed run (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case; the best counts (default 5)")
    parser.add_argument("--endpoints", type=int, default=4, help="scraped endpoints in the pool (default 4)")
    parser.add_argument("--streams-per-read", type=int, default=4, help="ext_proc streams per read (default 4)")
    parser.add_argument("--profile", choices=CASES, help="print cProfile's busiest functions of this case instead")
    parser.add_argument("--lines", type=int, default=40, help="functions --profile prints (default 40)")
    parser.add_argument("--tracing", type=float, metavar="RATIO",
                        help="the picker with --tracing's spans at this sampler ratio (needs the tracing extra)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}: expected any of {', '.join(CASES)}")
    for name in ("requests", "repeats", "endpoints", "streams_per_read"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.profile:
        profile(args.profile, requests=args.requests, endpoints=args.endpoints,
                streams_per_read=args.streams_per_read, lines=args.lines, tracing=args.tracing)
        return
    columns = ("python_calls", "c_calls", "us")
    print(f"| case | {' | '.join(columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for case in args.cases or CASES:
        result = measure(case, requests=args.requests, repeats=args.repeats, endpoints=args.endpoints,
                         streams_per_read=args.streams_per_read, tracing=args.tracing)
        print(f"| {case} | " + " | ".join(f"{result[column]:.1f}" for column in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
