"""`evergreen-trio picker` as a user types it: static and cluster modes, bind address, health names,
reference flags, high availability, and bad input (one line, exit 2)."""

from __future__ import annotations

import signal
import socket
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from kube_fakes import (
    NAMESPACE,
    PODS,
    POOLS_V1,
    KubeApiServer,
    metrics_reader,
    pod,
    pool_v1,
    start_sims,
    write_kubeconfig,
)
from picker_cli import EPHEMERAL_PORTS, health, picker_process, run_cli, wait_health

from evergreen_trio.picker.cli import message_size
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.runtime import EXT_PROC_SERVICE

ALPHA_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: header-label-affinity-scorer, name: zone, parameters: {headerName: x-zone, labelKey: zone}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: zone, weight: 1}, {pluginRef: queue-scorer, weight: 1}]
"""
EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: lora-affinity-scorer
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: lora-affinity-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""
EPP_HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
REPORTER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: request-attribute-reporter, parameters: {{attributes: {attributes}}}}}
"""
HOSTS = ("127.0.0.2", "127.0.0.3")
OTHER_ADDRESS = "127.0.0.5"  # another address of this machine: reached only through a 0.0.0.0 bind


async def cluster(nursery: trio.Nursery, tmp_path: Path) -> tuple[KubeApiServer, Path, int]:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = await start_sims(nursery, HOSTS)
    api.put(POOLS_V1, pool_v1(ports=(port,)))
    for i, host in enumerate(HOSTS):
        api.put(PODS, pod(f"model-{i}", host))
    return api, write_kubeconfig(tmp_path, api.port), port


async def test_cluster_mode_serves_every_health_name_on_all_interfaces(nursery: trio.Nursery, tmp_path: Path) -> None:
    api, kubeconfig, _ = await cluster(nursery, tmp_path)
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--config-text", EPP_CONFIG,
            "--secure-serving=false", "--kubeconfig", str(kubeconfig), *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        assert not picker.tls
        await wait_health(OTHER_ADDRESS, picker.health, "inference-extension")
        for name in ("inference-extension", EXT_PROC_SERVICE, "", "liveness", "readiness"):
            assert await trio.to_thread.run_sync(health, OTHER_ADDRESS, picker.health, name) == "SERVING", name
        metrics = await trio.to_thread.run_sync(partial(
            httpx.get, f"http://{OTHER_ADDRESS}:{picker.metrics}/metrics", headers=metrics_reader(api)))
        assert metrics.status_code == 200 and "inference_pool_ready_pods" in metrics.text
        assert 'inference_pool_ready_pods{name="pool"} 2.0' in metrics.text


async def test_static_mode_stays_on_loopback_unless_told(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  endpoints: ['127.0.0.2:1']\n")
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        assert not picker.tls
        assert await trio.to_thread.run_sync(health, "127.0.0.1", picker.health, "liveness") == "SERVING"
        assert await trio.to_thread.run_sync(health, OTHER_ADDRESS, picker.health, "liveness") == "UNAVAILABLE"
    async with picker_process(["--config", str(config), "--host", "0.0.0.0", *EPHEMERAL_PORTS]) as picker:
        assert await trio.to_thread.run_sync(health, OTHER_ADDRESS, picker.health, "liveness") == "SERVING"


async def test_cluster_mode_metrics_need_a_token_the_cluster_allows(nursery: trio.Nursery, tmp_path: Path) -> None:
    """``--metrics-endpoint-auth`` (on in cluster mode, as the reference): TokenReview, then
    SubjectAccessReview for ``get`` of the path; answers cached, so a scraper costs no review per
    scrape and is still served while the API server is away; a new token then gets 500."""
    api, kubeconfig, _ = await cluster(nursery, tmp_path)
    reader = metrics_reader(api)
    api.users["mallory-token"] = {"username": "mallory"}
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--secure-serving=false",
            "--kubeconfig", str(kubeconfig), *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")

        async def scrape(path: str = "/metrics", **headers: str) -> httpx.Response:
            url = f"http://127.0.0.1:{picker.metrics}{path}"
            return await trio.to_thread.run_sync(partial(httpx.get, url, headers=headers))

        assert (await scrape()).status_code == 401
        assert (await scrape(authorization="Bearer not-a-token")).status_code == 401
        assert (await scrape(authorization="Basic cHJvbWV0aGV1cw==")).status_code == 401
        denied = await scrape(authorization="Bearer mallory-token")
        assert denied.status_code == 403 and denied.text == "Authorization denied for user mallory\n"
        assert (await scrape("/debug", **reader)).status_code == 403  # allowed /metrics only
        served = await scrape(**reader)
        assert served.status_code == 200 and "inference_pool_ready_pods" in served.text
        reviews = [r for r in api.requests if "review" in r]
        assert (await scrape(**reader)).status_code == 200
        assert [r for r in api.requests if "review" in r] == reviews  # cached
        api.stop()
        assert (await scrape(**reader)).status_code == 200
        failed = await scrape(authorization="Bearer new-token")
        assert failed.status_code == 500 and failed.text == "Authentication failed\n"


async def test_an_alpha_plugin_runs_with_allow_experimental_plugins(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, kubeconfig, _ = await cluster(nursery, tmp_path)
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--config-text", ALPHA_CONFIG,
            "--allow-experimental-plugins=true", "--secure-serving=false", "--kubeconfig", str(kubeconfig),
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")


async def test_reference_flags_are_accepted_and_logged(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, kubeconfig, _ = await cluster(nursery, tmp_path)
    args = ["--pool-name", "pool", "--pool-group", "inference.networking.k8s.io", "--zap-encoder", "json",
            "-v", "3", "--tracing=false", "--metrics-endpoint-auth=false", "--enable-pprof", "--health-checking",
            "--refresh-metrics-interval", "100ms", "--metrics-staleness-threshold", "3s",
            "--total-queued-requests-metric", "vllm:num_requests_waiting", "--secure-serving=false",
            "--kubeconfig", str(kubeconfig), *EPHEMERAL_PORTS]
    async with picker_process(args, {"NAMESPACE": NAMESPACE}) as picker:
        await wait_health("127.0.0.1", picker.health, "inference-extension")
        metrics = await trio.to_thread.run_sync(httpx.get, f"http://127.0.0.1:{picker.metrics}/metrics")
        assert metrics.status_code == 200  # --metrics-endpoint-auth=false: no token needed


async def test_high_availability_one_ready_leader_and_takeover(nursery: trio.Nursery, tmp_path: Path) -> None:
    _, kubeconfig, _ = await cluster(nursery, tmp_path)
    args = ["--pool-name", "pool", "--pool-namespace", NAMESPACE, "--secure-serving=false",
            "--ha-enable-leader-election", "--kubeconfig", str(kubeconfig), *EPHEMERAL_PORTS]
    async with picker_process(args, {"EPP_NAME": "epp-a"}) as first:
        await wait_health("127.0.0.1", first.health, "readiness")
        async with picker_process(args, {"EPP_NAME": "epp-b"}) as second:
            await wait_health("127.0.0.1", second.health, "liveness")
            await trio.sleep(3)  # more than a retry period: the follower has looked at the Lease
            assert await trio.to_thread.run_sync(health, "127.0.0.1", second.health, "readiness") == "NOT_SERVING"
            assert await trio.to_thread.run_sync(health, "127.0.0.1", second.health, "") == "NOT_SERVING"
            first.process.send_signal(signal.SIGTERM)  # a clean stop releases the Lease
            await first.process.wait()
            await wait_health("127.0.0.1", second.health, "readiness", timeout_s=20)


@pytest.mark.parametrize(("args", "message"), [
    ([], "one of the arguments --config --pool-name is required"),
    (["--config", "x.yaml", "--pool-name", "p"], "not allowed with argument"),
    (["--pool-name", "p", "--secure-serving=maybe"], "expected true or false"),
    (["--config", "/nonexistent.yaml"], "a readable UTF-8 file"),
    (["--config", "{ok}", "--ha-enable-leader-election"], "--pool-name (cluster mode)"),
    (["--config", "{ok}", "--config-text", "x: 1"], "--pool-name (cluster mode)"),
    (["--pool-name", "p", "--config-text", "kind: EndpointPickerConfig\napiVersion: inference.networking.x-k8s.io"
      "/v1alpha1\nplugins: [{type: magic-scorer}]\n"], "magic-scorer"),
    (["--pool-name", "p", "--kubeconfig", "/nonexistent/kubeconfig"], "expected cluster access from"),
    (["--pool-name", "p", "--config-text", ALPHA_CONFIG], "plugin 'zone' (type 'header-label-affinity-scorer') has "
     "Alpha stability level, but --allow-experimental-plugins is not set"),
    (["--pool-name", "p", "--pool-group", "example.com"], "--pool-group"),
    (["--pool-name", "p", "--cert-path", "/nonexistent"], "--cert-path"),
    (["--config", "{ok}", "--grpc-max-recv-msg-size", "lots"], "--grpc-max-recv-msg-size: expected a quantity"),
    (["--config", "{ok}", "--grpc-max-send-msg-size=16E"], "a size below 2**63"),
    # The reference's AsInt64 refuses a fraction of a byte (before: 1 byte, silently).
    (["--config", "{ok}", "--grpc-max-recv-msg-size", "1.5"], "--grpc-max-recv-msg-size: expected a size below"),
    # Digits past float64's range: OverflowError and exit 1, naming no flag.
    (["--config", "{ok}", "--grpc-max-send-msg-size=" + "9" * 400], "--grpc-max-send-msg-size: expected a quantity"),
    (["--config", "{ok}", "--stop-grace", "9" * 400 + "s"], "--stop-grace: expected a duration"),
    (["--config", "{ok}", "--tls-min-version", "TLS1.2"], "one of VersionTLS10, VersionTLS11"),
    (["--config", "{ok}", "--tls-cipher-suites", "TLS_FAST"], "Go crypto/tls cipher suite names, got 'TLS_FAST'"),
    (["--config", "{ok}", "--tls-cipher-suites", "TLS_RSA_WITH_RC4_128_SHA"], "a suite OpenSSL"),
    (["--config", "{ok}", "--metrics-client-ca-file", "ca.pem"], "--metrics-cert-dir with it"),
    (["--config", "{ok}", "--metrics-cert-dir", "/nonexistent", "--metrics-client-ca-file", "ca.pem"],
     "/nonexistent/tls.crt"),
    (["--config", "{ok}", "--metrics-cert-dir", "/tmp"], "without authentication"),
    (["--pool-name", "p", "--metrics-cert-dir", "/tmp", "--metrics-endpoint-auth=false"], "without authentication"),
    (["--config", "{ok}", "--metrics-endpoint-auth"], "--metrics-endpoint-auth: expected --pool-name"),
    (["--config", "{ok}", "--emit-endpoint-scores=perhaps"], "expected true or false"),
    (["--pool-name", "p", "--config-text", REPORTER_CONFIG.format(attributes="[]")],
     "plugins[0].parameters.attributes: expected exactly one attribute, got '0 attributes'"),
    (["--pool-name", "p", "--config-text",
      REPORTER_CONFIG.format(attributes="[{key: {namespace: n}, expression: '1'}]")],
     "plugins[0].parameters.attributes[0].key.name: expected a non-empty metadata key name"),
    (["--pool-name", "p", "--config-text", EPP_HEAD + "saturationDetector: {pluginRef: nowhere}\n"],
     "flowControl.saturationDetector.pluginRef: expected a declared plugin of type"),
    (["--pool-name", "p", "--config-text", EPP_HEAD + "saturationDetector: {pluginRef: x, kvCacheUtilThreshold: 1}\n"],
     "EndpointPickerConfig.saturationDetector: expected either pluginRef or the thresholds"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path, 1)
    ok = tmp_path / "ok.yaml"
    ok.write_text("pool: {endpoints: ['127.0.0.2:1']}\n")
    result = run_cli([a.replace("{ok}", str(ok)) for a in args], {"KUBECONFIG": str(kubeconfig)})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    errors = [line for line in result.stderr.splitlines() if "evergreen-trio" in line or "error" in line]
    assert len(errors) <= 2, result.stderr  # argparse prints usage + one error line; ours one line


def test_message_sizes_are_what_the_references_as_int64_takes() -> None:
    """options.go: ParseQuantity then AsInt64, whose int64 form holds no fraction (apimachinery
    v0.35.7): ``1.5`` was 1 byte here, and is refused there, as are ``1.0`` and ``1.5Mi``; a
    fraction the suffix scales away is whole."""
    flag = "--grpc-max-recv-msg-size"
    sizes = {"10485760": 10485760, "10Mi": 10485760, "10MiB": 10485760, "20MB": 20_000_000, "1.5k": 1500,
             "0.5M": 500_000, "0": None, "9E": 9 * 10**18, "1Ti": 2**40}
    assert {text: message_size(text, flag) for text in sizes} == sizes
    for bad in ("1.5", "1.5B", "1.0", "0.5", "1.5Mi", "1.0001k", "10Ei", "16E", "1Pi", "1" + "0" * 18, "-10Mi"):
        with pytest.raises(ConfigError, match=flag):
            message_size(bad, flag)


def test_unknown_plugin_type_lists_the_known_ones() -> None:
    text = EPP_CONFIG.replace("type: queue-scorer", "type: low-queue-filter")
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "low-queue-filter" in line and "queue-scorer" in line and "max-score-picker" in line


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  endpoints: ['127.0.0.2:1']\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(["--config", str(config), "--grpc-port", str(port), "--grpc-health-port", "0",
                          "--metrics-port", "0"])
    assert result.returncode == 1
    (line,) = [ln for ln in result.stderr.splitlines() if "evergreen-trio picker" in ln]
    assert "Address already in use" in line and "Traceback" not in result.stderr


async def test_sigterm_turns_readiness_off_at_once_and_a_second_signal_ends_the_drain(tmp_path: Path) -> None:
    """The drain window (``--drain-timeout``): readiness NOT_SERVING at once, liveness SERVING and
    the ext_proc port still open; a second SIGTERM stops the process then, exit status 0."""
    config = tmp_path / "picker.yaml"
    config.write_text("pool:\n  endpoints: ['127.0.0.2:1']\n")
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS, "--drain-timeout", "5m"]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        picker.process.send_signal(signal.SIGTERM)
        await wait_health("127.0.0.1", picker.health, "readiness", want="NOT_SERVING", timeout_s=10)
        assert await trio.to_thread.run_sync(health, "127.0.0.1", picker.health, "liveness") == "SERVING"
        stream = await trio.open_tcp_stream("127.0.0.1", picker.grpc)
        await stream.aclose()
        picker.process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await picker.process.wait() == 0
