"""Every Trio scheduling pass and task step of one whole session (``python -m benchmarks.session_passes``).

One process holds both ends on loopback, as ``python -m benchmarks session`` does. After 20 warm-up
sessions on one ``Client``, a ``trio.abc.Instrument`` logs each pass (an I/O wait returning), each task
step and each socket read and write of the next session, then prints the log: the map of where a
session's passes go (docs/production.md, "What a session costs").
"""

from __future__ import annotations

from typing import Any

import trio

from benchmarks.bench_session import new_server, one_echo
from evergreen_trio import Client
from evergreen_trio._grpc import sockets

LOG: list[str] = []


class Passes(trio.abc.Instrument):
    """Logs passes and task steps while ``on``."""

    on = False

    def after_io_wait(self, timeout: float) -> None:
        if self.on:
            LOG.append("---- pass")

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on:
            LOG.append(f"  {task.name}")


PASSES = Passes()


def _log_socket_io() -> None:
    send_all, receive_some, write_now = trio.SocketStream.send_all, trio.SocketStream.receive_some, sockets.write_now

    async def logged_send_all(self: trio.SocketStream, data: Any) -> None:
        if PASSES.on:
            LOG.append(f"      sends {len(data)} B")
        await send_all(self, data)

    async def logged_receive_some(self: trio.SocketStream, max_bytes: int | None = None) -> Any:
        data = await receive_some(self, max_bytes)
        if PASSES.on:
            LOG.append(f"      reads {len(data)} B")
        return data

    def logged_write_now(stream: trio.abc.Stream, data: Any) -> int:
        sent = write_now(stream, data)
        if PASSES.on and sent:
            LOG.append(f"      sends {sent} B")
        return sent

    trio.SocketStream.send_all = logged_send_all  # type: ignore[method-assign]
    sockets.write_now = logged_write_now  # type: ignore[assignment]
    trio.SocketStream.receive_some = logged_receive_some  # type: ignore[method-assign]


async def main() -> None:
    server = new_server()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with Client(f"127.0.0.1:{port}") as client:
            for _ in range(20):
                async with client.session() as session:
                    await one_echo(session, "x")
            PASSES.on = True
            LOG.append("caller: opens the session and runs ECHO")
            async with client.session() as session:
                await one_echo(session, "x")
                LOG.append("caller: has the echo; leaves the session")
            LOG.append("caller: the session is closed")
            PASSES.on = False
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    _log_socket_io()
    trio.run(main, instruments=[PASSES])
    print("\n".join(LOG))
    steps = sum(line.startswith("  ") and not line.startswith("    ") for line in LOG)
    print(f"\n{LOG.count('---- pass')} passes, {steps} task steps")
