"""The package-wide error base. Each protocol roots its own hierarchy here."""

from __future__ import annotations

from collections.abc import Iterator


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


def leaf_exceptions(error: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``error``, depth first, with every (nested) exception group opened."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaf_exceptions(inner)
    else:
        yield error
