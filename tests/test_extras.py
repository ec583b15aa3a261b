"""The core install is Evergreen sessions; each other part names its extra when that is missing.

The real thing runs in CI (`make wheel-smoke`: the wheel with no extras in a fresh venv); here a
module is hidden (``sys.modules[name] = None`` makes importing it fail) in a child interpreter.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import evergreen_trio
from evergreen_trio._extras import EXTRA_MODULES

ROOT = Path(__file__).parents[1]
OPTIONAL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
PARTS = [
    ("evergreen_trio.picker", "picker"),
    ("evergreen_trio.avp", "avp"),
    ("evergreen_trio.avp.client", "avp"),
    ("evergreen_trio.ipc", "ipc"),
    ("evergreen_trio.arrow_refs", "ipc"),
    ("evergreen_trio.sim", "sim"),
    ("evergreen_trio.stack.gateway", "gateway"),
    ("evergreen_trio.generate.backend", "generate"),
    ("evergreen_trio.testing.strategies", "testing"),
    ("evergreen_trio.testing.wire", "testing"),
    ("evergreen_trio.testing.conformance", "testing"),
    ("evergreen_trio.picker.tracing", "tracing"),
]
CORE_MODULES = ("evergreen_trio", "evergreen_trio.serving.server", "evergreen_trio.client", "evergreen_trio.actions",
                "evergreen_trio.refs", "evergreen_trio.generate", "evergreen_trio.testing.pytest_plugin")


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def requirements(extra: str) -> set[str]:
    """The distributions ``extra`` installs, following ``evergreen-trio[...]`` references."""
    found: set[str] = set()
    for requirement in OPTIONAL[extra]:
        name = re.split(r"[\s<>=;!~\[]", requirement, maxsplit=1)[0].lower()
        if name == "evergreen-trio":
            for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):  # type: ignore[union-attr]
                found |= requirements(inner.strip())
        else:
            found.add(name.replace("_", "-"))
    return found


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_each_checked_module_comes_with_its_extra(extra: str) -> None:
    owners = importlib.metadata.packages_distributions()
    for module in EXTRA_MODULES[extra]:
        top = module.split(".")[0]
        if top not in owners:
            pytest.skip(f"{top} is not installed here")
        dists = {d.lower().replace("_", "-") for d in owners[top]}
        assert dists & requirements(extra), f"{module} ({dists}) is not in the {extra!r} extra of pyproject.toml"


def test_all_has_every_extra_but_gpu() -> None:
    # latency-predictor: the real llm-d latency predictor's servers, which the suite runs (a test extra).
    left_out = ("gpu", "ucx-cu13", "gpu-cu13", "test", "bench", "docs", "latency-predictor")
    everything = set().union(*(requirements(extra) for extra in OPTIONAL if extra not in left_out))
    assert requirements("all") == everything


def test_the_cuda_13_extras_mirror_the_cuda_12_ones() -> None:
    for extra, cuda13 in (("ucx", "ucx-cu13"), ("gpu", "gpu-cu13")):
        assert {name.replace("cu12", "cu13").replace("cuda12x", "cuda13x") for name in requirements(extra)} == \
            requirements(cuda13)


HIDDEN = {"evergreen_trio.avp": "isal"}
"""The module hidden for a part that needs only some of its extra (else the extra's last)."""


@pytest.mark.parametrize(("part", "extra"), PARTS)
def test_a_part_without_its_extra_names_it(part: str, extra: str) -> None:
    hidden = HIDDEN.get(part, EXTRA_MODULES[extra][-1].split(".")[0])
    done = python(f"import sys; sys.modules[{hidden!r}] = None; import {part}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("evergreen_trio._extras.MissingExtraError: ")
    assert f"pip install 'evergreen-trio[{extra}]'" in last and f"(missing: {hidden})" in last


def test_the_avp_codec_needs_no_http_server_or_client() -> None:
    # A module imports what it uses: the codec round trip with hypercorn and httpx hidden.
    done = python("import sys; sys.modules['hypercorn'] = sys.modules['httpx'] = None\n"
                  "import numpy as np, evergreen_trio.avp as avp\n"
                  "payload = np.arange(6, dtype='<f4')\n"
                  "assert avp.decode(avp.encode(payload, avp.AVPMetadata())).payload == payload.tobytes()")
    assert done.returncode == 0, done.stderr


def test_core_imports_no_optional_module() -> None:
    optional = sorted({m.split(".")[0] for modules in EXTRA_MODULES.values() for m in modules})
    done = python(f"import sys, {', '.join(CORE_MODULES)}; print(sorted(m for m in {optional!r} if m in sys.modules))")
    assert done.stdout.strip() == "[]", f"the core install would need {done.stdout.strip()}"


def test_a_command_without_its_extra_is_one_line_and_exit_2() -> None:
    done = python("import sys; sys.modules['yaml'] = None\n"
                  "from evergreen_trio.cli import main\n"
                  "sys.exit(main(['picker', '--config', 'pool.yaml', '--grpc-port', '0']))")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "evergreen-trio picker: error: evergreen_trio.picker needs the 'picker' extra: "
        "pip install 'evergreen-trio[picker]' (missing: yaml)"]
    done = python("import sys; sys.modules['yaml'] = None\n"
                  "from evergreen_trio.cli import main\n"
                  "sys.exit(main(['--help']))")
    assert done.returncode == 0 and "(needs: pip install 'evergreen-trio[picker]')" in done.stdout


def test_version_is_pyprojects() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert evergreen_trio.__version__ == project["version"] == importlib.metadata.version("evergreen-trio")
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stdout == f"evergreen-trio {project['version']}\n"


def test_the_testing_extra_brings_what_the_plugins_fixtures_run_on() -> None:
    """The plugin's async fixtures need pytest-trio; a user installing the kit gets it."""
    names = {re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0] for requirement in OPTIONAL["testing"]}
    assert {"pytest", "pytest-trio", "hypothesis", "grpcio"} <= names
