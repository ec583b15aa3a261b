"""CHANGELOG.md keeps Keep a Changelog's shape and has an entry for the version pyproject declares."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_changelog_has_unreleased_and_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert headings[0] == ("Unreleased", ""), "the first section is [Unreleased]"
    assert any(name == version and date for name, date in headings), f"no dated '## [{version}] - YYYY-MM-DD'"
    sections = set(re.findall(r"^### (\w+)$", text, re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections
