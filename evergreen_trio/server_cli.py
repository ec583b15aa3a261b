"""`evergreen-trio serve`: an Evergreen server with the built-in actions.

GENERATE is the toy generator, or with ``--generate-backend URL --model NAME`` any
OpenAI-compatible endpoint (see docs/generate.md).
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import AsyncExitStack

import trio

from evergreen_trio._cli import port, serve_until_signal
from evergreen_trio.actions import generate, register_builtin_actions
from evergreen_trio.generate import APIS, BackendConfigError, BackendSettings, open_backend
from evergreen_trio.refs import FileResolver
from evergreen_trio.server import Server

log = logging.getLogger(__name__)

_DEFAULTS = BackendSettings("http://127.0.0.1", "model")


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--generate-backend`` options (the fields of BackendSettings)."""
    group = parser.add_argument_group("GENERATE backend (an OpenAI-compatible endpoint; default: the toy generator)")
    group.add_argument("--generate-backend", metavar="URL", default=None,
                       help="API base, e.g. http://127.0.0.1:8080/v1 (no path: /v1 is added)")
    group.add_argument("--model", default=None, help="model name sent upstream (required with --generate-backend)")
    group.add_argument("--generate-api", choices=APIS, default=_DEFAULTS.api,
                       help="POST /completions (flattened prompt as one string) or /chat/completions "
                            "(default: %(default)s)")
    group.add_argument("--max-tokens", type=int, default=_DEFAULTS.max_tokens,
                       help="max_tokens per request (0: let the backend decide; default: %(default)s)")
    group.add_argument("--api-key-env", metavar="VAR", default=None,
                       help="send the environment variable VAR as a bearer token")
    group.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage")
    group.add_argument("--served-by-header", default=_DEFAULTS.served_by_header,
                       help="response header naming the model server (default: %(default)s)")
    group.add_argument("--connect-timeout", type=float, default=_DEFAULTS.connect_timeout_s, metavar="S",
                       help="connect timeout, then UNAVAILABLE (default: %(default)s)")
    group.add_argument("--read-timeout", type=float, default=_DEFAULTS.read_timeout_s, metavar="S",
                       help="longest silence, then DEADLINE_EXCEEDED (default: %(default)s)")
    group.add_argument("--total-timeout", type=float, default=_DEFAULTS.total_timeout_s, metavar="S",
                       help="whole request, then DEADLINE_EXCEEDED (default: %(default)s)")
    group.add_argument("--max-prompt-bytes", type=int, default=_DEFAULTS.max_prompt_bytes,
                       help="prompt text sent, then RESOURCE_EXHAUSTED (default: %(default)s)")
    group.add_argument("--max-response-bytes", type=int, default=_DEFAULTS.max_response_bytes,
                       help="one streamed response, then RESOURCE_EXHAUSTED (default: %(default)s)")


def backend_from_args(args: argparse.Namespace) -> BackendSettings | None:
    """The BackendSettings the command line describes, or None for the toy generator."""
    if args.generate_backend is None:
        if args.model is not None:
            raise BackendConfigError("--model needs --generate-backend")
        return None
    if args.model is None:
        raise BackendConfigError("--generate-backend needs --model")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise BackendConfigError(f"--api-key-env: expected the environment variable {args.api_key_env} to be set")
    return BackendSettings(
        url=args.generate_backend, model=args.model, api=args.generate_api, max_tokens=args.max_tokens or None,
        include_usage=not args.no_usage, api_key=api_key, served_by_header=args.served_by_header,
        connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
        total_timeout_s=args.total_timeout, max_prompt_bytes=args.max_prompt_bytes,
        max_response_bytes=args.max_response_bytes,
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="serve Evergreen sessions (ECHO, GENERATE)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=port, default=50051, help="port to bind, 0 for any (default: %(default)s)")
    serve.add_argument(
        "--allow-file-root", action="append", default=[], metavar="DIR",
        help="resolve file:// refs under DIR (repeatable); by default refs are refused",
    )
    add_backend_arguments(serve)
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; bad options raise BackendConfigError (exit 2)."""
    backend = backend_from_args(args)
    server = Server(resolvers=[FileResolver(args.allow_file_root)] if args.allow_file_root else ())
    target = f" (GENERATE -> {backend.endpoint} model {backend.model})" if backend else ""

    def announce(port: int) -> None:
        print(f"evergreen-trio serving on {args.host}:{port}{target}", flush=True)

    async def serve(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as stack:
            handler = generate
            if backend is not None:
                handler = (await stack.enter_async_context(open_backend(backend))).generate
            register_builtin_actions(server, generate_handler=handler)
            await server.serve(args.host, args.port, task_status=task_status)

    status = serve_until_signal(serve, started=announce, address=f"{args.host}:{args.port}")
    log.info("serve.stopped")
    return status
