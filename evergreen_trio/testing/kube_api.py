"""A stand-in Kubernetes API server for tests (Trio + h11): the subset the picker's discovery and
leader election use, speaking the real protocol so the real client library (lightkube) drives it.

- collections of namespaced objects: ``/api/v1/namespaces/NS/pods`` and
  ``/apis/GROUP/VERSION/namespaces/NS/PLURAL``; GET (list or one), POST (create, 409 if it
  exists), PUT (replace; 409 Conflict when ``metadata.resourceVersion`` is stale);
- one global ``resourceVersion`` counter; lists carry the collection's version;
- ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``) and ``fieldSelector`` (``metadata.name``);
- ``?watch=true``: a chunked stream of ``{"type", "object"}`` lines from ``resourceVersion`` on;
  a version older than the retained history gets the ERROR event with a 410 Expired Status, as
  the real server does; ``timeoutSeconds`` ends the stream; BOOKMARK events when the client sends
  ``allowWatchBookmarks=true`` or the test sets ``bookmark_interval_s``;
- :meth:`KubeApiServer.compact` drops history (so the next watch from an old version gets 410),
  :meth:`KubeApiServer.stop` / :meth:`KubeApiServer.start` take the server away and back on
  the same port with its state kept (an API server restart).

- TokenReview and SubjectAccessReview (POST ``/apis/authentication.k8s.io/v1/tokenreviews`` and
  ``/apis/authorization.k8s.io/v1/subjectaccessreviews``): a token in :attr:`KubeApiServer.users`
  authenticates as that user; a non-resource request is allowed when
  ``(username, verb, path)`` is in :attr:`KubeApiServer.grants`. A :class:`ReviewFault` in
  :attr:`KubeApiServer.review_faults` (keyed ``tokenreviews`` or ``subjectaccessreviews``) answers
  that kind badly instead: any status and body, late, or not at all (the connection dropped).

Tests change the cluster with :meth:`put` and :meth:`delete`. Not covered: authenticating the
client itself (any token is accepted), PATCH, DELETE over HTTP, continue tokens (lists come in one chunk).
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trio

from evergreen_trio._http import DropConnection, HttpRequest, HttpResponse, serve_http

log = logging.getLogger(__name__)
Obj = dict[str, Any]


@dataclass
class _Event:
    version: int
    collection: str
    kind: str
    obj: Obj


@dataclass
class _Collection:
    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)  # (namespace, name) -> object


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _matches_labels(obj: Obj, selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


def _matches_fields(obj: Obj, selector: str) -> bool:
    metadata = obj.get("metadata", {})
    for term in filter(None, selector.split(",")):
        key, value = term.replace("==", "=").split("=", 1)
        if metadata.get(key.removeprefix("metadata.")) != value:
            return False
    return True


_REVIEWS = ("/apis/authentication.k8s.io/v1/tokenreviews", "/apis/authorization.k8s.io/v1/subjectaccessreviews")
TOKEN_REVIEWS, ACCESS_REVIEWS = "tokenreviews", "subjectaccessreviews"


@dataclass(frozen=True)
class ReviewFault:
    """How the stand-in answers one kind of review instead of reviewing it: after ``delay_s``,
    ``status`` with ``body`` (``content_type`` None sends no Content-Type), or, with ``body``
    None, the proper review that late; ``drop`` closes the connection without a byte of answer;
    ``dribble_s`` sends the body a byte at a time (chunked), this far apart."""

    status: int = 201
    body: bytes | None = None
    content_type: str | None = "application/json"
    delay_s: float = 0.0
    drop: bool = False
    dribble_s: float | None = None


async def dribble(body: bytes, interval_s: float) -> AsyncIterator[bytes]:
    """``body`` a byte at a time, ``interval_s`` apart: a peer each read of which is on time."""
    for i in range(len(body)):
        yield body[i:i + 1]
        await trio.sleep(interval_s)


def api_status(code: int, reason: str, message: str) -> bytes:
    """A ``Status`` body as the API server sends with an error (a 403 ``Forbidden``, a 500)."""
    return json.dumps(_status(code, reason, message)).encode()


def _parse_path(path: str) -> tuple[str, str, str | None] | None:
    """``(collection, namespace, name)``; collection is ``api/v1/pods`` or ``apis/G/V/plural``."""
    parts = path.strip("/").split("/")
    if parts[:2] == ["api", "v1"]:
        prefix, rest = "api/v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        prefix, rest = "/".join(parts[:3]), parts[3:]
    else:
        return None
    if len(rest) not in (3, 4) or rest[0] != "namespaces":
        return None
    return f"{prefix}/{rest[2]}", rest[1], rest[3] if len(rest) == 4 else None


class KubeApiServer:
    """The stand-in server; run :meth:`serve` in a nursery (``started`` gets the port)."""

    def __init__(self, *, history: int = 10_000, bookmark_interval_s: float | None = None) -> None:
        self.collections: dict[str, _Collection] = {}
        self.events: list[_Event] = []
        self.version = 1
        self.oldest = 1  # watches from below this get 410 Gone
        self.history = history
        self.bookmark_interval_s = bookmark_interval_s
        self.requests: list[str] = []  # "METHOD target", for assertions
        self.users: dict[str, Obj] = {}  # bearer token -> TokenReview's status.user
        self.grants: set[tuple[str, str, str]] = set()  # (username, verb, non-resource path) allowed
        self.review_faults: dict[str, ReviewFault] = {}  # TOKEN_REVIEWS or ACCESS_REVIEWS -> fault
        self.port = 0
        self._changed = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None

    # -- the cluster, as tests change it --------------------------------------------------------

    def _bump(self, collection: str, kind: str, obj: Obj) -> Obj:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.events.append(_Event(self.version, collection, kind, copy.deepcopy(obj)))
        if len(self.events) > self.history:
            dropped = self.events[: len(self.events) - self.history]
            del self.events[: len(dropped)]
            self.oldest = dropped[-1].version + 1
        self._changed.set()
        self._changed = trio.Event()
        return obj

    def put(self, collection: str, obj: Obj) -> Obj:
        """Create or replace ``obj`` (ADDED or MODIFIED to watchers); returns it as stored."""
        metadata = obj.setdefault("metadata", {})
        key = (metadata.get("namespace", "default"), metadata["name"])
        metadata.setdefault("namespace", key[0])
        store = self.collections.setdefault(collection, _Collection()).objects
        kind = "MODIFIED" if key in store else "ADDED"
        if kind == "ADDED":
            metadata.setdefault("uid", str(uuid.uuid4()))
            metadata.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        store[key] = self._bump(collection, kind, obj)
        return store[key]

    def delete(self, collection: str, namespace: str, name: str) -> None:
        obj = self.collections.setdefault(collection, _Collection()).objects.pop((namespace, name))
        self._bump(collection, "DELETED", obj)

    def get(self, collection: str, namespace: str, name: str) -> Obj | None:
        return self.collections.get(collection, _Collection()).objects.get((namespace, name))

    def compact(self) -> None:
        """Forget all history: every watch from an older version now gets 410 Gone."""
        self.events.clear()
        self.oldest = self.version + 1

    # -- serving ----------------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; :meth:`stop` / :meth:`start` restart it on the same port."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.start()
            task_status.started(self.port)
            await trio.sleep_forever()  # keeps the nursery open across stop() / start()

    async def start(self) -> None:
        assert self._nursery is not None
        self._scope = trio.CancelScope()
        self.port = await self._nursery.start(self._listen, self._scope)

    def stop(self) -> None:
        """Close the listener and every connection (watches end mid-stream), keeping the state."""
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None

    async def _listen(self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[int]) -> None:
        with scope:
            await serve_http(self._handle, "127.0.0.1", self.port, task_status=task_status)

    async def _handle(self, request: HttpRequest) -> HttpResponse:
        self.requests.append(f"{request.method} {request.target}")
        url = urlsplit(request.target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if request.method == "POST" and url.path.rstrip("/") in _REVIEWS:
            path = url.path.rstrip("/")
            fault = self.review_faults.get(path.rsplit("/", 1)[1])
            if fault is None:
                return self._review(path, request.body)
            if fault.drop:  # the server's connection task ends and closes it, answering nothing
                raise DropConnection
            await trio.sleep(fault.delay_s)
            if fault.body is None:
                response = self._review(path, request.body)
                if fault.dribble_s is None:
                    return response
                body, status = response.body, response.status
            else:
                body, status = fault.body, fault.status
            headers = [("content-type", fault.content_type)] if fault.content_type is not None else []
            if fault.dribble_s is not None:
                return HttpResponse(status, headers, stream=dribble(body, fault.dribble_s))
            return HttpResponse(status, headers, body)
        parsed = _parse_path(url.path)
        if parsed is None:
            return self._json(404, _status(404, "NotFound", f"the server could not find {url.path}"))
        collection, namespace, name = parsed
        if request.method == "GET" and name is None and query.get("watch") in ("true", "1"):
            return self._watch(collection, namespace, query)
        if request.method == "GET" and name is None:
            return self._list(collection, namespace, query)
        if request.method == "GET" and name is not None:
            obj = self.get(collection, namespace, name)
            if obj is None:
                return self._json(404, _status(404, "NotFound", f"{collection} {name!r} not found"))
            return self._json(200, obj)
        if request.method in ("POST", "PUT"):
            return self._write(request, collection, namespace, name)
        return self._json(405, _status(405, "MethodNotAllowed", f"{request.method} is not supported here"))

    def _review(self, path: str, body: bytes) -> HttpResponse:
        try:
            review = json.loads(body)
            spec = review["spec"]
        except (ValueError, KeyError, TypeError):
            return self._json(400, _status(400, "BadRequest", "expected a review with a spec"))
        if path == _REVIEWS[0]:
            user = self.users.get(spec.get("token", ""))
            review["status"] = {"authenticated": True, "user": user} if user else {"authenticated": False}
        else:
            attributes = spec.get("nonResourceAttributes") or {}
            grant = (spec.get("user", ""), attributes.get("verb", ""), attributes.get("path", ""))
            review["status"] = {"allowed": grant in self.grants}
        return self._json(201, review)

    def _json(self, status: int, body: Mapping[str, Any]) -> HttpResponse:
        return HttpResponse(status, [("content-type", "application/json")], json.dumps(body).encode())

    def _selected(self, collection: str, namespace: str, query: Mapping[str, str], obj: Obj) -> bool:
        return (obj.get("metadata", {}).get("namespace") == namespace
                and _matches_labels(obj, query.get("labelSelector", ""))
                and _matches_fields(obj, query.get("fieldSelector", "")))

    def _list(self, collection: str, namespace: str, query: Mapping[str, str]) -> HttpResponse:
        objects = self.collections.get(collection, _Collection()).objects.values()
        items = [o for o in objects if self._selected(collection, namespace, query, o)]
        kind = (items[0].get("kind", "Object") if items else "Object") + "List"
        return self._json(200, {"kind": kind, "apiVersion": collection.rsplit("/", 1)[0].split("/", 1)[-1],
                                "metadata": {"resourceVersion": str(self.version)}, "items": items})

    def _write(self, request: HttpRequest, collection: str, namespace: str, name: str | None) -> HttpResponse:
        try:
            obj = json.loads(request.body)
            obj_name = obj["metadata"]["name"]
        except (ValueError, KeyError, TypeError):
            return self._json(400, _status(400, "BadRequest", "expected a JSON object with metadata.name"))
        obj["metadata"]["namespace"] = namespace
        existing = self.get(collection, namespace, obj_name)
        if request.method == "POST":
            if existing is not None:
                return self._json(409, _status(409, "AlreadyExists", f"{obj_name!r} already exists"))
            return self._json(201, self.put(collection, obj))
        if name != obj_name or existing is None:
            return self._json(404, _status(404, "NotFound", f"{name!r} not found"))
        sent = obj["metadata"].get("resourceVersion")
        if sent and sent != existing["metadata"]["resourceVersion"]:
            message = "the object has been modified; please apply your changes to the latest version"
            return self._json(409, _status(409, "Conflict", message))
        return self._json(200, self.put(collection, obj))

    def _watch(self, collection: str, namespace: str, query: Mapping[str, str]) -> HttpResponse:
        version_text = query.get("resourceVersion") or ""
        start = int(version_text) if version_text.isdigit() else None
        timeout_s = float(query["timeoutSeconds"]) if query.get("timeoutSeconds", "").isdigit() else 1800.0
        bookmarks = self.bookmark_interval_s or (1.0 if query.get("allowWatchBookmarks") == "true" else None)
        return HttpResponse(200, [("content-type", "application/json"), ("connection", "close")],
                            stream=self._events(collection, namespace, query, start, timeout_s, bookmarks))

    async def _events(self, collection: str, namespace: str, query: Mapping[str, str], start: int | None,
                      timeout_s: float, bookmarks: float | None) -> AsyncIterator[bytes]:
        def line(kind: str, obj: Obj) -> bytes:
            return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

        if start is not None and start != 0 and start + 1 < self.oldest:
            yield line("ERROR", _status(410, "Expired", f"too old resource version: {start} ({self.oldest - 1})"))
            return
        sent = self.version
        if start is None or start == 0:  # no version: the current state as ADDED events first
            for obj in list(self.collections.get(collection, _Collection()).objects.values()):
                if self._selected(collection, namespace, query, obj):
                    yield line("ADDED", obj)
        else:
            sent = start
        with trio.move_on_after(timeout_s):
            while True:
                # Taken before yielding: events added while a line is being sent set this event,
                # so the wait below returns at once and the next round sends them.
                changed, top = self._changed, self.version
                for event in [e for e in self.events if sent < e.version <= top]:
                    if event.collection == collection and self._selected(collection, namespace, query, event.obj):
                        yield line(event.kind, event.obj)
                sent = top
                with trio.move_on_after(bookmarks if bookmarks is not None else float("inf")) as waited:
                    await changed.wait()
                if waited.cancelled_caught:  # as the real server: the collection's kind, only a version
                    stored = self.collections.get(collection, _Collection()).objects.values()
                    kind = next((o.get("kind") for o in stored), None) or "Object"
                    api_version = collection.rsplit("/", 1)[0].split("/", 1)[-1]
                    yield line("BOOKMARK", {"apiVersion": api_version, "kind": kind,
                                            "metadata": {"resourceVersion": str(sent)}})


def kubeconfig_text(port: int, namespace: str = "default") -> str:
    """A kubeconfig pointing at the stand-in server on 127.0.0.1:``port`` (plain HTTP, any token)."""
    return f"""apiVersion: v1
kind: Config
clusters:
- name: stand-in
  cluster:
    server: http://127.0.0.1:{port}
users:
- name: tester
  user:
    token: stand-in-token
contexts:
- name: stand-in
  context:
    cluster: stand-in
    user: tester
    namespace: {namespace}
current-context: stand-in
"""
