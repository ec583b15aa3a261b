"""pytest plugin (entry point ``evergreen_trio``): your Evergreen server, served in-process or in a
child process, and a connected client.

- ``evergreen_app``: the :class:`~evergreen_trio.Server` the fixtures serve. By default the one the
  ini setting ``evergreen_app = MODULE:FACTORY`` names (as ``serve --app`` takes it), else ours with
  the built-in actions; define a fixture of that name in your ``conftest.py`` to serve another.
- ``evergreen_server`` (pytest-trio) serves it on a free loopback port and yields ``host:port``;
  ``evergreen_session`` yields a :class:`~evergreen_trio.ClientSession` connected to it.
- For synchronous tests (hypothesis state machines): ``evergreen_server_process`` runs the server in
  a child process (``serve --app`` when the ini setting names your app) and ``evergreen_wire_client``
  is a grpcio client of it.

Under hypothesis's ``@given`` each example is its own ``trio.run``, which async fixtures cannot
follow: serve one per example with :func:`~evergreen_trio.testing.serving.open_session` (docs/testing.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import trio

from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientSession, connect
from evergreen_trio.serving.app_import import load_app
from evergreen_trio.serving.server import Server
from evergreen_trio.testing.subprocess_server import ServerProcess, spawn_app, spawn_server

if TYPE_CHECKING:
    from evergreen_trio.testing.wire import SyncClient

APP_SETTING = "evergreen_app"


def pytest_addoption(parser: pytest.Parser) -> None:
    """The ini setting naming the app the fixtures serve."""
    parser.addini(APP_SETTING, "MODULE:FACTORY of the evergreen_trio.Server the evergreen_* fixtures serve "
                               "(as `evergreen-trio serve --app` takes it)", default="")


def _app_spec(config: pytest.Config) -> str:
    spec = config.getini(APP_SETTING)
    return spec.strip() if isinstance(spec, str) else ""


@pytest.fixture
def evergreen_app(pytestconfig: pytest.Config) -> Server:
    """The Server the fixtures serve: the ini setting ``evergreen_app``'s, else ours with ECHO and
    GENERATE. Override this fixture in your conftest.py to serve your own."""
    spec = _app_spec(pytestconfig)
    if spec:
        return load_app(spec)
    server = Server()
    register_builtin_actions(server)
    return server


@pytest.fixture
async def evergreen_server(nursery: trio.Nursery, evergreen_app: Server, request: pytest.FixtureRequest,
                           ) -> AsyncIterator[str]:
    """``evergreen_app`` served on a free loopback port for the test; yields its ``host:port``."""
    if getattr(request.function, "is_hypothesis_test", False):
        pytest.fail("evergreen_server/evergreen_session serve one test, not each @given example (each is its own "
                    "trio.run): use `async with open_session(evergreen_app)` from evergreen_trio.testing.serving "
                    "inside the test", pytrace=False)
    port = await nursery.start(evergreen_app.serve, "127.0.0.1", 0)
    yield f"127.0.0.1:{port}"


@pytest.fixture
async def evergreen_session(evergreen_server: str) -> AsyncIterator[ClientSession]:
    """A session connected to ``evergreen_server``."""
    async with connect(evergreen_server) as session:
        yield session


@pytest.fixture
def evergreen_server_process(pytestconfig: pytest.Config) -> Iterator[ServerProcess]:
    """The server in a child process (real process separation: it can be killed, and its memory is
    its own): ``serve --app`` of the ini setting ``evergreen_app``, else ours with the built-in
    actions; ``.address`` is its ``host:port``."""
    spec = _app_spec(pytestconfig)
    with spawn_app(spec) if spec else spawn_server() as server:
        yield server


@pytest.fixture
def evergreen_wire_client(evergreen_server_process: ServerProcess) -> Iterator[SyncClient]:
    """A synchronous grpcio client of ``evergreen_server_process``, for hypothesis properties
    and state machines (``evergreen_trio.testing.machine.machine_for``)."""
    from evergreen_trio.testing.wire import SyncClient

    with SyncClient(evergreen_server_process.address) as client:
        yield client
