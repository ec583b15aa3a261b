"""In-flight eviction on the ext_proc side, sans-IO: a high-priority request blocked by saturation
makes flow control evict a sheddable running one, whose stream answers 429 ``evicted`` and ends
(through the processor alone, then through the gRPC wire), and what is left alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.wrappers_pb2 import BytesValue

from evergreen_trio._grpc.server_wire import SyncBidiMethod
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.processor import DESTINATION, ExtProcStream, Picker
from evergreen_trio.picker.reclamation_metrics import ReclamationMetrics
from evergreen_trio.picker.runtime import PROCESS_PATH
from evergreen_trio.picker.telemetry import PickerMetrics
from tests.picker.test_flow_control import Clock, dropped, epp, start
from tests.picker.test_grpc_wire import PATH, Peer
from tests.picker.test_processor import make_picker, request_body, request_headers, response_body, response_headers

OBJECTIVES = "objectives: [{name: urgent, priority: 5}, {name: bulk, priority: -1}]\n"
URGENT = (("x-llm-d-inference-objective", "urgent"),)
BULK = (("x-llm-d-inference-objective", "bulk"),)


def evicting_picker(eviction: str = "true") -> Picker:
    """Three endpoints taking one request each (concurrency detector), eviction on; a fake clock."""
    section = f"  saturationDetector: {{pluginRef: concurrency-detector}}\n  enableEviction: {eviction}"
    plugins = "- {type: concurrency-detector, parameters: {maxConcurrency: 1}}"
    picker = make_picker(OBJECTIVES + "---" + epp(section, plugins).split("---", 1)[1], metrics=[EndpointMetrics()] * 3)
    assert picker.flow is not None
    picker.flow.queue.clock = Clock()
    return picker


def woken(stream: ExtProcStream) -> list[int]:
    """What the wire would be told: each call of the stream's ``on_unpark``."""
    calls: list[int] = []
    stream.on_unpark = lambda: calls.append(1)
    return calls


def test_a_blocked_urgent_request_evicts_the_sheddable_running_one() -> None:
    picker = evicting_picker()
    gate = picker.flow
    assert gate is not None and gate.reclamation is not None
    polls: list[int] = []
    gate.wake = lambda: polls.append(1)
    plain, replies = start(picker)
    assert replies
    bulk, replies = start(picker, extra=BULK)
    assert replies
    assert isinstance(bulk, ExtProcStream)
    wakes = woken(bulk)
    other, _ = start(picker)  # the pool is full: 3 of 3
    urgent, replies = start(picker, extra=URGENT)
    assert isinstance(urgent, ExtProcStream) and replies == [] and urgent.parked
    assert wakes == [1] and not bulk.finished  # evicted: its stream is woken to answer
    assert gate.reclamation.outstanding.keys() == {bulk.item.seq}  # type: ignore[union-attr]
    assert dropped(list(bulk.resume())) == (429, "evicted")
    assert bulk.finished and bulk.report.error == 429 and bulk.resume() == []
    assert polls == [1] and not gate.reclamation.outstanding and len(gate.reclamation.cooling) == 1
    urgent_wakes = woken(urgent)
    gate.poll()  # the shell's, after the wake: the bulk request's slot is free
    assert urgent_wakes == [1] and not urgent.parked
    (decision, *_) = urgent.resume()
    assert decision.request_headers.response.header_mutation.set_headers[0].header.key == DESTINATION
    assert gate.evictor is not None and gate.evictor.stats() == (3, 0) and gate.evictor.unconfirmed == 0
    for stream in (plain, other, urgent):  # the others run to their ends untouched
        stream.on_message(response_headers())  # type: ignore[attr-defined]
        (reply,) = stream.on_message(response_body(b"{}", end=True))  # type: ignore[attr-defined]
        assert not reply.HasField("immediate_response") and stream.finished  # type: ignore[attr-defined]
    assert gate.evictor.stats() == (0, 0)


def test_no_victim_without_eviction_or_without_a_sheddable_request_and_only_below_the_demand() -> None:
    for picker, extras in ((evicting_picker("false"), (BULK, BULK, BULK)), (evicting_picker(), ((), (), ()))):
        gate = picker.flow
        assert gate is not None
        running = [start(picker, extra=extra)[0] for extra in extras]
        urgent, replies = start(picker, extra=URGENT)
        assert replies == [] and urgent.parked  # type: ignore[attr-defined]
        assert not any(stream.finished for stream in running)  # type: ignore[attr-defined]
    picker = evicting_picker()
    for _ in range(3):
        start(picker, extra=BULK)
    _, replies = start(picker, extra=BULK)  # demand at -1: no same-band churn
    assert replies == [] and picker.flow is not None and picker.flow.evictor is not None
    assert picker.flow.evictor.unconfirmed == 0


def test_an_evicted_request_whose_response_completed_gets_nothing() -> None:
    picker = evicting_picker()
    stream, _ = start(picker, extra=BULK)
    assert isinstance(stream, ExtProcStream)
    stream.on_message(response_headers())
    assert stream.eviction() is not None  # mid response: still answered 429
    stream.finished = False
    stream.report.error = None
    stream.on_message(response_body(b"{}", end=True))
    assert stream.response_ended and stream.eviction() is None


def test_a_client_gone_before_its_eviction_was_answered_confirms_it() -> None:
    picker = evicting_picker()
    gate = picker.flow
    assert gate is not None and gate.reclamation is not None
    bulk, _ = start(picker, extra=BULK)
    start(picker)
    start(picker)
    start(picker, extra=URGENT)
    assert gate.reclamation.outstanding
    bulk.on_abort()  # type: ignore[attr-defined]  # Envoy reset the stream before the wire sent the 429
    assert not gate.reclamation.outstanding and gate.evictor is not None and gate.evictor.stats() == (2, 0)


def test_the_metrics_follow_the_revocations() -> None:
    picker = evicting_picker()
    gate = picker.flow
    assert gate is not None and gate.reclamation is not None
    metrics = PickerMetrics("pool")
    gate.reclamation.observer = metrics.reclamation
    bulk, _ = start(picker, extra=BULK)
    start(picker)
    start(picker)
    start(picker, extra=URGENT)
    bulk.resume()  # type: ignore[attr-defined]

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"inference_pool": "pool", **labels})

    assert isinstance(metrics.reclamation, ReclamationMetrics)
    assert sample("llm_d_epp_flow_control_revocations_issued_total", priority="5") == 1
    assert sample("llm_d_epp_flow_control_revocations_total", outcome="confirmed") == 1
    assert sample("llm_d_epp_flow_control_reclaim_target") == 0.0  # saturation 1.0 at ceiling 1.0
    assert sample("llm_d_epp_flow_control_pending_reclaim") == 1 / 3
    assert sample("llm_d_epp_flow_control_revocation_confirmation_seconds_count") == 1


# -- through the gRPC wire ----------------------------------------------------------------------


def framed(message: ep.ProcessingRequest) -> bytes:
    data = message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def received(peer: Peer, stream_id: int) -> list[ep.ProcessingResponse]:
    data, out = bytes(peer.data.get(stream_id, b"")), []
    while data:
        size = int.from_bytes(data[1:5], "big")
        out.append(ep.ProcessingResponse.FromString(data[5 : 5 + size]))
        data = data[5 + size :]
    return out


def send(peer: Peer, stream_id: int, *messages: ep.ProcessingRequest) -> None:
    peer.client.send_data(stream_id, b"".join(framed(m) for m in messages))
    peer.pump()


def test_the_wire_sends_the_eviction_on_a_stream_that_never_parked() -> None:
    """A request dispatched at once never parks, so nothing else would wake its stream: the wire
    gives every ext_proc stream its ``on_unpark`` when it opens."""
    picker = evicting_picker()
    gate = picker.flow
    assert gate is not None
    peer = Peer()
    peer.server.methods = {PROCESS_PATH: SyncBidiMethod(PROCESS_PATH, ep.ProcessingRequest, picker.new_stream)}
    connection_wakes: list[int] = []
    peer.server.on_wake = lambda: connection_wakes.append(1)
    body = request_body(b'{"model": "plain", "prompt": "hi"}')
    streams: dict[str, int] = {}
    for name, extra in (("plain", ()), ("bulk", BULK), ("other", ()), ("urgent", URGENT)):
        streams[name] = peer.open(PROCESS_PATH)
        send(peer, streams[name], request_headers(extra=extra), body)
    assert [len(received(peer, streams[n])) for n in ("plain", "bulk", "other", "urgent")] == [2, 2, 2, 0]
    assert connection_wakes == [1] and peer.server.has_unparked  # the bulk stream woke
    shell_polls: list[int] = []
    gate.wake = lambda: shell_polls.append(1)
    peer.server.resume_unparked()
    peer.pump()
    evicted = received(peer, streams["bulk"])[-1]
    assert dropped([evicted]) == (429, "evicted")
    assert peer.trailers(streams["bulk"])["grpc-status"] == "0" and shell_polls == [1]
    gate.poll()
    peer.server.resume_unparked()
    peer.pump()
    assert len(received(peer, streams["urgent"])) == 2  # routed now: its decision and its body
    send(peer, streams["plain"], response_headers(), response_body(b"{}", end=True))
    assert peer.trailers(streams["plain"])["grpc-status"] == "0"
    stale: Callable[[], None] | None = None
    for processor in [s.processor for s in peer.server._streams.values()]:
        stale = getattr(processor, "on_unpark", None)
    assert stale is not None
    stale()  # a wake with nothing to send sends nothing
    peer.server.resume_unparked()
    peer.pump()
    assert len(received(peer, streams["other"])) == 2


class AnswersBig:
    """Answers its first message with a large reply and finishes; ``resume`` would add a late one."""

    instances: list[AnswersBig] = []

    def __init__(self) -> None:
        self.finished = False
        self.on_unpark: Callable[[], None] | None = None
        AnswersBig.instances.append(self)

    def on_message(self, message: BytesValue) -> list[BytesValue]:
        self.finished = True
        return [BytesValue(value=b"x" * 100_000)]

    def resume(self) -> list[BytesValue]:
        return [BytesValue(value=b"late")]

    def on_end(self) -> list[BytesValue]:
        return []


def test_a_wake_after_the_stream_was_answered_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its reply still waits for the client's window (the stream is not gone yet) when it wakes."""
    monkeypatch.setattr(AnswersBig, "instances", [])
    peer = Peer(ack=False)
    peer.server.methods = {PATH: SyncBidiMethod(PATH, BytesValue, AnswersBig)}
    stream = peer.open()
    peer.send(stream, b"go")
    (processor,) = AnswersBig.instances
    assert processor.on_unpark is not None and not peer.trailers(stream)
    processor.on_unpark()
    peer.server.resume_unparked()
    peer.client.acknowledge_received_data(len(peer.data[stream]), stream)
    peer.pump()
    assert peer.replies(stream) == [b"x" * 100_000] and peer.trailers(stream)["grpc-status"] == "0"


async def test_the_shell_polls_when_a_revocation_times_out_and_the_next_decision_follows(
        autojump_clock: object) -> None:
    """An evicted stream that never ends (a hung Envoy) holds the pacing gate for the confirmation
    timeout: the flow control task wakes then, and a grace later the next victim goes."""
    import trio

    from evergreen_trio.picker.runtime import _flow_control

    picker = evicting_picker()
    gate = picker.flow
    assert gate is not None and gate.reclamation is not None
    gate.queue.clock = trio.current_time
    first, _ = start(picker, extra=BULK)
    second, _ = start(picker, extra=BULK)
    start(picker)
    assert isinstance(first, ExtProcStream) and isinstance(second, ExtProcStream)
    first_wakes, second_wakes = woken(first), woken(second)
    start(picker, extra=URGENT)
    assert second_wakes == [1] and first_wakes == []  # the newer one first; it never answers
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flow_control, gate, 30.0, trio.Event(), trio.Event)
        await trio.sleep(gate.reclamation.config.confirmation_timeout_s - 0.5)
        assert first_wakes == []
        await trio.sleep(1.0)
        assert first_wakes == [1] and gate.reclamation.outstanding.keys() == {first.item.seq}  # type: ignore[union-attr]
        assert trio.current_time() - began < 30.0  # not the interval: the pacing gate's own times
        nursery.cancel_scope.cancel()
