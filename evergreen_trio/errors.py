"""The package-wide error base. Each protocol roots its own hierarchy here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class EvergreenTrioError(Exception):
    """Base of every error evergreen-trio raises on purpose.

    Subclasses say what was expected and what came, so a caller can log the
    message as it is and a test can match on the type.
    """


class ConfigurationError(EvergreenTrioError, ValueError):
    """A setting makes no sense (a limit, a config file, a command-line option); the message names it.

    Distinct from a limit crossed at run time: this one is raised before anything runs, and a
    command exits 2 on it.
    """


class ArgumentTypeError(EvergreenTrioError, TypeError):
    """A function of ours got an argument of the wrong kind; the message names the argument and what it takes."""


def describe_kind(value: object) -> str:
    """A value's type as an error message names it (``int``, ``evergreen_trio.nodes.Leaf``)."""
    return f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")


def leaf_exceptions(error: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``error``, depth first, with every (nested) exception group opened."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaf_exceptions(inner)
    else:
        yield error


def single_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception that explains ``group``: KeyboardInterrupt or SystemExit first, then an error
    of ours, then any other error, then the first leaf (a cancellation)."""
    leaves = list(leaf_exceptions(group))
    for wanted in ((KeyboardInterrupt, SystemExit), EvergreenTrioError, Exception):
        for leaf in leaves:
            if isinstance(leaf, wanted):
                return leaf
    return leaves[0] if leaves else group


@contextmanager
def plain_errors() -> Iterator[None]:
    """Let no exception group made by the nurseries inside leave: raise :func:`single_error` of it.

    Trio's rule for a library's nurseries: a caller writes ``except SessionAbortedError``, not
    ``except*``, and Ctrl-C ends a script with a plain KeyboardInterrupt.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = single_error(group)
        # Raised with its own cause and without the group as context, so a traceback shows it alone.
        raise error from error.__cause__
