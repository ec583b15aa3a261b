"""The Trio shell of :mod:`evergreen_trio.picker.grpc_wire`: a TCP listener, one task per connection.

Each connection task reads, feeds the sans-IO connection (which calls the stream processors
synchronously) and writes everything queued in one ``send_all``: an ext_proc request costs one
read and one write here, with no asyncio loop and no Trio/asyncio crossing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from evergreen_trio.picker.grpc_wire import GrpcWireConnection, SyncBidiMethod, WireLimits

log = logging.getLogger(__name__)
RECEIVE_BYTES = 256 * 1024


async def _serve_connection(
    methods: dict[str, SyncBidiMethod[Any, Any]], limits: WireLimits, stream: trio.SocketStream
) -> None:
    connection = GrpcWireConnection(methods, limits)
    async with stream:
        try:
            await stream.send_all(connection.data_to_send())
            while not connection.closed:
                data = await stream.receive_some(RECEIVE_BYTES)
                if not data:
                    return
                connection.receive_data(data)
                out = connection.data_to_send()
                if out:
                    await stream.send_all(out)
        except trio.BrokenResourceError as exc:
            log.debug("grpc_wire.connection_lost error=%s", exc)


async def serve_sync_bidi(
    methods: Sequence[SyncBidiMethod[Any, Any]],
    host: str,
    port: int,
    *,
    limits: WireLimits | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``methods`` over gRPC on ``host:port`` until cancelled; ``started`` gets the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound: int = listeners[0].socket.getsockname()[1]
    table = {m.path: m for m in methods}
    log.info("grpc_wire.listening host=%s port=%d", host, bound)
    task_status.started(bound)
    await trio.serve_listeners(partial(_serve_connection, table, limits or WireLimits()), listeners)
