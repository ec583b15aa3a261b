"""Reading the package's own source in tests."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``ast.parse`` with the collector off: CPython 3.11.7 raises "AST constructor recursion depth
    mismatch" when a collection during the parse runs a finalizer (gh-106905)."""
    gc.disable()
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    finally:
        gc.enable()
