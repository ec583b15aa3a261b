"""The Pythons we claim are the ones CI tests: requires-python, the classifiers and ``.ci/run`` agree."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def ci_pythons() -> list[str]:
    found = re.search(r'^PYTHONS="([^"]*)"$', (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert found is not None, ".ci/run names its Pythons in PYTHONS=\"...\""
    return found.group(1).split()


def test_classifiers_name_exactly_the_pythons_ci_runs() -> None:
    prefix = "Programming Language :: Python :: 3."
    claimed = [c.removeprefix("Programming Language :: Python :: ") for c in PROJECT["classifiers"]
               if c.startswith(prefix)]
    assert claimed == ci_pythons()


def test_requires_python_spans_exactly_the_pythons_ci_runs() -> None:
    minors = [int(version.split(".")[1]) for version in ci_pythons()]
    assert minors == list(range(minors[0], minors[-1] + 1))
    assert PROJECT["requires-python"] == f">=3.{minors[0]},<3.{minors[-1] + 1}"


def test_this_python_is_one_we_claim() -> None:
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in ci_pythons()
