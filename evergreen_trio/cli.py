"""`evergreen-trio` and its subcommands: argument parsing and wiring, no logic.

Each area registers its own subcommands through a ``register(subparsers)``
function in the module named in ``COMMAND_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

COMMAND_MODULES = (
    "evergreen_trio.server_cli",
    "evergreen_trio.sim.cli",
    "evergreen_trio.testing.conformance",
    "evergreen_trio.gateway",
    "evergreen_trio.ipc.cli",
    "evergreen_trio.picker.cli",
    "evergreen_trio.avp.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evergreen-trio", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
