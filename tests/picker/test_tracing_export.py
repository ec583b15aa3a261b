"""The Trio task that exports ``--tracing``'s spans: batches, a failing, raising or hanging exporter
(one warning an episode, never an error out of the task), and the bounded flush at the end."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from evergreen_trio.picker.tracing import Tracing, new_tracing
from evergreen_trio.picker.tracing_env import TracingSettings
from evergreen_trio.picker.tracing_export import SpanExport, exporting


class Exporter(SpanExporter):
    """Keeps each batch; fails while ``failing``, raises while ``raising``, blocks while ``held``."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.failing = self.raising = False
        self.held = threading.Event()
        self.held.set()
        self.shut = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.held.wait()
        if self.raising:
            raise RuntimeError("exporter bug")
        if self.failing:
            return SpanExportResult.FAILURE
        self.batches.append(len(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut = True


def tracing(exporter: Exporter, **settings: float) -> Tracing:
    values = {"ratio": 1.0, "batch_size": 4, "delay_s": 0.05, "export_timeout_s": 5.0, **settings}
    return new_tracing(TracingSettings(**values), exporter)  # type: ignore[arg-type]


def spans(tracing: Tracing, count: int) -> None:
    for _ in range(count):
        tracing.handlers.start_span("s").end()


def warnings(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


async def test_spans_go_in_batches_and_what_is_left_is_flushed_at_the_end() -> None:
    exporter = Exporter()
    traced = tracing(exporter, delay_s=600)  # only a full batch wakes the task, and the end
    async with exporting(traced):
        spans(traced, 4)
        with trio.fail_after(5):
            while not exporter.batches:  # noqa: ASYNC110 (another thread exports)
                await trio.sleep(0.01)
        spans(traced, 3)
    assert exporter.batches == [4, 3] and exporter.shut and not traced.buffer.spans


async def test_a_failing_exporter_is_one_warning_an_episode(caplog: pytest.LogCaptureFixture) -> None:
    exporter = Exporter()
    traced = tracing(exporter)
    export = SpanExport(traced)
    exporter.failing = True
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            spans(traced, 2)
            await export.export()
        assert export.failed_spans == 6 and not exporter.batches
        traced.exporter_log.last = "Failed to export traces to localhost:4317, error code: StatusCode.UNAVAILABLE"
        spans(traced, 1)
        await export.export()
        exporter.failing = False
        spans(traced, 2)
        await export.export()
        exporter.failing = True
        spans(traced, 1)
        await export.export()
    failed = warnings(caplog, "picker.tracing_export_failed")
    assert len(failed) == 2 and "the exporter reported a failure" in failed[0] and "UNAVAILABLE" in failed[1]
    assert warnings(caplog, "picker.tracing_export_recovered") == ["picker.tracing_export_recovered lost_spans=7"]
    assert exporter.batches == [2]


async def test_a_raising_exporter_is_a_failure_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    exporter = Exporter()
    traced = tracing(exporter)
    exporter.raising = True
    spans(traced, 1)
    with caplog.at_level(logging.WARNING):
        await SpanExport(traced).export()
    assert "RuntimeError: exporter bug" in warnings(caplog, "picker.tracing_export_failed")[0]


async def test_a_hanging_exporter_times_out_and_the_flush_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    exporter = Exporter()
    exporter.held.clear()
    traced = tracing(exporter, export_timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING):
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    stop = trio.CancelScope()
                    await nursery.start(SpanExport(traced, flush_timeout_s=0.3).run, stop)
                    spans(traced, 4)  # a full batch: exported at once, and hangs
                    await trio.sleep(0.5)
                    spans(traced, 2)
                    stop.cancel()  # the flush waits for the hanging thread, for 0.3 s
        assert "no answer in 0.2s" in warnings(caplog, "picker.tracing_export_failed")[0]
        assert warnings(caplog, "picker.tracing_flush_incomplete") == [
            "picker.tracing_flush_incomplete lost_spans=2 timeout_s=0.3"]
        assert exporter.shut
    finally:
        exporter.held.set()  # the abandoned export thread returns


def test_the_sdks_exporter_log_lines_become_the_reason_of_the_latest_tracing() -> None:
    first, second = tracing(Exporter()), tracing(Exporter())
    logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").error("Failed to export: %s", "refused")
    assert (first.exporter_log.last, second.exporter_log.last) == ("", "Failed to export: refused")
