"""The package-wide error base. Each protocol roots its own hierarchy here."""

from __future__ import annotations


class EvergreenTrioError(Exception):
    """Base of every error evergreen-trio raises on purpose.

    Subclasses say what was expected and what came, so a caller can log the
    message as it is and a test can match on the type.
    """
