"""`evergreen-trio sim`: serve one simulated vLLM server on a port."""

from __future__ import annotations

import argparse
from functools import partial

from evergreen_trio._cli import add_dataclass_options, dataclass_options, port, serve_until_signal
from evergreen_trio.sim.config import OPTION_HELP, SimConfig
from evergreen_trio.sim.server import run_sim


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The SimConfig the options describe; raises SimConfigError."""
    return SimConfig(lora_adapters=tuple(args.lora), **dataclass_options(args, SimConfig, OPTION_HELP))


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    return serve_until_signal(partial(run_sim, config, host=args.host, port=args.port), started=lambda _: None,
                              address=f"{args.host}:{args.port}")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``sim`` subcommand."""
    parser = subparsers.add_parser("sim", help="run a simulated vLLM (OpenAI-compatible) model server",
                                   description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8001, help="port to bind, 0 for any (default: %(default)s)")
    add_dataclass_options(parser, SimConfig, OPTION_HELP)
    parser.add_argument("--lora", action="append", default=[], metavar="NAME",
                        help="serve a LoRA adapter of this name (repeatable)")
    parser.set_defaults(run=_run)
