"""Our CLI started with exactly the arguments the official inferencepool chart gives the reference
EPP container, and llm-d-router's own deployment (tests/deploy/chart/, with origin), and with our
own manifests' and Dockerfile's:
it comes up, is reached from another address, and answers the probes the manifests declare.

Two things differ from a pod, both for this machine: the ports are ephemeral (appended
``--grpc-port 0 ...``; the chart passes none, so nothing it passes is overridden), and files the
pod mounts under /config are read from a test directory (the ``--config-file`` path is remapped)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "picker"))
from kube_fakes import NAMESPACE, PODS, POOLS_V1, KubeApiServer, pod, pool_v1, start_sims, write_kubeconfig
from picker_cli import EPHEMERAL_PORTS, health, picker_process, wait_health
from test_manifests import DOCS, dockerfile_cmd

CHART = Path(__file__).parent / "chart"
OTHER_ADDRESS = "127.0.0.5"


def render(values: dict[str, Any]) -> dict[str, Any]:
    """The template's args/ports/probes for ``values``: just the Helm constructs it uses."""
    text = (CHART / "epp-deployment-args.tpl").read_text()
    text = re.sub(r"\{\{- /\*.*?\*/ -\}\}\n", "", text, flags=re.S)
    conditions = {
        'ne .Values.inferencePool.apiVersion "inference.networking.k8s.io"':
            values["apiVersion"] != "inference.networking.k8s.io",
        'eq (.Values.inferencePool.modelServerType | default "vllm") "triton-tensorrt-llm"':
            values["modelServerType"] == "triton-tensorrt-llm",
        "gt (.Values.inferenceExtension.replicas | int) 1": values["replicas"] > 1,
        ".Values.inferenceExtension.tracing.enabled": values["tracing"],
        "not .Values.inferenceExtension.monitoring.prometheus.enabled": not values["prometheus"],
        ".Values.inferenceExtension.extraContainerPorts": False,
    }
    out: list[str] = []
    stack: list[bool] = []
    range_body: list[str] | None = None
    for line in text.splitlines():
        directive = re.fullmatch(r"\s*\{\{-? (.*?) -?\}\}\s*", line)
        if range_body is not None:
            if directive and directive.group(1) == "end":
                for key, value in values["flags"].items():
                    out.extend(b.replace("{{ $key }}", key).replace("{{ $value }}", str(value)) for b in range_body)
                range_body = None
            else:
                range_body.append(line)
            continue
        if directive:
            word = directive.group(1)
            if word.startswith("if "):
                stack.append(conditions[word[3:]])
            elif word == "else":
                stack[-1] = not stack[-1]
            elif word == "end":
                stack.pop()
            elif word.startswith("range "):
                range_body = []
            continue
        if all(stack):
            line = line.replace("{{ .Release.Name }}", values["release"])
            line = line.replace("{{ .Release.Namespace }}", values["namespace"])
            line = line.replace("{{ .Values.inferenceExtension.pluginsConfigFile }}", values["pluginsConfigFile"])
            line = line.replace('{{ (split "/" .Values.inferencePool.apiVersion)._0 }}', values["apiVersion"])
            out.append(line)
    assert not stack and "{{" not in "\n".join(out), "\n".join(out)
    rendered: dict[str, Any] = yaml.safe_load("\n".join(out))
    return rendered


DEFAULTS = {"release": "pool", "namespace": NAMESPACE, "apiVersion": "inference.networking.k8s.io",
            "pluginsConfigFile": "default-plugins.yaml", "modelServerType": "vllm", "replicas": 1,
            "flags": {}, "tracing": False, "prometheus": False}
VARIANTS = {
    "defaults": {},
    "ha-tracing-flags": {"replicas": 2, "tracing": True, "prometheus": True, "flags": {"v": 3}},
    "triton-x-k8s": {"modelServerType": "triton-tensorrt-llm", "apiVersion": "inference.networking.x-k8s.io"},
}


def localize(args: list[str], config_dir: Path) -> list[str]:
    return [str(config_dir / a.removeprefix("/config/")) if a.startswith("/config/") else a for a in args]


async def pool_cluster(nursery: trio.Nursery, tmp_path: Path, group: str, name: str = "pool") -> Path:
    api = KubeApiServer()
    await nursery.start(api.serve)
    port = await start_sims(nursery, ("127.0.0.2", "127.0.0.3"))
    if group == "inference.networking.k8s.io":
        api.put(POOLS_V1, pool_v1(name, ports=(port,)))
    else:
        from kube_fakes import POOLS_V1ALPHA2, pool_v1alpha2

        api.put(POOLS_V1ALPHA2, pool_v1alpha2(name, port=port))
    api.put(PODS, pod("model-0", "127.0.0.2"))
    api.put(PODS, pod("model-1", "127.0.0.3"))
    return write_kubeconfig(tmp_path, api.port)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_the_charts_args_run_our_picker(nursery: trio.Nursery, tmp_path: Path, variant: str) -> None:
    values = {**DEFAULTS, **VARIANTS[variant]}
    container = render(values)
    args = localize([str(a) for a in container["args"]], CHART)
    assert args[:4] == ["--pool-name", "pool", "--pool-namespace", NAMESPACE]
    kubeconfig = await pool_cluster(nursery, tmp_path, values["apiVersion"])
    async with picker_process([*args, *EPHEMERAL_PORTS], {"KUBECONFIG": str(kubeconfig)}) as picker:
        assert picker.tls  # the chart serves ext_proc over TLS
        for probe in ("readinessProbe", "livenessProbe"):
            service = container[probe]["grpc"]["service"]
            await wait_health(OTHER_ADDRESS, picker.health, service)
        if values["replicas"] > 1:  # HA: the chart probes liveness/readiness; we are the only candidate
            assert container["readinessProbe"]["grpc"]["service"] == "readiness"


async def test_llm_d_routers_own_deployment_args_run_our_picker(nursery: trio.Nursery, tmp_path: Path) -> None:
    """llm-d-router's deployment (chart/llm-d-router-deployment.yaml) passes flags the inferencepool chart
    does not: ``--allow-experimental-plugins=true``, ``--v 4``, ``--metrics-endpoint-auth=...``."""
    text = (CHART / "llm-d-router-deployment.yaml").read_text()
    variables = {"EPP_NAME": "epp", "EPP_REPLICA_COUNT": "1", "EPP_IMAGE": "epp:dev", "POOL_NAME": "pool",
                 "NAMESPACE": NAMESPACE, "METRICS_ENDPOINT_AUTH": "true", "ENABLE_LEADER_ELECTION": "false"}
    for name, value in variables.items():
        text = text.replace("${" + name + "}", value)
    (container,) = yaml.safe_load(text)["spec"]["template"]["spec"]["containers"]
    (tmp_path / "epp-config.yaml").write_text((CHART / "default-plugins.yaml").read_text())
    args = [str(tmp_path / a.removeprefix("/etc/epp/")) if a.startswith("/etc/epp/") else a for a in container["args"]]
    for flag in ("--grpc-port", "--grpc-health-port"):  # ephemeral ports instead
        index = args.index(flag)
        del args[index : index + 2]
    assert "--allow-experimental-plugins=true" in args
    kubeconfig = await pool_cluster(nursery, tmp_path, "inference.networking.k8s.io")
    async with picker_process([*args, *EPHEMERAL_PORTS], {"KUBECONFIG": str(kubeconfig)}) as picker:
        for probe in ("readinessProbe", "livenessProbe"):
            await wait_health(OTHER_ADDRESS, picker.health, container[probe]["grpc"]["service"])


async def test_our_deployment_args_run_and_are_reached_from_another_address(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    spec = DOCS[("Deployment", "evergreen-picker")]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    config_map = DOCS[("ConfigMap", spec["volumes"][0]["configMap"]["name"])]
    for name, text in config_map["data"].items():
        (tmp_path / name).write_text(text)
    args = [a.replace("$(NAMESPACE)", NAMESPACE) for a in localize(container["args"], tmp_path)]
    for flag in ("--grpc-port", "--grpc-health-port", "--metrics-port"):  # ephemeral ports instead
        index = args.index(flag)
        del args[index : index + 2]
    kubeconfig = await pool_cluster(nursery, tmp_path, "inference.networking.k8s.io",
                                    DOCS[("InferencePool", "evergreen-pool")]["metadata"]["name"])
    async with picker_process([*args, *EPHEMERAL_PORTS], {"KUBECONFIG": str(kubeconfig)}) as picker:
        await wait_health(OTHER_ADDRESS, picker.health, container["readinessProbe"]["grpc"]["service"])
        await wait_health(OTHER_ADDRESS, picker.health, container["livenessProbe"]["grpc"]["service"])


async def test_the_dockerfile_cmd_is_reached_from_another_address(tmp_path: Path) -> None:
    (tmp_path / "picker.yaml").write_text("pool:\n  endpoints: ['127.0.0.2:1']\n")
    cmd = dockerfile_cmd()
    cmd[cmd.index("--config") + 1] = str(tmp_path / "picker.yaml")
    for flag in ("--grpc-port", "--grpc-health-port", "--metrics-port"):
        cmd[cmd.index(flag) + 1] = "0"
    async with picker_process(cmd) as picker:
        assert await trio.to_thread.run_sync(health, OTHER_ADDRESS, picker.health, "liveness") == "SERVING"
