"""deploy/kubernetes: every manifest parses, and the fields the picker relies on agree with each other."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from evergreen_trio._grpc.health import ServerHealth
from evergreen_trio._wire import SERVICE
from evergreen_trio.cli import build_parser
from evergreen_trio.picker.config import load_config
from evergreen_trio.picker.runtime import DRAIN_WINDOW_SECONDS, STOP_GRACE_SECONDS

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
Doc = Mapping[str, Any]


def manifests() -> dict[tuple[str, str], Doc]:
    found: dict[tuple[str, str], Doc] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


DOCS = manifests()


def one(kind: str) -> Doc:
    (doc,) = [d for (k, _), d in DOCS.items() if k == kind]
    return doc


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("key", sorted(DOCS))
def test_every_manifest_has_the_basics(key: tuple[str, str]) -> None:
    doc = DOCS[key]
    body = {"ConfigMap": "data", "Role": "rules", "RoleBinding": "subjects", "ServiceAccount": "metadata",
            "ClusterRole": "rules", "ClusterRoleBinding": "subjects"}
    assert isinstance(doc["apiVersion"], str) and doc[body.get(key[0], "spec")]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def test_inference_pool_points_at_the_picker_service() -> None:
    pool = one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    service = DOCS[("Service", ref["name"])]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ref["port"]["number"] == ports["grpc-ext-proc"]["port"] == 9002
    assert ports["grpc-ext-proc"]["appProtocol"] == "http2"  # Envoy must speak HTTP/2 (gRPC) to the picker


def test_picker_deployment_ports_probes_and_args_agree_with_its_service() -> None:
    deployment = DOCS[("Deployment", "evergreen-picker")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    assert args[:2] == ["--pool-name", one("InferencePool")["metadata"]["name"]]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports == {"grpc": int(option(args, "--grpc-port")),
                               "grpc-health": int(option(args, "--grpc-health-port")),
                               "metrics": int(option(args, "--metrics-port"))} == {
        "grpc": 9002, "grpc-health": 9003, "metrics": 9090}
    service = DOCS[("Service", "evergreen-picker")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(container_ports.values())
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    # Liveness stays SERVING while the picker drains, so the probe does not restart it mid-drain.
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": ServerHealth.LIVENESS}
    # A SIGTERM's drain (cluster mode: the reference's 30 s window, then the stop grace) fits the pod's grace.
    assert pod["spec"]["terminationGracePeriodSeconds"] > DRAIN_WINDOW_SECONDS + STOP_GRACE_SECONDS
    assert "--drain-timeout" not in args and "--stop-grace" not in args


def test_picker_config_is_mounted_and_valid_for_the_pool(tmp_path: Path) -> None:
    pod = DOCS[("Deployment", "evergreen-picker")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_path = Path(option(container["args"], "--config-file"))
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = DOCS[("ConfigMap", volume["configMap"]["name"])]
    text = config_map["data"][config_path.name]
    (tmp_path / "picker.yaml").write_text(text)
    pool = one("InferencePool")
    config = load_config(tmp_path / "picker.yaml", cluster_pool=pool["metadata"]["name"])
    assert config.pool.name == pool["metadata"]["name"] and config.pool.endpoints == ()
    assert config.scheduler.lora_affinity == 1.0 and config.scheduler.prefix_cache == 3.0


def test_picker_may_read_what_it_watches() -> None:
    deployment = DOCS[("Deployment", "evergreen-picker")]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = DOCS[("RoleBinding", "evergreen-picker")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = DOCS[("Role", binding["roleRef"]["name"])]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert {(group, resource, verb) for verb in ("get", "list", "watch")} <= granted
    assert {("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "update")} <= granted
    # The metrics port's reviews (--metrics-endpoint-auth, on in cluster mode) are cluster-scoped.
    cluster_binding = DOCS[("ClusterRoleBinding", "evergreen-picker-auth")]
    assert [(s["kind"], s["name"]) for s in cluster_binding["subjects"]] == [("ServiceAccount", account)]
    cluster_rules = DOCS[("ClusterRole", cluster_binding["roleRef"]["name"])]["rules"]
    assert {(g, r, v) for rule in cluster_rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]} == {("authentication.k8s.io", "tokenreviews", "create"),
                                        ("authorization.k8s.io", "subjectaccessreviews", "create")}
    assert "--metrics-endpoint-auth=false" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_model_servers_match_the_pool_selector_and_port() -> None:
    pool = one("InferencePool")
    servers = DOCS[("Deployment", "evergreen-model-server")]
    pod = servers["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [pool["spec"]["targetPorts"][0]["number"]]
    assert container["command"] == ["evergreen-trio"] and container["args"][0] == "sim"
    assert int(option(container["args"], "--port")) == pool["spec"]["targetPorts"][0]["number"]
    assert option(container["args"], "--host") == "0.0.0.0"


def test_http_route_sends_traffic_to_the_pool_through_the_gateway() -> None:
    route = one("HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert ("Gateway", parent["name"]) in DOCS
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": one("InferencePool")["metadata"]["name"]}]


def test_dockerfile_runs_the_picker_on_the_same_ports() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 9002 9003 9090$", text, re.M)
    assert 'ENTRYPOINT ["evergreen-trio", "picker"]' in text  # the chart passes only the picker's flags
    # cluster mode's lightkube and cryptography; the chart's --tracing=true needs the SDK
    assert '--wheel-dir /wheels ".[picker,tracing]"' in text
    # after the rest: xds-protos' older opentelemetry/proto files must not stay (grpc/grpc#42926)
    assert "--force-reinstall --no-deps /wheels/opentelemetry_proto-*.whl" in text
    for source in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.M):
        for name in shlex.split(source):
            assert (DEPLOY.parents[1] / name).exists(), name
    cmd = dockerfile_cmd()
    assert option(cmd, "--host") == "0.0.0.0"
    assert [int(option(cmd, f)) for f in ("--grpc-port", "--grpc-health-port", "--metrics-port")] == [9002, 9003, 9090]


def dockerfile_cmd() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text()
    match = re.search(r"^CMD (\[.*?\])$", text, re.M | re.S)
    assert match is not None
    cmd: list[str] = yaml.safe_load(match.group(1).replace("\\\n", ""))
    return cmd


def test_evergreen_server_args_ports_probes_and_services_agree() -> None:
    deployment = DOCS[("Deployment", "evergreen-server")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["evergreen-trio"]
    args = build_parser().parse_args(container["args"])  # the flags the real command accepts
    assert args.command == "serve" and args.host == "0.0.0.0" and args.workers >= 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": SERVICE}
    assert container["livenessProbe"]["grpc"] == {"port": args.port, "service": ServerHealth.LIVENESS}
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pre_stop[1]) + args.drain_grace
    for name in ("evergreen-server", "evergreen-server-pods"):
        service = DOCS[("Service", name)]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert service_ports["grpc"]["targetPort"] == args.port
        assert service_ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"  # gRPC: HTTP/2 in cleartext
        assert {p["targetPort"] for p in service_ports.values()} <= set(ports.values())
    assert DOCS[("Service", "evergreen-server-pods")]["spec"]["clusterIP"] == "None"  # one DNS record per pod
