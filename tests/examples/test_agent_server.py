"""examples/agent_server.py as its docstring says to run it: as a script, and under
``evergreen-trio serve --app``; examples/agent_tool_client.py asks it a question each time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "agent_server.py", "--port", "0"],
        [sys.executable, "-m", "evergreen_trio.cli", "serve", "--app", "agent_server:make_server", "--port", "0"],
    ],
    ids=["script", "serve-app"],
)
def test_the_agent_answers_through_the_client_tool_and_stops_on_sigterm(command: list[str]) -> None:
    server = subprocess.Popen(command, cwd=EXAMPLES, env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()
        found = re.search(r" on (\S+)", ready)
        assert found, ready
        asked = subprocess.run([sys.executable, "agent_tool_client.py", found.group(1), "What is Trio?"],
                               cwd=EXAMPLES, env=_env(), capture_output=True, text=True, timeout=120, check=False)
        assert asked.returncode == 0, asked.stderr[-3000:]
        assert asked.stdout == "From what your tool found: Trio is a Python library for structured concurrency.\n"
    finally:
        server.send_signal(signal.SIGTERM)
        status = server.wait(timeout=60)
        if server.stdout is not None:
            server.stdout.close()
    assert status == 0


def test_the_agents_property_tests_pass_as_a_user_runs_them() -> None:
    """examples/test_agent_properties.py: the kit driving the agent's own action, served by ``serve --app``."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_agent_properties.py"],
                          cwd=EXAMPLES, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]
