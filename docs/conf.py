"""Sphinx configuration: the guides in docs/*.md (MyST) and the API reference from docstrings (autodoc).

Build with ``make docs`` (warnings are errors); the site lands in build/docs/html.
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout even where it is not installed

project = "evergreen-trio"
release = _version("evergreen-trio")
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_heading_anchors = 4  # the guides link to each other's sections (file.md#slug)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "alabaster"
html_title = f"evergreen-trio {release}"
