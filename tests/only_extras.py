"""pytest plugin for tests/test_collection.py: import as if only some extras were installed.

``EVERGREEN_TRIO_ONLY_EXTRAS=ipc,testing pytest -p only_extras ...`` (with ``tests`` on ``PYTHONPATH``)
hides every top-level module that only the other extras of pyproject.toml bring (the developers'
``test``, ``bench`` and ``docs`` included): importing one raises ``ModuleNotFoundError`` and
``importlib.util.find_spec`` answers None, as in a venv with ``pip install 'evergreen-trio[ipc,testing]'
pytest pytest-trio`` (those two always stay). A module that the core dependencies or an allowed extra
also provide (``google``: protobuf) stays. ``-p`` plugins load before the entry-point ones, so the
hiding covers every import but pytest's own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=;!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def distributions(extras: Sequence[str]) -> set[str]:
    """The distributions these extras install, following ``evergreen-trio[...]`` references."""
    found: set[str] = set()
    for extra in extras:
        for requirement in PROJECT["optional-dependencies"][extra]:
            if _name(requirement) == "evergreen-trio":
                inner = re.search(r"\[(.*)\]", requirement)
                assert inner is not None, requirement
                found |= distributions([e.strip() for e in inner.group(1).split(",")])
            else:
                found.add(_name(requirement))
    return found


def hidden_modules(allowed: Sequence[str]) -> set[str]:
    """Top-level modules that only the extras outside ``allowed`` provide."""
    # pytest-xdist too: CI's two workers load it into every pytest, this one's child included.
    kept = (distributions(allowed) | {_name(r) for r in PROJECT["dependencies"]}
            | {"pytest", "pytest-trio", "pytest-xdist"})
    others = distributions([extra for extra in PROJECT["optional-dependencies"] if extra not in allowed]) - kept
    owners = importlib.metadata.packages_distributions()
    return {top for top, dists in owners.items()
            if {d.lower().replace("_", "-") for d in dists} <= others}


class _Hide(importlib.abc.MetaPathFinder):
    """Importing a hidden module (or one inside it) fails as if it were not installed."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> None:
        if fullname.split(".")[0] in _hidden:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by only_extras)", name=fullname)


def _find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec``, None for a hidden module (as for a missing one)."""
    if name.split(".")[0] in _hidden:
        return None
    return _real_find_spec(name, package)


_allowed = [e for e in os.environ.get("EVERGREEN_TRIO_ONLY_EXTRAS", "").split(",") if e]
_hidden = hidden_modules(_allowed)
_loaded = sorted(_hidden & set(sys.modules))
if _loaded:
    raise RuntimeError(f"only_extras: {_loaded} were imported before the plugin could hide them")
# Not `sys.modules[name] = None`: libraries test `name in sys.modules` (hypothesis does, for numpy).
sys.meta_path.insert(0, _Hide())
_real_find_spec = importlib.util.find_spec
importlib.util.find_spec = _find_spec
