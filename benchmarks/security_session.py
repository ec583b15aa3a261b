"""Attacks on the Evergreen session server over a real socket, and what a legitimate session sees meanwhile.

``attacks(quick)`` starts ``evergreen-trio serve`` in a child process (short timeouts, so the
timeout attacks finish in seconds), measures ECHO session latency on fresh connections while the
server is idle, then runs each attack from a raw HTTP/2 client (hand-built frames: hyperframe +
hpack, so nothing stops it from breaking the rules) while the same latency probe runs, and reports
per attack: what the server should answer, what it answered, latency p50/max during the attack
against idle p50, and the server's RSS growth. ``tests/security/test_session_*.py`` run the same
attack clients against an in-process server and assert the answers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import hpack
import trio
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from evergreen_trio import SessionAbortedError, connect, text
from evergreen_trio.nodes import Inner, Leaf, NodeRef
from evergreen_trio.serving.server import START_SESSION

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_CONCURRENT_STREAMS = 0x3
REFUSED_STREAM = 0x7
CANCEL = 0x8
ENHANCE_YOUR_CALM = 0xB

ServerArgs = ("--first-message-timeout", "1", "--idle-timeout", "2", "--max-connections", "1000",
              "--max-sessions-per-peer", "10000", "--metrics-port", "0")
"""The benchmark server's options: short timeouts, so the timeout attacks end within seconds, and
caps low enough for the quick attacks to cross."""

HEARTBEAT_S = 1
"""``--worker-heartbeat-timeout`` of the frozen-worker row."""

SCRAPE = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"


@dataclass
class RawH2:
    """A hostile HTTP/2 client: frames built by hand, the server's frames parsed and recorded."""

    stream: trio.SocketStream
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    settings: dict[int, int] = field(default_factory=dict)
    statuses: dict[int, str] = field(default_factory=dict)
    resets: dict[int, int] = field(default_factory=dict)
    goaway: int | None = None
    goaway_last_stream: int | None = None
    closed: bool = False
    answer: bool = True  # acknowledge SETTINGS and PINGs (a client that sent no preface must not)
    pings_acked: int = 0
    _buffer: bytearray = field(default_factory=bytearray)
    _sending: trio.Lock = field(default_factory=trio.Lock)

    @classmethod
    async def open(cls, port: int, *, preface: bool = True, source: str | None = None) -> RawH2:
        """A connection to 127.0.0.1:``port``, from the loopback address ``source`` if given (another peer)."""
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
        client = cls(stream, answer=preface)
        if preface:
            await client.send(PREFACE + SettingsFrame(0).serialize())
        return client

    def headers(self, stream_id: int, *, end_stream: bool = False, path: str = START_SESSION,
                metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
        block = self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"), *metadata,
        ])
        frame = HeadersFrame(stream_id, block)
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame.serialize()

    @staticmethod
    def data(stream_id: int, payload: bytes, *, end_stream: bool = False) -> bytes:
        return DataFrame(stream_id, payload, flags=["END_STREAM"] if end_stream else []).serialize()

    @staticmethod
    def reset(stream_id: int, code: int = CANCEL) -> bytes:
        return RstStreamFrame(stream_id, error_code=code).serialize()

    @staticmethod
    def ping() -> bytes:
        return PingFrame(0, opaque_data=b"evergrn!").serialize()

    async def send(self, data: bytes) -> None:
        """Write ``data``; a connection the server closed is only recorded (``closed``)."""
        async with self._sending:  # the reader answers SETTINGS and PINGs while an attack writes
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.closed = True

    async def until(self, done: Callable[[RawH2], bool], seconds: float) -> bool:
        """Read and record the server's frames until ``done(self)``, the connection closes, or ``seconds``."""
        with trio.move_on_after(seconds):
            while not done(self) and not self.closed:
                try:
                    data = await self.stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.closed = True
                    break
                await self._feed(data)
        return done(self)

    async def _feed(self, data: bytes) -> None:
        self._buffer += data
        replies = b""
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._buffer[:9]))
            if len(self._buffer) < 9 + length:
                break
            frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
            del self._buffer[: 9 + length]
            replies += self._record(frame)
        if replies and self.answer and not self.closed:
            await self.send(replies)

    def _record(self, frame: Frame) -> bytes:
        if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.settings.update(frame.settings)
            return SettingsFrame(0, flags=["ACK"]).serialize()
        if isinstance(frame, PingFrame):
            if "ACK" in frame.flags:
                self.pings_acked += 1
                return b""
            return PingFrame(0, flags=["ACK"], opaque_data=frame.opaque_data).serialize()
        if isinstance(frame, HeadersFrame):
            headers = dict(self.decoder.decode(frame.data, raw=False))
            if "grpc-status" in headers:
                self.statuses[frame.stream_id] = f"{headers['grpc-status']} {headers.get('grpc-message', '')}"
        elif isinstance(frame, RstStreamFrame):
            self.resets[frame.stream_id] = frame.error_code
        elif isinstance(frame, GoAwayFrame):
            self.goaway, self.goaway_last_stream = frame.error_code, frame.last_stream_id
        elif isinstance(frame, DataFrame) and frame.flow_controlled_length:
            size = frame.flow_controlled_length
            return WindowUpdateFrame(0, size).serialize() + WindowUpdateFrame(frame.stream_id, size).serialize()
        return b""

    async def aclose(self) -> None:
        await self.stream.aclose()


def message_prefix(length: int) -> bytes:
    """A gRPC length prefix (uncompressed) claiming ``length`` bytes."""
    return b"\x00" + length.to_bytes(4, "big")


# -- the attacks: each returns what the server answered, in words ---------------------------------


async def oversized_prefix(port: int) -> str:
    """One stream whose first message claims 4 GiB; 48 KiB of it is sent (within the initial window)."""
    client = await RawH2.open(port)
    await client.send(client.headers(1) + client.data(1, message_prefix(2**32 - 1) + bytes(16_000)))
    for _ in range(2):
        await client.send(client.data(1, bytes(16_000)))
    await client.until(lambda c: 1 in c.statuses, 10)
    await client.aclose()
    return f"grpc-status {client.statuses.get(1, 'none')}"


async def too_many_streams(port: int, streams: int = 150) -> str:
    """``streams`` sessions opened at once on one connection, ignoring SETTINGS_MAX_CONCURRENT_STREAMS."""
    client = await RawH2.open(port)
    await client.send(b"".join(client.headers(2 * i + 1) for i in range(streams)))
    limit = await _advertised_limit(client)
    await client.until(lambda c: len(c.resets) >= streams - limit, 10)
    await client.send(client.ping())
    alive = await client.until(lambda c: c.pings_acked > 0, 10)
    refused = sum(code == REFUSED_STREAM for code in client.resets.values())
    await client.aclose()
    goaway = "no GOAWAY" if client.goaway is None else f"GOAWAY {_code_name(client.goaway)}"
    return f"max_concurrent_streams={limit} refused={refused} {goaway} ping={'answered' if alive else 'lost'}"


def _code_name(code: int) -> str:
    names = {0: "NO_ERROR", REFUSED_STREAM: "REFUSED_STREAM", ENHANCE_YOUR_CALM: "ENHANCE_YOUR_CALM"}
    return names.get(code, str(code))


async def _advertised_limit(client: RawH2) -> int:
    await client.until(lambda c: MAX_CONCURRENT_STREAMS in c.settings, 10)
    return client.settings.get(MAX_CONCURRENT_STREAMS, -1)


async def rapid_reset(port: int, pairs: int) -> str:
    """``pairs`` HEADERS+RST_STREAM pairs, 100 per write, reconnecting whenever the server sends GOAWAY."""
    sent = connections = calmed = 0
    while sent < pairs:
        client = await RawH2.open(port)
        connections += 1
        stream_id = 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.until, lambda c: c.goaway is not None, math.inf)
            while sent < pairs and client.goaway is None and not client.closed:
                ids = range(stream_id, stream_id + 200, 2)
                batch = b"".join(client.headers(i) + client.reset(i) for i in ids)
                stream_id += 200
                sent += 100
                await client.send(batch)
                await trio.lowlevel.checkpoint()
            with trio.move_on_after(2):
                while client.goaway is None and not client.closed:  # noqa: ASYNC110 - the reader sets them
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        calmed += client.goaway == ENHANCE_YOUR_CALM
        await client.aclose()
    return f"{pairs} pairs over {connections} connections, {calmed} ended by GOAWAY ENHANCE_YOUR_CALM"


async def many_sessions(port: int, connections: int, per_connection: int = 100) -> str:
    """``connections`` x ``per_connection`` silent sessions, held until the server ends them."""
    clients = [await RawH2.open(port) for _ in range(connections)]
    for client in clients:
        await client.send(b"".join(client.headers(2 * i + 1) for i in range(per_connection)))
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(client.until, lambda c: len(c.statuses) >= per_connection, 30)
    codes = {status.split()[0] for client in clients for status in client.statuses.values()}
    ended = sum(len(client.statuses) for client in clients)
    for client in clients:
        await client.aclose()
    return f"{ended}/{connections * per_connection} sessions ended, grpc-status {'/'.join(sorted(codes))}"


async def silent_session(port: int) -> str:
    """A session that is opened and never sent anything."""
    client = await RawH2.open(port)
    await client.send(client.headers(1))
    await client.until(lambda c: 1 in c.statuses, 30)
    await client.aclose()
    return f"grpc-status {client.statuses.get(1, 'none')}"


async def silent_connection(port: int, *, preface: bool) -> str:
    """A connection that sends nothing (no preface), or only the preface and SETTINGS (no stream)."""
    start = time.monotonic()
    client = await RawH2.open(port, preface=preface)
    await client.until(lambda c: False, 30)
    await client.aclose()
    goaway = "" if client.goaway is None else f"GOAWAY {client.goaway} then "
    return f"{goaway}closed after {time.monotonic() - start:.1f} s" if client.closed else "still open after 30 s"


async def cycle_check_cost(port: int, fragments: int, *, chain: int = 250, fan: int = 100_000) -> str:
    """Issue 22 item 2: ``chain`` nodes ``c1 -> c2 -> ...``, each also naming one hub with ``fan``
    children, then ``fragments`` small fragments each naming ``c1``; an ECHO at the end proves
    the server has checked them all. The check once re-walked the graph (6 s a fragment)."""
    async with connect(f"127.0.0.1:{port}", timeout=600) as session:
        hub = await session.send(Inner(tuple(NodeRef(f"leaf{i}") for i in range(fan)), id="hub"))
        for i in range(chain, 0, -1):
            await session.send(Inner((NodeRef(f"c{i + 1}"), hub) if i < chain else (hub,), id=f"c{i}"))
        start = time.perf_counter()
        for k in range(fragments):
            await session.send(Inner((NodeRef("c1"),), id=f"x{k}"))
        call = await session.run("ECHO", {"input": text("done")}, ["output"])
        await call["output"].read_bytes()
    return f"{fragments} fragments naming c1 checked in {time.perf_counter() - start:.2f} s"


async def flatten_fanout(port: int, action: str, leaf_bytes: int | None, fan: tuple[int, ...]) -> str:
    """Issue 22 item 3: one leaf of ``leaf_bytes`` (None: a node with no payload at all) shared
    through nested fans (``(128,)``: a root naming it 128 times; ``(1000, 1000)``: a root naming
    1000 times a node naming it 1000 times), then ``action`` over the root. Returns the session's
    final status."""
    shared = Inner((), id="shared") if leaf_bytes is None else Leaf((b"x" * leaf_bytes,), "text/plain", id="shared")
    try:
        async with connect(f"127.0.0.1:{port}", timeout=600) as session:
            below = await session.send(shared)
            for level, width in enumerate(reversed(fan)):
                below = await session.send(Inner((below,) * width, id=f"fan{level}"))
            output = "output" if action == "ECHO" else "response"
            input_name = "input" if action == "ECHO" else "prompt"
            call = await session.run(action, {input_name: below}, [output])
            await call[output].read_bytes()
    except SessionAbortedError as error:
        return f"grpc-status {error.code.value} {error.message}"
    return "grpc-status 0"


async def connection_flood(port: int, count: int) -> str:
    """Issue 22 item 4: ``count`` idle connections (preface only), held; how many the server refused."""
    clients: list[RawH2] = []
    try:
        for _ in range(count):  # one after another: a burst past the listen backlog stalls everyone's connect
            clients.append(await RawH2.open(port))
        async with trio.open_nursery() as nursery:
            for client in clients:
                nursery.start_soon(client.until, lambda c: c.goaway is not None or c.settings != {}, 10)
        refused = [c for c in clients if c.goaway == ENHANCE_YOUR_CALM and c.goaway_last_stream == 0]
    finally:
        for client in clients:
            await client.aclose()
    return f"{len(refused)} of {count} refused with GOAWAY ENHANCE_YOUR_CALM (last stream 0)"


async def one_peer_sessions(port: int, sessions: int, *, source: str = "127.0.0.2") -> str:
    """Issue 22 item 4: one remote address opens ``sessions`` silent sessions, 100 per connection."""
    clients = []
    statuses: dict[str, int] = {}
    try:
        for first in range(0, sessions, 100):
            client = await RawH2.open(port, source=source)
            clients.append(client)
            await client.send(b"".join(client.headers(2 * i + 1) for i in range(min(100, sessions - first))))
        with trio.move_on_after(5):
            while sum(len(c.statuses) for c in clients) < sessions - 1:
                for client in clients:
                    await client.until(lambda c: False, 0.05)
        for client in clients:
            for status in client.statuses.values():
                statuses[status.split()[0]] = statuses.get(status.split()[0], 0) + 1
    finally:
        for client in clients:
            await client.aclose()
    refused = statuses.get("8", 0)
    return f"{sessions - refused} held, {refused} refused with grpc-status 8 (the peer's share)"


async def health_watches(port: int, watches: int) -> str:
    """Issue 22 item 4: ``watches`` Health/Watch streams, 100 per connection, held."""
    from grpclib.health.v1.health_pb2 import HealthCheckRequest

    body = HealthCheckRequest(service="").SerializeToString()
    request = message_prefix(len(body)) + body
    clients = []
    try:
        for first in range(0, watches, 100):
            client = await RawH2.open(port)
            clients.append(client)
            await client.send(b"".join(
                client.headers(2 * i + 1, path="/grpc.health.v1.Health/Watch") + client.data(2 * i + 1, request)
                for i in range(min(100, watches - first))))
        with trio.move_on_after(3):
            while sum(len(c.statuses) for c in clients) < watches - 100:
                for client in clients:
                    await client.until(lambda c: False, 0.05)
        refused = sum(s.startswith("8 ") for c in clients for s in c.statuses.values())
    finally:
        for client in clients:
            await client.aclose()
    return f"{watches - refused} held, {refused} refused with grpc-status 8"


async def unauthenticated_streams(port: int, streams: int, *, batch: int = 50) -> str:
    """Issue 22 item 4: ``streams`` sessions without a token on one connection, ``batch`` per write
    (within SETTINGS_MAX_CONCURRENT_STREAMS), each batch once the last one was answered."""
    client = await RawH2.open(port)
    sent = 0
    while sent < streams and client.goaway is None and not client.closed:
        ids = [2 * (sent + i) + 1 for i in range(min(batch, streams - sent))]
        sent += len(ids)
        await client.send(b"".join(client.headers(i, end_stream=True) for i in ids))
        await client.until(lambda c, ids=ids: c.goaway is not None or all(i in c.statuses for i in ids), 10)
    await client.until(lambda c: c.goaway is not None, 2)
    await client.aclose()
    codes: dict[str, int] = {}
    for status in client.statuses.values():
        codes[status.split()[0]] = codes.get(status.split()[0], 0) + 1
    goaway = "no GOAWAY" if client.goaway is None else f"GOAWAY {_code_name(client.goaway)}"
    return f"{sent} sent, grpc-status {codes}, {goaway}"


async def connect_from(source: str, port: int) -> trio.SocketStream:
    """A TCP connection to 127.0.0.1:``port`` from the loopback address ``source`` (another client)."""
    return await trio.open_tcp_stream("127.0.0.1", port, local_address=source)


async def scrape_from(source: str, port: int) -> bytes:
    """One metrics scrape from ``source``: the response's bytes up to a sample every server has."""
    stream = await connect_from(source, port)
    with trio.fail_after(10):
        await stream.send_all(SCRAPE)
        response = b""
        while b"evergreen_sessions_started_total" not in response:
            data = await stream.receive_some(1 << 16)
            if not data:
                break
            response += data
    await stream.aclose()
    return response


async def closed_by_server(stream: trio.SocketStream, seconds: float = 10) -> int | None:
    """Read until the server closes ``stream``: the responses read, or None if still open after ``seconds``."""
    answered = 0
    with trio.move_on_after(seconds):
        try:
            while data := await stream.receive_some(1 << 16):
                answered += data.count(b"HTTP/1.1 200")
        except trio.BrokenResourceError:
            pass
        return answered
    return None


async def metrics_hog(port: int, share: int = 16) -> str:
    """Issue 22 item 6: one address opens its ``share`` of the metrics port and one more, then
    pipelines 5,000 scrapes on a connection it never reads; another address scrapes meanwhile."""
    held = [await connect_from("127.0.0.2", port) for _ in range(share)]
    try:
        extra = await closed_by_server(await connect_from("127.0.0.2", port), 5)
        other = (await scrape_from("127.0.0.3", port)).split(b"\r\n", 1)[0].decode()
    finally:
        for stream in held:
            await stream.aclose()
    start = time.monotonic()
    reader = await connect_from("127.0.0.2", port)
    await reader.send_all(SCRAPE * 5000)
    await trio.sleep(12)  # past the 10 s send deadline, reading nothing
    answered = await closed_by_server(reader, 10)
    await reader.aclose()
    extra_said = "closed at accept" if extra == 0 else "kept"
    non_reader = f"closed after {time.monotonic() - start:.0f} s ({answered} of 5000 answered)"
    return f"connection {share + 1} {extra_said}; another address: {other}; non-reader {non_reader}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    pids: list[int] = []
    for children in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{children.path}/children") as listing:
                pids += [int(p) for p in listing.read().split()]
        except FileNotFoundError:
            continue
    return sorted(pids)


async def freeze_worker(supervisor: int, address: str) -> str:
    """Issue 22 item 5: SIGSTOP one worker of ``serve --workers 2``; how long until it is replaced,
    and whether new sessions are then served."""
    victim = _children(supervisor)[0]
    start = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        with trio.fail_after(60):
            while _alive(victim) or len(_children(supervisor)) < 2:  # noqa: ASYNC110 - another process
                await trio.sleep(0.05)
    finally:
        if _alive(victim):
            os.kill(victim, signal.SIGKILL)
    replaced = time.monotonic() - start
    served = 0
    for _ in range(8):
        with contextlib.suppress(Exception):
            await echo_once(address)
            served += 1
    return f"replaced after {replaced:.1f} s; then {served}/8 new sessions served"


# -- the benchmark -------------------------------------------------------------------------------


async def echo_once(address: str, metadata: Mapping[str, str] | None = None) -> float:
    """One ECHO session on a fresh connection; its duration in ms."""
    start = time.perf_counter()
    async with connect(address, timeout=30, metadata=metadata) as session:
        call = await session.run("ECHO", {"input": text("ping")}, ["output"])
        await call["output"].read_bytes()
    return (time.perf_counter() - start) * 1000


async def probe(address: str, samples: list[float], stop: trio.Event,
                metadata: Mapping[str, str] | None = None) -> None:
    """ECHO sessions back to back until ``stop``; a failed one counts as the time it took (a stall)."""
    while not stop.is_set():
        start = time.perf_counter()
        try:
            samples.append(await echo_once(address, metadata))
        except Exception:  # a worker killed under it, a refused session: the wait is what counts
            samples.append((time.perf_counter() - start) * 1000)
        await trio.sleep(0.01)


PROBE = """
import json, sys, trio
from benchmarks.security_session import probe_process
trio.run(probe_process, sys.argv[1], json.loads(sys.argv[2]))
"""
"""The legitimate client's own process: its latency is the server's answer, not the attacker's work
(an attacker parsing 5,000 trailers in the probe's process used to count as a server stall)."""


async def probe_process(address: str, metadata: Mapping[str, str]) -> None:
    """:func:`probe` until standard input closes; prints ``ready`` after the first session, then
    the samples as JSON."""
    samples: list[float] = []
    stop = trio.Event()
    samples.append(await echo_once(address, metadata or None))
    print("ready", flush=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe, address, samples, stop, metadata or None)
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        while await stdin.receive_some():
            pass
        stop.set()
    print(json.dumps(samples[1:]), flush=True)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


async def _measure(address: str, pid: int, attack: Callable[[], Awaitable[str]],
                   metadata: Mapping[str, str] | None = None) -> tuple[str, list[float], float]:
    stop = trio.Event()
    before = rss_mib(pid)
    peak = before
    prober = await trio.lowlevel.open_process(
        [sys.executable, "-c", PROBE, address, json.dumps(dict(metadata or {}))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    assert prober.stdin is not None and prober.stdout is not None
    printed = b""
    try:
        with trio.fail_after(60):
            while b"ready\n" not in printed:
                printed += await prober.stdout.receive_some()
        async with trio.open_nursery() as nursery:

            async def watch_rss() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, rss_mib(pid))
                    await trio.sleep(0.05)

            nursery.start_soon(watch_rss)
            observed = await attack()
            await trio.sleep(0.2)
            stop.set()
        await prober.stdin.aclose()
        with trio.fail_after(60):
            while chunk := await prober.stdout.receive_some():
                printed += chunk
            await prober.wait()
    finally:
        prober.kill()
    samples: list[float] = json.loads(printed.split(b"ready\n", 1)[1])
    return observed, samples or [math.nan], max(peak, rss_mib(pid)) - before


def attacks(quick: bool, only: str = "") -> list[dict[str, object]]:
    """Run every attack (``only``: those whose name contains it) against a fresh ``evergreen-trio
    serve``; one row per attack."""
    return trio.run(_attacks, quick, only)


@asynccontextmanager
async def _serve(*args: str, printed: list[str] | None = None) -> AsyncIterator[tuple[trio.Process, str]]:
    """``evergreen-trio serve --port 0 ARGS`` in a child process: (process, its address); with
    ``--metrics-port``, the metrics line is appended to ``printed``."""
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while line.count(b"\n") < (2 if "--metrics-port" in args else 1):
                line += await process.stdout.receive_some(1)
        first, *more = line.decode().splitlines()
        if printed is not None:
            printed += more
        yield process, first.split()[-1]
    finally:
        process.terminate()
        await process.wait()


Plan = list[tuple[str, str, Callable[[], Awaitable[str]]]]


async def _rows(address: str, pid: int, plan: Plan, idle_p50: float,
                metadata: Mapping[str, str] | None = None,
                connections: Mapping[str, int] | None = None) -> list[dict[str, object]]:
    """One row per attack; ``connections``: attacking connections at once, by attack (default 1;
    the RSS target is per connection)."""
    rows: list[dict[str, object]] = []
    for name, expected, run in plan:
        observed, samples, growth = await _measure(address, pid, run, metadata)
        rows.append({
            "server": "session", "attack": name, "expected": expected, "observed": observed,
            "idle_p50_ms": round(idle_p50, 2), "p50_ms": round(statistics.median(samples), 2),
            "max_ms": round(max(samples), 2), "rss_growth_mib": round(growth, 1),
        })
        if connections and name in connections:
            rows[-1]["connections"] = connections[name]
    return rows


async def _attacks(quick: bool, only: str) -> list[dict[str, object]]:
    printed: list[str] = []
    async with _serve(*ServerArgs, printed=printed) as (process, address):
        metrics_port = int(printed[0].rsplit(":", 1)[1].split("/")[0])
        port = int(address.rsplit(":", 1)[1])
        idle = [await echo_once(address) for _ in range(10 if quick else 50)]
        idle_p50 = statistics.median(idle)
        plan: Plan = [
            ("4 GiB message prefix", "grpc-status 8 (RESOURCE_EXHAUSTED), nothing buffered",
             lambda: oversized_prefix(port)),
            ("150 streams on one connection", "max_concurrent_streams=100 refused=50 no GOAWAY ping=answered",
             lambda: too_many_streams(port)),
            ("4,000 streams in one write", "GOAWAY ENHANCE_YOUR_CALM after 101 refused",
             lambda: too_many_streams(port, 4000)),
            ("rapid reset (HEADERS+RST_STREAM)", "GOAWAY ENHANCE_YOUR_CALM past 500 stream errors a second",
             lambda: rapid_reset(port, 10_000 if quick else 100_000)),
            ("silent sessions (x100 per connection)", "each ended with grpc-status 4 (DEADLINE_EXCEEDED) at 1 s",
             lambda: many_sessions(port, 5 if quick else 50)),
            ("silent session", "grpc-status 4 (DEADLINE_EXCEEDED) after --first-message-timeout 1",
             lambda: silent_session(port)),
            ("connection without preface", "closed after --first-message-timeout 1",
             lambda: silent_connection(port, preface=False)),
            ("connection without a stream", "GOAWAY 0 (NO_ERROR) after --idle-timeout 2",
             lambda: silent_connection(port, preface=True)),
            ("22.2 250-node chain over a 100,000-child hub, then small fragments naming its head",
             "each fragment checked in proportion to itself (was 6 s of frozen server each)",
             lambda: cycle_check_cost(port, 200 if quick else 1000)),
            ("22.3 GENERATE over a 4 MiB leaf shared 300 times (1.2 GiB flattened)",
             "grpc-status 8 at max_flattened_bytes (1 GiB); the toy keeps one chunk",
             lambda: flatten_fanout(port, "GENERATE", 4 << 20, (300,))),
            ("22.3 GENERATE over an empty node shared 1000 x 1001 times",
             "grpc-status 8 at max_flattened_nodes (1,000,000); the walk pauses every 1,024 steps",
             lambda: flatten_fanout(port, "GENERATE", None, (1000, 1001))),
            ("22.3 ECHO over a 1-byte leaf shared 5 x 1000 times (50 x 1000 without --quick)",
             "served (under the limits), other sessions unaffected",
             lambda: flatten_fanout(port, "ECHO", 1, (5 if quick else 50, 1000))),
            ("22.4 150 Health/Watch streams", "100 held, 50 refused with grpc-status 8",
             lambda: health_watches(port, 150)),
            ("22.6 metrics port: 17 connections from one address, then 5,000 scrapes never read",
             "the 17th closed at accept, another address scrapes; non-reader closed at the 10 s send deadline",
             lambda: metrics_hog(metrics_port)),
        ]
        silent_flood = {"silent sessions (x100 per connection)": 5 if quick else 50}
        rows = await _rows(address, process.pid, _named(plan, only), idle_p50, connections=silent_flood)
    for args, metadata, plan_for in _other_servers():
        with tempfile.TemporaryDirectory() as folder:
            tokens = os.path.join(folder, "tokens")
            if not _named(plan_for(0, "", 0), only):  # nothing wanted there: not even started
                continue
            await trio.Path(tokens).write_text("let-me-in\n")
            argv = [tokens if arg == "TOKENS" else arg for arg in args]
            async with _serve(*argv) as (process, address):
                port = int(address.rsplit(":", 1)[1])
                plan = _named(plan_for(port, address, process.pid), only)
                rows += await _rows(address, process.pid, plan, idle_p50, metadata)
    # A probe the kernel hands to a frozen worker waits for its replacement: that row's stall
    # target is the heartbeat timeout plus the usual 250 ms.
    return [{**row, "target_max_ms": HEARTBEAT_S * 1000 + 250.0} if str(row["attack"]).startswith("22.5") else row
            for row in rows]


def _named(plan: Plan, only: str) -> Plan:
    """The attacks of ``plan`` whose name contains ``only``."""
    return [attack for attack in plan if only in attack[0]]


def _other_servers() -> list[tuple[tuple[str, ...], Mapping[str, str] | None, Callable[[int, str, int], Plan]]]:
    """The attacks that need a server of their own: (its options, TOKENS standing for a token
    file's path; the probe's metadata; the plan for its port, address and pid)."""
    caps = ("--max-sessions-per-peer", "300", "--idle-timeout", "30", "--first-message-timeout", "30")
    return [
        ((*ServerArgs, *caps), None, lambda port, address, pid: [
            ("22.4 1,100 idle connections (--max-connections 1000, 30 s timeouts)",
             "GOAWAY ENHANCE_YOUR_CALM (last stream 0) past the cap, closed at once",
             lambda: connection_flood(port, 1100)),
            ("22.4 400 silent sessions from one address (--max-sessions-per-peer 300)",
             "300 held, 100 refused with grpc-status 8; other addresses unaffected",
             lambda: one_peer_sessions(port, 400)),
        ]),
        ((*ServerArgs, "--auth-token-file", "TOKENS"), {"authorization": "Bearer let-me-in"},
         lambda port, address, pid: [
            ("22.4 1,000 sessions without a token on one connection, 50 per write (--auth-token-file)",
             "grpc-status 16 each, counted nowhere; GOAWAY ENHANCE_YOUR_CALM past 100 refusals",
             lambda: unauthenticated_streams(port, 1000)),
        ]),
        (("--workers", "2", "--worker-heartbeat-timeout", str(HEARTBEAT_S)), None, lambda port, address, pid: [
            ("22.5 --workers 2: one worker frozen (SIGSTOP)",
             "killed after --worker-heartbeat-timeout 1 and restarted; new sessions served",
             lambda: freeze_worker(pid, address)),
        ]),
    ]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def rapid_reset_cost(pairs: int) -> str:
    """The server's CPU and RSS spent on ``pairs`` rapid-reset pairs (default options)."""
    async with _serve() as (process, address):
        cpu, rss = cpu_seconds(process.pid), rss_mib(process.pid)
        observed = await rapid_reset(int(address.rsplit(":", 1)[1]), pairs)
        await trio.sleep(1)  # what the server still does after the sender stopped
        cpu, rss = cpu_seconds(process.pid) - cpu, rss_mib(process.pid) - rss
        return f"{observed}: server CPU {cpu:.2f} s, RSS {rss:+.1f} MiB"


def main() -> None:
    """``python -m benchmarks.security_session [--quick] [--only NAME-PART] [--rapid-reset-cost PAIRS]``"""
    if "--rapid-reset-cost" in sys.argv:
        pairs = int(sys.argv[sys.argv.index("--rapid-reset-cost") + 1])
        print(trio.run(rapid_reset_cost, pairs))
        return
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for row in attacks("--quick" in sys.argv, only):
        print(" | ".join(str(value) for value in row.values()))


if __name__ == "__main__":
    main()
