"""The reassembly state machine: ordering, gaps, duplicates, rollover, EOS, mismatches; the arena."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ipc_helpers import sample_messages, sample_table

from evergreen_trio.ipc.arena import ALIGN, Arena
from evergreen_trio.ipc.arrow import BatchDecoder, OutgoingMessage
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import BodyMismatchError, IpcError, LimitExceededError, SequenceError
from evergreen_trio.ipc.framing import (
    BodyDescriptor,
    BodyType,
    body_in,
    classify_body,
    encode_descriptor,
    encode_end_of_stream,
    encode_metadata,
    make_tag,
)
from evergreen_trio.ipc.reassembly import Reassembler

MESSAGES = sample_messages(2_000, 500)
UINT32 = 2**32


def events(messages: list[OutgoingMessage], first: int = 0) -> list[tuple[str, int, object]]:
    out: list[tuple[str, int, object]] = []
    for i, m in enumerate(messages):
        seq = (first + i) % UINT32
        out.append(("meta", seq, encode_metadata(seq, m.flatbuffer.to_pybytes())))
        if m.header.has_body:
            out.append(("body", seq, m.body))
    out.append(("eos", (first + len(messages)) % UINT32, encode_end_of_stream((first + len(messages)) % UINT32)))
    return out


def on_body(machine: Reassembler, tag: int, data: object, nbytes: int) -> None:
    """What a transport does: classify the tag once, decode a descriptor, hand the typed body on."""
    accepts = BodyType.DESCRIPTOR if tag >> 56 == BodyType.DESCRIPTOR else BodyType.RAW
    machine.on_body(body_in(classify_body(tag, nbytes, DEFAULT_LIMITS, accepts), data, nbytes, DEFAULT_LIMITS))


def feed(machine: Reassembler, event: tuple[str, int, object]) -> None:
    kind, seq, payload = event
    if kind == "body":
        assert isinstance(payload, pa.Buffer)
        on_body(machine, make_tag(seq, BodyType.RAW), payload, payload.size)
    else:
        machine.on_metadata(payload)  # type: ignore[arg-type]


@given(st.permutations(range(len(events(MESSAGES)))), st.sampled_from([0, UINT32 - 3, UINT32 - 1]))
def test_any_arrival_order_releases_messages_in_sequence(order: list[int], first: int) -> None:
    evs = events(MESSAGES, first)
    machine = Reassembler(first_seq=first)
    released = []
    for index in order:
        feed(machine, evs[index])
        released += machine.pop_ready()
    assert machine.finished
    assert [r.seq for r in released] == [(first + i) % UINT32 for i in range(len(MESSAGES))]
    decoder = BatchDecoder()
    batches = [b for r in released if (b := decoder.feed(r.flatbuffer, r.header, r.body)) is not None]
    assert pa.Table.from_batches(batches).equals(sample_table(2_000))


@given(st.data())
def test_a_gap_is_never_finished(data: st.DataObject) -> None:
    evs = events(MESSAGES)
    dropped = data.draw(st.integers(0, len(evs) - 2))
    machine = Reassembler()
    for i, event in enumerate(evs):
        if i != dropped:
            feed(machine, event)
            machine.pop_ready()
    assert not machine.finished
    with pytest.raises(SequenceError):
        machine.expect_finished()
    assert machine.missing()


def test_duplicates_and_messages_past_eos_are_rejected() -> None:
    evs = events(MESSAGES)
    machine = Reassembler()
    feed(machine, evs[0])
    with pytest.raises(SequenceError, match="twice"):
        feed(machine, evs[0])
    machine.on_metadata(encode_end_of_stream(2))
    with pytest.raises(SequenceError, match="End of Stream"):
        feed(machine, evs[3])


def test_first_message_must_be_a_schema_and_eos_cannot_be_first() -> None:
    with pytest.raises(SequenceError, match="Schema"):
        Reassembler().on_metadata(encode_metadata(0, MESSAGES[1].flatbuffer.to_pybytes()))
    with pytest.raises(SequenceError, match="empty"):
        Reassembler().on_metadata(encode_end_of_stream(0))


def test_window_limit() -> None:
    machine = Reassembler(IpcLimits(max_pending_messages=4))
    with pytest.raises(SequenceError, match="too far ahead"):
        machine.on_metadata(encode_metadata(4, MESSAGES[1].flatbuffer.to_pybytes()))


def test_pending_bytes_are_released_with_their_messages() -> None:
    """A stream many times max_pending_bytes goes through when each body waits for nothing but its
    own metadata; held bodies past it are refused."""
    largest = max(m.body.size for m in MESSAGES if m.body is not None)
    machine = Reassembler(IpcLimits(max_pending_bytes=largest + 4096, max_body_bytes=largest))
    for event in events(MESSAGES):
        feed(machine, event)
        machine.pop_ready()
    assert machine.finished
    held = Reassembler(IpcLimits(max_pending_bytes=largest + 4096, max_body_bytes=largest))
    bodies = [event for event in events(MESSAGES) if event[0] == "body"]
    assert sum(body.size for _, _, body in bodies) > largest + 4096  # type: ignore[attr-defined]
    with pytest.raises(LimitExceededError, match="max_pending_bytes"):
        for event in bodies:
            feed(held, event)


@pytest.mark.parametrize("body_first", [True, False])
def test_body_length_mismatch_is_rejected(body_first: bool) -> None:
    machine = Reassembler()
    feed(machine, ("meta", 0, encode_metadata(0, MESSAGES[0].flatbuffer.to_pybytes())))
    meta = ("meta", 1, encode_metadata(1, MESSAGES[1].flatbuffer.to_pybytes()))
    body = MESSAGES[1].body
    short = body.slice(0, body.size - 8)
    with pytest.raises(BodyMismatchError, match="bodyLength"):
        if body_first:
            on_body(machine, make_tag(1, BodyType.RAW), short, short.size)
            feed(machine, meta)
        else:
            feed(machine, meta)
            on_body(machine, make_tag(1, BodyType.RAW), short, short.size)


def test_descriptor_must_match_the_metadata_buffers() -> None:
    machine = Reassembler()
    feed(machine, ("meta", 0, encode_metadata(0, MESSAGES[0].flatbuffer.to_pybytes())))
    feed(machine, ("meta", 1, encode_metadata(1, MESSAGES[1].flatbuffer.to_pybytes())))
    header = MESSAGES[1].header
    wrong = BodyDescriptor(header.body_length, tuple((o, n + 1) for o, n in header.buffers))
    with pytest.raises(BodyMismatchError):
        on_body(machine, make_tag(1, BodyType.DESCRIPTOR), encode_descriptor(wrong), 0)


def test_schema_with_a_body_is_rejected() -> None:
    machine = Reassembler()
    on_body(machine, make_tag(0, BodyType.RAW), b"12345678", 8)
    with pytest.raises(BodyMismatchError, match="SCHEMA"):
        feed(machine, ("meta", 0, encode_metadata(0, MESSAGES[0].flatbuffer.to_pybytes())))


@pytest.mark.fuzz
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2**64 - 1), st.binary(max_size=64)), max_size=20))
def test_fuzz_arbitrary_events_give_typed_errors(items: list[tuple[bool, int, bytes]]) -> None:
    machine = Reassembler(IpcLimits(max_pending_messages=64))
    try:
        for is_meta, tag, data in items:
            if is_meta:
                machine.on_metadata(data)
            else:
                on_body(machine, tag, data, len(data))
            machine.pop_ready()
    except IpcError:
        pass


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5000)), max_size=60))
def test_arena_regions_never_overlap(ops: list[tuple[bool, int]]) -> None:
    arena = Arena(64 * 1024)
    live: list[int] = []
    for allocate, size in ops:
        if allocate or not live:
            start = arena.allocate(size)
            if start is not None:
                assert start % ALIGN == 0
                live.append(start)
        else:
            arena.free(live.pop(size % len(live)))
        spans = sorted((s, s + n) for s, n in arena.regions().items())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(end <= arena.capacity for _, end in spans)
    for start in live:
        arena.free(start)
    assert arena.used_bytes == 0 and arena.allocate(arena.capacity - ALIGN) == 0
