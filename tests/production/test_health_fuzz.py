"""Any service name a health client sends gets an answer, and the server keeps serving."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.serving.server import SERVICE
from evergreen_trio.testing.wire import health_status


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    process = subprocess.Popen([sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    yield line.split()[3]
    process.terminate()
    process.wait(60)


@given(name=st.text(max_size=300))
def test_any_service_name_is_answered(address: str, name: str) -> None:
    expected = {"": "SERVING", SERVICE: "SERVING", "liveness": "SERVING"}.get(name, "NOT_FOUND")
    assert health_status(address, name) == expected
