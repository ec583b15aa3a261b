"""`python -m benchmarks workers`: where servers and load run for each N, on a host of any size.

The measurement itself needs many cores and minutes (a 2-core machine fits only N = 1 pinned);
this pins down the layout: disjoint cores, the same load for every N, and what does not fit said.
"""

from __future__ import annotations

from benchmarks.bench_workers import layouts


def test_sixteen_cores_pin_every_n_apart_from_eight_load_cores() -> None:
    found, notes = layouts(range(16))
    assert [(layout.workers, layout.server_cores) for layout in found] == [
        (1, (0,)), (2, (0, 1)), (4, (0, 1, 2, 3)), (8, tuple(range(8)))]
    assert {layout.load_cores for layout in found} == {tuple(range(8, 16))}
    assert notes == []


def test_two_cores_pin_one_worker_share_two_and_say_so() -> None:
    found, notes = layouts([0, 1])
    assert [(layout.workers, layout.server_cores, layout.load_cores) for layout in found] == [
        (1, (0,), (1,)), (2, None, (None,))]
    assert notes == ["2 workers: servers and load share all 2 cores (pinned needs 3)",
                     "4 workers: skipped, needs 5 cores, this host has 2",
                     "8 workers: skipped, needs 9 cores, this host has 2"]
