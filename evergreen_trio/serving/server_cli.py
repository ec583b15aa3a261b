"""`evergreen-trio serve`: an Evergreen server with the built-in actions, or your own (``--app``).

``--app MODULE:FACTORY`` serves the :class:`Server` FACTORY gives (its actions, limits, resolvers
and targets) with every serve option applied: TLS, tokens, the server limits, metrics, health,
drain, workers (each worker imports it). GENERATE is the toy generator, or with
``--generate-backend URL --model NAME`` any OpenAI-compatible endpoint (see docs/generate.md).
SIGTERM/SIGINT drain it (``--drain-grace``); ``--workers N`` runs N of it on one port under a
supervisor; ``--metrics-port`` exports Prometheus metrics (docs/production.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
import tempfile
from collections.abc import Callable
from contextlib import AsyncExitStack, ExitStack
from functools import partial
from typing import Any, TextIO

import trio
from prometheus_client import CollectorRegistry

from evergreen_trio._cli import StartError, port, positive_int, seconds, serve_until_signal
from evergreen_trio._grpc.limits import MAX_SETTINGS_VALUE
from evergreen_trio.actions import generate, register_builtin_actions
from evergreen_trio.errors import ConfigurationError, leaf_exceptions
from evergreen_trio.generate import APIS, BackendConfigError, BackendSettings
from evergreen_trio.refs import FileResolver
from evergreen_trio.serving import tls
from evergreen_trio.serving.app_import import load_app
from evergreen_trio.serving.auth import TokenFileAuthorizer
from evergreen_trio.serving.metrics import serve_metrics
from evergreen_trio.serving.server import DRAIN_GRACE_SECONDS, IDLE_TIMEOUT_SECONDS, Server, tune_gc
from evergreen_trio.serving.signals import drain_on_signals, with_stop_deadline
from evergreen_trio.serving.workers import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    MAX_WORKERS,
    Supervisor,
    WorkerError,
    heartbeat,
    multiprocess_registry,
    reserve_port,
    signal_self_when_gone,
)

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


def worker_count(text: str) -> int:
    """argparse type: a number of worker processes, 1 to MAX_WORKERS."""
    count = positive_int(text)
    if count > MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_WORKERS} workers, got {text!r}")
    return count


def add_operations_arguments(parser: argparse.ArgumentParser) -> None:
    """Metrics, drain and worker processes (docs/production.md)."""
    group = parser.add_argument_group("operations")
    group.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                       help="serve Prometheus metrics on HOST:PORT (0: a free port; default: off)")
    group.add_argument("--drain-grace", type=seconds, default=DRAIN_GRACE_SECONDS, metavar="S",
                       help="on SIGTERM/SIGINT: stop accepting sessions (health NOT_SERVING) and let open ones "
                            "run this long before ending them with UNAVAILABLE (default: %(default)s)")
    group.add_argument("--workers", type=worker_count, default=1, metavar="N",
                       help=f"N (at most {MAX_WORKERS}) server processes on the port (SO_REUSEPORT), restarted "
                            "if they die (default: 1)")
    group.add_argument("--worker-heartbeat-timeout", type=seconds, default=HEARTBEAT_TIMEOUT, metavar="S",
                       help="with --workers: a worker whose loop sends no heartbeat for S seconds is killed and "
                            "restarted (default: %(default)s)")
    group.add_argument("--reuse-port", action="store_true",
                       help="listen with SO_REUSEPORT, so other processes can serve the same port")
    group.add_argument("--supervised-by", type=int, default=None, help=argparse.SUPPRESS)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="serve Evergreen sessions (ECHO, GENERATE, or your --app)")
    serve.add_argument("--app", metavar="MODULE:FACTORY", default=None,
                       help="serve your Server: FACTORY is a Server, or a callable returning one, in MODULE "
                            "(imported from the current directory, in every worker); default: ECHO and GENERATE")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=port, default=50051, help="port to bind, 0 for any (default: %(default)s)")
    serve.add_argument(
        "--allow-file-root", action="append", default=[], metavar="DIR",
        help="resolve file:// refs under DIR (repeatable); by default refs are refused",
    )
    add_backend_arguments(serve)
    add_security_arguments(serve)
    add_operations_arguments(serve)
    serve.set_defaults(run=run_serve)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS, auth and limits of the session server (docs/security.md)."""
    group = parser.add_argument_group("TLS, auth and limits")
    group.add_argument("--tls-cert", metavar="FILE", help="serve TLS with this PEM certificate chain")
    group.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", metavar="FILE",
                       help="require client certificates signed by this CA (mTLS; needs --tls-cert)")
    group.add_argument("--auth-token-file", metavar="FILE",
                       help="accept only 'authorization: Bearer T' for a token T of FILE (one per line, "
                            "# comments; re-read within seconds of a change)")
    group.add_argument("--max-sessions", type=positive_int, default=10_000, metavar="N",
                       help="sessions open on the server, then RESOURCE_EXHAUSTED (default: %(default)s)")
    group.add_argument("--max-sessions-per-connection", type=positive_int, default=100, metavar="N",
                       help="HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (default: %(default)s)")
    group.add_argument("--max-sessions-per-peer", type=positive_int, default=2_500, metavar="N",
                       help="sessions open from one remote address, then RESOURCE_EXHAUSTED; behind a proxy "
                            "(Envoy) raise it to --max-sessions (default: %(default)s)")
    group.add_argument("--max-connections", type=positive_int, default=4096, metavar="N",
                       help="connections open on the server, then GOAWAY(ENHANCE_YOUR_CALM) and close "
                            "(default: %(default)s)")
    group.add_argument("--first-message-timeout", type=seconds, default=30.0, metavar="S",
                       help="a session that sends nothing, or a connection that does not finish its "
                            "handshake, is ended after S seconds (default: %(default)s)")
    group.add_argument("--idle-timeout", type=seconds, default=IDLE_TIMEOUT_SECONDS, metavar="S",
                       help="a session silent both ways with no action working (one waiting for the peer's "
                            "input does not count), or a connection with no session, is ended after S "
                            "seconds; 0: never (default: %(default)s)")
    group.add_argument("--send-error-details", action="store_true",
                       help="send a failed handler's exception text to the client (default: the status and "
                            "an error id, which the server's log line also has)")


def security_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Server keyword arguments the TLS/auth/limit options describe.

    Raises :class:`ServeConfigError` naming the option at fault (a missing or unreadable file, a
    certificate that does not match its key, a value out of range).
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ServeConfigError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ServeConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.max_sessions_per_connection > MAX_SETTINGS_VALUE:
        got = args.max_sessions_per_connection
        raise ServeConfigError(f"--max-sessions-per-connection: expected at most {MAX_SETTINGS_VALUE} "
                               f"(HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS), got {got}")
    if not args.first_message_timeout > 0:
        raise ServeConfigError(f"--first-message-timeout: expected more than 0 s, got {args.first_message_timeout:g}")
    options: dict[str, Any] = {
        "max_sessions": args.max_sessions,
        "max_sessions_per_connection": args.max_sessions_per_connection,
        "max_sessions_per_peer": args.max_sessions_per_peer,
        "max_connections": args.max_connections,
        "first_message_timeout": args.first_message_timeout,
        "idle_timeout": args.idle_timeout or None,
    }
    if args.tls_cert is not None:
        try:
            options["tls"] = tls.server_context(args.tls_cert, args.tls_key, client_ca_file=args.tls_client_ca)
        except (OSError, ssl.SSLError) as error:
            files = ", ".join(f for f in (args.tls_cert, args.tls_key, args.tls_client_ca) if f)
            raise ServeConfigError(f"--tls-cert/--tls-key/--tls-client-ca ({files}): {error}") from None
    if args.auth_token_file is not None:
        try:
            options["authorize"] = TokenFileAuthorizer(args.auth_token_file)
        except (OSError, UnicodeDecodeError, ConfigurationError) as error:
            raise ServeConfigError(f"--auth-token-file: {error}") from None
    return options


class ServeConfigError(ConfigurationError):
    """A serve option that cannot work (names the option)."""


def server_from_args(args: argparse.Namespace, security: dict[str, Any]) -> Server:
    """The Server to serve: ours (actions registered later), or ``--app``'s rebuilt with the options.

    The app keeps its actions, limits, ref resolvers, targets and reflection setting, and its TLS
    context and ``authorize`` unless an option replaces them; the server limits are the options' (whose
    defaults are Server's own). Raises AppImportError or ServeConfigError (exit 2).
    """
    resolvers = [FileResolver(args.allow_file_root)] if args.allow_file_root else []
    details = args.send_error_details
    if args.app is None:
        return Server(resolvers=resolvers, error_details=details, **security)
    if args.generate_backend is not None:
        raise ServeConfigError("--generate-backend configures the built-in GENERATE; an --app serves its own actions")
    app = load_app(args.app)
    if resolvers and "file" in app.options.resolvers:
        raise ServeConfigError(f"--allow-file-root: the app {args.app} already resolves file:// refs")
    for option in ("tls", "authorize"):
        if option not in security and getattr(app, option) is not None:
            security[option] = getattr(app, option)
    server = Server(
        limits=app.options.limits, resolvers=[*app.options.resolvers.values(), *resolvers], targets=app.targets,
        fragment_bytes=app.options.fragment_bytes, error_details=details or app.options.error_details,
        reflection=app.reflection, **security,
    )
    server.actions.update(app.actions)
    return server


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (which drain first); bad options raise BackendConfigError or
    ServeConfigError (exit 2)."""
    channel = _supervisor_channel() if args.supervised_by is not None else None  # before the app is imported
    backend = backend_from_args(args)
    security = security_from_args(args)
    if not args.worker_heartbeat_timeout > 0:
        got = args.worker_heartbeat_timeout
        raise ServeConfigError(f"--worker-heartbeat-timeout: expected more than 0 s, got {got:g}")
    server = server_from_args(args, security)
    scheme = " TLS" if server.tls is not None else ""
    target = f" (GENERATE -> {backend.endpoint} model {backend.model})" if backend else ""
    if args.app is not None:
        target = f" (app {args.app}: {', '.join(sorted(server.actions)) or 'no actions'})"

    def serving(port: int) -> str:
        return f"evergreen-trio serving{scheme} on {_bracketed(args.host)}:{port}{target}"

    if args.workers > 1 and args.supervised_by is None:
        return run_workers(args, serving)
    supervised = args.supervised_by is not None
    announced = trio.Event()

    def announce(ports: tuple[int, int | None]) -> None:
        _announce(serving(ports[0]), args.host, ports[1], out=channel)
        announced.set()

    async def serve(*, task_status: trio.TaskStatus[tuple[int, int | None]] = trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as stack:
            handler = generate
            if backend is not None:
                from evergreen_trio.generate import open_backend  # httpx: the `generate` extra

                handler = (await stack.enter_async_context(open_backend(backend))).generate
            if args.app is None:
                register_builtin_actions(server, generate_handler=handler)
            async with trio.open_nursery() as nursery:
                if supervised:
                    nursery.start_soon(signal_self_when_gone, args.supervised_by)
                    # Beats well within the supervisor's timeout (the worker got the same flag).
                    assert channel is not None
                    nursery.start_soon(heartbeat, announced, min(HEARTBEAT_INTERVAL, args.worker_heartbeat_timeout / 5),
                                       channel.fileno())
                metrics = None
                if args.metrics_port is not None and not supervised:  # a supervisor serves its workers' metrics
                    metrics = await _start_metrics(nursery, server.metrics.registry, args.host, args.metrics_port)
                bound = await nursery.start(partial(server.serve, args.host, args.port,
                                                    reuse_port=args.reuse_port or supervised))
                task_status.started((bound, metrics))

    tune_gc()
    status = serve_until_signal(serve, started=announce, address=f"{args.host}:{args.port}",
                                drain=with_stop_deadline(partial(server.drain, args.drain_grace)))
    log.info("serve.stopped")
    return status


async def _start_metrics(nursery: trio.Nursery, registry: CollectorRegistry, host: str, port: int) -> int:
    """:func:`serve_metrics` started in ``nursery``: its port, or a StartError naming ``--metrics-port``
    (the session port's "cannot listen" line named the other address)."""
    try:
        bound: int = await nursery.start(serve_metrics, registry, host, port)
    except OSError as error:
        raise StartError(f"--metrics-port: cannot listen on {host}:{port}: {error}") from None
    return bound


def _announce(serving: str, host: str, metrics_port: int | None, *more: str, out: TextIO | None = None) -> None:
    # The first line says it is ready: everything it announces is already listening.
    for line in (serving, *more):
        print(line, file=out, flush=True)
    if metrics_port is not None:
        print(f"evergreen-trio metrics on http://{_bracketed(host)}:{metrics_port}/metrics", file=out, flush=True)


def _bracketed(host: str) -> str:
    """``host`` as it goes before ``:PORT`` in an address or a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def _supervisor_channel() -> TextIO:
    """A worker's line to its supervisor: the pipe it got as stdout, for its ready line and heartbeats.

    Its stdout becomes its stderr: a line the app prints (``loading weights...``) was taken for
    the ready line, so the supervisor said it served before the worker listened."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return channel


def run_workers(args: argparse.Namespace, serving: Callable[[int], str]) -> int:
    """The supervisor of ``serve --workers N``: holds the port, runs and restarts the workers.

    ``serving(port)`` is the ready line for the port it holds."""
    try:
        reserved = reserve_port(args.host, args.port)
    except OSError as error:
        raise StartError(f"cannot listen on {args.host}:{args.port}: {error}") from None
    port = reserved.getsockname()[1]
    command = [sys.executable, "-m", "evergreen_trio.cli", *args.argv,
               "--port", str(port), "--supervised-by", str(os.getpid())]

    async def main(metrics_dir: str | None) -> None:
        # Each worker drains for up to --drain-grace; the rest is for its final statuses and exit.
        supervisor = Supervisor(command, args.workers, metrics_dir=metrics_dir, stop_timeout=args.drain_grace + 15,
                                heartbeat_timeout=args.worker_heartbeat_timeout)
        async with trio.open_nursery() as nursery:
            cancel = nursery.cancel_scope
            nursery.start_soon(drain_on_signals, supervisor.shutdown, supervisor.stop, cancel)
            metrics = None
            if metrics_dir is not None:
                registry = multiprocess_registry(metrics_dir)
                metrics = await _start_metrics(nursery, registry, args.host, args.metrics_port)
            pids = await nursery.start(supervisor.run)
            if not supervisor.stopping:  # a signal while they started: stopping, not serving
                _announce(serving(port), args.host, metrics,
                          f"evergreen-trio workers: {len(pids)} (pids {' '.join(map(str, pids))})")

    failed = False
    with reserved, ExitStack() as stack:
        metrics_dir = None
        if args.metrics_port is not None:
            metrics_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="evergreen-trio-metrics-"))
        try:
            trio.run(main, metrics_dir)
        except* WorkerError as group:
            failed = True
            for failure in leaf_exceptions(group):
                log.error("serve.failed error=%s", failure)
    log.info("serve.stopped workers=%d", args.workers)
    return 1 if failed else 0
