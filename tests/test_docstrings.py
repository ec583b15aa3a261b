"""Every public name has a docstring: what the API reference (``make docs``) is built from.

Walks every module of ``evergreen_trio`` that declares ``__all__`` (the package faces, found by
walking, so a new one is covered without a list to update). For each exported name:

- a class or function has its own docstring (a dataclass's generated ``Name(field, ...)`` does
  not count), and so has each public method and property the class defines itself (one it
  overrides may inherit its base's, as ``inspect.getdoc`` and Sphinx do);
- a constant has an attribute docstring: a string literal right after its assignment in the
  module that defines it.

A face whose extra is not installed is skipped, naming the extra.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import itertools
import pkgutil
from pathlib import Path
from types import ModuleType

import pytest
from sources import parse

import evergreen_trio
from evergreen_trio._extras import MissingExtraError

PACKAGE = Path(evergreen_trio.__file__).parent


def _public_modules() -> list[str]:
    names = ["evergreen_trio"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="evergreen_trio."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names



def _assigned_names(path: Path) -> set[str]:
    names = set()
    for node in parse(path).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def _faces() -> list[str]:
    """Public modules whose source declares ``__all__`` (read, not imported: extras may be missing)."""
    faces = []
    for name in _public_modules():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        if "__all__" in _assigned_names(Path(spec.origin)):
            faces.append(name)
    return faces


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except MissingExtraError as exc:
        pytest.skip(f"{name} needs the {exc.extra!r} extra")


def _own_doc(value: object) -> str:
    doc = vars(value).get("__doc__") if inspect.isclass(value) else getattr(value, "__doc__", None)
    return (doc or "").strip()


def _attribute_documented(name: str) -> bool:
    """Whether some module of the package assigns ``name`` at top level followed by a string literal."""
    for path in PACKAGE.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        body = parse(path).body
        for node, following in itertools.pairwise(body):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(
                    following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(
                    following.value.value, str):
                return True
    return False


def _undocumented_members(cls: type) -> list[str]:
    missing = []
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        documented = value if isinstance(value, property) else getattr(cls, attr)
        is_member = isinstance(value, property) or inspect.isfunction(value)
        if is_member and not (inspect.getdoc(documented) or "").strip():
            missing.append(attr)
    return missing


@pytest.mark.parametrize("face", _faces())
def test_every_public_name_has_a_docstring(face: str) -> None:
    module = _import(face)
    assert (module.__doc__ or "").strip(), f"{face} has no module docstring"
    missing = []
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value):
            doc = _own_doc(value)
            if not doc or doc.startswith(f"{name}("):
                missing.append(name)
            if value.__module__.startswith("evergreen_trio"):
                missing += [f"{name}.{attr}" for attr in _undocumented_members(value)]
        elif inspect.isroutine(value):
            if not _own_doc(value):
                missing.append(name)
        elif not inspect.ismodule(value) and not _attribute_documented(name):
            missing.append(name)
    assert not missing, f"{face}: no docstring on {missing}"


def test_the_walk_finds_the_package_faces() -> None:
    assert {"evergreen_trio", "evergreen_trio.dag", "evergreen_trio.picker"} <= set(_faces())
