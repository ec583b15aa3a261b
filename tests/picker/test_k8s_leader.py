"""Lease leader election against the stand-in API server: one leader, a takeover within the
lease duration when it dies, a leader that loses the API server steps down."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest
import trio
from kube_fakes import (
    DEEP_JSON_500,
    LEASES,
    NAMESPACE,
    NO_CONTENT_TYPE_503,
    FaultyKubeApi,
    KubeApiServer,
    eventually,
    write_kubeconfig,
)

from evergreen_trio._http import HttpResponse
from evergreen_trio.picker.k8s import ClusterAccess, lease_election

TIMING = {"duration_s": 1.0, "renew_deadline_s": 0.7, "retry_s": 0.1}


async def test_one_leader_and_takeover_within_the_lease_duration(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    await nursery.start(api.serve)
    access = ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port)))
    state: dict[str, bool] = {}
    scopes = {name: trio.CancelScope() for name in ("a", "b")}

    async def candidate(name: str) -> None:
        with scopes[name]:
            await lease_election(access, NAMESPACE, "epp-pool", name, partial(state.__setitem__, name), **TIMING)

    nursery.start_soon(candidate, "a")
    await eventually(lambda: state.get("a") is True)
    nursery.start_soon(candidate, "b")
    await trio.sleep(1.5)  # longer than the lease: a renewing leader keeps it
    assert state == {"a": True, "b": False}
    lease = api.get(LEASES, NAMESPACE, "epp-pool")
    assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    began = time.monotonic()
    scopes["a"].cancel()  # the leader dies without releasing
    await eventually(lambda: state.get("b") is True)
    assert time.monotonic() - began < 1.0 + 2.0  # the lease duration plus a generous margin
    lease = api.get(LEASES, NAMESPACE, "epp-pool")
    assert lease is not None and lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1


async def elected(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path) -> list[bool]:
    """``api`` serving, and candidate ``a`` elected through it; the leadership changes it saw."""
    await nursery.start(api.serve)
    access = ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port)))
    changes: list[bool] = []
    nursery.start_soon(partial(lease_election, access, NAMESPACE, "epp-pool", "a", changes.append, **TIMING))
    await eventually(lambda: changes[-1:] == [True])
    return changes


async def test_leader_steps_down_when_it_cannot_renew(nursery: trio.Nursery, tmp_path: Path) -> None:
    api = KubeApiServer()
    changes = await elected(nursery, api, tmp_path)
    api.stop()
    await eventually(lambda: changes[-1:] == [False])
    await api.start()
    await eventually(lambda: changes[-1:] == [True])
    assert changes == [False, True, False, True]


@pytest.mark.parametrize("answer", [NO_CONTENT_TYPE_503, DEEP_JSON_500], ids=["503-no-content-type", "500-deep-json"])
async def test_a_garbage_answer_is_a_failed_attempt(nursery: trio.Nursery, tmp_path: Path,
                                                    answer: HttpResponse) -> None:
    # lightkube raises KeyError and RecursionError reading these: they ended the election, and the picker.
    api = FaultyKubeApi()
    changes = await elected(nursery, api, tmp_path)
    api.faults["/leases/"] = answer
    await eventually(lambda: changes[-1:] == [False] and api.faulted >= 3)  # answered, and retried
    del api.faults["/leases/"]
    await eventually(lambda: changes[-1:] == [True])
