"""``evergreen-trio avp serve [--host 127.0.0.1] [--port 8765] [--token-file FILE]``: an AVP agent over HTTP."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from evergreen_trio._cli import UsageError, port, serve_until_signal
from evergreen_trio.avp.maps import find_maps
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp
from evergreen_trio.errors import ConfigurationError
from evergreen_trio.serving.auth import TokenFile


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    avp = subparsers.add_parser("avp", help="AVP agents over HTTP")
    commands = avp.add_subparsers(dest="avp_command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="receive AVP messages; answer each with its payload type, dtype, shape and bytes"
    )
    serve_parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=port, default=8765, help="port (default 8765; 0: any free port)")
    serve_parser.add_argument(
        "--token-file", type=Path,
        help="require 'Authorization: Bearer TOKEN', TOKEN a line of this file (401 otherwise); one token per "
             "line, blank lines and # comments ignored, re-read when it changes (as serve --auth-token-file)",
    )
    serve_parser.set_defaults(run=run_serve)


def _token_file(path: Path) -> TokenFile:
    try:
        return TokenFile(path)
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise UsageError(f"argument --token-file: cannot read {path}: {reason}") from None
    except ConfigurationError as exc:
        raise UsageError(f"argument --token-file: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; an unreadable token file, or one without a token, raises UsageError (exit 2)."""
    tokens = _token_file(args.token_file) if args.token_file else None
    app = AVPApp(AVPServerOptions(token_file=tokens, maps=find_maps()))

    def announce(bound: int) -> None:
        print(f"avp http://{args.host}:{bound}", flush=True)

    return serve_until_signal(partial(serve_avp, app, args.host, args.port), started=announce,
                              address=f"{args.host}:{args.port}")
