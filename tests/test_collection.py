"""Each test folder collects with only the extras its tests use; a module needing another skips naming it.

A fresh venv per extra would cost minutes per run, so the child pytest loads ``tests/only_extras.py``,
which hides what the other extras bring (a meta-path finder that fails their imports) before any plugin
or conftest imports. CI also runs ``tests/ipc`` in a real venv with only ``[ipc,testing]`` (``make test-minimal``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def collect(folder: str, extras: str) -> list[str]:
    """The child's summary lines (skips, errors, the count) after it collected ``folder``."""
    env = {**os.environ, "EVERGREEN_TRIO_ONLY_EXTRAS": extras,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "only_extras", "--collect-only", "-q", "-rs",
                           folder], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if "::" not in line and line.strip()]
    assert not [line for line in summary if line.startswith("ERROR")], summary
    skipped = [line for line in summary if line.startswith("SKIPPED")]
    assert all("extra" in line for line in skipped), skipped
    return summary


def test_the_core_install_collects_every_folder_and_skips_naming_the_extras() -> None:
    summary = collect("tests", "testing")
    assert any("needs the 'picker' extra" in line for line in summary)
    assert any("pip install 'evergreen-trio[ipc]'" in line for line in summary)


def test_ipc_collects_whole_with_only_its_extra() -> None:
    summary = collect("tests/ipc", "ipc,testing")
    assert not [line for line in summary if line.startswith("SKIPPED")], summary


@pytest.mark.parametrize(("folder", "extras"), [("tests/avp", "avp,testing"), ("tests/picker", "picker,testing")])
def test_a_folder_collects_with_its_extra(folder: str, extras: str) -> None:
    count = collect(folder, extras)[-1].split()[0]
    assert int(count) > 0
