"""`evergreen-trio gateway`: the picker, a real Envoy and optionally N simulated model servers, under one nursery.

``run_gateway`` starts, in order, the simulated servers (``simulate`` > 0: their addresses
define the pool's endpoints), the picker on the pool, and Envoy on the config ``gateway_config``
writes; it reports a :class:`GatewayInfo` once a request through Envoy reaches a model server.
Everything lives in one nursery: Ctrl-C, or the picker or Envoy failing or stopping, cancels the
rest, and Envoy (a child process) is terminated with it. A simulated server that fails once running
is logged and restarted on its port; it never stops the others.
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("gateway", __name__)

import argparse
import contextvars
import ipaddress
import logging
import socket
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from evergreen_trio._cli import add_dataclass_options, dataclass_options, port, serve_until_signal
from evergreen_trio._logsafe import peer_text
from evergreen_trio.errors import ConfigurationError, EvergreenTrioError
from evergreen_trio.picker.config import PickerConfig, config_from_documents, read_documents
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.envoy_process import run_envoy
from evergreen_trio.picker.epp_flags import go_bool
from evergreen_trio.picker.flow_control.config import queue_wait
from evergreen_trio.picker.runtime import PickerPorts, run_picker
from evergreen_trio.sim.config import OPTION_HELP, SimConfig
from evergreen_trio.sim.server import run_sim

logger = logging.getLogger(__name__)

MAX_SIMULATE = 64
"""Most simulated servers one gateway runs."""

ENVOY_LOG_FORMAT = "[envoy] %Y-%m-%d %T.%e %l %n: %v"
"""Envoy writes its own log lines with this prefix (it is a child process with our stderr)."""

_component: contextvars.ContextVar[str] = contextvars.ContextVar("evergreen_trio_gateway_component", default="")


class GatewayError(EvergreenTrioError):
    """The gateway could not start, or one of its parts stopped."""


class GatewaySettingsError(GatewayError, ConfigurationError):
    """A :class:`GatewaySettings` field makes no sense; the message names it."""


@dataclass(frozen=True)
class GatewaySettings:
    """What ``run_gateway`` runs.

    ``config_path`` is a picker config (YAML, see docs/picker.md); it may be None when
    ``simulate`` > 0, which then makes a pool of the simulated servers that accepts any model.
    """

    config_path: Path | None = None
    listen: str = "127.0.0.1:8080"
    """Envoy's listener, ``ip:port`` (port 0: any free port, reported in GatewayInfo)."""
    simulate: int = 0
    """Simulated model servers to run; their addresses replace the config's endpoints."""
    sim: SimConfig = field(default_factory=SimConfig)
    """Knobs of every simulated server; model names come from the config's models when it lists any."""
    round_robin_port: int | None = None
    """Also open Envoy's round-robin listener (no picker) on this port (0: any free), the routing baseline."""
    picker_host: str = "127.0.0.1"
    secure_picker: bool = False
    """TLS between Envoy and the picker (a self-signed certificate), as in a cluster."""
    grpc_port: int = 0
    health_port: int = 0
    metrics_port: int = 0
    ready_timeout_s: float = 30.0
    """How long the stack may take to answer its first request through Envoy."""

    def __post_init__(self) -> None:
        if not 0 <= self.simulate <= MAX_SIMULATE:
            raise GatewaySettingsError(f"simulate must be in 0..{MAX_SIMULATE}, got {self.simulate}")
        if self.config_path is None and not self.simulate:
            raise GatewaySettingsError("expected a config file, or simulate >= 1 to make a pool of simulated servers")
        split_listen(self.listen)
        for name in ("grpc_port", "health_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise GatewaySettingsError(f"{name} must be in 0..65535, got {getattr(self, name)}")
        if self.round_robin_port is not None and not 0 <= self.round_robin_port < 65536:
            raise GatewaySettingsError(f"round_robin_port must be in 0..65535, got {self.round_robin_port}")
        if self.ready_timeout_s <= 0:
            raise GatewaySettingsError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


@dataclass(frozen=True)
class GatewayInfo:
    """Where a running gateway's parts are (what ``task_status.started`` reports)."""

    url: str
    """The gateway: send OpenAI requests here."""
    round_robin_url: str | None
    admin_url: str
    picker: PickerPorts
    endpoints: tuple[str, ...]
    """The pool's model servers, ``ip:port``."""
    envoy_config: Path

    def lines(self) -> list[str]:
        """A human summary, one part per line."""
        lines = [f"gateway      {self.url}"]
        if self.round_robin_url:
            lines.append(f"round robin  {self.round_robin_url}  (baseline, no picker)")
        lines += [
            f"picker       grpc 127.0.0.1:{self.picker.grpc}  health :{self.picker.health}  "
            f"metrics http://127.0.0.1:{self.picker.metrics}/metrics",
            f"envoy admin  {self.admin_url}  config {self.envoy_config}",
        ]
        lines += [f"endpoint     http://{address}" for address in self.endpoints]
        return lines


class _ComponentPrefix(logging.Filter):
    """Prefixes each record with the gateway part it came from, e.g. ``[sim-2]``."""

    def filter(self, record: logging.LogRecord) -> bool:
        component = _component.get()
        if component and not getattr(record, "_gateway_prefixed", False):
            record.msg = f"[{component}] {record.msg}"
            record._gateway_prefixed = True
        return True


@contextmanager
def _prefixed_logs() -> Iterator[None]:
    handlers = logging.getLogger().handlers
    prefix = _ComponentPrefix()
    for handler in handlers:
        handler.addFilter(prefix)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(prefix)


async def _part(
    name: str, run: Callable[..., Awaitable[None]], *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one part under its log prefix; a part that returns is an error (it must run until cancelled)."""
    _component.set(name)
    await run(task_status=task_status)
    raise GatewayError(f"{name} stopped on its own; stopping the gateway")


SIM_RESTART_MAX_DELAY_S = 30.0
"""A simulated server that fails is restarted on its port after 0.5 s, doubling up to this."""


async def _sim_part(
    name: str,
    config: SimConfig,
    *,
    run: Callable[..., Awaitable[None]] = run_sim,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one simulated server under its log prefix, restarting it on the same port whenever it
    fails or stops, so that one sim's trouble never stops the picker or Envoy beside it. Only a
    failure before it first listens is the gateway's (raised)."""
    _component.set(name)
    port = 0
    started = False
    delay = 0.5
    while True:
        try:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(partial(run, config, host="127.0.0.1", port=port))
                if not started:
                    task_status.started(port)
                    started = True
                delay = 0.5
            reason = "stopped on its own"
        except Exception as error:
            if not started:
                raise
            reason = f"{type(error).__name__}: {peer_text(str(error))}"
        logger.error("gateway.sim_failed name=%s port=%d reason=%s; restarting in %.1fs", name, port, reason, delay)
        await trio.sleep(delay)
        delay = min(delay * 2, SIM_RESTART_MAX_DELAY_S)


def split_listen(listen: str) -> tuple[str, int]:
    """``ip:port`` or ``[v6]:port`` -> (ip, port); port 0 means any free port."""
    host, _, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise GatewaySettingsError(f"listen must be ip:port, got {listen!r}") from None
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise GatewaySettingsError(f"listen port must be in 0..65535, got {listen!r}") from None
    return host, int(port)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _read_documents(path: Path | None) -> list[object]:
    if path is None:
        return [{"pool": {"name": "simulated", "endpoints": []}}]
    return read_documents(path)


def pool_config(documents: Sequence[object], endpoints: Sequence[str] | None) -> PickerConfig:
    """The picker config of ``documents``, with the plain document's endpoints replaced when given."""
    if endpoints is None:
        return config_from_documents(documents)
    patched: list[object] = []
    for document in documents:
        if isinstance(document, Mapping) and "kind" not in document and isinstance(document.get("pool"), Mapping):
            pool = {**document["pool"], "endpoints": [{"address": a, "engine": "vllm"} for a in endpoints]}
            document = {**document, "pool": pool}
        patched.append(document)
    return config_from_documents(patched)


def served_names(config: PickerConfig) -> tuple[str, ...]:
    """The model names the pool's servers must serve: each model's targets, or the model itself."""
    names: list[str] = []
    for model in config.models:
        for name in [t.name for t in model.target_models] or [model.name]:
            if name not in names:
                names.append(name)
    return tuple(names)


async def _wait_until_routed(url: str, timeout_s: float) -> None:
    """Until ``GET /v1/models`` through Envoy and the picker answers 200 (the picker has scraped the pool)."""
    last = "no answer"
    async with httpx.AsyncClient(timeout=2.0) as client:
        with trio.move_on_after(timeout_s):
            while True:
                try:
                    response = await client.get(f"{url}/v1/models")
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code}"
                except httpx.HTTPError as error:
                    last = type(error).__name__
                await trio.sleep(0.05)
    raise GatewayError(f"expected a request through {url} to reach a model server within {timeout_s}s; last: {last}")


async def _bound_listeners(admin_url: str) -> dict[str, int]:
    """Envoy's listener name -> bound port, from its admin API (needed when a port was 0)."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        statuses = (await client.get(f"{admin_url}/listeners", params={"format": "json"})).json()
    return {
        status["name"]: int(status["local_address"]["socket_address"]["port_value"])
        for status in statuses["listener_statuses"]
    }


async def run_gateway(
    settings: GatewaySettings, *, task_status: trio.TaskStatus[GatewayInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the whole gateway until cancelled; ``started`` gets where everything is."""
    documents = _read_documents(settings.config_path)
    simulated = settings.simulate > 0
    # Validate the config before anything starts (placeholder endpoints stand in for the simulators).
    config = pool_config(documents, [f"127.0.0.1:{i + 1}" for i in range(settings.simulate)] if simulated else None)
    listen_host, listen_port = split_listen(settings.listen)
    sim_config = settings.sim
    names = served_names(config)
    if simulated and names:
        sim_config = replace(sim_config, model=names[0], lora_adapters=names[1:],
                             max_loras=max(sim_config.max_loras, 1))
    with _prefixed_logs(), tempfile.TemporaryDirectory(prefix="evergreen-gateway-") as workdir:
        async with trio.open_nursery() as nursery:
            if simulated:
                ports = []
                for index in range(settings.simulate):
                    ports.append(await nursery.start(partial(_sim_part, f"sim-{index + 1}", sim_config)))
                config = pool_config(documents, [f"127.0.0.1:{port}" for port in ports])
            endpoints = tuple(endpoint.address for endpoint in config.pool.endpoints)
            ssl_context = None
            if settings.secure_picker:
                from evergreen_trio.picker.tls import self_signed_context  # cryptography: the picker extra

                ssl_context = self_signed_context()
            picker_ports: PickerPorts = await nursery.start(_part, "picker", partial(
                run_picker, config, host=settings.picker_host, grpc_port=settings.grpc_port,
                health_port=settings.health_port, metrics_port=settings.metrics_port, ssl_context=ssl_context,
            ))
            admin_port = _free_port()
            envoy_config = write_gateway_config(Path(workdir) / "envoy.json", gateway_config(
                f"{settings.picker_host}:{picker_ports.grpc}", listen_port, admin_port=admin_port,
                listen_host=listen_host,
                round_robin_endpoints=endpoints if settings.round_robin_port is not None else (),
                round_robin_port=settings.round_robin_port, picker_tls=settings.secure_picker,
                queue_wait_s=queue_wait(config.flow_control),
            ))
            await nursery.start(_part, "envoy", partial(
                run_envoy, envoy_config, admin_port=admin_port, extra_args=("--log-format", ENVOY_LOG_FORMAT),
            ))
            admin_url = f"http://127.0.0.1:{admin_port}"
            bound = await _bound_listeners(admin_url)
            host = f"[{listen_host}]" if ":" in listen_host else listen_host
            info = GatewayInfo(
                url=f"http://{host}:{bound['gateway']}",
                round_robin_url=f"http://{host}:{bound['round_robin']}" if "round_robin" in bound else None,
                admin_url=admin_url,
                picker=picker_ports,
                endpoints=endpoints,
                envoy_config=Path(workdir) / "envoy.json",
            )
            await _wait_until_routed(info.url, settings.ready_timeout_s)
            for line in info.lines():
                logger.info("gateway.ready %s", line)
            task_status.started(info)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """The GatewaySettings the command line describes; raises GatewaySettingsError or SimConfigError."""
    return GatewaySettings(
        config_path=args.config,
        listen=args.listen,
        simulate=args.simulate,
        sim=SimConfig(lora_adapters=tuple(args.sim_lora), **dataclass_options(args, SimConfig, OPTION_HELP,
                                                                               prefix="sim_")),
        round_robin_port=args.round_robin_port,
        grpc_port=args.grpc_port,
        health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        ready_timeout_s=args.ready_timeout,
        secure_picker=args.secure_serving,
    )


def _announce(info: GatewayInfo) -> None:
    print("\n".join(info.lines()), flush=True)
    print("Ctrl-C stops everything.", flush=True)


def _run(args: argparse.Namespace) -> int:
    """Run the gateway until SIGINT or SIGTERM, which cancel it (rather than a KeyboardInterrupt mid-send)."""
    # The picker's scrapers log every scrape through httpx at INFO: too chatty for a console.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return serve_until_signal(run_gateway, settings_from_args(args), started=_announce)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``gateway`` subcommand."""
    parser = subparsers.add_parser(
        "gateway", help="run the picker, a real Envoy and optionally simulated model servers",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--config", type=Path, default=None, help="picker config (YAML); optional with --simulate")
    parser.add_argument("--listen", default="127.0.0.1:8080", help="Envoy listener ip:port (default: %(default)s)")
    parser.add_argument("--simulate", type=int, default=0, metavar="N",
                        help="run N simulated model servers as the pool (default: %(default)s)")
    parser.add_argument("--round-robin-port", type=port, default=None,
                        help="also open a round-robin listener (no picker) on this port, as a baseline")
    parser.add_argument("--grpc-port", type=port, default=0, help="picker ext_proc port (default: any free)")
    parser.add_argument("--grpc-health-port", type=port, default=0, help="picker health port (default: any free)")
    parser.add_argument("--metrics-port", type=port, default=0, help="picker metrics port (default: any free)")
    parser.add_argument("--secure-serving", type=go_bool, nargs="?", const=True, default=False, metavar="BOOL",
                        help="TLS between Envoy and the picker, self-signed (default: false)")
    parser.add_argument("--ready-timeout", type=float, default=30.0,
                        help="seconds to wait for the first request through Envoy (default: %(default)s)")
    group = parser.add_argument_group("simulated servers (with --simulate)")
    add_dataclass_options(group, SimConfig, OPTION_HELP, prefix="sim-")
    group.add_argument("--sim-lora", action="append", default=[], metavar="NAME",
                       help="serve a LoRA adapter of this name (repeatable)")
    parser.set_defaults(run=_run)
