"""A plain synchronous Evergreen client on grpcio: send a whole session, collect what comes back.

It shares no code with the package's own gRPC server and client, so judging a server (ours included)
with it does not rely on the stack under test. One channel (one HTTP/2 connection) carries
the sessions one after another.
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("testing", __name__)

import argparse
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc  # type: ignore[import-untyped]

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.dag.errors import StatusCode
from evergreen_trio.errors import EvergreenTrioError

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message the client sends or accepts."""


class UnreachableError(EvergreenTrioError):
    """Nothing answers at the target: refused, no route, or no TLS handshake in time."""


_HEADER_NAME = re.compile(r"[0-9a-z_.-]+")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


def parse_header(text: str) -> tuple[str, str]:
    """argparse type: ``'name: value'`` as a lower-case gRPC metadata pair: an ASCII name, a printable
    ASCII value, no ``-bin`` (binary) header."""
    name, sep, value = text.partition(":")
    name, value = name.strip().lower(), value.strip()
    if not sep or not _HEADER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"expected 'name: value', got {text!r}")
    if name.endswith("-bin"):
        raise argparse.ArgumentTypeError(f"expected a text header, got the binary (-bin) header {name!r}")
    if not _HEADER_VALUE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected a value of printable ASCII, got {text!r}")
    return name, value


@dataclass(frozen=True)
class Outcome:
    """How one session ended: the status, its message, what the server sent, and whether the
    client gave up waiting (``hung``: no final status within the timeout)."""

    code: int
    details: str
    received: tuple[SessionMessage, ...]
    hung: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """The session ended OK, in time."""
        return self.code == StatusCode.OK and not self.hung

    def describe(self) -> str:
        """The outcome in words: the status name and message, or the hang."""
        if self.hung:
            return f"no final status after {self.seconds:.1f} s (the server hung)"
        try:
            name = StatusCode(self.code).name
        except ValueError:
            name = str(self.code)
        return f"{name}: {self.details}" if self.details else name


class SyncClient:
    """Sessions against ``host:port``, one at a time, each bounded by ``timeout`` seconds.

    ``tls_ca`` (PEM bytes) connects with TLS trusting those CAs; ``headers`` go with every session.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 10.0,
        tls_ca: bytes | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.tls = tls_ca is not None
        self._metadata = tuple(headers)
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if tls_ca is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self._start = self._channel.stream_stream(
            START_SESSION,
            request_serializer=SessionMessage.SerializeToString,
            response_deserializer=SessionMessage.FromString,
        )

    def run(self, messages: Sequence[SessionMessage]) -> Outcome:
        """Send ``messages``, half-close, and read replies until the server's final status."""
        received: list[SessionMessage] = []
        started = time.monotonic()
        try:
            replies = self._start(iter(messages), timeout=self.timeout, wait_for_ready=False, metadata=self._metadata)
            for reply in replies:
                received.append(reply)
        except grpc.RpcError as error:
            code = error.code()
            elapsed = time.monotonic() - started
            hung = code == grpc.StatusCode.DEADLINE_EXCEEDED and elapsed >= self.timeout * 0.99
            return Outcome(code.value[0], error.details() or "", tuple(received), hung, elapsed)
        return Outcome(StatusCode.OK, "", tuple(received), False, time.monotonic() - started)

    def wait_ready(self) -> None:
        """Connect (and finish the TLS handshake) within ``timeout``, or raise UnreachableError."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            how = "with TLS " if self.tls else "in plaintext "
            raise UnreachableError(
                f"nothing answers {how}at {self.target} within {self.timeout:g} s "
                "(is the server up, on this port, and speaking TLS only if --tls-ca is given?)"
            ) from None

    def close(self) -> None:
        """Close the channel (its one HTTP/2 connection)."""
        self._channel.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def health_status(address: str, service: str = "", timeout: float = 10.0) -> str:
    """``grpc.health.v1.Health/Check`` for ``service`` at ``host:port``, asked with grpcio: the
    serving status's name (``SERVING``, ``NOT_SERVING``) or the call's status code's
    (``NOT_FOUND``, ``UNAVAILABLE``, ...)."""
    from grpclib.health.v1 import health_pb2

    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return str(exc.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


__all__ = [
    "MAX_MESSAGE_BYTES",
    "Outcome",
    "SyncClient",
    "UnreachableError",
    "health_status",
    "parse_header",
]
