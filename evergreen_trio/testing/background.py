"""An in-process server on its own Trio thread, for synchronous test code (hypothesis state
machines, grpcio clients) that cannot run inside the test's event loop.

This is the one bridge of the testing kit that needs a thread: the server runs its own
``trio.run`` there, and leaving the block cancels it and joins the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from evergreen_trio.errors import EvergreenTrioError
from evergreen_trio.server import Server


class BackgroundServerError(EvergreenTrioError):
    """The background server failed to start or crashed."""


@dataclass
class BackgroundServer:
    server: Server
    address: str


@contextmanager
def serve_in_thread(server: Server, host: str = "127.0.0.1", *, start_timeout: float = 30.0) -> Iterator[
    BackgroundServer
]:
    """Serve ``server`` on a free port of ``host`` from a thread until the block exits."""
    ready = threading.Event()
    state: dict[str, object] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            state["token"] = trio.lowlevel.current_trio_token()
            state["scope"] = nursery.cancel_scope
            state["port"] = await nursery.start(server.serve, host, 0)
            ready.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the caller at exit
            state["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="evergreen-test-server", daemon=True)
    thread.start()
    ready.wait(start_timeout)
    if "port" not in state:
        raise BackgroundServerError(f"the server did not start: {state.get('error')!r}")
    try:
        yield BackgroundServer(server, f"{host}:{state['port']}")
    finally:
        scope = state["scope"]
        assert isinstance(scope, trio.CancelScope)
        token = state["token"]
        assert isinstance(token, trio.lowlevel.TrioToken)
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join()
    if "error" in state:
        raise BackgroundServerError(f"the server crashed: {state['error']!r}") from state["error"]  # type: ignore[misc]
