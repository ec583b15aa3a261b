"""Attacks on the HTTP servers (``avp serve``, ``sim``; issue 22 items 1, 13-16) over a real socket, and what a
legitimate client sees meanwhile.

``attacks(quick)`` starts each server in a child process (short body and write deadlines, so the
timeout attacks end within seconds), measures a legitimate request's latency on its own keep-alive
connection while idle, then while each attack runs, and reports per attack what the server should
answer, what it answered, the latency p50/max during the attack against idle p50, and the server's
RSS growth. The attack clients are plain functions of the port, shared with
``tests/security/test_http_attacks.py``, which runs them against in-process servers and asserts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h11
import trio

ROOT = Path(__file__).parent.parent
CHILD_OPTIONS = {"body_timeout_s": 2.0, "write_timeout_s": 2.0}
"""The benchmark servers' deadlines: short, so the timeout attacks end within seconds."""

SERVERS = {
    "avp": """
import logging, sys, trio
from functools import partial
from evergreen_trio._asgi import HttpServerLimits
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
options = AVPServerOptions(body_timeout_s=2.0, http=HttpServerLimits(write_timeout_s=2.0))
async def main():
    async with trio.open_nursery() as nursery:
        print(await nursery.start(serve_avp, AVPApp(options), "127.0.0.1", 0), flush=True)
trio.run(main)
""",
    "sim": """
import logging, sys, trio
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
async def main():
    async with trio.open_nursery() as nursery:
        print(await nursery.start(run_sim, SimConfig()), flush=True)
trio.run(main)
""",
}


# ------------------------------------------------------------------ clients


async def read_until_closed(stream: trio.SocketStream, seconds: float) -> tuple[bytes, bool]:
    """What the server sends within ``seconds``, and whether it closed the connection by then."""
    reply = b""
    with trio.move_on_after(seconds):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                return reply, True
            reply += chunk
    return reply, False


async def exchange(port: int, data: bytes, seconds: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data`` on a new connection; (what came back within ``seconds``, whether the server closed)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        try:
            await stream.send_all(data)
        except trio.BrokenResourceError:
            return b"", True
        return await read_until_closed(stream, seconds)


def status_line(reply: bytes) -> str:
    """``505 closed``: the first response's status and whether the connection was closed."""
    return reply.split(b"\r\n", 1)[0].decode("latin-1").removeprefix("HTTP/1.1 ") or "no answer"


class KeepAlive:
    """A legitimate HTTP/1.1 client: requests one at a time on one kept-alive connection."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> KeepAlive:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: tuple[tuple[str, str], ...] = ()) -> tuple[int, bytes]:
        """(status, body) of one request."""
        conn = self.conn
        data = conn.send(h11.Request(method=method, target=target, headers=[
            ("host", "x"), ("content-length", str(len(body))), *headers]))
        data += conn.send(h11.Data(data=body)) if body else b""
        await self.stream.send_all(data + conn.send(h11.EndOfMessage()))
        status, answer = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += event.data
            elif isinstance(event, h11.EndOfMessage):
                conn.start_next_cycle()
                return status, bytes(answer)
            else:
                raise ConnectionError(f"the server closed the legitimate connection ({event!r})")

    async def aclose(self) -> None:
        await self.stream.aclose()


def small_message() -> bytes:
    """A legitimate AVP message: 64 float32 values."""
    import numpy as np

    from evergreen_trio.avp import AVPMetadata, encode

    return encode(np.zeros(64, "<f4"), AVPMetadata(tensor_shape=(64,)))


@functools.cache
def zstd_bomb() -> bytes:
    """A valid AVP message of about 2 KB whose zstd payload inflates to 64 MiB of zeros."""
    import numpy as np

    from evergreen_trio.avp import AVPMetadata, encode

    return encode(np.zeros(16 << 20, "<f4"), AVPMetadata(tensor_shape=(16 << 20,)), compression="max")


async def legit_call(client: KeepAlive, server: str) -> int:
    """One legitimate request's status: an AVP transmit, or a simulator's ``/v1/models``."""
    if server == "avp":
        status, _ = await client.request("POST", "/avp/v2/transmit", LEGIT_BODY)
    else:
        status, _ = await client.request("GET", "/v1/models")
    return status


LEGIT_BODY = b""  # set on first use (numpy import kept out of module import)


# ------------------------------------------------------------------ attacks


def _h2_client(validate: bool = True) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=validate, normalize_outbound_headers=validate))
    conn.initiate_connection()  # the preface and SETTINGS
    return conn


def h2c_headers(path: bytes = b"/\xff\xfe", method: bytes = b"GET") -> bytes:
    """An h2c client's preface, SETTINGS and one HEADERS frame with ``path`` (99 bytes with the default)."""
    conn = _h2_client(validate=False)
    conn.send_headers(1, [(b":method", method), (b":scheme", b"http"), (b":path", path), (b":authority", b"x")],
                      end_stream=True)
    return conn.data_to_send()


def h2c_priorities(count: int = 1001) -> bytes:
    """An h2c client's preface, SETTINGS and ``count`` PRIORITY frames on idle streams."""
    conn = _h2_client()
    for index in range(count):
        conn.prioritize(2 * index + 1)
    return conn.data_to_send()


async def h2c_bad_path(port: int, scale: float) -> str:
    """Item 1: one h2c HEADERS frame with a non-UTF-8 ``:path``."""
    reply, closed = await exchange(port, h2c_headers())
    return f"{status_line(reply)}, {'closed' if closed else 'open'}"


async def h2c_priority_flood(port: int, scale: float) -> str:
    """Item 1: the h2c preface, then 1,001 PRIORITY frames on idle streams."""
    reply, closed = await exchange(port, h2c_priorities())
    return f"{status_line(reply)}, {'closed' if closed else 'open'}"


async def h2c_upgrade(port: int, scale: float) -> str:
    """Item 1: an HTTP/1.1 request asking to upgrade to h2c."""
    reply, _ = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
                                    b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", 0.5)
    return status_line(reply)


async def non_ascii_request_line(port: int, scale: float) -> str:
    """Item 1 (HTTP/1.1): a request line with a non-ASCII method and one with a non-UTF-8 path."""
    first, _ = await exchange(port, b"G\xc3\xa9T /health HTTP/1.1\r\nhost: x\r\n\r\n")
    second, _ = await exchange(port, b"GET /%ff%fe HTTP/1.1\r\nhost: x\r\n\r\n")
    return f"{status_line(first)}; {status_line(second)}"


async def header_only_requests(port: int, scale: float) -> str:
    """Item 13: 260 connections each sending a transmit's headers (Content-Length 100) and no body."""
    count = max(1, round(260 * scale))
    streams: list[trio.SocketStream] = []
    head = b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
    for _ in range(count):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        streams.append(stream)
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head)
    answers: dict[str, int] = {}

    async def wait(stream: trio.SocketStream) -> None:
        key = status_line((await read_until_closed(stream, 10))[0])
        answers[key] = answers.get(key, 0) + 1

    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(wait, stream)
    for stream in streams:
        await stream.aclose()
    return ", ".join(f"{n} x {key}" for key, n in sorted(answers.items()))


async def big_bodies(port: int, scale: float) -> str:
    """Item 14: 16 transmits announcing 64 MiB each, sending 8 MiB of it and stalling."""
    count, sent = max(2, round(16 * scale)), 8 << 20
    answers: dict[str, int] = {}

    async def one() -> None:
        head = b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (64 << 20)
        reply, _ = await exchange(port, head + b"AV" + b"\0" * sent, 10)
        key = status_line(reply)
        answers[key] = answers.get(key, 0) + 1

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return ", ".join(f"{n} x {key}" for key, n in sorted(answers.items()))


async def zstd_bombs(port: int, scale: float) -> str:
    """Item 14: 2 KB zstd messages that inflate to 64 MiB each, back to back on two connections."""
    bomb = zstd_bomb()
    count = max(2, round(20 * scale))
    answers: dict[int, int] = {}

    async def sender(n: int) -> None:
        client = await KeepAlive.open(port)
        try:
            for _ in range(n):
                status, _ = await client.request("POST", "/avp/v2/transmit", bomb)
                answers[status] = answers.get(status, 0) + 1
        finally:
            await client.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender, count // 2)
        nursery.start_soon(sender, count - count // 2)
    return f"{len(bomb)} B each: " + ", ".join(f"{n} x {status}" for status, n in sorted(answers.items()))


async def non_reader(port: int, scale: float) -> str:
    """Item 14: pipelined ``GET /health`` on one connection whose responses are never read, sent until
    the server stops reading and then drops the connection."""
    batch = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 1000
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    sent = 0
    async with stream:
        started = trio.current_time()
        with trio.move_on_after(60 * scale):
            try:
                while True:
                    await stream.send_all(batch)
                    sent += 1000
            except trio.BrokenResourceError:
                return f"dropped after {trio.current_time() - started:.1f}s, {sent} requests sent"
        return f"still open after {trio.current_time() - started:.1f}s, {sent} requests sent"


async def newline_model_id(port: int, scale: float) -> str:
    """Item 16: a handshake whose ``model_id`` holds a newline and a forged log line."""
    forged = json.dumps({"agent_id": "x", "identity": {"model_id": "m\nWARNING forged.line admin=1"}}).encode()
    client = await KeepAlive.open(port)
    try:
        status, _ = await client.request("POST", "/avp/v2/handshake", forged)
    finally:
        await client.aclose()
    return str(status)


@dataclass(frozen=True)
class HttpAttack:
    """One attack: the issue item, a name, the servers it targets, the expected answer, its client."""

    item: str
    name: str
    servers: tuple[str, ...]
    expected: str
    run: Callable[[int, float], Awaitable[str]]
    connections: int = 1
    """Attacking connections at once, at full scale (the RSS target is per connection)."""


ATTACKS = (
    HttpAttack("1", "h2c HEADERS, non-UTF-8 :path", ("avp", "sim"), "505, closed", h2c_bad_path),
    HttpAttack("1", "h2c 1,001 PRIORITY frames", ("avp", "sim"), "505, closed", h2c_priority_flood),
    HttpAttack("1", "HTTP/1.1 Upgrade: h2c", ("avp", "sim"), "200 OK (no 101)", h2c_upgrade),
    HttpAttack("1", "non-ASCII method, non-UTF-8 path", ("avp", "sim"), "400 Bad Request; 400 Bad Request",
               non_ascii_request_line),
    HttpAttack("13", "260 header-only transmits", ("avp",), "held, 408 at body_timeout_s; no 503 for others",
               header_only_requests, connections=260),
    HttpAttack("14", "16 x 64 MiB bodies, 8 MiB sent", ("avp",), "408 at body_timeout_s (503 past the byte cap)",
               big_bodies, connections=16),
    HttpAttack("14", "2 KB zstd -> 64 MiB, x20", ("avp",), "200, inflated off the event loop", zstd_bombs,
               connections=2),
    HttpAttack("14", "pipelined GETs, never read", ("avp",), "closed at write_timeout_s", non_reader),
    HttpAttack("16", "model_id with a newline", ("avp",), "200; one escaped log line", newline_model_id),
)

SCALES = {"header_only_requests": 0.5, "big_bodies": 0.5, "zstd_bombs": 0.3, "non_reader": 0.5}
"""The --quick size of each attack, as a fraction of the full one (absent: 1)."""


# ------------------------------------------------------------------ the benchmark


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _timed(client: KeepAlive, server: str, statuses: dict[int, int]) -> float:
    start = trio.current_time()
    status = await legit_call(client, server)
    statuses[status] = statuses.get(status, 0) + 1
    return (trio.current_time() - start) * 1000


async def _measure(server: str, attack: HttpAttack, quick: bool) -> dict[str, object]:
    global LEGIT_BODY
    LEGIT_BODY = LEGIT_BODY or small_message()
    scale = SCALES.get(attack.run.__name__, 1.0) if quick else 1.0
    process = await trio.lowlevel.open_process([sys.executable, "-c", SERVERS[server]], cwd=ROOT,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = bytearray()
    try:
        assert process.stdout is not None and process.stderr is not None
        port = int(await process.stdout.receive_some(100))
        legit = await KeepAlive.open(port)
        idle = [await _timed(legit, server, {}) for _ in range(100)]
        statuses: dict[int, int] = {}
        base = peak = rss_mib(process.pid)
        during: list[float] = []
        observed: list[str] = []

        async def attack_task(cancel: trio.CancelScope) -> None:
            index = str(ATTACKS.index(attack))
            done = await trio.run_process([sys.executable, "-m", "benchmarks.security_http", "--attack", index,
                                           str(port), str(scale)], cwd=ROOT, capture_stdout=True, check=False)
            observed.append(done.stdout.decode().strip() or f"attacker exited {done.returncode}")
            cancel.cancel()

        async def drain_log() -> None:
            assert process.stderr is not None
            while chunk := await process.stderr.receive_some(65536):
                log.extend(chunk)

        async with trio.open_nursery() as outer:
            outer.start_soon(drain_log)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attack_task, nursery.cancel_scope)
                while True:
                    during.append(await _timed(legit, server, statuses))
                    peak = max(peak, rss_mib(process.pid))
                    await trio.sleep(0.005)
            await legit.aclose()
            outer.cancel_scope.cancel()
    finally:
        process.terminate()
        await process.wait()
    result = observed[0] if observed else "no result"
    # The many-connection attacks shrink with --quick; the two-connection one keeps its two.
    connections = attack.connections if attack.connections <= 2 else max(1, round(attack.connections * scale))
    if attack.run is newline_model_id:
        lines = [line for line in log.decode(errors="replace").splitlines() if "forged.line" in line]
        result += f"; {len(lines)} log line(s) name it, {sum('WARNING' in ln[:8] for ln in lines)} forged"
    return {
        "server": server, "attack": f"{attack.item}. {attack.name}", "expected": attack.expected,
        "observed": result, "idle_p50_ms": round(statistics.median(idle), 3),
        "p50_ms": round(statistics.median(during), 3), "max_ms": round(max(during), 3),
        "rss_growth_mib": round(peak - base, 1), "connections": connections, "legit_calls": len(during),
        "scale": scale,
        "legit_statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def attacks(quick: bool) -> list[dict[str, object]]:
    """One row per (server, attack) (keys described in ``benchmarks/bench_security.py``)."""
    return [trio.run(_measure, server, attack, quick) for attack in ATTACKS for server in attack.servers]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attack"]:  # the attacker's own process: ``--attack INDEX PORT SCALE``
        print(trio.run(ATTACKS[int(sys.argv[2])].run, int(sys.argv[3]), float(sys.argv[4])))
    else:
        for row in attacks("--quick" in sys.argv):
            print(json.dumps(row))
