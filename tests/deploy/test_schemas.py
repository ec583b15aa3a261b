"""`kubectl kustomize deploy/kubernetes` renders, and every object it renders is valid: core and RBAC
objects against Kubernetes' own JSON schema (the kubernetes-validate package ships it), the
InferencePool against tests/deploy/schemas/inferencepool-v1.schema.json (see its $comment).
Gateway and HTTPRoute are only checked by test_manifests.py: their CRDs are not stored here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33.0"
NOT_VALIDATED = {"Gateway", "HTTPRoute"}  # gateway.networking.k8s.io CRDs: not stored in this repository


def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (apt-get install kubectl)")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_every_rendered_object_is_valid() -> None:
    docs = rendered()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "InferencePool"} <= kinds
    pool_schema = json.loads((SCHEMAS / "inferencepool-v1.schema.json").read_text())
    for doc in docs:
        if doc["kind"] == "InferencePool":
            jsonschema.validate(doc, pool_schema)
        elif doc["kind"] not in NOT_VALIDATED:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validators_reject_mistakes() -> None:
    docs = {d["kind"]: d for d in rendered()}
    deployment = json.loads(json.dumps(docs["Deployment"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9002"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    pool = json.loads(json.dumps(docs["InferencePool"]))
    pool["spec"]["targetPortNumber"] = 8000  # the pre-GA field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, json.loads((SCHEMAS / "inferencepool-v1.schema.json").read_text()))
