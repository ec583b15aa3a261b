"""`make docs`'s build, as CI runs it: Sphinx with warnings as errors over the guides and the API reference.

A broken link between guides, a page left out of the site or a docstring autodoc cannot render fails
here. Skipped, naming the extra, where the ``docs`` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

needs_docs_extra = pytest.mark.skipif(
    not all(importlib.util.find_spec(module) for module in ("sphinx", "myst_parser")),
    reason="the docs build needs the docs extra: pip install -e '.[docs]'",
)


@needs_docs_extra
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"),
         "docs", str(tmp_path / "html")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    html = tmp_path / "html"
    guides = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert guides <= {p.stem for p in html.glob("*.html")}, "a guide in docs/ is not part of the site"
    reference = (html / "api" / "evergreen_trio.html").read_text()
    assert 'id="evergreen_trio.Server"' in reference and 'id="evergreen_trio.connect"' in reference


def test_every_package_face_has_a_reference_page() -> None:
    """A module that declares ``__all__`` (outside private packages) is a face: docs/api must document it."""
    package = ROOT / "evergreen_trio"
    faces = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if any(part.startswith("_") for part in parts[1:-1]) or not re.search(r"^__all__\b", path.read_text(), re.M):
            continue
        faces.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("*.rst")}
    assert faces == pages, f"faces without a page: {sorted(faces - pages)}; pages of no face: {sorted(pages - faces)}"
