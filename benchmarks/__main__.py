"""Run every benchmark area (or the ones named): each prints its table and writes benchmarks/results/<area>.json."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

AREAS = sorted(p.stem.removeprefix("bench_") for p in Path(__file__).parent.glob("bench_*.py"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("areas", nargs="*", help=f"areas to run (default all: {', '.join(AREAS)})")
    parser.add_argument("--quick", action="store_true", help="fewer runs and smaller sizes, for a smoke check")
    args = parser.parse_args()
    unknown = set(args.areas) - set(AREAS)
    if unknown:
        parser.error(f"unknown areas {sorted(unknown)}; known: {AREAS}")
    for area in args.areas or AREAS:
        importlib.import_module(f"benchmarks.bench_{area}").run(quick=args.quick)


if __name__ == "__main__":
    main()
