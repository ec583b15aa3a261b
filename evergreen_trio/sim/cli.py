"""`evergreen-trio sim`: serve one simulated vLLM server on a port."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from functools import partial

import trio

from evergreen_trio.signals import cancel_on_signals
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimConfigError
from evergreen_trio.sim.server import run_sim

logger = logging.getLogger("evergreen_trio.sim")

_HELP = {
    "model": "served model name",
    "max_batch": "most running sequences",
    "kv_blocks": "KV cache blocks",
    "block_size": "tokens per KV block",
    "chars_per_token": "characters per simulated token",
    "prefill_us_per_token": "prefill microseconds per uncached prompt token",
    "decode_ms_per_token": "decode step milliseconds at batch 1",
    "decode_batch_factor": "decode step slowdown per extra running sequence",
    "max_batched_tokens": "most uncached prompt tokens prefilled per step",
    "max_loras": "most LoRA adapters loaded at once",
    "lora_load_ms": "milliseconds to load an adapter",
    "max_model_len": "most prompt + output tokens",
    "default_max_tokens": "output tokens when the request does not say",
    "max_waiting": "most queued requests (then 503)",
    "max_body_bytes": "largest request body (then 413)",
    "seed": "seed of the generated text",
    "time_scale": "multiplies every simulated duration",
}


def add_config_arguments(parser: argparse._ActionsContainer, *, prefix: str = "") -> None:
    """One option per SimConfig knob (``--max-batch`` ...) and ``--lora`` (repeatable), names after ``prefix``."""
    for field in fields(SimConfig):
        if field.name == "lora_adapters":
            continue
        default = field.default
        assert default is not MISSING
        parser.add_argument(
            f"--{prefix}{field.name.replace('_', '-')}", type=type(default), default=default,
            help=f"{_HELP[field.name]} (default: %(default)s)",
        )
    parser.add_argument(f"--{prefix}lora", action="append", default=[], metavar="NAME",
                        help="serve a LoRA adapter of this name (repeatable)")


def config_from_args(args: argparse.Namespace, *, prefix: str = "") -> SimConfig:
    """Build the SimConfig the options describe (``prefix`` as in ``add_config_arguments``, with ``_``)."""
    values = {f.name: getattr(args, prefix + f.name) for f in fields(SimConfig) if f.name != "lora_adapters"}
    return SimConfig(lora_adapters=tuple(getattr(args, prefix + "lora")), **values)


def _run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except SimConfigError as error:
        logger.error("sim.config-error %s", error)
        return 2
    trio.run(_serve, config, args.host, args.port)
    return 0


async def _serve(config: SimConfig, host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_on_signals, nursery.cancel_scope)
        await nursery.start(partial(run_sim, config, host=host, port=port))


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``sim`` subcommand."""
    parser = subparsers.add_parser("sim", help="run a simulated vLLM (OpenAI-compatible) model server",
                                   description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8001, help="port to bind, 0 for any (default: %(default)s)")
    add_config_arguments(parser)
    parser.set_defaults(run=_run)
