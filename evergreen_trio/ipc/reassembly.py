"""The client-side reassembly state machine (sans-IO).

Metadata messages and tagged bodies arrive on separate streams in any order. The
machine pairs them by sequence number (tag mask ``0x00000000FFFFFFFF``), checks each
body against its header, and releases complete messages strictly in sequence order,
rolling over at ``UINT32_MAX``. It is finished once End of Stream has arrived and no
sequence number before it is missing. What it holds waiting for the other half (or for an
earlier message) is bounded in count (``max_pending_messages``) and in bytes
(``max_pending_bytes``: metadata and inline bodies; a shared-memory body is the server's memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import BodyMismatchError, LimitExceededError, SequenceError
from evergreen_trio.ipc.flatbuf import MessageHeader, MessageKind, parse_message_header
from evergreen_trio.ipc.framing import (
    UINT32_MAX,
    BodyDescriptor,
    BodyIn,
    BodyType,
    EndOfStream,
    decode_metadata,
)


@dataclass(frozen=True)
class ReadyMessage:
    """A message whose metadata and (if any) body have both arrived, in sequence order.

    ``body`` is the transport's object for a raw body (type 0), a :class:`BodyDescriptor`
    for a shared-memory body (type 1), or ``None`` for a message without a body.
    """

    seq: int
    flatbuffer: bytes
    header: MessageHeader
    body_type: BodyType | None
    body: object


def _held_bytes(incoming: BodyIn) -> int:
    """The client memory a held body takes: its length inline, nothing for a shared-memory descriptor."""
    return 0 if incoming.tag.body_type is BodyType.DESCRIPTOR else incoming.nbytes


class Reassembler:
    """Pair metadata and bodies; emit them in order; detect gaps, duplicates and mismatches."""

    def __init__(self, limits: IpcLimits = DEFAULT_LIMITS, first_seq: int = 0) -> None:
        self._limits = limits
        self._first = first_seq
        self._next = first_seq
        self._metadata: dict[int, tuple[bytes, MessageHeader]] = {}
        self._bodies: dict[int, BodyIn] = {}
        self._eos: int | None = None
        self._held = 0
        self.delivered = 0

    def _offset(self, seq: int, what: str) -> int:
        offset = (seq - self._next) & UINT32_MAX
        if offset >= self._limits.max_pending_messages:
            raise SequenceError(
                f"{what} {seq}: expected a sequence number in [{self._next}, "
                f"{self._next} + {self._limits.max_pending_messages}), got one already delivered or too far ahead"
            )
        if self._eos is not None and offset >= (self._eos - self._next) & UINT32_MAX:
            raise SequenceError(f"{what} {seq}: expected a sequence number before End of Stream {self._eos}")
        return offset

    def on_metadata(self, data: bytes | memoryview) -> None:
        """Feed one metadata-stream message (Flatbuffers header or End of Stream)."""
        message = decode_metadata(data, self._limits)
        if isinstance(message, EndOfStream):
            self._on_eos(message.seq)
            return
        self._offset(message.seq, "metadata")
        if message.seq in self._metadata:
            raise SequenceError(f"metadata {message.seq}: received twice")
        header = parse_message_header(message.flatbuffer, max_buffers=self._limits.max_buffers_per_body)
        is_first = message.seq == self._first and self.delivered == 0
        if is_first != (header.kind is MessageKind.SCHEMA):
            raise SequenceError(
                f"metadata {message.seq}: expected {'a Schema' if is_first else 'a batch'} message, "
                f"got {header.kind.name}"
            )
        if header.body_length > self._limits.max_body_bytes:
            raise LimitExceededError(
                f"metadata {message.seq}: expected a body <= {self._limits.max_body_bytes} bytes, "
                f"got {header.body_length}"
            )
        if message.seq in self._bodies:
            self._check(message.seq, header, self._bodies[message.seq])
        self._hold(len(message.flatbuffer), f"metadata {message.seq}")
        self._metadata[message.seq] = (message.flatbuffer, header)

    def on_body(self, incoming: BodyIn) -> None:
        """Feed one body, its tag already parsed and its size checked by the transport."""
        seq = incoming.tag.seq
        self._offset(seq, "body")
        if seq in self._bodies:
            raise SequenceError(f"body {seq}: received twice")
        if seq in self._metadata:
            self._check(seq, self._metadata[seq][1], incoming)
        self._hold(_held_bytes(incoming), f"body {seq}")
        self._bodies[seq] = incoming

    def _hold(self, nbytes: int, what: str) -> None:
        # Without a byte bound a server could park max_pending_messages bodies of max_body_bytes
        # each (8 TiB at the defaults) by never sending the messages that would release them.
        if self._held + nbytes > self._limits.max_pending_bytes:
            raise LimitExceededError(
                f"{what}: expected <= {self._limits.max_pending_bytes} bytes held for reassembly "
                f"(max_pending_bytes), got {self._held} held and {nbytes} more"
            )
        self._held += nbytes

    def _check(self, seq: int, header: MessageHeader, incoming: BodyIn) -> None:
        if not header.has_body:
            raise BodyMismatchError(f"body {seq}: expected none for a {header.kind.name} message, got one")
        if isinstance(incoming.body, BodyDescriptor):
            lengths = tuple(length for _, length in incoming.body.buffers)
            expected = tuple(length for _, length in header.buffers)
            if incoming.nbytes != header.body_length or lengths != expected:
                raise BodyMismatchError(
                    f"body {seq}: expected {header.body_length} bytes in buffers {list(expected)}, "
                    f"got {incoming.nbytes} bytes in buffers {list(lengths)}"
                )
            return
        if incoming.nbytes != header.body_length:
            raise BodyMismatchError(
                f"body {seq}: expected {header.body_length} bytes (metadata bodyLength), got {incoming.nbytes}"
            )

    def _on_eos(self, seq: int) -> None:
        if self._eos is not None:
            raise SequenceError(f"End of Stream {seq}: received twice (first said {self._eos})")
        eos_offset = (seq - self._next) & UINT32_MAX
        if eos_offset > self._limits.max_pending_messages:
            raise SequenceError(f"End of Stream {seq}: expected at or after {self._next}, got one far behind")
        beyond = [s for s in (*self._metadata, *self._bodies) if (s - self._next) & UINT32_MAX >= eos_offset]
        if beyond:
            raise SequenceError(f"End of Stream {seq}: messages {sorted(beyond)} arrived past its end")
        if self._next == self._first and self.delivered == 0 and seq == self._first:
            raise SequenceError(f"End of Stream {seq}: expected a Schema message first, got an empty stream")
        self._eos = seq

    def pop_ready(self) -> list[ReadyMessage]:
        """Complete messages in sequence order, removed from the machine."""
        ready: list[ReadyMessage] = []
        while self._next in self._metadata:
            flatbuffer, header = self._metadata[self._next]
            if header.has_body and self._next not in self._bodies:
                break
            del self._metadata[self._next]
            self._held -= len(flatbuffer)
            body_type: BodyType | None = None
            body: object = None
            if header.has_body:
                incoming = self._bodies.pop(self._next)
                self._held -= _held_bytes(incoming)
                body_type, body = incoming.tag.body_type, incoming.body
            ready.append(ReadyMessage(self._next, flatbuffer, header, body_type, body))
            self._next = (self._next + 1) & UINT32_MAX
            self.delivered += 1
        return ready

    @property
    def finished(self) -> bool:
        """End of Stream has arrived and every message before it has been released."""
        return self._eos is not None and self._next == self._eos and not self._metadata and not self._bodies

    def missing(self) -> list[int]:
        """Sequence numbers not yet released, up to End of Stream (or the highest seen)."""
        seen = [(s - self._next) & UINT32_MAX for s in (*self._metadata, *self._bodies)]
        end = (self._eos - self._next) & UINT32_MAX if self._eos is not None else max(seen, default=-1) + 1
        candidates = ((self._next + i) & UINT32_MAX for i in range(end))
        return [
            s
            for s in candidates
            if s not in self._metadata or (self._metadata[s][1].has_body and s not in self._bodies)
        ]

    def pending_bodies(self) -> list[object]:
        """Bodies held but not yet released (the shell frees or recycles them on teardown)."""
        return [incoming.body for incoming in self._bodies.values()]

    def expect_finished(self) -> None:
        """Raise :class:`SequenceError` naming what is missing if the stream is incomplete."""
        if self.finished:
            return
        if self._eos is None:
            raise SequenceError(f"stream: expected End of Stream, got none after {self.delivered} messages")
        raise SequenceError(f"stream: End of Stream {self._eos} arrived but messages {self.missing()[:16]} are missing")
