"""Discovery against the stand-in API server, through lightkube on Trio: the endpoint set follows
the pool and its pods, and survives watch expiry, API server restarts and outages."""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import httpx2
import pytest
import trio
from kube_fakes import (
    DEEP_JSON_500,
    LEASES,
    NAMESPACE,
    NO_CONTENT_TYPE_503,
    PODS,
    POOLS_V1,
    POOLS_V1ALPHA2,
    FaultyKubeApi,
    KubeApiServer,
    eventually,
    pod,
    pool_v1,
    pool_v1alpha2,
    write_kubeconfig,
)

from evergreen_trio._http import HttpResponse
from evergreen_trio.picker.config import Endpoint, PoolConfig
from evergreen_trio.picker.k8s import ClusterAccess, PoolRef, parse_selector, pool_discovery
from evergreen_trio.picker.k8s import access as access_module
from evergreen_trio.picker.k8s import discovery as discovery_module
from evergreen_trio.testing.kube_api import dribble


class Seen:
    def __init__(self) -> None:
        self.sets: list[list[str]] = []

    def __call__(self, endpoints: Sequence[Endpoint]) -> None:
        self.sets.append([e.address for e in endpoints])

    @property
    def last(self) -> list[str] | None:
        return self.sets[-1] if self.sets else None


@pytest.fixture
async def api(nursery: trio.Nursery) -> AsyncIterator[KubeApiServer]:
    server = KubeApiServer(bookmark_interval_s=0.2)
    await nursery.start(server.serve)
    yield server


async def start(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path, ref: PoolRef | None = None) -> Seen:
    seen = Seen()
    access = ClusterAccess.load(str(write_kubeconfig(tmp_path, api.port)))
    nursery.start_soon(lambda: pool_discovery(access, ref or PoolRef("pool", NAMESPACE), PoolConfig("pool", ()),
                                              seen, max_backoff_s=0.3))
    return seen


async def serving_one_pod(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path) -> Seen:
    """``api`` serving the pool and its one pod ``m-0``, with discovery started against it."""
    await nursery.start(api.serve)
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    return await start(nursery, api, tmp_path)


async def test_follows_scale_readiness_ip_and_pool_edits(nursery: trio.Nursery, api: KubeApiServer,
                                                         tmp_path: Path) -> None:
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    api.put(PODS, pod("other", "10.0.0.9", labels={"app": "not-the-pool"}))
    api.put(PODS, pod("pending", None, ready=False))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    steps = [
        (lambda: api.put(PODS, pod("m-1", "10.0.0.2")), ["10.0.0.1:8000", "10.0.0.2:8000"]),  # scale up
        (lambda: api.put(PODS, pod("m-0", "10.0.0.1", ready=False)), ["10.0.0.2:8000"]),  # readiness flip
        (lambda: api.put(PODS, pod("m-0", "10.0.0.3")), ["10.0.0.2:8000", "10.0.0.3:8000"]),  # new IP
        (lambda: api.delete(PODS, NAMESPACE, "m-1"), ["10.0.0.3:8000"]),  # scale down
        (lambda: api.put(POOLS_V1, pool_v1(ports=(8000, 8001))), ["10.0.0.3:8000", "10.0.0.3:8001"]),  # ports
        (lambda: api.put(POOLS_V1, pool_v1(labels={"app": "not-the-pool"})), ["10.0.0.9:8000"]),  # selector
    ]
    for change, expected in steps:
        began = time.monotonic()
        change()
        await eventually(lambda e=expected: seen.last == e)  # type: ignore[misc]
        assert time.monotonic() - began < 5.0
    # The re-list that empties the pool can land before the new watch is sent: wait for that too.
    await eventually(lambda: any("labelSelector=app%3Dnot-the-pool" in r or "labelSelector=app=not-the-pool" in r
                                 for r in api.requests if "watch=true" in r and "/pods" in r))


async def test_v1alpha2_pool(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path) -> None:
    api.put(POOLS_V1ALPHA2, pool_v1alpha2(port=8200))
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path, PoolRef("pool", NAMESPACE, "inference.networking.x-k8s.io"))
    await eventually(lambda: seen.last == ["10.0.0.1:8200"])


async def test_selector_mode_without_a_pool(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path) -> None:
    api.put(PODS, pod("m-0", "10.0.0.1", labels={"app": "model", "tier": "a"}))
    api.put(PODS, pod("m-1", "10.0.0.2", labels={"app": "model", "tier": "b"}))
    ref = PoolRef("pool", NAMESPACE, selector=parse_selector("app=model,tier=b"), ports=(9000,))
    seen = await start(nursery, api, tmp_path, ref)
    await eventually(lambda: seen.last == ["10.0.0.2:9000"])


async def test_410_gone_relists(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "evergreen_trio.picker.k8s")
    monkeypatch.setattr(discovery_module, "WATCH_TIMEOUT_S", 1)  # watches end (cleanly) every second
    api = KubeApiServer()  # no bookmarks: the resumed version stays the last event's
    await nursery.start(api.serve)
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    lists_before = sum(1 for r in api.requests if "/pods" in r and "watch=true" not in r)
    api.put(LEASES, {"metadata": {"name": "unrelated", "namespace": NAMESPACE}})  # the version moves on
    api.compact()  # the versions the watches resume from are gone: 410 on resume
    await eventually(lambda: sum(1 for r in api.requests if "/pods" in r and "watch=true" not in r) > lists_before)
    api.put(PODS, pod("m-1", "10.0.0.2"))
    await eventually(lambda: seen.last == ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert "410 Gone, re-listing" in caplog.text


async def test_api_server_restart_and_outage_keep_the_last_endpoints(
        nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path) -> None:
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    api.stop()  # the API server goes away: connections reset, then refused
    await trio.sleep(1.0)
    assert seen.last == ["10.0.0.1:8000"]
    api.put(PODS, pod("m-1", "10.0.0.2"))  # changed while away: picked up by the re-list
    api.compact()
    await api.start()
    await eventually(lambda: seen.last == ["10.0.0.1:8000", "10.0.0.2:8000"])


async def test_missing_pool_reports_nothing_until_created(nursery: trio.Nursery, api: KubeApiServer,
                                                          tmp_path: Path) -> None:
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path)
    await trio.sleep(0.5)
    assert seen.sets == []  # not synced: readiness stays NOT_SERVING
    api.put(POOLS_V1, pool_v1())
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])


async def test_endpoints_are_capped(nursery: trio.Nursery, api: KubeApiServer, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(discovery_module, "MAX_ENDPOINTS", 2)
    api.put(POOLS_V1, pool_v1())
    for i in range(4):
        api.put(PODS, pod(f"m-{i}", f"10.0.0.{i + 1}"))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000", "10.0.0.2:8000"])
    api.put(PODS, pod("m-4", "10.0.0.5"))  # left out too: the pods kept are bounded
    api.put(PODS, pod("m-0", "10.0.0.9"))  # a kept pod still follows its changes
    await eventually(lambda: seen.last == ["10.0.0.2:8000", "10.0.0.9:8000"])
    (line,) = [r.getMessage() for r in caplog.records if "too_many_pods" in r.getMessage()]
    assert "limit=2 left_out=2" in line


class EndlessPodWatch(KubeApiServer):
    """Answers every pod watch with one line that never ends, as fast as it can."""

    async def _events(self, collection: str, namespace: str, query: Mapping[str, str], start: int | None,
                      timeout_s: float, bookmarks: float | None) -> AsyncIterator[bytes]:
        if collection != PODS:
            async for line in super()._events(collection, namespace, query, start, timeout_s, bookmarks):
                yield line
            return
        while True:  # each chunk is one send: a checkpoint
            yield b"x" * 65536


async def test_an_endless_watch_line_fails_the_round(nursery: trio.Nursery, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    # lightkube buffered the line until the idle timeout (90 s), ~150 MiB a second from a local server.
    monkeypatch.setattr(access_module, "MAX_EVENT_BYTES", 1 << 20)
    api = EndlessPodWatch()
    seen = await serving_one_pod(nursery, api, tmp_path)
    await eventually(lambda: "DecodingError: expected at most 1048576 bytes in a watch event" in caplog.text)
    await eventually(lambda: sum(1 for r in api.requests if "/pods" in r and "watch=true" not in r) >= 2)
    assert seen.sets == [["10.0.0.1:8000"]]  # kept, and re-listed after a backoff


class GzipPodList(KubeApiServer):
    """Answers pod lists gzip-compressed, asked or not (a small body may inflate to any size), while
    ``compress``."""

    compress = True

    def _list(self, collection: str, namespace: str, query: Mapping[str, str]) -> HttpResponse:
        response = super()._list(collection, namespace, query)
        if collection != PODS or not self.compress:
            return response
        return HttpResponse(200, [*response.headers, ("content-encoding", "gzip")], gzip.compress(response.body))


async def test_list_bodies_are_bounded_and_uncompressed(nursery: trio.Nursery, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "evergreen_trio.picker.k8s")  # the second failure in a row is at debug
    monkeypatch.setattr(access_module, "MAX_BODY_BYTES", 4096)
    api = GzipPodList()
    seen = await serving_one_pod(nursery, api, tmp_path)
    await eventually(lambda: "expected an uncompressed body, got Content-Encoding 'gzip'" in caplog.text)
    api.compress = False
    big = pod("m-1", "10.0.0.2")
    big["metadata"]["annotations"] = {"note": "x" * 4096}
    api.put(PODS, big)
    await eventually(lambda: "DecodingError: expected at most 4096 bytes of body" in caplog.text)
    assert seen.sets == []


class DribbledPodList(KubeApiServer):
    """Answers pod lists a byte every 0.2 s: each read is within the client's timeout, the list never ends."""

    def _list(self, collection: str, namespace: str, query: Mapping[str, str]) -> HttpResponse:
        response = super()._list(collection, namespace, query)
        if collection != PODS:
            return response
        return HttpResponse(200, response.headers, stream=dribble(response.body, 0.2))


async def test_a_list_that_never_ends_fails_the_round(nursery: trio.Nursery, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(discovery_module, "LIST_TIMEOUT_S", 1.0)
    api = DribbledPodList()
    seen = await serving_one_pod(nursery, api, tmp_path)
    await eventually(lambda: "ReadTimeout: expected the list within 1.0s" in caplog.text)
    await eventually(lambda: sum(1 for r in api.requests if "/pods" in r) >= 2)  # retried
    assert seen.sets == []


@pytest.mark.parametrize("answer", [NO_CONTENT_TYPE_503, DEEP_JSON_500], ids=["503-no-content-type", "500-deep-json"])
async def test_a_garbage_answer_keeps_the_endpoints(nursery: trio.Nursery, tmp_path: Path,
                                                    answer: HttpResponse, caplog: pytest.LogCaptureFixture) -> None:
    # lightkube raises RecursionError reading deeply nested JSON: it ended discovery, and the picker.
    api = FaultyKubeApi()
    seen = await serving_one_pod(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    api.faults["/pods"] = answer
    api.stop()  # the watches end; the re-lists get the answer
    await api.start()
    await eventually(lambda: api.faulted >= 3)  # answered, and retried
    assert "picker.kube_unavailable what=pods" in caplog.text
    api.put(PODS, pod("m-1", "10.0.0.2"))
    del api.faults["/pods"]
    await eventually(lambda: seen.last == ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert seen.sets == [["10.0.0.1:8000"], ["10.0.0.1:8000", "10.0.0.2:8000"]]


class InstantPodWatch(KubeApiServer):
    """Ends every pod watch at once: with nothing, or with a 410 Gone when ``gone``."""

    gone = False

    async def _events(self, collection: str, namespace: str, query: Mapping[str, str], start: int | None,
                      timeout_s: float, bookmarks: float | None) -> AsyncIterator[bytes]:
        if collection != PODS:
            async for line in super()._events(collection, namespace, query, start, timeout_s, bookmarks):
                yield line
        elif self.gone:
            yield b'{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}\n'


@pytest.mark.parametrize("gone", [False, True], ids=["ended-at-once", "410-at-once"])
async def test_a_watch_ended_at_once_is_not_restarted_at_once(nursery: trio.Nursery, tmp_path: Path,
                                                             gone: bool) -> None:
    # lightkube resumed the first at once, the loop re-listed after the second at once: 300-600 a second.
    api = InstantPodWatch()
    api.gone = gone
    await nursery.start(api.serve)
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    await trio.sleep(1.5)
    assert 1 <= sum(1 for r in api.requests if "/pods" in r and "watch=true" in r) <= 3
    assert seen.sets == [["10.0.0.1:8000"]]


class RawUnicodeWatch(KubeApiServer):
    """Sends watch events with non-ASCII characters raw, as Go's encoder sends U+0085 (NEL)."""

    async def _events(self, collection: str, namespace: str, query: Mapping[str, str], start: int | None,
                      timeout_s: float, bookmarks: float | None) -> AsyncIterator[bytes]:
        async for line in super()._events(collection, namespace, query, start, timeout_s, bookmarks):
            yield json.dumps(json.loads(line), ensure_ascii=False).encode() + b"\n"


async def test_a_line_break_of_unicode_in_a_string_keeps_the_watch(nursery: trio.Nursery, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # lightkube split the event at the NEL as str.splitlines does: the watch failed, and re-listed.
    api = RawUnicodeWatch(bookmark_interval_s=0.2)
    await nursery.start(api.serve)
    api.put(POOLS_V1, pool_v1())
    api.put(PODS, pod("m-0", "10.0.0.1"))
    seen = await start(nursery, api, tmp_path)
    await eventually(lambda: seen.last == ["10.0.0.1:8000"])
    annotated = pod("m-1", "10.0.0.2")
    annotated["metadata"]["annotations"] = {"note": "a\u0085b\u2028c\u2029d"}
    api.put(PODS, annotated)
    await eventually(lambda: seen.last == ["10.0.0.1:8000", "10.0.0.2:8000"])
    await trio.sleep(0.5)  # a bookmark or two more
    assert sum(1 for r in api.requests if "/pods" in r and "watch=true" not in r) == 1
    assert "kube_unavailable" not in caplog.text


async def test_line_breaks_of_unicode_are_escaped_across_chunks() -> None:
    text = '{"a": "x\u0085y\u2028z\u2029\u2019"}\n'.encode()

    class OneByteAtATime(httpx2.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for i in range(len(text)):
                yield text[i:i + 1]

    request = httpx2.Request("GET", "http://api/api/v1/pods?watch=true")
    body = b"".join([chunk async for chunk in access_module._BoundedStream(OneByteAtATime(), request, True)])
    assert body == b'{"a": "x\\u0085y\\u2028z\\u2029\xe2\x80\x99"}\n'
    assert json.loads(body) == json.loads(text)


async def test_the_api_servers_message_is_logged_on_one_short_line(nursery: trio.Nursery, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    api = FaultyKubeApi()
    await nursery.start(api.serve)
    message = "etcd down\npicker.endpoints count=1 endpoints=6.6.6.6:80" + "x" * 100_000
    api.faults["/inferencepools"] = HttpResponse(500, [("content-type", "application/json")], json.dumps(
        {"kind": "Status", "code": 500, "message": message}).encode())
    await start(nursery, api, tmp_path)
    await eventually(lambda: "kube_unavailable" in caplog.text)
    (line,) = [r.getMessage() for r in caplog.records if "kube_unavailable" in r.getMessage()]
    assert "etcd down\\npicker.endpoints" in line and len(line) < 600  # was the whole message, a forged line in it
