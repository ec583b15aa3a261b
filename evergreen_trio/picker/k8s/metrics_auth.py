"""The metrics port's authentication and authorization, as controller-runtime's
``filters.WithAuthenticationAndAuthorization``, which the reference EPP puts in front of its
metrics unless ``--metrics-endpoint-auth=false``.

Each scrape's bearer token is checked with a TokenReview, and the user's right to the request
(``get`` of a non-resource path such as ``/metrics``) with a SubjectAccessReview: no token or one
not authenticated is 401, a user not allowed 403, and an API server that cannot answer 500. The
answers are cached as its delegating authenticator and authorizer cache them (a token one minute,
an allowed request five minutes, a denied one 30 seconds), here in maps of bounded size keyed by
the token's digest, and at most :data:`REVIEWS_IN_FLIGHT` reviews run at once, so a scraper
sending new tokens cannot grow memory or flood the API server.

A review that fails is never cached, and fails closed with 500 ("Authentication failed", or
"Authorization for user NAME failed" as the reference words it) and one warning naming the cause:
an error status (the picker's own RBAC missing is a 403 from the API server), no whole answer
within twice the client's timeout (a server sending a byte every few seconds too), a dropped connection,
a body that is no JSON or not a review (whatever lightkube's decoder refuses: a field of the wrong
type, a required field such as ``allowed`` missing, where Go's decoder would read false and answer
403), a TokenReview's ``status.error`` and a SubjectAccessReview both allowed and denied (errors in
the reference's webhook clients too).
A TokenReview without a status authenticates nobody (401) and a SubjectAccessReview without one
allows nothing (403), cached as the reference caches them.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio
from lightkube import AsyncClient
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

import evergreen_trio.picker.k8s.access as k8s_access
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.serving.metrics import Authorize

log = logging.getLogger(__name__)
TOKEN_TTL_S, ALLOWED_TTL_S, DENIED_TTL_S = 60.0, 300.0, 30.0  # controller-runtime's
REVIEWS_IN_FLIGHT = 4
MAX_CACHED = 1024
LOGGED_CAUSE_CHARS = 300
_K = TypeVar("_K")
_V = TypeVar("_V")
_R = TypeVar("_R")


class TtlCache(Generic[_K, _V]):
    """At most ``size`` entries, each kept until its own deadline; the oldest goes first when full."""

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.clock = size, clock
        self._entries: dict[_K, tuple[float, _V]] = {}

    def get(self, key: _K) -> _V | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] <= self.clock():
            return None
        return entry[1]

    def put(self, key: _K, value: _V, ttl_s: float) -> None:
        self._entries.pop(key, None)
        while len(self._entries) >= self.size:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (self.clock() + ttl_s, value)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class ReviewedUser:
    """Who a TokenReview says a token belongs to (what the SubjectAccessReview asks about)."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


_NOBODY = ReviewedUser("")  # a token the API server did not authenticate (cached too)


class ReviewError(Exception):
    """A review answered, but with an error of its own (not cached)."""


def _cause(exc: Exception) -> str:
    """``exc`` for one log line: its type and its text, cut and escaped (an API server's message may
    be long or hold newlines)."""
    return f"{type(exc).__name__}: {peer_text(str(exc), LOGGED_CAUSE_CHARS)}"


async def _answered(review: Awaitable[_R]) -> _R:
    """``review``'s answer, whole within twice the client's timeout (which bounds each read, not the
    answer: a byte every few seconds would hold a review slot forever); ReviewError otherwise."""
    deadline_s = 2 * k8s_access.REQUEST_TIMEOUT_S
    with trio.move_on_after(deadline_s):
        return await review
    raise ReviewError(f"no whole answer in {deadline_s}s")


def bearer_token(authorization: str | None) -> str | None:
    """The token of ``Authorization: Bearer TOKEN`` (scheme in any case), as Kubernetes reads it."""
    parts = (authorization or "").split(" ")
    if len(parts) < 2 or parts[0].lower() != "bearer" or not parts[1]:
        return None
    return parts[1]


class MetricsAuth:
    """Checks scrapes against the cluster; :meth:`serving` yields the check ``serve_metrics`` takes."""

    def __init__(self, access: ClusterAccess, clock: Callable[[], float] = time.monotonic) -> None:
        self.access = access
        self.users: TtlCache[bytes, ReviewedUser] = TtlCache(MAX_CACHED, clock)
        self.decisions: TtlCache[tuple[str, str, str], bool] = TtlCache(MAX_CACHED, clock)
        self._reviews = trio.CapacityLimiter(REVIEWS_IN_FLIGHT)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[Authorize]:
        """A cluster client for the reviews, open while the metrics port serves."""
        client = self.access.client()
        try:
            yield lambda method, path, headers: self.check(client, method, path, headers)
        finally:
            with trio.CancelScope(shield=True):
                await client.close()

    async def check(self, client: AsyncClient, method: str, path: str,
                    headers: Mapping[str, str]) -> tuple[int, str] | None:
        """None when the request may be served, else the status and text to answer."""
        token = bearer_token(headers.get("authorization"))
        if token is None:
            return 401, "Unauthorized"
        # Any failure of a review is the API server's answer failing, whatever lightkube raises for
        # it (a body without Content-Type raises KeyError, a deeply nested one RecursionError): the
        # scrape fails closed and the port serves on.
        try:
            user = await self._authenticate(client, token)
        except Exception as exc:
            log.warning("picker.metrics_review_failed review=TokenReview error=%s", _cause(exc))
            return 500, "Authentication failed"
        if user is _NOBODY:
            return 401, "Unauthorized"
        try:
            allowed = await self._authorize(client, user, method.lower(), path)
        except Exception as exc:
            log.warning("picker.metrics_review_failed review=SubjectAccessReview error=%s", _cause(exc))
            return 500, f"Authorization for user {user.username} failed"
        if not allowed:
            return 403, f"Authorization denied for user {user.username}"
        return None

    async def _authenticate(self, client: AsyncClient, token: str) -> ReviewedUser:
        digest = hashlib.sha256(token.encode()).digest()  # the cache holds no token
        user = self.users.get(digest)
        if user is None:
            async with self._reviews:
                review = await _answered(client.create(TokenReview(spec=TokenReviewSpec(token=token))))
            status = review.status
            if status is not None and not status.authenticated and status.error:
                raise ReviewError(f"TokenReview status.error: {status.error}")
            info = status.user if status is not None and status.authenticated else None
            user = _NOBODY if info is None or not info.username else ReviewedUser(
                info.username, info.uid or "", tuple(info.groups or ()),
                {key: tuple(values) for key, values in (info.extra or {}).items()})
            self.users.put(digest, user, TOKEN_TTL_S)
        return user

    async def _authorize(self, client: AsyncClient, user: ReviewedUser, verb: str, path: str) -> bool:
        key = (user.username, verb, path)
        allowed = self.decisions.get(key)
        if allowed is None:
            spec = SubjectAccessReviewSpec(
                user=user.username, uid=user.uid or None, groups=list(user.groups) or None,
                extra={key: list(values) for key, values in user.extra.items()} or None,
                nonResourceAttributes=NonResourceAttributes(path=path, verb=verb))
            async with self._reviews:
                review = await _answered(client.create(SubjectAccessReview(spec=spec)))
            status = review.status
            if status is not None and status.allowed and status.denied:
                raise ReviewError("SubjectAccessReview returned both allowed and denied")
            allowed = bool(status is not None and status.allowed)
            self.decisions.put(key, allowed, ALLOWED_TTL_S if allowed else DENIED_TTL_S)
        return allowed
