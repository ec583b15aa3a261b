"""`evergreen-trio picker` (the Endpoint Picker) and `evergreen-trio gateway-config` (its Envoy bootstrap,
or with ``--evergreen HOST:PORT ...`` an Envoy front for Evergreen servers: :mod:`evergreen_trio.evergreen_front`)."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

from evergreen_trio._cli import UsageError, port, serve_until_signal
from evergreen_trio.evergreen_front import add_front_arguments, front_from_args
from evergreen_trio.picker.config import load_config
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.runtime import PickerPorts, run_picker


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    picker = subparsers.add_parser("picker", help="run the Endpoint Picker (Envoy ext_proc server)")
    picker.add_argument("--config", required=True, metavar="FILE", help="YAML config (and/or Kubernetes manifests)")
    picker.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    picker.add_argument("--grpc-port", type=port, default=9002, help="ext_proc gRPC port (default 9002)")
    picker.add_argument("--grpc-health-port", type=port, default=9003, help="gRPC health port (default 9003)")
    picker.add_argument("--metrics-port", type=port, default=9090, help="Prometheus metrics port (default 9090)")
    picker.set_defaults(run=run_picker_command)

    config = subparsers.add_parser("gateway-config", help="write an Envoy bootstrap that routes through the picker")
    config.add_argument("--picker", default="127.0.0.1:9002", metavar="IP:PORT", help="the picker's gRPC address")
    config.add_argument("--listener-port", type=port, default=8081, help="Envoy's HTTP listener port (default 8081)")
    config.add_argument("--admin-port", type=port, default=9901, help="Envoy's admin port (default 9901)")
    config.add_argument("--pool-endpoint", action="append", default=[], metavar="IP:PORT",
                        help="adds the /override/ route (override_host policy) over these endpoints; repeatable")
    config.add_argument("--request-body-mode", default="FULL_DUPLEX_STREAMED",
                        choices=["BUFFERED", "FULL_DUPLEX_STREAMED"])
    config.add_argument("--response-body-mode", default="FULL_DUPLEX_STREAMED",
                        choices=["NONE", "BUFFERED", "FULL_DUPLEX_STREAMED"])
    config.add_argument("--output", "-o", default="-", metavar="FILE", help="file (.json or .yaml); '-' = stdout")
    add_front_arguments(config)
    config.set_defaults(run=run_gateway_config)


def run_picker_command(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; a bad config raises ConfigError (exit 2)."""
    config = load_config(args.config)

    def announce(ports: PickerPorts) -> None:
        print(f"evergreen-trio picker: grpc {args.host}:{ports.grpc} health {ports.health} "
              f"metrics {ports.metrics}", flush=True)

    return serve_until_signal(partial(
        run_picker, config, host=args.host, grpc_port=args.grpc_port, health_port=args.grpc_health_port,
        metrics_port=args.metrics_port), started=announce,
        address=f"{args.host} (ports {args.grpc_port}, {args.grpc_health_port}, {args.metrics_port})")


def run_gateway_config(args: argparse.Namespace) -> int:
    try:
        bootstrap = front_from_args(args) if args.evergreen else gateway_config(
            args.picker, args.listener_port, admin_port=args.admin_port, pool_endpoints=args.pool_endpoint,
            request_body_mode=args.request_body_mode, response_body_mode=args.response_body_mode)
    except ValueError as exc:  # ConfigError is one too
        raise UsageError(str(exc)) from None
    if args.output == "-":
        json.dump(bootstrap, sys.stdout, indent=2)
        print()
        return 0
    try:
        path = write_gateway_config(args.output, bootstrap)
    except OSError as exc:
        raise UsageError(f"argument --output: cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {path}", file=sys.stderr)
    return 0
