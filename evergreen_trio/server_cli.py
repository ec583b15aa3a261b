"""`evergreen-trio serve`: an Evergreen server with the built-in actions."""

from __future__ import annotations

import argparse
import logging

import trio

from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.refs import FileResolver
from evergreen_trio.server import Server

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="serve Evergreen sessions (ECHO, GENERATE)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument(
        "--allow-file-root", action="append", default=[], metavar="DIR",
        help="resolve file:// refs under DIR (repeatable); by default refs are refused",
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    server = Server(resolvers=[FileResolver(args.allow_file_root)] if args.allow_file_root else ())
    register_builtin_actions(server)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, args.host, args.port)
            print(f"evergreen-trio serving on {args.host}:{port}", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        log.info("serve.stopped reason=interrupt")
    return 0
