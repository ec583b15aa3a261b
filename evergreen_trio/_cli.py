"""What every ``evergreen-trio`` command shares, so all of them fail the same way.

- Usage and configuration errors (an argument, a config file, a setting): one line
  ``evergreen-trio CMD: error: ...`` naming the argument or ``file:line:column``, exit 2.
- Runtime failures (a port in use, a peer gone, an unknown ticket): one such line, exit 1.
- Tracebacks only with ``--log-level debug``.
- ``--log-level`` is accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, NoReturn

import trio

from evergreen_trio.errors import ConfigurationError, EvergreenTrioError, leaf_exceptions
from evergreen_trio.serving.signals import run_until_signal

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class UsageError(ConfigurationError):
    """A command-line argument, or a file it names, cannot be used; the message names it."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (the culprit, no usage dump), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return int(text)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def new_file(text: str) -> Path:
    """argparse type: a file to write, whose folder exists."""
    path = Path(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file in an existing folder, got {text!r} "
                                         f"({path.parent} is not a folder)")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file, got the folder {text!r}")
    return path


def log_level(text: str) -> str:
    """argparse type: a logging level name, any case; returns it upper-case."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", type=log_level, default=default, metavar="LEVEL",
                        help=f"{', '.join(LOG_LEVELS)} (default: info); debug also shows tracebacks")


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` on ``parser`` and on every subcommand below it, so it may come before or after.

    The subcommands' copies default to "not given", so a level given before the subcommand stays.
    """
    _add_log_level(parser, "INFO")
    for sub in _subcommands(parser):
        _add_log_level(sub, argparse.SUPPRESS)


def _subcommands(parser: argparse.ArgumentParser) -> Iterable[argparse.ArgumentParser]:
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    sub.set_defaults(prog=sub.prog)
                    yield sub
                    yield from _subcommands(sub)


def add_dataclass_options(
    parser: argparse._ActionsContainer, cls: type[Any], helps: Mapping[str, str], *, prefix: str = ""
) -> None:
    """One ``--{prefix}field-name`` option per field of the dataclass ``cls`` named in ``helps``.

    Each takes its type and default from the field's default.
    """
    for field in fields(cls):
        if field.name in helps:
            default = field.default
            assert default is not MISSING, field.name
            parser.add_argument(
                f"--{prefix}{field.name.replace('_', '-')}", type=type(default), default=default,
                help=f"{helps[field.name]} (default: %(default)s)",
            )


def dataclass_options(args: argparse.Namespace, cls: type[Any], helps: Mapping[str, str], *,
                      prefix: str = "") -> dict[str, Any]:
    """The values of the options ``add_dataclass_options`` added (``prefix`` with ``_`` for ``-``)."""
    return {f.name: getattr(args, prefix + f.name) for f in fields(cls) if f.name in helps}


class StartError(EvergreenTrioError):
    """A server could not start listening (its address is in use, not local, not allowed)."""


def serve_until_signal(
    run: Callable[..., Any],
    *args: object,
    started: Callable[[Any], object],
    address: str | None = None,
    drain: Callable[[], Awaitable[object]] | None = None,
) -> int:
    """Run a server (``run(*args, task_status=...)``) until SIGINT or SIGTERM; exit status 0.

    ``started`` gets what the server reports once it listens (print the address there). An
    OSError before that (a port in use) becomes a :class:`StartError` naming ``address``.
    ``drain`` runs on the first signal before the server is cancelled (:func:`run_until_signal`).
    """
    listening = False

    def on_started(value: object) -> None:
        nonlocal listening
        listening = True
        started(value)

    try:
        trio.run(lambda: run_until_signal(run, *args, started=on_started, drain=drain))
    except Exception as error:
        reasons = [leaf for leaf in leaf_exceptions(error) if isinstance(leaf, OSError)]
        if listening or address is None or not reasons:
            raise
        raise StartError(f"cannot listen on {address}: {_one_line(str(reasons[0]))}") from error
    return 0


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def describe_failure(error: BaseException) -> tuple[int, str] | None:
    """The exit status and the one-line message for ``error`` (exception groups opened), or None.

    None: only cancellation or interruption inside (the command was stopped, not failed).
    """
    leaves = [leaf for leaf in leaf_exceptions(error) if isinstance(leaf, Exception)]
    if not leaves:
        return None
    culprit = next((leaf for leaf in leaves if isinstance(leaf, ConfigurationError)), leaves[0])
    if isinstance(culprit, ConfigurationError):
        return EXIT_USAGE, _one_line(str(culprit))
    if isinstance(culprit, EvergreenTrioError | OSError):
        return EXIT_FAILURE, _one_line(str(culprit)) or type(culprit).__name__
    return EXIT_FAILURE, _one_line(f"{type(culprit).__name__}: {culprit} (--log-level debug shows the traceback)")


def run_command(prog: str, command: Callable[[], int], *, debug: bool) -> int:
    """Run ``command`` and turn what escapes it into an exit status and one line on stderr."""
    try:
        return command()
    except SystemExit:
        raise
    except BaseException as error:  # every failure becomes one line; Ctrl-C before the handler, a quiet 130
        if debug:
            traceback.print_exception(error)
        failure = describe_failure(error)
        if failure is None:
            logging.getLogger(__name__).info("stopped reason=interrupt")
            return EXIT_INTERRUPTED
        status, message = failure
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return status
