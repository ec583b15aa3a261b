"""evergreen-trio: serve and consume GenAI wire protocols on Trio.

Evergreen sessions (serve, conformance), the Endpoint Picker for Envoy (picker, gateway-config,
gateway), a simulated vLLM model server (sim) and Arrow Dissociated IPC (ipc serve, ipc get).

Each area registers its subcommands through ``register(subparsers)`` in the module named in
``COMMAND_MODULES``; ``evergreen_trio._cli`` holds what they share.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

from evergreen_trio._cli import Parser, add_global_options, run_command

COMMAND_MODULES = (
    "evergreen_trio.server_cli",
    "evergreen_trio.sim.cli",
    "evergreen_trio.testing.conformance",
    "evergreen_trio.gateway",
    "evergreen_trio.ipc.cli",
    "evergreen_trio.picker.cli",
    "evergreen_trio.avp.cli",
)


def build_parser() -> Parser:
    """The ``evergreen-trio`` parser with every subcommand."""
    tool, commands, _ = (__doc__ or "").split("\n\n", 2)
    parser = Parser(prog="evergreen-trio", description=f"{tool} {commands}")
    parser.add_argument("--version", action="version",
                        version=f"evergreen-trio {importlib.metadata.version('evergreen-trio')}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    add_global_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --workers` starts workers with them
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    return run_command(args.prog, lambda: int(args.run(args)), debug=args.log_level == "DEBUG")


if __name__ == "__main__":
    sys.exit(main())
