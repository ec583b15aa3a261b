"""``evergreen-trio ipc serve FILE`` and ``evergreen-trio ipc get URI TICKET --out OUT``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import trio

from evergreen_trio._cli import UsageError, new_file, serve_until_signal
from evergreen_trio.ipc.errors import IpcError
from evergreen_trio.ipc.service import Catalog, fetch, serve
from evergreen_trio.ipc.transports.base import Role, ServeOptions
from evergreen_trio.ipc.uri import IpcUri

PROGRESS_AFTER_S = 0.5
PROGRESS_EVERY_S = 0.1
_BAR = 30


def flight_location(text: str) -> str:
    """argparse type for ``--flight``: a ``grpc://HOST:PORT`` location (port 0: any free port)."""
    try:
        parts = urlsplit(text)
        valid = parts.scheme in ("grpc", "grpc+tcp") and bool(parts.hostname) and parts.port is not None
    except ValueError:  # a bad port or IPv6 address
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"expected grpc://HOST:PORT (port 0..65535), got {text!r}")
    return text


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ipc = subparsers.add_parser("ipc", help="Arrow Dissociated IPC: serve and fetch Arrow data")
    commands = ipc.add_subparsers(dest="ipc_command", required=True, metavar="COMMAND")
    serve_parser = commands.add_parser("serve", help="serve an Arrow IPC file or stream until interrupted")
    serve_parser.add_argument("file", type=Path, help="Arrow IPC file or stream; the ticket is its base name")
    serve_parser.add_argument(
        "--uri", default="tcp://127.0.0.1:0", help="ucx://HOST:PORT, tcp://HOST:PORT or shm:// (port 0: any)"
    )
    serve_parser.add_argument(
        "--flight", type=flight_location, help="also run a Flight control plane at this grpc://HOST:PORT location"
    )
    serve_parser.add_argument(
        "--role",
        choices=[role.value for role in Role],
        default=Role.BOTH.value,
        help="send metadata and bodies (both), or only one of them when two processes serve a stream",
    )
    serve_parser.set_defaults(run=run_serve)
    get_parser = commands.add_parser("get", help="fetch a stream and write it as an Arrow IPC file")
    get_parser.add_argument("uri", help="the URI printed by `ipc serve`")
    get_parser.add_argument("ticket", help="the ticket (the served file's base name)")
    get_parser.add_argument("--out", type=new_file, required=True, help="output Arrow IPC file")
    get_parser.add_argument("--data-uri", help="the data server's URI when another process serves the bodies")
    get_parser.set_defaults(run=run_get)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; a file that is not Arrow IPC raises UsageError (exit 2)."""
    catalog = Catalog()
    try:
        catalog.add_file(args.file)
    except OSError as exc:
        raise UsageError(f"argument file: {args.file}: {exc.strerror or exc}") from None
    except IpcError as exc:  # its message names the file already
        raise UsageError(f"argument file: {exc}") from None

    def announce(uri: IpcUri) -> None:
        print(uri, flush=True)
        if args.flight:
            from evergreen_trio.ipc.flight import ControlPlane

            plane = ControlPlane(args.flight, catalog, uri)
            print(f"flight grpc://127.0.0.1:{plane.port}", file=sys.stderr, flush=True)

    return serve_until_signal(serve, args.uri, catalog, ServeOptions(role=Role(args.role)), started=announce,
                              address=args.uri)


class Progress:
    """A one-line progress bar on stderr, shown only on a terminal, for transfers longer than half a second."""

    def __init__(self, total: int | None = None) -> None:
        self.enabled = sys.stderr.isatty()
        self.total = total
        self.start = time.monotonic()
        self.last = 0.0
        self.bytes = 0
        self.batches = 0
        self.shown = False

    def update(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.batches += 1
        now = time.monotonic()
        if not self.enabled or now - self.start < PROGRESS_AFTER_S or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        self.shown = True
        rate = self.bytes / (now - self.start) / 1e6
        if self.total:
            filled = min(_BAR, _BAR * self.bytes // self.total)
            bar = f"[{'#' * filled}{'.' * (_BAR - filled)}] "
        else:
            bar = f"[{'.' * (self.batches % _BAR)}#{'.' * (_BAR - 1 - self.batches % _BAR)}] "
        sys.stderr.write(f"\r{bar}{self.bytes / 2**20:,.1f} MiB  {self.batches} batches  {rate:,.0f} MB/s")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


async def get(uri: str, ticket: str, out: Path, data_uri: str | None = None) -> int:
    """Fetch ``ticket`` and write an Arrow IPC file; return the number of rows."""
    rows = 0
    progress = Progress()
    async with fetch(uri, ticket, data_uri=data_uri) as stream:
        writer = None
        try:
            async for batch in stream:
                if writer is None:
                    writer = pa.ipc.new_file(str(out), batch.schema)
                writer.write_batch(batch)
                rows += batch.num_rows
                progress.update(batch.nbytes)
                del batch
            if writer is None and stream.schema is not None:
                writer = pa.ipc.new_file(str(out), stream.schema)
        finally:
            if writer is not None:
                writer.close()
            progress.finish()
    return rows


def run_get(args: argparse.Namespace) -> int:
    """Fetch and write; IpcError and OSError propagate (exit 1: one line)."""
    rows = trio.run(get, args.uri, args.ticket, args.out, args.data_uri)
    print(f"{rows} rows -> {args.out}", file=sys.stderr)
    return 0
