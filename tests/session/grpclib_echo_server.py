"""A grpclib (``h2``) echo server in a process of its own, for the client wire's tests: prints its port,
then serves until its stdin closes."""

from __future__ import annotations

import asyncio
import sys

from grpclib.server import Server

from benchmarks.grpclib_echo import Echo


async def main() -> None:
    server = Server([Echo()])
    await server.start("127.0.0.1", 0)
    print(server._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(main())
