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
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx2
import msgspec
import trio
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

from evergreen_trio.picker.k8s.access import ClusterAccess
from evergreen_trio.serving.metrics import Authorize

log = logging.getLogger(__name__)
TOKEN_TTL_S, ALLOWED_TTL_S, DENIED_TTL_S = 60.0, 300.0, 30.0  # controller-runtime's
REVIEWS_IN_FLIGHT = 4
MAX_CACHED = 1024
_K = TypeVar("_K")
_V = TypeVar("_V")


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
        try:
            user = await self._authenticate(client, token)
            if user is _NOBODY:
                return 401, "Unauthorized"
            if not await self._authorize(client, user, method.lower(), path):
                return 403, f"Authorization denied for user {user.username}"
        except (ApiError, httpx2.HTTPError, msgspec.MsgspecError, ValueError) as exc:
            log.warning("picker.metrics_review_failed error=%s", exc)
            return 500, "Authentication failed"
        return None

    async def _authenticate(self, client: AsyncClient, token: str) -> ReviewedUser:
        digest = hashlib.sha256(token.encode()).digest()  # the cache holds no token
        user = self.users.get(digest)
        if user is None:
            async with self._reviews:
                review = await client.create(TokenReview(spec=TokenReviewSpec(token=token)))
            status = review.status
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
                review = await client.create(SubjectAccessReview(spec=spec))
            allowed = bool(review.status is not None and review.status.allowed)
            self.decisions.put(key, allowed, ALLOWED_TTL_S if allowed else DENIED_TTL_S)
        return allowed
