"""The Trio task that exports the picker's finished spans (``--tracing``): :func:`exporting`.

It empties :class:`~evergreen_trio.picker.tracing.SpanBuffer` every ``OTEL_BSP_SCHEDULE_DELAY``
(sooner when a full batch waits), a batch at a time, through the SDK's exporter in a worker
thread (``trio.to_thread``, one at a time) bounded by ``OTEL_BSP_EXPORT_TIMEOUT``. A failing
exporter (a collector down, slow or refusing) costs the batch and one warning per episode of
failures, never a request. It runs until the picker has stopped serving (the streams that end
during a graceful stop are exported too), then flushes what is left for at most
:data:`FLUSH_TIMEOUT_S` and shuts the exporter down.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:  # the `tracing` extra: the runtime imports this module without it
    from evergreen_trio.picker.tracing import Tracing

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
"""The most the final flush waits on shutdown (a collector that is down must not hold the picker)."""


@asynccontextmanager
async def exporting(tracing: Tracing | None) -> AsyncIterator[None]:
    """Export ``tracing``'s spans (None: nothing to do) while the body runs, then flush them."""
    if tracing is None:
        yield
        return
    stop = trio.CancelScope(shield=True)  # the picker's cancellation reaches the body, not this task
    async with trio.open_nursery() as nursery:
        await nursery.start(SpanExport(tracing).run, stop)
        try:
            yield
        finally:
            stop.cancel()


class SpanExport:
    """Exports ``tracing``'s buffered spans: :meth:`run` until ``stop`` is cancelled."""

    def __init__(self, tracing: Tracing, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        self.tracing = tracing
        self.flush_timeout_s = flush_timeout_s
        self.failing = False
        self.failed_spans = 0
        """Spans in the batches lost in the current episode of failures."""
        self.exported = 0
        self._wake = trio.Event()
        # One export thread at a time: one abandoned on its timeout holds this until it returns.
        self._threads = trio.CapacityLimiter(1)

    async def run(self, stop: trio.CancelScope, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        buffer = self.tracing.buffer
        buffer.on_batch = self._full_batch
        task_status.started()
        try:
            with stop:
                while True:
                    with trio.move_on_after(self.tracing.settings.delay_s):
                        await self._wake.wait()
                    self._wake = trio.Event()
                    await self.export()
        finally:
            buffer.on_batch = None
            left, exported = len(buffer.spans), self.exported
            with trio.CancelScope(shield=True) as flush:
                flush.deadline = trio.current_time() + self.flush_timeout_s
                await self.export()
            if self.exported - exported < left:
                log.warning("picker.tracing_flush_incomplete lost_spans=%d timeout_s=%g",
                            left - (self.exported - exported), self.flush_timeout_s)
            self.tracing.exporter.shutdown()

    def _full_batch(self) -> None:
        self._wake.set()

    async def export(self) -> None:
        """Export the buffered spans a batch at a time, until none is left or a batch fails."""
        buffer, settings = self.tracing.buffer, self.tracing.settings
        while buffer.spans:
            batch = buffer.take(settings.batch_size)
            reason = None
            with trio.move_on_after(settings.export_timeout_s) as waited:
                try:
                    exported = await trio.to_thread.run_sync(self.tracing.export, batch, limiter=self._threads,
                                                             abandon_on_cancel=True)
                except Exception as exc:  # an exporter's bug must not end the picker
                    reason = f"{type(exc).__name__}: {str(exc)[:200]}"
                else:
                    if not exported:
                        reason = self.tracing.exporter_log.last or "the exporter reported a failure"
            if waited.cancelled_caught:
                reason = f"no answer in {settings.export_timeout_s:g}s"
            if reason is not None:
                self._failed(reason, len(batch))
                return
            self.exported += len(batch)
            if self.failing:
                log.info("picker.tracing_export_recovered lost_spans=%d", self.failed_spans)
                self.failing, self.failed_spans = False, 0

    def _failed(self, reason: str, spans: int) -> None:
        if not self.failing:
            log.warning("picker.tracing_export_failed exporter=%s reason=%r: spans are lost until it answers; "
                        "routing goes on", self.tracing.settings.exporter, reason)
            self.failing = True
        self.failed_spans += spans
