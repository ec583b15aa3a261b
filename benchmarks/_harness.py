"""Shared benchmark plumbing: repeated timing, medians, percentiles, the printed table and JSON results."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# BENCH_RESULTS_DIR redirects the JSON (tests run quick benchmarks without touching the committed results).
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).parent / "results")


@dataclass
class Row:
    """One line of a benchmark table: a measured case, its value, unit and ratio to the named peer."""

    case: str
    value: float
    unit: str
    peer: str = ""
    ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def median_of(runs: int, measure: Callable[[], float]) -> tuple[float, list[float]]:
    """Call ``measure`` ``runs`` times; return the median and every sample."""
    samples = [measure() for _ in range(runs)]
    return statistics.median(samples), samples


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    """Seconds per call of ``fn`` over ``repeat`` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def print_table(title: str, rows: Iterable[Row]) -> None:
    rows = list(rows)
    print(f"\n## {title}\n")
    print("| case | value | unit | peer | ratio |")
    print("|---|---:|---|---|---:|")
    for row in rows:
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}x"
        print(f"| {row.case} | {row.value:,.4g} | {row.unit} | {row.peer} | {ratio} |")


def write_results(area: str, rows: Iterable[Row], **context: Any) -> Path:
    """Write ``benchmarks/results/<area>.json`` and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{area}.json"
    payload = {
        "area": area,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "rows": [asdict(row) for row in rows],
        **context,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def run_plain_asyncio(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the standard library's own selector loop, for the asyncio peers.

    Pinned, not assumed: when importing ``evergreen_trio`` imported trio-asyncio, which replaces
    ``asyncio.new_event_loop`` process-wide, a plain ``asyncio.run`` ran on trio-asyncio's
    ``SyncTrioEventLoop``, which doubled raw grpclib's round trip (141 -> 280 us) and weakened every
    asyncio peer. No dependency of ours does that now; a peer must not depend on it.
    """
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main)
