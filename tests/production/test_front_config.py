"""The Envoy front's configuration, without Envoy: what it routes and refuses, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from evergreen_trio.serving.evergreen_front import FrontConfigError, front_config, parse_server
from evergreen_trio.serving.server import SERVICE


def test_a_session_stays_on_one_server_and_is_never_replayed() -> None:
    config = front_config(["10.0.0.1:50051", "10.0.0.2:50051"], 8443, admin_port=9901)
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert route["match"]["prefix"] == f"/{SERVICE}/"
    assert route["route"]["timeout"] == "0s"
    assert set(route["route"]["retry_policy"]["retry_on"].split(",")) == {"connect-failure", "refused-stream"}
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "ROUND_ROBIN" and cluster["type"] == "STATIC"
    protocol = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in protocol["explicit_http_config"]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"] == {"service_name": SERVICE}
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == 100
    assert "transport_socket" not in listener["filter_chains"][0]


def test_dns_names_resolve_strictly() -> None:
    config = front_config(["evergreen-server-pods.default.svc.cluster.local:50051"], 8443, admin_port=9901)
    assert config["static_resources"]["clusters"][0]["type"] == "STRICT_DNS"


def test_bad_arguments_name_what_is_wrong(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(FrontConfigError, match="at least one"):
        front_config([], 1, admin_port=2)
    with pytest.raises(FrontConfigError, match="both or neither"):
        front_config(["127.0.0.1:1"], 1, admin_port=2, tls_cert=str(cert))
    with pytest.raises(FrontConfigError, match="--tls-key: expected a readable file"):
        front_config(["127.0.0.1:1"], 1, admin_port=2, tls_cert=str(cert), tls_key=str(tmp_path / "missing"))
    with pytest.raises(FrontConfigError, match="max_concurrent_streams"):
        front_config(["127.0.0.1:1"], 1, admin_port=2, max_concurrent_streams=0)


@pytest.mark.parametrize(("args", "expected"), [
    (["--evergreen", "nohost"], "expected HOST:PORT"),
    (["--evergreen", "bad_name:80"], "an IP address or a DNS name"),
    (["--evergreen", "127.0.0.1:1", "--tls-cert", "missing.pem", "--tls-key", "missing.key"], "--tls-cert"),
    (["--evergreen", "127.0.0.1:1", "--tls-key", "k.pem"], "both or neither"),
    # Each was written out, then refused by Envoy: a name to listen on, a count past its field's range.
    (["--evergreen", "127.0.0.1:1", "--listen-host", "nowhere"], "--listen-host: expected an IP address"),
    (["--evergreen", "127.0.0.1:1", "--max-concurrent-streams", "2147483648"],
     "max_concurrent_streams: expected 1..2147483647, got 2147483648"),
    (["--evergreen", "127.0.0.1:1", "--max-connections", "4294967296"],
     "max_connections: expected 1..4294967295, got 4294967296"),
])
def test_gateway_config_refuses_bad_input_with_exit_2(args: list[str], expected: str) -> None:
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert expected in done.stderr and "Traceback" not in done.stderr


@given(st.text(max_size=80))
@example("127.0.0.1:\u00b2")  # a digit to str.isdigit(), not to int()
def test_parse_server_takes_a_valid_address_or_names_the_problem(text: str) -> None:
    try:
        host, port = parse_server(text)
    except FrontConfigError as error:
        assert "--evergreen" in str(error)
    else:
        assert 0 < port < 65536 and host and host in text
