"""The pytest plugin serving a user's own Server, as a user's project meets it: a subprocess pytest
run in a folder holding their module, their conftest.py (an ``evergreen_app`` fixture) or their
ini setting (``evergreen_app = MODULE:FACTORY``), and their tests, @given ones included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from user_app import APP

ROOT = Path(__file__).parents[2]

CONFTEST = '''
import pytest
from agentapp import make_server

@pytest.fixture
def evergreen_app():
    return make_server()
'''

ASYNC_TESTS = '''
from hypothesis import HealthCheck, given, settings, strategies as st
from evergreen_trio import text
from evergreen_trio.testing.serving import open_session

SEEN = []

async def test_the_session_fixture_serves_my_app(evergreen_session):
    call = await evergreen_session.run("UPPER", {"input": text("mine")}, ["output"])
    assert await call["output"].read_text() == "MINE"

@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.text(alphabet="abc", max_size=5))
async def test_each_example_gets_its_own_server(evergreen_app, words):
    async with open_session(evergreen_app) as session:
        call = await session.run("UPPER", {"input": text(words)}, ["output"])
        assert await call["output"].read_text() == words.upper()
    SEEN.append(words)

def test_every_example_ran():
    assert len(SEEN) >= 2
'''

MISUSE = '''
from hypothesis import HealthCheck, given, settings, strategies as st

@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers())
async def test_fixture_under_given(evergreen_session, number):
    pass
'''

PROCESS_TESTS = '''
import trio
from evergreen_trio import connect, text

def test_the_process_fixture_serves_my_app(evergreen_server_process):
    async def upper():
        async with connect(evergreen_server_process.address, timeout=30) as session:
            call = await session.run("UPPER", {"input": text("child")}, ["output"])
            return await call["output"].read_text()
    assert trio.run(upper) == "CHILD"

async def test_the_default_app_fixture_loads_the_setting_too(evergreen_session):
    call = await evergreen_session.run("UPPER", {"input": text("too")}, ["output"])
    assert await call["output"].read_text() == "TOO"
'''


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False)


def project(tmp_path: Path, ini: str = "") -> Path:
    (tmp_path / "agentapp.py").write_text(APP)
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntrio_mode = true\n{ini}")
    return tmp_path


def test_a_conftest_evergreen_app_is_what_the_fixtures_serve_even_under_given(tmp_path: Path) -> None:
    folder = project(tmp_path)
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_mine.py").write_text(ASYNC_TESTS)
    done = pytest_in(folder)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout


def test_the_session_fixture_under_given_fails_saying_what_to_do(tmp_path: Path) -> None:
    folder = project(tmp_path)
    (folder / "test_misuse.py").write_text(MISUSE)
    done = pytest_in(folder)
    assert done.returncode == 1
    assert "open_session(evergreen_app)" in done.stdout, done.stdout[-4000:]


def test_the_ini_setting_serves_the_app_in_process_and_in_a_child_process(tmp_path: Path) -> None:
    folder = project(tmp_path, "evergreen_app = agentapp:make_server\n")
    (folder / "test_process.py").write_text(PROCESS_TESTS)
    done = pytest_in(folder)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
