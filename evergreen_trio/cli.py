"""evergreen-trio: serve and consume GenAI wire protocols on Trio.

Evergreen sessions (serve, conformance), the Endpoint Picker for Envoy (picker, gateway-config,
gateway), a simulated vLLM model server (sim) and Arrow Dissociated IPC (ipc serve, ipc get).

Each area registers its subcommands through ``register(subparsers)`` in the module named in
``COMMAND_MODULES``; ``evergreen_trio._cli`` holds what they share.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from evergreen_trio import __version__
from evergreen_trio._cli import Parser, add_global_options, run_command
from evergreen_trio._extras import MissingExtraError

COMMAND_MODULES = {
    "evergreen_trio.serving.server_cli": ("serve",),
    "evergreen_trio.sim.cli": ("sim",),
    "evergreen_trio.testing.conformance": ("conformance",),
    "evergreen_trio.stack.gateway": ("gateway",),
    "evergreen_trio.ipc.cli": ("ipc",),
    "evergreen_trio.picker.cli": ("picker", "gateway-config"),
    "evergreen_trio.avp.cli": ("avp",),
}
"""Each module that registers subcommands, and their names (listed for an install without its extra)."""


def build_parser() -> Parser:
    """The ``evergreen-trio`` parser with every subcommand."""
    tool, commands, _ = (__doc__ or "").split("\n\n", 2)
    parser = Parser(prog="evergreen-trio", description=f"{tool} {commands}")
    parser.add_argument("--version", action="version",
                        version=f"evergreen-trio {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module, names in COMMAND_MODULES.items():
        try:
            importlib.import_module(module).register(subparsers)
        except MissingExtraError as missing:
            for name in names:
                _register_missing(subparsers, name, missing)
    add_global_options(parser)
    return parser


def _register_missing(subparsers: argparse._SubParsersAction[Parser], name: str, missing: MissingExtraError) -> None:
    """``name`` as a command that only says which extra to install (exit 2), whatever its arguments."""
    parser = subparsers.add_parser(name, help=f"(needs: pip install 'evergreen-trio[{missing.extra}]')",
                                   add_help=False)

    def refuse(args: argparse.Namespace) -> int:
        raise missing

    parser.set_defaults(run=refuse, missing_extra=missing)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not hasattr(args, "missing_extra"):  # a command without its extra takes any arguments
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --workers` starts workers with them
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    return run_command(args.prog, lambda: int(args.run(args)), debug=args.log_level == "DEBUG")


if __name__ == "__main__":
    sys.exit(main())
