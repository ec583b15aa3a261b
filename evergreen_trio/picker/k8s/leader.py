"""Leader election on a ``coordination.k8s.io/v1`` Lease, the way client-go's leaderelection does it.

Every ``retry_s`` each candidate reads the Lease. The holder renews ``renewTime``; another
candidate takes the Lease over once it has seen the same holder and ``renewTime`` unchanged for
the lease duration (measured on its own monotonic clock, so clock skew between pods does not
matter). Writes carry the ``resourceVersion`` read, so two candidates cannot both win: the
loser gets 409 Conflict. A leader that cannot renew within ``renew_deadline_s`` steps down
before anyone can take over. A leader stopped cleanly releases the Lease.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.k8s.access import ANSWER_ERRORS, LOGGED_ERROR_CHARS, ClusterAccess

log = logging.getLogger(__name__)
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_S = 15.0, 10.0, 2.0  # controller-runtime's defaults


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class _Observed:
    """The holder and renewTime last seen, and when (monotonic) they last changed."""

    def __init__(self) -> None:
        self.record: tuple[str | None, object] | None = None
        self.since = 0.0

    def see(self, holder: str | None, renew: object) -> float:
        """Seconds the record has stayed unchanged."""
        now = trio.current_time()
        if (holder, renew) != self.record:
            self.record, self.since = (holder, renew), now
        return now - self.since


async def _try_once(client: AsyncClient, namespace: str, name: str, identity: str, observed: _Observed,
                    duration_s: float) -> bool:
    """One acquire-or-renew attempt; True when we hold the Lease afterwards."""
    try:
        lease = await client.get(Lease, name, namespace=namespace)
    except ApiError as exc:
        if exc.status is None or exc.status.code != 404:
            raise
        now = _now()
        await client.create(Lease(
            metadata=ObjectMeta(name=name, namespace=namespace),
            spec=LeaseSpec(holderIdentity=identity, leaseDurationSeconds=int(duration_s), acquireTime=now,
                           renewTime=now, leaseTransitions=0)))
        return True
    spec = lease.spec or LeaseSpec()
    unchanged_s = observed.see(spec.holderIdentity, spec.renewTime)
    if spec.holderIdentity == identity:
        spec.renewTime = _now()
    elif not spec.holderIdentity or unchanged_s >= float(spec.leaseDurationSeconds or duration_s):
        now = _now()
        spec.holderIdentity, spec.acquireTime, spec.renewTime = identity, now, now
        spec.leaseDurationSeconds = int(duration_s)
        spec.leaseTransitions = (spec.leaseTransitions or 0) + 1
    else:
        return False
    lease.spec = spec
    await client.replace(lease)  # carries metadata.resourceVersion: 409 if someone wrote first
    return True


async def lease_election(
    access: ClusterAccess,
    namespace: str,
    name: str,
    identity: str,
    on_leader: Callable[[bool], None],
    *,
    duration_s: float = LEASE_DURATION_S,
    renew_deadline_s: float = RENEW_DEADLINE_S,
    retry_s: float = RETRY_S,
) -> None:
    """Campaign for Lease ``namespace/name`` as ``identity`` until cancelled; ``on_leader`` on each change.

    ``on_leader(False)`` is called once at the start (followers are not ready).
    """
    client = access.client()
    observed = _Observed()
    leader = False
    last_renew = 0.0
    on_leader(False)
    try:
        while True:
            try:
                with trio.fail_after(retry_s * 2):
                    held = await _try_once(client, namespace, name, identity, observed, duration_s)
            except (*ANSWER_ERRORS, trio.TooSlowError) as exc:
                log.debug("picker.lease_attempt_failed lease=%s error=%s", name,
                          peer_text(str(exc), LOGGED_ERROR_CHARS))
                held = leader and trio.current_time() - last_renew < renew_deadline_s
            else:
                if held:
                    last_renew = trio.current_time()
            if held != leader:
                leader = held
                log.info("picker.%s lease=%s/%s identity=%s", "leader" if leader else "follower",
                         namespace, name, identity)
                on_leader(leader)
            await trio.sleep(retry_s)
    finally:
        with trio.CancelScope(shield=True):
            if leader:
                await _release(client, namespace, name, identity)
            await client.close()


async def _release(client: AsyncClient, namespace: str, name: str, identity: str) -> None:
    """On a clean stop, hand the Lease back (as client-go's ReleaseOnCancel) so a follower takes over
    on its next retry instead of after the lease duration. Best effort: 2 s at most."""
    with trio.move_on_after(2.0):
        try:
            lease = await client.get(Lease, name, namespace=namespace)
            if lease.spec is not None and lease.spec.holderIdentity == identity:
                lease.spec.holderIdentity = None
                lease.spec.leaseDurationSeconds = 1
                await client.replace(lease)
                log.info("picker.lease_released lease=%s/%s identity=%s", namespace, name, identity)
        except ANSWER_ERRORS as exc:
            log.warning("picker.lease_release_failed lease=%s error=%s", name, peer_text(str(exc), LOGGED_ERROR_CHARS))
