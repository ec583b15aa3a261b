"""The plugin's synchronous fixtures: a server process and a grpcio client of it."""

from __future__ import annotations

from evergreen_trio.testing.checks import check_valid, probe_plan
from evergreen_trio.testing.subprocess_server import ServerProcess
from evergreen_trio.testing.wire import SyncClient


def test_server_process_and_wire_client(evergreen_server_process: ServerProcess,
                                        evergreen_wire_client: SyncClient) -> None:
    plan = probe_plan()
    check_valid(plan, evergreen_wire_client.run(plan.messages()))
    assert evergreen_server_process.rss_bytes() > 0
