"""The metrics port's review caches and token parsing (``evergreen_trio.picker.k8s.metrics_auth``), a
flood of new tokens against the reviews, and an API server answering the reviews badly, each over
real sockets: a scraper (httpx) to the metrics port, whose check asks the stand-in API server."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from kube_fakes import metrics_reader, write_kubeconfig
from prometheus_client import CollectorRegistry

from evergreen_trio.picker.k8s import ClusterAccess, access
from evergreen_trio.picker.k8s.metrics_auth import (
    DENIED_TTL_S,
    MAX_CACHED,
    TOKEN_TTL_S,
    MetricsAuth,
    TtlCache,
    bearer_token,
)
from evergreen_trio.serving.metrics import serve_metrics
from evergreen_trio.testing.kube_api import ACCESS_REVIEWS, TOKEN_REVIEWS, KubeApiServer, ReviewFault, api_status

READER = "system:serviceaccount:monitoring:prometheus"  # the user metrics_reader's token authenticates as


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0.5, 10), st.floats(0, 3)), max_size=200))
def test_a_ttl_cache_never_holds_more_than_its_size_nor_answers_after_a_deadline(
        puts: list[tuple[int, float, float]]) -> None:
    now = [0.0]
    cache: TtlCache[int, float] = TtlCache(8, lambda: now[0])
    for key, ttl, elapse in puts:
        cache.put(key, now[0] + ttl, ttl)
        now[0] += elapse
        assert len(cache) <= 8
        value = cache.get(key)
        assert value is None or value > now[0]  # a value is its own deadline


def test_bearer_tokens_are_read_as_kubernetes_reads_them() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer abc extra") == "abc"
    for header in (None, "", "Bearer", "Bearer ", "Basic abc", "Token abc"):
        assert bearer_token(header) is None


@dataclass
class Scrapes:
    """A metrics port checked against the stand-in ``api``; ``now`` is the caches' clock."""

    api: KubeApiServer
    auth: MetricsAuth
    url: str
    now: list[float]
    reader: dict[str, str]

    async def get(self, headers: dict[str, str] | None = None) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.get(self.url, headers=self.reader if headers is None else headers)


@pytest.fixture
async def scrapes(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Scrapes]:
    # The review client's timeout (10 s) made short, so an answer past it costs the test little.
    monkeypatch.setattr(access, "REQUEST_TIMEOUT_S", 2.0)
    api = KubeApiServer()
    await nursery.start(api.serve)
    now = [0.0]
    auth = MetricsAuth(ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port))), clock=lambda: now[0])

    async def serve(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with auth.serving() as authorize:
            await serve_metrics(CollectorRegistry(), "127.0.0.1", 0, authorize=authorize, task_status=task_status)

    yield Scrapes(api, auth, f"http://127.0.0.1:{await nursery.start(serve)}/metrics", now, metrics_reader(api))


async def test_a_flood_of_new_tokens_keeps_the_caches_bounded_and_a_reader_served(scrapes: Scrapes) -> None:
    async with httpx.AsyncClient() as client:
        for i in range(MAX_CACHED + 200):
            response = await client.get(scrapes.url, headers={"authorization": f"Bearer flood-{i}"})
            assert response.status_code == 401
        assert len(scrapes.auth.users) == MAX_CACHED
        assert (await client.get(scrapes.url, headers=scrapes.reader)).status_code == 200


def _review(kind: str, status: object | None) -> bytes:
    """A review of ``kind`` as answered, with ``status`` (None: without one)."""
    review: dict[str, object] = {"spec": {"token": "prometheus-token"} if kind == TOKEN_REVIEWS else {"user": READER}}
    if status is not None:
        review["status"] = status
    return json.dumps(review).encode()


def _forbidden(kind: str) -> ReviewFault:
    """The API server's answer when the picker's ServiceAccount may not create reviews of ``kind``."""
    group = "authentication.k8s.io" if kind == TOKEN_REVIEWS else "authorization.k8s.io"
    message = (f'{kind}.{group} is forbidden: User "system:serviceaccount:llm:picker" cannot create resource '
               f'"{kind}" in API group "{group}" at the cluster scope')
    return ReviewFault(403, api_status(403, "Forbidden", message))


MiB = 1 << 20
DEEP = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit for json.loads
# Each bad answer, for either review, and the exception type the warning names.
FAULTS = {
    "not-json": (ReviewFault(body=b"<html>502 Bad Gateway</html>", content_type="text/html"), "DecodeError"),
    "a-json-array": (ReviewFault(body=b"[1, 2]"), "ValidationError"),
    "status-a-string": (ReviewFault(body=b'{"spec": {}, "status": "Success"}'), "ValidationError"),
    "huge-wrong-shape": (ReviewFault(body=b'{"spec": {}, "status": "' + b"x" * 16 * MiB + b'"}'), "ValidationError"),
    "500-status": (ReviewFault(500, api_status(500, "InternalError", "etcdserver: request timed out")), "ApiError"),
    "503-no-content-type": (ReviewFault(503, b"upstream connect error", content_type=None), "KeyError"),
    "500-deeply-nested-json": (ReviewFault(500, DEEP), "RecursionError"),
    "403-picker-rbac-missing": (ReviewFault(403), "ApiError"),  # the body names the kind: see _forbidden
    "past-the-client-timeout": (ReviewFault(delay_s=60), "ReadTimeout"),
    "a-byte-a-second": (ReviewFault(dribble_s=1.0), "ReviewError"),  # each read within the client's timeout
    "connection-dropped": (ReviewFault(drop=True), "RemoteProtocolError"),
}
SHAPES = {  # bodies of one kind only
    (TOKEN_REVIEWS, "authenticated-a-string"): (_review(TOKEN_REVIEWS, {"authenticated": "true", "user": {
        "username": READER}}), "ValidationError"),
    (TOKEN_REVIEWS, "status-error"): (_review(TOKEN_REVIEWS, {"authenticated": False, "error": "webhook down"}),
                                      "ReviewError"),
    (ACCESS_REVIEWS, "allowed-missing"): (_review(ACCESS_REVIEWS, {"reason": "no opinion"}), "ValidationError"),
    (ACCESS_REVIEWS, "allowed-a-string"): (_review(ACCESS_REVIEWS, {"allowed": "false"}), "ValidationError"),
    (ACCESS_REVIEWS, "allowed-and-denied"): (_review(ACCESS_REVIEWS, {"allowed": True, "denied": True}),
                                             "ReviewError"),
}
CASES = [pytest.param(kind, fault, cause, id=f"{kind}-{name}") for name, (fault, cause) in FAULTS.items()
         for kind in (TOKEN_REVIEWS, ACCESS_REVIEWS)]
CASES += [pytest.param(kind, ReviewFault(body=body), cause, id=f"{kind}-{name}")
          for (kind, name), (body, cause) in SHAPES.items()]


@pytest.mark.parametrize(("kind", "fault", "cause"), CASES)
async def test_a_bad_review_answer_fails_closed_uncached_logged_once_and_the_next_scrape_is_served(
        scrapes: Scrapes, caplog: pytest.LogCaptureFixture, kind: str, fault: ReviewFault, cause: str) -> None:
    """As controller-runtime's filter: an error reviewing the token is 500 "Authentication failed",
    authorizing the user 500 "Authorization for user ... failed"; nothing is cached, one warning
    names the cause, and once the API server answers properly the same scraper is served."""
    scrapes.api.review_faults[kind] = _forbidden(kind) if fault.status == 403 else fault
    caplog.set_level(logging.INFO, "evergreen_trio.picker.k8s")
    with trio.fail_after(30):  # a hang guard: the slow answer ends at the client's timeout
        refused = await scrapes.get()
    assert refused.status_code == 500
    want = "Authentication failed" if kind == TOKEN_REVIEWS else f"Authorization for user {READER} failed"
    assert refused.text == want + "\n"
    assert len(scrapes.auth.decisions) == 0
    assert len(scrapes.auth.users) == (0 if kind == TOKEN_REVIEWS else 1)  # the token's own review succeeded
    (line,) = [r.getMessage() for r in caplog.records if "metrics_review_failed" in r.getMessage()]
    review = "TokenReview" if kind == TOKEN_REVIEWS else "SubjectAccessReview"
    assert f"review={review} error={cause}: " in line
    assert "\n" not in line and len(line) < 1024
    del scrapes.api.review_faults[kind]
    assert (await scrapes.get()).status_code == 200
    assert (await scrapes.get({"authorization": "Bearer unknown"})).status_code == 401


@pytest.mark.parametrize(("kind", "status", "ttl_s"), [(TOKEN_REVIEWS, 401, TOKEN_TTL_S),
                                                      (ACCESS_REVIEWS, 403, DENIED_TTL_S)])
async def test_a_review_without_a_status_is_a_refusal_cached_as_the_reference_caches_it(
        scrapes: Scrapes, kind: str, status: int, ttl_s: float) -> None:
    """A review answered without ``status`` decodes (as Go's zero value) to "not authenticated" or
    "not allowed": 401 or 403, cached as a refusal (a minute, 30 s), never as allowed; served once
    the API server answers properly and the refusal has expired."""
    scrapes.api.review_faults[kind] = ReviewFault(body=_review(kind, None))
    assert (await scrapes.get()).status_code == status
    del scrapes.api.review_faults[kind]
    assert (await scrapes.get()).status_code == status  # the refusal, from the cache
    assert not scrapes.auth.decisions.get((READER, "get", "/metrics"))
    scrapes.now[0] += ttl_s + 1
    assert (await scrapes.get()).status_code == 200
