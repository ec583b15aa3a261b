"""``evergreen-trio avp serve [--host 127.0.0.1] [--port 8765] [--token-file FILE]``: an AVP agent over HTTP."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import trio

from evergreen_trio.avp.maps import find_maps
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp
from evergreen_trio.signals import cancel_on_signals


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    avp = subparsers.add_parser("avp", help="AVP agents over HTTP")
    commands = avp.add_subparsers(dest="avp_command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="receive AVP messages; answer each with its payload type, dtype, shape and bytes"
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    serve_parser.add_argument(
        "--token-file", type=Path, help="require 'Authorization: Bearer <the file's first line>' (401 otherwise)"
    )
    serve_parser.set_defaults(run=run_serve)


def _read_token(path: Path) -> bytes:
    try:
        token = path.read_bytes().strip().split(b"\n", 1)[0].strip()
    except OSError as exc:
        raise ValueError(f"--token-file: cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"--token-file: expected a token on the first line of {path}, got an empty file")
    return token


def run_serve(args: argparse.Namespace) -> int:
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port: expected 0..65535, got {args.port}")
        token = _read_token(args.token_file) if args.token_file else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = AVPApp(AVPServerOptions(token=token, maps=find_maps()))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_signals, nursery.cancel_scope)
            port = await nursery.start(serve_avp, app, args.host, args.port)
            print(f"avp http://{args.host}:{port}", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:  # before the signal handler is in place
        return 0
    except (OSError, BaseExceptionGroup) as exc:  # a group from inside the server's nurseries
        failed = next((leaf for leaf in _leaves(exc) if isinstance(leaf, OSError)), None)
        if failed is None:
            raise
        print(f"error: cannot listen on {args.host}:{args.port}: {failed.strerror or failed}", file=sys.stderr)
        return 1
    return 0


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
