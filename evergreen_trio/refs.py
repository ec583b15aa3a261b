"""Resolvers for chunks whose payload is an external ``ref`` URI. None is allowed by default."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

import trio

from evergreen_trio.dag.errors import RefRejectedError, StatusCode


class RefResolver(Protocol):
    """Turns a ref URI of one scheme into its bytes, streamed."""

    scheme: str

    def check(self, uri: str) -> None:
        """Raise RefRejectedError when ``uri`` can never be resolved here (checked when the ref arrives)."""

    def open(self, uri: str) -> AsyncIterator[bytes]:
        """The bytes ``uri`` names, in blocks; RefRejectedError when they cannot be had."""


@dataclass(frozen=True)
class ExternalRef:
    """A chunk's ref as a reader sees it: the URI and the resolver this side enabled for it."""

    uri: str
    resolver: RefResolver


MAX_PATH_BYTES = 4096
"""The longest path a file:// ref may name (Linux's PATH_MAX: no longer one can be opened). Resolving
a path costs time quadratic in its components: a 640 KB one of ``/a/a/...`` took 6 s of the one thread."""


class FileResolver:
    """``file://`` refs confined to ``roots``: no ``..``, no symlink leading out of a root."""

    scheme = "file"

    def __init__(self, roots: Sequence[str | os.PathLike[str]], *, read_bytes: int = 1 << 20) -> None:
        if not roots:
            raise ValueError("FileResolver needs at least one root folder")
        self.roots = tuple(Path(os.path.realpath(root)) for root in roots)
        self.read_bytes = read_bytes

    def path(self, uri: str) -> Path:
        """The real path ``uri`` names, or RefRejectedError saying why it is refused."""
        parts = urlsplit(uri)
        if parts.scheme.lower() != "file":
            raise RefRejectedError(f"ref {uri!r}: expected a file:// URI")
        if parts.netloc not in ("", "localhost"):
            raise RefRejectedError(f"ref {uri!r}: expected file:///absolute/path, got host {parts.netloc!r}")
        raw = unquote(parts.path)
        if len(raw.encode(errors="surrogateescape")) > MAX_PATH_BYTES:
            raise RefRejectedError(f"ref {uri[:64]!r}...: a path longer than {MAX_PATH_BYTES} bytes")
        if "\x00" in raw or not raw.startswith("/"):
            raise RefRejectedError(f"ref {uri!r}: expected an absolute path")
        if ".." in raw.split("/"):
            raise RefRejectedError(f"ref {uri!r}: '..' is not allowed in a path")
        real = Path(os.path.realpath(raw))
        if not any(real == root or root in real.parents for root in self.roots):
            raise RefRejectedError(f"ref {uri!r}: outside the allowed roots", code=StatusCode.PERMISSION_DENIED)
        return real

    def check(self, uri: str) -> None:
        """Raise RefRejectedError when ``uri`` is not a file:// path under ``roots`` (see ``path``)."""
        self.path(uri)

    async def open(self, uri: str) -> AsyncIterator[bytes]:
        """The file's bytes in blocks of ``read_bytes``; RefRejectedError when refused or unreadable."""
        path = self.path(uri)
        try:
            async with await trio.open_file(path, "rb") as handle:
                while block := await handle.read(self.read_bytes):
                    yield block
        except OSError as exc:
            raise RefRejectedError(f"ref {uri!r}: cannot be read ({exc.strerror})") from None


def resolver_map(resolvers: Iterable[RefResolver]) -> dict[str, RefResolver]:
    """Index resolvers by scheme; two for one scheme is a configuration error."""
    by_scheme: dict[str, RefResolver] = {}
    for resolver in resolvers:
        if resolver.scheme in by_scheme:
            raise ValueError(f"two ref resolvers for scheme {resolver.scheme!r}")
        by_scheme[resolver.scheme] = resolver
    return by_scheme
