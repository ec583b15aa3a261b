"""The transport of each URI scheme. UCX is imported only when a ``ucx://`` URI is used."""

from __future__ import annotations

from collections.abc import Callable

from evergreen_trio.ipc.errors import UriError
from evergreen_trio.ipc.transports.base import Transport
from evergreen_trio.ipc.transports.shm import ShmTransport
from evergreen_trio.ipc.transports.tcp import TcpTransport


def _ucx() -> Transport:
    from evergreen_trio.ipc.transports.ucx import UcxTransport

    return UcxTransport()


TRANSPORTS: dict[str, Callable[[], Transport]] = {"tcp": TcpTransport, "shm": ShmTransport, "ucx": _ucx}


def transport_for(scheme: str) -> Transport:
    """The transport serving ``scheme``; raises UriError for a scheme no transport serves."""
    try:
        return TRANSPORTS[scheme]()
    except KeyError:
        raise UriError(f"transport: expected one of {sorted(TRANSPORTS)}, got {scheme!r}") from None
