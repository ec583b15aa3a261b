"""Dissociated IPC URIs: ``scheme://host:port/path?want_data=..&free_data=..&remote_handle=..``."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from evergreen_trio.ipc.errors import UriError
from evergreen_trio.ipc.framing import UINT64_MAX, WANT_DATA_TAG

SCHEMES = ("ucx", "tcp", "shm")


@dataclass(frozen=True)
class IpcUri:
    """A parsed URI. ``path`` is the Unix socket of ``shm``; ``host``/``port`` the rest."""

    scheme: str
    want_data: int
    host: str = ""
    port: int = 0
    path: str = ""
    free_data: int | None = None
    remote_handle: bytes | None = None

    def __str__(self) -> str:
        query = [f"want_data={self.want_data}"]
        if self.free_data is not None:
            query.append(f"free_data={self.free_data}")
        if self.remote_handle is not None:
            query.append("remote_handle=" + quote(base64.b64encode(self.remote_handle).decode(), safe=""))
        netloc = f"{self.host}:{self.port}" if self.host else ""
        if ":" in self.host:
            netloc = f"[{self.host}]:{self.port}"
        return f"{self.scheme}://{netloc}{quote(self.path)}?{'&'.join(query)}"


def _uint64(name: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # str.isdigit() alone admits '²', which int() refuses
        raise UriError(f"{name}: expected a decimal uint64, got {text!r}")
    value = int(text)
    if value > UINT64_MAX:
        raise UriError(f"{name}: expected <= {UINT64_MAX}, got {value}")
    return value


def parse_uri(text: str, *, listen: bool = False) -> IpcUri:
    """Parse and validate a URI; ``want_data`` is required.

    With ``listen`` (the address a server binds): ``want_data`` may be left out (the
    server's own tags are advertised), port 0 picks a free port, an ``shm`` path may be
    left out (a fresh one is made) and the host defaults to 127.0.0.1. Raises UriError.
    """
    try:
        parts = urlsplit(text)
        port = parts.port or 0
    except ValueError as exc:
        raise UriError(f"URI: expected scheme://host:port?want_data=N, got {text!r} ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise UriError(f"URI scheme: expected one of {SCHEMES}, got {parts.scheme!r}")
    params: dict[str, str] = {}
    for item in filter(None, parts.query.split("&")):
        key, sep, value = item.partition("=")
        if not sep:
            raise UriError(f"URI query: expected key=value, got {item!r}")
        if key in params:
            raise UriError(f"URI query: parameter {key!r} given twice")
        params[key] = unquote(value)
    if "want_data" not in params and not listen:
        raise UriError(f"URI: expected the required want_data parameter, got {sorted(params)}")
    handle = None
    if "remote_handle" in params:
        try:
            handle = base64.b64decode(params["remote_handle"], validate=True)
        except (binascii.Error, ValueError):
            raise UriError(f"remote_handle: expected base64, got {params['remote_handle']!r}") from None
    free = _uint64("free_data", params["free_data"]) if "free_data" in params else None
    path = unquote(parts.path)
    host = parts.hostname or ("127.0.0.1" if listen and parts.scheme != "shm" else "")
    # A listener may leave the path, port or host for the server to choose.
    if not listen and parts.scheme == "shm" and not path:
        raise UriError(f"shm URI: expected the control socket path, got {text!r}")
    if not listen and parts.scheme != "shm" and (not parts.hostname or not port):
        raise UriError(f"{parts.scheme} URI: expected host:port, got {parts.netloc!r}")
    return IpcUri(
        scheme=parts.scheme,
        want_data=_uint64("want_data", params["want_data"]) if "want_data" in params else WANT_DATA_TAG,
        host=host,
        port=port,
        path=path,
        free_data=free,
        remote_handle=handle,
    )
