"""``evergreen-trio avp serve [--host 127.0.0.1] [--port 8765] [--token-file FILE]``: an AVP agent over HTTP."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from evergreen_trio._cli import UsageError, port, serve_until_signal
from evergreen_trio.avp.maps import find_maps
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    avp = subparsers.add_parser("avp", help="AVP agents over HTTP")
    commands = avp.add_subparsers(dest="avp_command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="receive AVP messages; answer each with its payload type, dtype, shape and bytes"
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=port, default=8765, help="port (default 8765; 0: any free port)")
    serve_parser.add_argument(
        "--token-file", type=Path, help="require 'Authorization: Bearer <the file's first line>' (401 otherwise)"
    )
    serve_parser.set_defaults(run=run_serve)


def _read_token(path: Path) -> bytes:
    try:
        token = path.read_bytes().strip().split(b"\n", 1)[0].strip()
    except OSError as exc:
        raise UsageError(f"argument --token-file: cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise UsageError(f"argument --token-file: expected a token on the first line of {path}, got an empty file")
    return token


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; an unreadable or empty token file raises UsageError (exit 2)."""
    token = _read_token(args.token_file) if args.token_file else None
    app = AVPApp(AVPServerOptions(token=token, maps=find_maps()))

    def announce(bound: int) -> None:
        print(f"avp http://{args.host}:{bound}", flush=True)

    return serve_until_signal(partial(serve_avp, app, args.host, args.port), started=announce,
                              address=f"{args.host}:{args.port}")
