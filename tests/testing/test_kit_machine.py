"""The state machine against our server in a child process: strict status codes, over-limit
sessions, full metadata, and repeated identical metadata (which our server accepts)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from evergreen_trio.dag import SessionLimits
from evergreen_trio.testing.machine import machine_for
from evergreen_trio.testing.strategies import DEFAULT_DELIVERY, DEFAULT_SHAPE
from evergreen_trio.testing.subprocess_server import ServerProcess
from evergreen_trio.testing.wire import SyncClient


def test_our_server_keeps_every_rule_session_after_session(
    small_server: ServerProcess, wire_client: SyncClient, small_limits: SessionLimits
) -> None:
    machine = machine_for(
        wire_client,
        limits=small_limits,
        strict_codes=True,
        full_metadata=True,
        shape=replace(DEFAULT_SHAPE, full_metadata=True),
        # reuse_outputs: see test_output_reuse_holds_on_our_server (a race in our server).
        delivery=replace(DEFAULT_DELIVERY, repeat_metadata=True, reuse_outputs=False),
        after_session=lambda: None if small_server.process.poll() is None else _died(small_server),
    )
    run_state_machine_as_test(machine, settings=settings(settings.default, stateful_step_count=8))


def _died(server: ServerProcess) -> None:
    raise AssertionError(f"the server process exited with {server.process.returncode}")
