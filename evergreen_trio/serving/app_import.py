"""Your server by import string, as uvicorn takes ``module:app``: ``serve --app MODULE:FACTORY`` and
the pytest plugin's ``evergreen_app`` setting load it with :func:`load_app`.

``FACTORY`` names a :class:`~evergreen_trio.Server`, or a callable that takes no arguments and
returns one. The current directory is importable, as it is for ``python -m``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from evergreen_trio.errors import ConfigurationError
from evergreen_trio.serving.server import Server


class AppImportError(ConfigurationError):
    """An import string that gives no Server; the message names the string and the missing piece."""


def load_app(spec: str) -> Server:
    """The Server ``spec`` (``MODULE:FACTORY``) names, importing MODULE and calling FACTORY if it is callable.

    Raises :class:`AppImportError` (one line) for a malformed string, a module that cannot be
    imported, a missing attribute, a factory that raises, or anything that is not a Server.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute.isidentifier():
        raise AppImportError(f"{spec!r}: expected MODULE:FACTORY, e.g. myproject.agent:make_server")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as missing:
        if missing.name is not None and (module_name + ".").startswith(missing.name + "."):
            raise AppImportError(f"{spec!r}: no module named {missing.name!r}") from None
        raise AppImportError(f"{spec!r}: importing {module_name} failed: {_one_line(missing)}") from missing
    except Exception as error:  # the user's module raised while importing
        raise AppImportError(f"{spec!r}: importing {module_name} failed: {_one_line(error)}") from error
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise AppImportError(f"{spec!r}: module {module_name!r} has no attribute {attribute!r}") from None
    app = target
    if not isinstance(target, Server) and callable(target):
        try:
            app = target()
        except Exception as error:
            raise AppImportError(f"{spec!r}: {attribute}() raised {_one_line(error)}") from error
        if inspect.isawaitable(app):
            if inspect.iscoroutine(app):
                app.close()
            raise AppImportError(f"{spec!r}: {attribute}() is async; expected a plain function returning a Server")
    if not isinstance(app, Server):
        got = f"{attribute}() returned {type(app).__name__}" if app is not target else f"got {type(app).__name__}"
        raise AppImportError(f"{spec!r}: expected a Server or a callable returning one, {got}")
    return app


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
