"""An Envoy in front of many Evergreen servers: ``evergreen-trio gateway-config --evergreen HOST:PORT ...``.

One address for clients, sessions spread across the servers. An Evergreen session is one HTTP/2
stream, so Envoy balances per stream and a session stays on the server that took it: an HTTP/2
upstream cluster, round robin, and a route with no timeout and no retry once a stream reached
a server (only ``connect-failure`` and ``refused-stream``, where no server saw the session).
Active gRPC health checks of ``evergreen.v2.EvergreenService`` take a draining server (it
answers NOT_SERVING) out of rotation while its open sessions finish.

Hostile clients: TLS with ALPN h2 (optional), a cap on downstream connections (the overload
manager's ``downstream_connections`` monitor), ``max_concurrent_streams`` per connection,
``http.max_requests_per_io_cycle`` and the premature-reset check (``overload.premature_reset_*``
runtime keys: a connection whose streams are mostly reset within a second is closed), header
and idle timeouts, and circuit breakers on the upstream cluster.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evergreen_trio._wire import SERVICE
from evergreen_trio.errors import EvergreenTrioError

CLUSTER = "evergreen"
_EXT = "type.googleapis.com/envoy.extensions."
_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
_UINT32 = 2**32 - 1
"""The most a count in Envoy's config takes (a UInt32Value: circuit breakers, thresholds)."""
_INT32 = 2**31 - 1
"""The most HTTP/2 ``max_concurrent_streams`` takes (Envoy validates 1..2147483647)."""


class FrontConfigError(EvergreenTrioError, ValueError):
    """An argument of the Envoy front makes no sense (the message names it and what was expected)."""


def parse_server(text: str, where: str = "--evergreen") -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); the host is an IP address or a DNS name."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise FrontConfigError(f"{where}: expected HOST:PORT with a port in 1..65535, got {text!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise FrontConfigError(f"{where}: expected an IP address or a DNS name, got {host!r}") from None
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _existing(path: str | None, flag: str) -> str | None:
    if path is not None and not Path(path).is_file():
        raise FrontConfigError(f"{flag}: expected a readable file, got {path!r}")
    return path


def front_config(
    servers: Sequence[str],
    listener_port: int,
    *,
    admin_port: int,
    listen_host: str = "127.0.0.1",
    tls_cert: str | None = None,
    tls_key: str | None = None,
    upstream_ca: str | None = None,
    max_connections: int = 10_000,
    max_concurrent_streams: int = 100,
    max_requests_per_io_cycle: int = 1,
    premature_reset_min_stream_lifetime_s: int = 1,
    premature_reset_total_stream_count: int = 500,
    max_upstream_streams: int = 100_000,
    session_idle_timeout_s: float = 300.0,
    health_interval_s: float = 2.0,
    health_timeout_s: float = 1.0,
    unhealthy_threshold: int = 2,
) -> dict[str, Any]:
    """An Envoy bootstrap (as a dict) serving Evergreen sessions on ``listen_host:listener_port``
    from ``servers`` (``HOST:PORT``; DNS names resolve with STRICT_DNS, every address a name has
    becomes a server).

    ``tls_cert``/``tls_key`` terminate TLS (ALPN h2); ``upstream_ca`` makes Envoy speak TLS to the
    servers and verify them against that CA. Raises :class:`FrontConfigError` on a bad argument.
    """
    if not servers:
        raise FrontConfigError("--evergreen: expected at least one HOST:PORT, got none")
    if (tls_cert is None) != (tls_key is None):
        raise FrontConfigError("--tls-cert and --tls-key: expected both or neither")
    _existing(tls_cert, "--tls-cert")
    _existing(tls_key, "--tls-key")
    _existing(upstream_ca, "--evergreen-ca")
    if not _is_ip(listen_host):
        raise FrontConfigError(f"--listen-host: expected an IP address (Envoy listens on no name), got {listen_host!r}")
    for name, number, most in (
        ("max_connections", max_connections, _UINT32), ("max_concurrent_streams", max_concurrent_streams, _INT32),
        ("max_requests_per_io_cycle", max_requests_per_io_cycle, _UINT32),
        ("max_upstream_streams", max_upstream_streams, _UINT32), ("unhealthy_threshold", unhealthy_threshold, _UINT32),
    ):
        if not 1 <= number <= most:
            raise FrontConfigError(f"{name}: expected 1..{most}, got {number}")
    addresses = [parse_server(text) for text in servers]
    hcm: dict[str, Any] = {
        "@type": _EXT + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "evergreen",
        "codec_type": "HTTP2",  # gRPC only: no HTTP/1.1 parser exposed
        "use_remote_address": True,
        "request_headers_timeout": "10s",
        "request_timeout": "0s",  # a session lasts as long as it lasts; idleness is bounded below
        "stream_idle_timeout": _seconds(session_idle_timeout_s),
        "common_http_protocol_options": {"idle_timeout": "3600s", "headers_with_underscores_action": "REJECT_REQUEST"},
        "http2_protocol_options": {
            "max_concurrent_streams": max_concurrent_streams,
            "initial_stream_window_size": 65536,
            "initial_connection_window_size": 1048576,
        },
        "route_config": {"name": "evergreen", "virtual_hosts": [{
            "name": "evergreen", "domains": ["*"],
            "routes": [{
                "match": {"prefix": f"/{SERVICE}/", "grpc": {}},
                "route": {
                    "cluster": CLUSTER,
                    "timeout": "0s",
                    # Only where no server saw the stream: a session is never replayed.
                    "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": 2,
                                     "retry_host_predicate": [{
                                         "name": "envoy.retry_host_predicates.previous_hosts",
                                         "typed_config": {"@type": "type.googleapis.com/envoy.extensions."
                                                          "retry.host.previous_hosts.v3.PreviousHostsPredicate"},
                                     }]},
                },
            }],
        }]},
        "http_filters": [{"name": "envoy.filters.http.router",
                          "typed_config": {"@type": _EXT + "filters.http.router.v3.Router"}}],
    }
    chain: dict[str, Any] = {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                          "typed_config": hcm}]}
    if tls_cert is not None:
        chain["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": _EXT + "transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "tls_certificates": [{"certificate_chain": {"filename": tls_cert},
                                      "private_key": {"filename": tls_key}}],
                "alpn_protocols": ["h2"],
            },
        }}
    cluster: dict[str, Any] = {
        "name": CLUSTER,
        "type": "STATIC" if all(_is_ip(host) for host, _ in addresses) else "STRICT_DNS",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(host, port)}} for host, port in addresses]}]},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _EXT + "upstreams.http.v3.HttpProtocolOptions",
            # PINGs find a server that stopped answering without closing its connection.
            "explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": "10s", "timeout": "5s"}}},
        }},
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": max_connections, "max_pending_requests": max_connections,
            "max_requests": max_upstream_streams, "max_retries": 16,
        }]},
        # Never route to a server that failed its checks, even when most did: a 503 says the truth.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [{
            "timeout": _seconds(health_timeout_s),
            "interval": _seconds(health_interval_s),
            "no_traffic_interval": _seconds(health_interval_s),
            "unhealthy_threshold": unhealthy_threshold,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": SERVICE},
        }],
    }
    if upstream_ca is not None:
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": _EXT + "transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"alpn_protocols": ["h2"],
                                   "validation_context": {"trusted_ca": {"filename": upstream_ca}}},
        }}
    return {
        "admin": {"address": _socket("127.0.0.1", admin_port)},
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {
            "overload.premature_reset_min_stream_lifetime_seconds": premature_reset_min_stream_lifetime_s,
            "overload.premature_reset_total_stream_count": premature_reset_total_stream_count,
            "http.max_requests_per_io_cycle": max_requests_per_io_cycle,
        }}]},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _EXT + "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": max_connections,
            },
        }]},
        "static_resources": {
            "listeners": [{
                "name": "evergreen",
                "address": _socket(listen_host, listener_port),
                "per_connection_buffer_limit_bytes": 1 << 20,
                "filter_chains": [chain],
            }],
            "clusters": [cluster],
        },
    }


def add_front_arguments(parser: argparse.ArgumentParser) -> None:
    """``gateway-config``'s options for a front of Evergreen servers (``--evergreen``)."""
    group = parser.add_argument_group("Evergreen front (--evergreen; see docs/production.md)")
    group.add_argument("--evergreen", nargs="+", metavar="HOST:PORT",
                       help="write an Envoy front for these Evergreen servers (instead of the picker's gateway)")
    group.add_argument("--listen-host", default="127.0.0.1", help="the front's listener address (default 127.0.0.1)")
    group.add_argument("--tls-cert", metavar="FILE", help="terminate TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", metavar="FILE", help="... and this private key (PEM)")
    group.add_argument("--evergreen-ca", metavar="FILE", help="speak TLS to the servers, verified against this CA")
    group.add_argument("--max-connections", type=int, default=10_000, help="client connections (default 10000)")
    group.add_argument("--max-concurrent-streams", type=int, default=100,
                       help="sessions per client connection (default 100)")


def front_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The bootstrap ``gateway-config --evergreen ...`` describes; :class:`FrontConfigError` if bad."""
    return front_config(
        args.evergreen, args.listener_port, admin_port=args.admin_port, listen_host=args.listen_host,
        tls_cert=args.tls_cert, tls_key=args.tls_key, upstream_ca=args.evergreen_ca,
        max_connections=args.max_connections, max_concurrent_streams=args.max_concurrent_streams,
    )
