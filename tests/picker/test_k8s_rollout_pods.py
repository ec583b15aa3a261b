"""The rollout screener's pod notifications against the stand-in API server, through lightkube on
Trio: the revision shares follow pods scaled, relabelled, made unready and deleted, and survive an
API server outage; the scope selector goes to the API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from kube_fakes import NAMESPACE, PODS, KubeApiServer, eventually, pod, write_kubeconfig

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.k8s import ClusterAccess
from evergreen_trio.picker.k8s.rollout_pods import watch_rollout_pods
from evergreen_trio.picker.rollout import RolloutParams, RolloutScreener

REV, ROLE = "disaggregatedset.x-k8s.io/revision", "disaggregatedset.x-k8s.io/role"
SET = "disaggregatedset.x-k8s.io/name"
CONFIG = f"""apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: disaggregatedset-rollout-screener
  name: rollout
  parameters:
    scope: {{labelSelector: '{SET}=my-set'}}
    revisionGating: {{mode: sum, requireRoles: {{values: [prefill, decode]}}}}
"""


def member(name: str, revision: str, role: str, *, ready: bool = True, scope: str = "my-set") -> dict[str, Any]:
    return pod(name, "10.0.0.1", ready=ready, labels={REV: revision, ROLE: role, SET: scope})


async def test_shares_follow_the_pods_in_scope(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer(bookmark_interval_s=0.2)
    await nursery.start(api.serve)
    config = parse_config(CONFIG, cluster_pool="pool")
    assert config.epp is not None
    params = config.epp.plugins["rollout"].params
    assert isinstance(params, RolloutParams)
    screener = RolloutScreener(params, "rollout")
    for name, revision, role in (("a-p", "v1", "prefill"), ("a-d", "v1", "decode"), ("b-p", "v2", "prefill")):
        api.put(PODS, member(name, revision, role))
    api.put(PODS, member("other", "v2", "decode", scope="another-set"))  # out of scope
    access = ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port)))
    nursery.start_soon(lambda: watch_rollout_pods(access, NAMESPACE, [screener], max_backoff_s=0.3))
    await eventually(lambda: screener.shares == {"v1": 1.0})  # v2 has no Ready decode pod in scope
    assert all("labelSelector=" in r and "my-set" in r for r in api.requests if "/pods" in r), api.requests
    api.put(PODS, member("b-d", "v2", "decode"))
    await eventually(lambda: screener.shares == {"v1": 0.5, "v2": 0.5})
    api.put(PODS, member("a-d", "v2", "decode"))  # relabelled: v1 loses its decode pod
    await eventually(lambda: screener.shares == {"v2": 1.0})
    api.put(PODS, member("b-d", "v2", "decode", ready=False))
    api.delete(PODS, NAMESPACE, "a-d")
    await eventually(lambda: screener.shares == {} and screener.role_counts == {"v1": {"prefill": 1},
                                                                                 "v2": {"prefill": 1}})
    api.put(PODS, member("c-d", "v1", "decode"))
    await eventually(lambda: screener.shares == {"v1": 1.0})
    api.stop()  # the API server away: the known pods stay, and come back relisted
    await trio.sleep(0.5)
    assert screener.shares == {"v1": 1.0}
    api.put(PODS, member("c-d", "v1", "decode", ready=False))
    await api.start()
    await eventually(lambda: screener.shares == {})
