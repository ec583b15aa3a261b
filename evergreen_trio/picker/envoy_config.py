"""The Envoy bootstrap for the picker: the one the tests use and ``evergreen-trio gateway-config`` writes.

Routes on the main listener:

- ``/`` goes to an ORIGINAL_DST cluster that connects to the ``x-gateway-destination-endpoint``
  header the picker set (any ip:port, no endpoint list needed);
- ``/override/`` (only with ``pool_endpoints``) goes, prefix stripped, to a STATIC cluster of the
  pool with the ``override_host`` load-balancing policy: it reads the destination (or the
  comma-separated list, or the fallback key) from ``envoy.lb`` metadata, walks it on retry, and
  reports the endpoint that served in ``envoy.lb/x-gateway-destination-endpoint-served``.

An optional second listener on ``round_robin_port`` routes straight to a ROUND_ROBIN cluster of
``round_robin_endpoints`` with no ext_proc, as the baseline to compare the picker against.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from evergreen_trio.picker.config import parse_address
from evergreen_trio.picker.processor import DESTINATION, FALLBACK, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE

PICKER_CLUSTER = "endpoint_picker"
ORIGINAL_DST_CLUSTER = "original_destination"
OVERRIDE_HOST_CLUSTER = "override_host"
ROUND_ROBIN_CLUSTER = "round_robin"
_EXT = "type.googleapis.com/envoy.extensions."
_HCM = _EXT + "filters.network.http_connection_manager.v3.HttpConnectionManager"
_BODY_MODES = ("NONE", "BUFFERED", "FULL_DUPLEX_STREAMED")


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _endpoints(addresses: Sequence[str]) -> list[dict[str, Any]]:
    result = []
    for i, address in enumerate(addresses):
        host, port = parse_address(address, f"endpoints[{i}]")
        result.append({"endpoint": {"address": _socket(host, port)}})
    return result


def _static_cluster(name: str, addresses: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": _endpoints(addresses)}]},
        **extra,
    }


def _metadata_key(key: str) -> dict[str, Any]:
    return {"key": LB_NAMESPACE, "path": [{"key": key}]}


def _hcm(name: str, routes: list[dict[str, Any]], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _HCM,
            "stat_prefix": name,
            "codec_type": "AUTO",
            "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}]},
            "http_filters": [*filters, {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _EXT + "filters.http.router.v3.Router"},
            }],
        },
    }


def _duration(seconds: float) -> str:
    """``seconds`` as a protobuf JSON Duration (``5.0s``): at most 9 fractional digits and no
    exponent, where ``repr`` may write either (Envoy refuses ``5.00123456789s`` and ``1e-05s``)."""
    text = f"{seconds:.9f}".rstrip("0")
    return f"{text}0s" if text.endswith(".") else f"{text}s"


def _ext_proc_filter(request_body_mode: str, response_body_mode: str, message_timeout_s: float) -> dict[str, Any]:
    duplex = "FULL_DUPLEX_STREAMED" in (request_body_mode, response_body_mode)
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT + "filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": False,
            "message_timeout": _duration(message_timeout_s),
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": request_body_mode,
                "response_body_mode": response_body_mode,
                # Envoy requires trailers sent when a body mode is FULL_DUPLEX_STREAMED.
                "request_trailer_mode": "SEND" if duplex else "SKIP",
                "response_trailer_mode": "SEND" if duplex else "SKIP",
            },
            "metadata_options": {
                "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, LB_NAMESPACE]},
                # Without receiving_namespaces Envoy silently drops the picker's dynamic metadata.
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
            },
        },
    }


def _subset_hint_filter(header: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _EXT + "filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": header,
                "on_header_present": {"metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET, "type": "STRING"},
                "remove": True,
            }],
        },
    }


def _picker_cluster(picker_address: str, tls: bool) -> dict[str, Any]:
    """The picker's cluster: HTTP/2 with keepalive PINGs; with ``tls``, TLS with ALPN h2.

    Like the gateways in front of the reference picker, Envoy does not verify the picker's
    certificate (it is self-signed unless ``--cert-path`` gives one): TLS here is encryption
    on the wire, and the picker is reached by a cluster-internal address.
    """
    host, port = parse_address(picker_address, "picker_address")
    cluster = _static_cluster(
        PICKER_CLUSTER, [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"],
        typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _EXT + "upstreams.http.v3.HttpProtocolOptions",
            # PINGs find a picker that stopped answering without closing its socket.
            "explicit_http_config": {"http2_protocol_options": {
                "connection_keepalive": {"interval": "1s", "timeout": "1s"}}},
        }})
    if tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _EXT + "transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return cluster


def _original_dst_cluster() -> dict[str, Any]:
    return {
        "name": ORIGINAL_DST_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
    }


def _override_route(timeout: str, retries: int) -> dict[str, Any]:
    return {
        "match": {"prefix": "/override/"},
        "route": {
            "cluster": OVERRIDE_HOST_CLUSTER,
            "prefix_rewrite": "/",
            "timeout": timeout,
            "retry_policy": {"retry_on": "connect-failure,refused-stream,reset,5xx", "num_retries": retries},
        },
    }


def _override_host_cluster(pool_endpoints: Sequence[str]) -> dict[str, Any]:
    return _static_cluster(OVERRIDE_HOST_CLUSTER, pool_endpoints, load_balancing_policy={"policies": [{
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": _EXT + "load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"metadata": _metadata_key(DESTINATION)},
                    {"metadata": _metadata_key(FALLBACK)},
                    {"header": DESTINATION},
                ],
                "selected_host_key": _metadata_key(SERVED),
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _EXT + "load_balancing_policies.round_robin.v3.RoundRobin"},
                }}]},
            },
        },
    }]})


def _round_robin_listener(host: str, port: int, timeout: str) -> dict[str, Any]:
    return {
        "name": "round_robin",
        "address": _socket(host, port),
        "filter_chains": [{"filters": [_hcm("round_robin", [{
            "match": {"prefix": "/"}, "route": {"cluster": ROUND_ROBIN_CLUSTER, "timeout": timeout},
        }], [])]}],
    }


def _overload_manager(max_downstream_connections: int) -> dict[str, Any]:
    if max_downstream_connections < 1:
        raise ValueError(f"expected max_downstream_connections >= 1, got {max_downstream_connections}")
    return {"resource_monitors": [{
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": _EXT + "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": max_downstream_connections,
        },
    }]}


# A queued request's message_timeout: its queue wait plus this margin (dispatch, the pick, the
# round trip), at most this cap, the longest Envoy accepts (its ext_proc validation: 1 h); with no
# queue-wait limit (TTL 0s), the cap.
QUEUE_MARGIN_S = 5.0
MAX_QUEUE_WAIT_S = 3600.0


def gateway_config(
    picker_address: str,
    listener_port: int,
    *,
    admin_port: int,
    round_robin_endpoints: Sequence[str] = (),
    round_robin_port: int | None = None,
    pool_endpoints: Sequence[str] = (),
    listen_host: str = "127.0.0.1",
    request_body_mode: str = "FULL_DUPLEX_STREAMED",
    response_body_mode: str = "FULL_DUPLEX_STREAMED",
    subset_hint_header: str | None = None,
    message_timeout_s: float = 5.0,
    queue_wait_s: float | None = None,
    upstream_timeout_s: float = 300.0,
    retries: int = 2,
    max_downstream_connections: int = 50_000,
    picker_tls: bool = False,
) -> dict[str, Any]:
    """An Envoy bootstrap (as a dict) routing ``listen_host:listener_port`` through the picker.

    ``subset_hint_header`` (tests) copies that request header into the ``envoy.lb.subset_hint``
    metadata, the way a gateway would inject a subset. ``max_downstream_connections`` bounds the
    client connections Envoy accepts at once (its overload manager refuses the rest).
    ``picker_tls`` speaks TLS to the picker (one run with ``--secure-serving``).
    ``queue_wait_s``: the longest a request may wait in the picker's flow control queue (its
    ``defaultRequestTTL``; 0 = no limit): ``message_timeout`` then covers it, up to Envoy's
    largest (1 h), since a queued request's answer comes only when it is dispatched (Envoy
    applies the timeout in BUFFERED mode; FULL_DUPLEX_STREAMED does not time the request phase
    out). ValueError for a bad body mode, connection bound or wait, ConfigError for a bad address.
    """
    if queue_wait_s is not None:
        if queue_wait_s < 0:
            raise ValueError(f"expected a queue wait >= 0 s, got {queue_wait_s}")
        wait_s = min(queue_wait_s + QUEUE_MARGIN_S, MAX_QUEUE_WAIT_S) if queue_wait_s else MAX_QUEUE_WAIT_S
        message_timeout_s = max(message_timeout_s, wait_s)
    for mode in (request_body_mode, response_body_mode):
        if mode not in _BODY_MODES:
            raise ValueError(f"expected a body mode in {_BODY_MODES}, got {mode!r}")
    if request_body_mode == "NONE":
        raise ValueError("expected request body mode BUFFERED or FULL_DUPLEX_STREAMED, got 'NONE'")
    if round_robin_port is not None and not round_robin_endpoints:
        raise ValueError("expected round_robin_endpoints with round_robin_port, got none")
    filters = [_subset_hint_filter(subset_hint_header)] if subset_hint_header else []
    filters.append(_ext_proc_filter(request_body_mode, response_body_mode, message_timeout_s))
    timeout = _duration(upstream_timeout_s)
    routes = [_override_route(timeout, retries)] if pool_endpoints else []
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": ORIGINAL_DST_CLUSTER, "timeout": timeout}})
    clusters = [_picker_cluster(picker_address, picker_tls), _original_dst_cluster()]
    if pool_endpoints:
        clusters.append(_override_host_cluster(pool_endpoints))
    listeners = [{
        "name": "gateway",
        "address": _socket(listen_host, listener_port),
        "filter_chains": [{"filters": [_hcm("gateway", routes, filters)]}],
    }]
    if round_robin_port is not None:
        listeners.append(_round_robin_listener(listen_host, round_robin_port, timeout))
        clusters.append(_static_cluster(ROUND_ROBIN_CLUSTER, round_robin_endpoints, lb_policy="ROUND_ROBIN"))
    return {
        "admin": {"address": _socket("127.0.0.1", admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "overload_manager": _overload_manager(max_downstream_connections),
    }


def write_gateway_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write a bootstrap as JSON (Envoy picks the format by the ``.json``/``.yaml`` suffix)."""
    target = Path(path)
    if target.suffix in (".yaml", ".yml"):
        target.write_text(yaml.safe_dump(config, sort_keys=False))
    else:
        target.write_text(json.dumps(config, indent=2) + "\n")
    return target
