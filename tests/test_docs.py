"""`make docs`'s build, as CI runs it: Sphinx with warnings as errors over the guides and the API reference.

A broken link between guides, a page left out of the site or a docstring autodoc cannot render fails
here. Skipped, naming the extra, where the ``docs`` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(module) for module in ("sphinx", "myst_parser")),
    reason="the docs build needs the docs extra: pip install -e '.[docs]'",
)


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
