"""`evergreen-trio picker` (the Endpoint Picker) and `evergreen-trio gateway-config` (its Envoy bootstrap, or
with ``--evergreen HOST:PORT ...`` an Envoy front for Evergreen servers: :mod:`evergreen_trio.serving.evergreen_front`).

The picker runs in one of two modes. Static (``--config FILE``): the endpoints are listed in
the file; defaults are loopback and plaintext, for one machine. Cluster (``--pool-name NAME``):
a drop-in for the reference Endpoint Picker image of the official ``inferencepool`` Helm chart;
the endpoints are the InferencePool's Ready pods, and the defaults are the reference's: all
interfaces, TLS on the ext_proc port.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from evergreen_trio._cli import UsageError, port, serve_until_signal
from evergreen_trio._grpc.server import SSLContextSource
from evergreen_trio.picker.config import PickerConfig, load_config, parse_address, parse_config, parse_duration
from evergreen_trio.picker.envoy_config import gateway_config, write_gateway_config
from evergreen_trio.picker.epp_config import alpha_plugins
from evergreen_trio.picker.epp_flags import add_reference_flags, apply_reference_flags, go_bool
from evergreen_trio.picker.errors import ConfigError, PickerError
from evergreen_trio.picker.file_discovery import DiscoveredEndpoints, FileDiscovery
from evergreen_trio.picker.file_watch import discovery_for
from evergreen_trio.picker.flow_control.config import go_duration, quantity, quantity_int64
from evergreen_trio.picker.latency import producers
from evergreen_trio.picker.latency_wire import config_from_env
from evergreen_trio.picker.plugin_state import DumpState
from evergreen_trio.picker.runtime import (
    DRAIN_WINDOW_SECONDS,
    Discovery,
    LeaderElection,
    MetricsAuthSource,
    NotificationWatch,
    ObjectiveWatch,
    PickerDrain,
    PickerPorts,
    PodNotifications,
    run_picker,
)
from evergreen_trio.serving.evergreen_front import add_front_arguments, front_from_args
from evergreen_trio.serving.signals import with_stop_deadline

if TYPE_CHECKING:  # the `tracing` extra, imported only with --tracing
    from evergreen_trio.picker.tracing import Tracing

log = logging.getLogger(__name__)
REFERENCE_POOL_GROUP = "inference.networking.k8s.io"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    picker = subparsers.add_parser(
        "picker", help="run the Endpoint Picker (Envoy ext_proc server)",
        description="Static mode: --config FILE. Cluster mode (drop-in for the reference EPP): --pool-name NAME.")
    mode = picker.add_mutually_exclusive_group(required=True)
    mode.add_argument("--config", metavar="FILE", help="static mode: YAML config with the endpoints")
    mode.add_argument("--pool-name", metavar="NAME", help="cluster mode: the InferencePool to serve")
    picker.add_argument("--pool-namespace", metavar="NS",
                        help="the pool's namespace (default: $NAMESPACE, else the kubeconfig's, else default)")
    picker.add_argument("--pool-group", default=REFERENCE_POOL_GROUP, metavar="GROUP",
                        help=f"the InferencePool API group ({REFERENCE_POOL_GROUP} or inference.networking.x-k8s.io)")
    text = picker.add_mutually_exclusive_group()
    text.add_argument("--config-file", metavar="FILE", help="cluster mode: EndpointPickerConfig or our YAML")
    text.add_argument("--config-text", metavar="TEXT", help="the same, given inline")
    picker.add_argument("--host", default=None,
                        help="address to bind (default: 127.0.0.1 static, all interfaces cluster)")
    picker.add_argument("--secure-serving", type=go_bool, nargs="?", const=True, default=None, metavar="BOOL",
                        help="TLS on the ext_proc port (default: false static, true cluster)")
    picker.add_argument("--cert-path", metavar="DIR", help="directory with tls.crt and tls.key (else self-signed)")
    picker.add_argument("--grpc-port", type=port, default=9002, help="ext_proc gRPC port (default 9002)")
    picker.add_argument("--grpc-health-port", type=port, default=9003, help="gRPC health port (default 9003)")
    picker.add_argument("--metrics-port", type=port, default=9090, help="Prometheus metrics port (default 9090)")
    picker.add_argument("--kubeconfig", metavar="FILE", help="cluster access (default: $KUBECONFIG, else in-cluster)")
    picker.add_argument("--ha-enable-leader-election", type=go_bool, nargs="?", const=True, default=False,
                        metavar="BOOL", help="take a coordination.k8s.io Lease; only the leader is ready")
    picker.add_argument("--endpoint-selector", metavar="K=V,...",
                        help="cluster mode without an InferencePool: pods with these labels")
    picker.add_argument("--endpoint-target-ports", metavar="PORT,...", help="with --endpoint-selector: their ports")
    picker.add_argument("--refresh-metrics-interval", metavar="DURATION", help="scrape interval (default 50ms)")
    picker.add_argument("--metrics-staleness-threshold", metavar="DURATION", help="metrics age limit (default 2s)")
    picker.add_argument("--model-server-metrics-path", metavar="PATH", help="scrape path (default /metrics)")
    picker.add_argument("--model-server-metrics-scheme", default=None, choices=["http", "https"],
                        help="scrape scheme (default http; a metrics-data-source's scheme otherwise)")
    picker.add_argument("--drain-timeout", metavar="DURATION",
                        help="on SIGTERM: NOT_SERVING and the Lease released at once, ext_proc served this long "
                             "(default 30s with --pool-name, as the reference; 0s with --config)")
    picker.add_argument("--stop-grace", default="90s", metavar="DURATION",
                        help="then the port closes with a GOAWAY and the streams in flight get this long "
                             "to end (default 90s)")
    flag = partial(picker.add_argument, type=go_bool, nargs="?", const=True, default=False, metavar="BOOL")
    flag("--allow-experimental-plugins", help="allow the reference's Alpha plugin types in the config")
    flag("--emit-endpoint-scores", help="each candidate's score in envoy.lb/x-gateway-destination-endpoint-scores")
    flag("--disable-endpoint-subset-filter", help="ignore Envoy's envoy.lb.subset_hint metadata")
    flag("--enable-grpc-stream-metrics", help="the llm_d_epp_extproc_stream* metrics")
    flag("--tracing", help="OpenTelemetry spans of each request, as the reference's (OTEL_* variables; "
                           "needs the tracing extra)")
    flag("--model-server-metrics-https-insecure-skip-verify", default=True,
         help="with --model-server-metrics-scheme https: the model servers' certificates not verified (default true)")
    flag("--metrics-endpoint-auth", default=None,
         help="scrapes need a Kubernetes token allowed to GET the path (default true with --pool-name)")
    picker.add_argument("--grpc-max-recv-msg-size", metavar="SIZE",
                        help="largest ext_proc message taken, e.g. 10MiB (default: the largest body cap + 64 KiB)")
    picker.add_argument("--grpc-max-send-msg-size", metavar="SIZE", help="largest ext_proc reply sent (default: any)")
    picker.add_argument("--tls-min-version", metavar="VERSION", help="ext_proc TLS floor: VersionTLS12 (default), ...")
    picker.add_argument("--tls-cipher-suites", metavar="SUITE,...", help="ext_proc TLS 1.2 suites, Go crypto/tls names")
    picker.add_argument("--metrics-cert-dir", metavar="DIR", help="TLS on the metrics port: tls.crt and tls.key there")
    picker.add_argument("--metrics-client-ca-file", metavar="FILE",
                        help="with --metrics-cert-dir: scrapers need a client certificate this CA signed")
    add_reference_flags(picker)
    picker.set_defaults(run=run_picker_command)

    config = subparsers.add_parser("gateway-config", help="write an Envoy bootstrap that routes through the picker")
    config.add_argument("--picker", type=ip_port, default="127.0.0.1:9002", metavar="IP:PORT",
                        help="the picker's gRPC address")
    config.add_argument("--picker-tls", type=go_bool, nargs="?", const=True, default=False, metavar="BOOL",
                        help="connect to the picker over TLS (a picker run with --secure-serving)")
    config.add_argument("--listener-port", type=port, default=8081, help="Envoy's HTTP listener port (default 8081)")
    config.add_argument("--admin-port", type=port, default=9901, help="Envoy's admin port (default 9901)")
    config.add_argument("--pool-endpoint", type=ip_port, action="append", default=[], metavar="IP:PORT",
                        help="adds the /override/ route (override_host policy) over these endpoints; repeatable")
    config.add_argument("--request-body-mode", default="FULL_DUPLEX_STREAMED",
                        choices=["BUFFERED", "FULL_DUPLEX_STREAMED"])
    config.add_argument("--response-body-mode", default="FULL_DUPLEX_STREAMED",
                        choices=["NONE", "BUFFERED", "FULL_DUPLEX_STREAMED"])
    config.add_argument("--queue-wait", metavar="DURATION",
                        help="the picker's flow control defaultRequestTTL (e.g. 60s; 0s = no limit): Envoy's "
                             "message_timeout then lets a queued request wait that long")
    config.add_argument("--output", "-o", default="-", metavar="FILE", help="file (.json or .yaml); '-' = stdout")
    add_front_arguments(config)
    config.set_defaults(run=run_gateway_config)


def ip_port(text: str) -> str:
    """argparse type: an ``ip:port`` (``[v6]:port``) address as Envoy's static clusters take it,
    checked here so that an error names the flag, not :func:`gateway_config`'s parameter."""
    try:
        parse_address(text, "")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"expected {exc.expected}, got {text!r}") from None
    return text


@dataclass(frozen=True)
class PickerSettings:
    """Everything ``run_picker`` is called with, resolved from the command line."""

    config: PickerConfig
    host: str
    ssl_context: SSLContextSource | None
    discovery: Discovery | None
    leader_election: LeaderElection | None
    objectives: ObjectiveWatch | None = None
    drain: PickerDrain = dataclasses.field(default_factory=PickerDrain)
    metrics_ssl_context: SSLContextSource | None = None
    metrics_auth: MetricsAuthSource | None = None
    pod_notifications: PodNotifications | None = None
    notifications: NotificationWatch | None = None
    discovery_state: DumpState | None = None  # the dataLayer.discovery plugin's, for /debug/plugins/state


def _pool_overrides(config: PickerConfig, args: argparse.Namespace) -> PickerConfig:
    pool = config.pool
    if args.refresh_metrics_interval:
        pool = dataclasses.replace(pool, refresh_interval_s=parse_duration(args.refresh_metrics_interval,
                                                                      "--refresh-metrics-interval"))
    if args.metrics_staleness_threshold:
        pool = dataclasses.replace(pool, staleness_threshold_s=parse_duration(args.metrics_staleness_threshold,
                                                                         "--metrics-staleness-threshold"))
    if args.model_server_metrics_path:
        if not args.model_server_metrics_path.startswith("/"):
            raise ConfigError("--model-server-metrics-path", "a path starting with '/'", args.model_server_metrics_path)
        pool = dataclasses.replace(pool, metrics_path=args.model_server_metrics_path)
    if args.model_server_metrics_scheme is not None:  # the legacy flags, over a metrics-data-source's scheme
        https = args.model_server_metrics_scheme == "https"
        tls = (args.model_server_metrics_https_insecure_skip_verify, "", "", "") if https else None
        pool = dataclasses.replace(pool, metrics_tls=tls)
    return dataclasses.replace(config, pool=pool)


def _ext_proc_overrides(config: PickerConfig, args: argparse.Namespace) -> PickerConfig:
    """The reference's ext_proc flags over the config's values."""
    ext_proc = dataclasses.replace(
        config.ext_proc, emit_endpoint_scores=config.ext_proc.emit_endpoint_scores or args.emit_endpoint_scores,
        honor_subset_hint=config.ext_proc.honor_subset_hint and not args.disable_endpoint_subset_filter,
        stream_metrics=config.ext_proc.stream_metrics or args.enable_grpc_stream_metrics)
    if args.grpc_max_recv_msg_size is not None:
        size = message_size(args.grpc_max_recv_msg_size, "--grpc-max-recv-msg-size")
        ext_proc = dataclasses.replace(ext_proc, max_receive_message_bytes=size)
    if args.grpc_max_send_msg_size is not None:
        size = message_size(args.grpc_max_send_msg_size, "--grpc-max-send-msg-size")
        ext_proc = dataclasses.replace(ext_proc, max_send_message_bytes=size)
    return dataclasses.replace(config, ext_proc=ext_proc)


def message_size(text: str, flag: str) -> int | None:
    """The reference's gRPC message size flag: a Kubernetes quantity with an optional ``B``
    (``10MiB``, ``25MB``, ``4194304``) that its ``AsInt64`` takes (a fraction of a byte is refused,
    as there); 0 means gRPC's default, None here."""
    value = text.strip()
    if len(value) > 1 and value[-1] in "Bb":
        value = value[:-1]
    quantity(value, flag)  # the syntax: its error names the flag
    size = quantity_int64(value)
    if size is None:
        raise ConfigError(flag, "a size below 2**63 in whole bytes, as resource.Quantity's AsInt64 takes it", text)
    return size or None


def _cluster_parts(args: argparse.Namespace, config: PickerConfig, metrics_auth: bool,
                   ) -> tuple[Discovery, LeaderElection | None, ObjectiveWatch, MetricsAuthSource | None,
                              PodNotifications, NotificationWatch]:
    # Imported here: the static mode needs no Kubernetes client.
    from evergreen_trio.picker.k8s import ClusterAccess, PoolRef, lease_election, parse_selector, pool_discovery
    from evergreen_trio.picker.k8s.discovery import pool_resource
    from evergreen_trio.picker.k8s.metrics_auth import MetricsAuth

    pool_resource(args.pool_group)  # ConfigError now for a group we cannot watch
    access = ClusterAccess.load(args.kubeconfig)
    namespace = args.pool_namespace or os.environ.get("NAMESPACE") or access.namespace
    if args.endpoint_selector:
        listed = [p.strip() for p in (args.endpoint_target_ports or "").split(",")]
        ports = [int(p) for p in listed if p.isascii() and p.isdigit()]  # isdigit() alone admits '²'
        if not ports:
            raise ConfigError("--endpoint-target-ports", "a comma-separated list of ports", args.endpoint_target_ports)
        ref = PoolRef(args.pool_name, namespace, args.pool_group,
                      selector=parse_selector(args.endpoint_selector), ports=tuple(ports))
    else:
        ref = PoolRef(args.pool_name, namespace, args.pool_group)
    discovery = partial(pool_discovery, access, ref, config.pool)
    election = None
    if args.ha_enable_leader_election:
        identity = os.environ.get("EPP_NAME") or os.environ.get("HOSTNAME") or f"picker-{os.getpid()}"
        election = partial(lease_election, access, namespace, f"epp-{args.pool_name}", identity)
    from evergreen_trio.picker.k8s.notification_watch import watch_notification_sources
    from evergreen_trio.picker.k8s.objectives import objective_watch
    from evergreen_trio.picker.k8s.rollout_pods import watch_rollout_pods

    return (discovery, election, partial(objective_watch, access, namespace, config.pool.name),
            MetricsAuth(access).serving if metrics_auth else None, partial(watch_rollout_pods, access, namespace),
            partial(watch_notification_sources, access, namespace))


def config_source(args: argparse.Namespace) -> str:
    """How the config was given, for error messages."""
    return str(args.config or args.config_file or ("--config-text" if args.config_text is not None else "defaults"))


def load_picker_config(args: argparse.Namespace) -> PickerConfig:
    """The config of either mode; ConfigError names the field (the caller names the source)."""
    if args.pool_name is None:
        return load_config(args.config)
    if args.config_text is not None:
        return parse_config(args.config_text, cluster_pool=args.pool_name)
    if args.config_file is not None:
        return load_config(args.config_file, cluster_pool=args.pool_name)
    return parse_config("", cluster_pool=args.pool_name)


def picker_settings(args: argparse.Namespace, config: PickerConfig) -> PickerSettings:
    """Resolve the mode, flags, TLS and cluster access; ConfigError / PickerError on a bad one."""
    cluster = args.pool_name is not None
    if not cluster:
        for flag in ("config_file", "config_text", "kubeconfig", "endpoint_selector"):
            if getattr(args, flag):
                raise ConfigError("--" + flag.replace("_", "-"), "--pool-name (cluster mode) with it", "--config")
        if args.ha_enable_leader_election:
            raise ConfigError("--ha-enable-leader-election", "--pool-name (cluster mode) with it", "--config")
    config = _ext_proc_overrides(_pool_overrides(config, args), args)
    if not args.allow_experimental_plugins:
        for plugin in alpha_plugins(config.epp):
            raise PickerError(f"plugin {plugin.name!r} (type {plugin.type!r}) has Alpha stability level, "
                              f"but --allow-experimental-plugins is not set")
    auth = cluster if args.metrics_endpoint_auth is None else args.metrics_endpoint_auth
    if auth and not cluster:
        raise ConfigError("--metrics-endpoint-auth", "--pool-name (cluster mode) with it", "--config")
    if args.metrics_cert_dir and not args.metrics_client_ca_file and not auth:
        raise ConfigError("--metrics-cert-dir", "--metrics-client-ca-file with it, or --metrics-endpoint-auth "
                          "(metrics TLS without authentication)", args.metrics_cert_dir)
    secure = cluster if args.secure_serving is None else args.secure_serving
    if args.cert_path and not Path(args.cert_path).is_dir():
        raise ConfigError("--cert-path", "a directory with tls.crt and tls.key", args.cert_path)
    host = args.host or ("0.0.0.0" if cluster else "127.0.0.1")
    drain = _drain(args, cluster)
    discovery, election, objectives, metrics_auth, pods, notifications = (
        _cluster_parts(args, config, auth) if cluster else (None, None, None, None, None, None))
    declared = config.epp.discovery if config.epp is not None else None
    discovery_state = None
    if declared is not None and isinstance(declared.params, FileDiscovery):
        # As the reference's runner: a dataLayer.discovery plugin replaces the InferencePool.
        loaded = DiscoveredEndpoints()
        discovery, discovery_state = discovery_for(declared.params, config.pool, loaded), loaded.dump_state
    from evergreen_trio.picker.tls import TlsProfile, ext_proc_context, metrics_context  # the `picker` extra

    profile = TlsProfile.from_flags(args.tls_min_version, args.tls_cipher_suites)
    return PickerSettings(config, host, ext_proc_context(secure, args.cert_path, profile), discovery, election,
                          objectives, drain, metrics_context(args.metrics_cert_dir, args.metrics_client_ca_file),
                          metrics_auth, pods, notifications, discovery_state)


def _drain(args: argparse.Namespace, cluster: bool) -> PickerDrain:
    default_window = DRAIN_WINDOW_SECONDS if cluster else 0.0
    window = default_window if args.drain_timeout is None else go_duration(args.drain_timeout, "--drain-timeout")
    return PickerDrain(window, go_duration(args.stop_grace, "--stop-grace"))


def run_picker_command(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; a bad config or flag raises a ConfigurationError (exit 2)."""
    apply_reference_flags(args)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per Kubernetes request
    try:
        config = load_picker_config(args)
    except ConfigError as exc:  # from a file, it names the file already
        raise UsageError(str(exc) if args.config or args.config_file else f"{config_source(args)}: {exc}") from None
    try:
        settings = picker_settings(args, config)
        if config.epp is not None and producers(config.epp.plugins):
            config_from_env(os.environ)  # a bad PREDICTION_SERVER_URL or TRAINING_SERVER_URL: one line, now
    except PickerError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:  # lightkube or cryptography missing
        raise UsageError(f"cluster mode and TLS need the picker extra "
                         f"(pip install 'evergreen-trio[picker]'): {exc}") from None

    def announce(ports: PickerPorts) -> None:
        print(f"evergreen-trio picker: grpc {settings.host}:{ports.grpc} health {ports.health} "
              f"metrics {ports.metrics} tls {'on' if settings.ssl_context else 'off'}", flush=True)

    return serve_until_signal(partial(
        run_picker, settings.config, tracing=picker_tracing(args.tracing), host=settings.host, grpc_port=args.grpc_port,
        health_port=args.grpc_health_port, metrics_port=args.metrics_port, ssl_context=settings.ssl_context,
        metrics_ssl_context=settings.metrics_ssl_context, metrics_auth=settings.metrics_auth,
        discovery=settings.discovery,
        leader_election=settings.leader_election, objectives=settings.objectives, drain=settings.drain,
        pod_notifications=settings.pod_notifications, notifications=settings.notifications,
        discovery_state=settings.discovery_state),
        started=announce, drain=with_stop_deadline(settings.drain.drain),
        address=f"{settings.host} (ports {args.grpc_port}, {args.grpc_health_port}, {args.metrics_port})")


def picker_tracing(enabled: bool) -> Tracing | None:
    """With ``--tracing``: the tracer provider and exporter the ``OTEL_*`` variables ask for (a
    missing ``tracing`` extra is a MissingExtraError naming it)."""
    if not enabled:
        return None
    from evergreen_trio.picker.tracing import new_tracing
    from evergreen_trio.picker.tracing_env import tracing_settings

    return new_tracing(tracing_settings(os.environ))


def run_gateway_config(args: argparse.Namespace) -> int:
    try:
        bootstrap = front_from_args(args) if args.evergreen else gateway_config(
            args.picker, args.listener_port, admin_port=args.admin_port, pool_endpoints=args.pool_endpoint,
            picker_tls=args.picker_tls,
            request_body_mode=args.request_body_mode, response_body_mode=args.response_body_mode,
            queue_wait_s=go_duration(args.queue_wait, "--queue-wait") if args.queue_wait is not None else None)
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
