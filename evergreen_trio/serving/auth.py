"""Who may open a session: an authorizer maps a stream's metadata and peer to a principal, or refuses.

``Server(authorize=...)`` calls it once per session, before the session starts: no action runs for
a refused stream. Raise :class:`UnauthenticatedError` (no or bad credentials -> UNAUTHENTICATED)
or :class:`PermissionDeniedError` (known, not allowed -> PERMISSION_DENIED); any other exception
is the authorizer's bug and answers INTERNAL. Handlers see the principal as ``ctx.principal``.

>>> server = Server(authorize=TokenFileAuthorizer("/etc/evergreen/tokens"))
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evergreen_trio._files import READ_WITHOUT_WAITING, not_regular
from evergreen_trio.dag import SessionError, StatusCode
from evergreen_trio.errors import ConfigurationError

log = logging.getLogger(__name__)

MAX_TOKEN_FILE_BYTES = 1 << 20
"""A token file's size limit (some 20,000 tokens): re-reads run on the event loop."""


@dataclass(frozen=True)
class Peer:
    """The other end of a session's connection: ``address`` (host:port) and, with mTLS, its
    certificate as :meth:`ssl.SSLSocket.getpeercert` gives it (``None`` without TLS or client cert)."""

    address: str
    certificate: Mapping[str, Any] | None = field(default=None)


Authorizer = Callable[[Mapping[str, str], Peer], "str | Awaitable[str]"]
"""``authorize(metadata, peer) -> principal`` (plain or async); metadata keys are lower-case."""


class UnauthenticatedError(SessionError):
    """The caller showed no credentials, or credentials this server does not accept."""

    code = StatusCode.UNAUTHENTICATED


class PermissionDeniedError(SessionError):
    """The caller is known but may not open this session."""

    code = StatusCode.PERMISSION_DENIED


class TokenFile:
    """The bearer tokens of a token file, the one format and loader of every command that takes one
    (``serve --auth-token-file``, ``avp serve --token-file``).

    The file holds one token per line; blank lines and ``#`` comments (whole-line or trailing) are
    ignored, and surrounding whitespace is stripped. Tokens are kept as SHA-256 digests and compared
    in constant time (every token, so neither a token's content nor its length leaks through timing).
    The file is re-read when its mtime, size or inode changes, checked at most every
    ``check_interval`` seconds when a token is checked (no background task); a file that disappears
    or cannot be read revokes every token until it is back (fail closed).

    Raises ``OSError`` or ``UnicodeDecodeError`` at construction when the file cannot be read, and
    :class:`~evergreen_trio.errors.ConfigurationError` when it is not a regular file, is larger than
    ``MAX_TOKEN_FILE_BYTES`` or holds no token. Re-reads run on the caller's thread (the event loop):
    a FIFO or device is refused without waiting, and a regular file's read is bounded.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_interval: float = 1.0) -> None:
        self.path = os.fspath(path)
        self.check_interval = check_interval
        self._stamp, self._digests = self._load()
        if not self._digests:
            raise ConfigurationError(
                f"{self.path}: expected at least one token (one per line; blank lines and # comments are ignored)")
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self) -> tuple[tuple[int, int, int], list[bytes]]:
        """The file's stamp and token digests, read from one descriptor."""
        fd = os.open(self.path, READ_WITHOUT_WAITING)  # at startup, and on the event loop
        try:
            st = os.fstat(fd)
            if (kind := not_regular(st.st_mode)) is not None:
                raise ConfigurationError(f"{self.path}: expected a regular file of tokens, got {kind}")
            chunks, left = [], MAX_TOKEN_FILE_BYTES + 1  # one byte more tells a file that grew past the bound
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        if left <= 0:
            raise ConfigurationError(f"{self.path}: expected at most {MAX_TOKEN_FILE_BYTES} bytes of tokens, got more")
        # Line ends as a text-mode open() reads them (\n, \r\n, \r), not splitlines()' ten more.
        text = b"".join(chunks).decode().replace("\r\n", "\n").replace("\r", "\n")
        lines = (line.split("#", 1)[0].strip() for line in text.split("\n"))
        digests = [hashlib.sha256(line.encode()).digest() for line in lines if line]
        return (st.st_mtime_ns, st.st_size, st.st_ino), digests

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.check_interval:
            return
        self._checked = now
        try:
            if self._stat() != self._stamp:
                self._stamp, self._digests = self._load()
                log.info("auth.tokens_reloaded path=%s tokens=%d", self.path, len(self._digests))
        except (OSError, UnicodeDecodeError, ConfigurationError) as error:
            if self._digests:
                log.error("auth.tokens_unreadable path=%s error=%s (refusing every token)", self.path, error)
            self._digests, self._stamp = [], (0, 0, 0)

    def principal(self, token: str | bytes) -> str | None:
        """``token:`` and 12 hex digits of the token's SHA-256 when the file (re-read if it changed)
        holds ``token`` (surrounding whitespace ignored); None otherwise."""
        self._refresh()
        raw = token.strip() if isinstance(token, bytes) else token.strip().encode()
        if not raw:
            return None
        digest = hashlib.sha256(raw).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return "token:" + digest.hex()[:12] if matched else None


class TokenFileAuthorizer:
    """Accepts ``authorization: Bearer TOKEN`` where TOKEN is a line of ``path`` (a :class:`TokenFile`).

    The principal is ``token:`` and the first 12 hex digits of the token's SHA-256.
    Raises what :class:`TokenFile` raises at construction.
    """

    def __init__(self, path: str | os.PathLike[str], *, check_interval: float = 1.0) -> None:
        self.tokens = TokenFile(path, check_interval=check_interval)
        self.path = self.tokens.path

    def __call__(self, metadata: Mapping[str, str], peer: Peer) -> str:
        """The principal for a valid bearer token; raises :class:`UnauthenticatedError` otherwise."""
        scheme, _, token = metadata.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthenticatedError("expected metadata 'authorization: Bearer <token>'")
        principal = self.tokens.principal(token)
        if principal is None:
            raise UnauthenticatedError(f"the bearer token from {peer.address} is not accepted")
        return principal


__all__ = [
    "Authorizer",
    "Peer",
    "PermissionDeniedError",
    "TokenFile",
    "TokenFileAuthorizer",
    "UnauthenticatedError",
]
