"""Cluster access: kubeconfig resolution and the lightkube client, on Trio.

Why lightkube: it is maintained, typed, and async through ``httpx2``, whose transport runs on
``anyio`` and therefore directly under ``trio.run`` (no asyncio loop, no bridge). Two of its
conveniences are not used because they are asyncio-only: the watch's built-in retry sleeps with
``asyncio.sleep``, so every watch here runs with ``on_error_raise`` and this package retries with
``trio.sleep``.

lightkube reads a list's body whole and splits a watch into lines with no bound, so the client
bounds both: a watch line (one event) is at most :data:`MAX_EVENT_BYTES`, any other body at most
:data:`MAX_BODY_BYTES`, bodies come uncompressed (a compressed one could inflate past any bound), and
a response over a bound fails as ``httpx2.DecodingError``, which the callers' retry loops count.
A watch of one collection starts at most once a :data:`WATCH_SPACING_S`: lightkube resumes a
watch the server ends straight away, and the retry loops re-list after a 410 Gone at once.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2
import msgspec
import trio
from lightkube import AsyncClient, ConfigError, KubeConfig

from evergreen_trio.picker.errors import PickerError

REQUEST_TIMEOUT_S = 10.0
MAX_EVENT_BYTES = 8 << 20  # an object is at most 1.5 MiB in etcd; its watch event, quoted, well under this
MAX_BODY_BYTES = 256 << 20  # a list (in one body) of a pool's pods or of a notification source's objects
WATCH_SPACING_S = 1.0  # a server ending each watch at once, or answering it 410, was asked 300-600 times a second
# What one request to the API server raises when it is away or answers garbage: network and HTTP
# status errors, an undecodable body (lightkube raises KeyError for an error status without a
# Content-Type, RecursionError for deeply nested JSON), a service-account token file missing for
# a moment during rotation.
ANSWER_ERRORS = (httpx2.HTTPError, msgspec.MsgspecError, ValueError, TypeError, KeyError, RecursionError,
                 ConfigError)
LOGGED_ERROR_CHARS = 300  # of one such error in a log line, escaped (the server's message: any size, any newline)


class KubeError(PickerError):
    """No usable cluster access: a kubeconfig that does not load, or no in-cluster account."""


@dataclass(frozen=True)
class ClusterAccess:
    """A loaded kubeconfig (or in-cluster service account) and its default namespace."""

    config: KubeConfig
    namespace: str

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> ClusterAccess:
        """``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster service account; KubeError if none."""
        path = kubeconfig or os.environ.get("KUBECONFIG")
        try:
            config = KubeConfig.from_file(path) if path else KubeConfig.from_service_account()
            context = config.get()
            if context is None:
                raise ConfigError("no current context")
            namespace = context.namespace or "default"
        except (ConfigError, OSError, ValueError, KeyError) as exc:
            where = path or "the in-cluster service account"
            raise KubeError(f"expected cluster access from {where}, got {type(exc).__name__}: {exc}") from None
        return cls(config, namespace)

    def client(self) -> AsyncClient:
        """A new client; requests time out after 10 s (watches have their own server-side timeout)."""
        client = AsyncClient(self.config, namespace=self.namespace, timeout=httpx2.Timeout(REQUEST_TIMEOUT_S))
        http = client._client._client  # lightkube's httpx2 client: no public way to bound its bodies
        http.headers["accept-encoding"] = "identity"
        http.event_hooks["request"].append(_WatchPacer())
        http.event_hooks["response"].append(_bound_body)
        return client


class _WatchPacer:
    """Holds back a watch request until :data:`WATCH_SPACING_S` after the last one of its
    collection and selectors (the same URL but for ``resourceVersion``)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}  # only those within the spacing: a few

    async def __call__(self, request: httpx2.Request) -> None:
        if request.url.params.get("watch") != "true":
            return
        key = str(request.url.copy_remove_param("resourceVersion"))
        last = self.started.get(key)
        if last is not None:
            await trio.sleep_until(last + WATCH_SPACING_S)
        now = trio.current_time()
        self.started = {k: t for k, t in self.started.items() if t > now - WATCH_SPACING_S}
        self.started[key] = now


async def _bound_body(response: httpx2.Response) -> None:
    """Refuse a compressed body we did not ask for, and bound the rest (called before it is read)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise httpx2.DecodingError(f"expected an uncompressed body, got Content-Encoding {encoding[:40]!r}",
                                   request=response.request)
    assert isinstance(response.stream, httpx2.AsyncByteStream)  # an AsyncClient's
    watch = response.request.url.params.get("watch") == "true"
    response.stream = _BoundedStream(response.stream, response.request, watch)


class _BoundedStream(httpx2.AsyncByteStream):
    """A body that fails past :data:`MAX_BODY_BYTES`, or, a watch's, past :data:`MAX_EVENT_BYTES`
    without a newline (one event a line)."""

    def __init__(self, inner: httpx2.AsyncByteStream, request: httpx2.Request, watch: bool) -> None:
        self.inner, self.request, self.watch = inner, request, watch

    async def __aiter__(self) -> AsyncIterator[bytes]:
        limit = MAX_EVENT_BYTES if self.watch else MAX_BODY_BYTES
        run = 0  # bytes since the start, or, in a watch, since the last newline
        carry = b""  # a watch chunk's end that may be the start of a character _escape_breaks replaces
        async for chunk in self.inner:
            if self.watch:
                chunk = carry + chunk
                cut = 2 if chunk.endswith(b"\xe2\x80") else 1 if chunk.endswith((b"\xc2", b"\xe2")) else 0
                chunk, carry = _escape_breaks(chunk[:len(chunk) - cut]), chunk[len(chunk) - cut:]
            newline = chunk.rfind(b"\n") if self.watch else -1
            run = len(chunk) - newline - 1 if newline >= 0 else run + len(chunk)
            if run > limit:
                what = "bytes in a watch event" if self.watch else "bytes of body"
                raise httpx2.DecodingError(f"expected at most {limit} {what}, got more", request=self.request)
            yield chunk
        if carry:
            yield carry

    async def aclose(self) -> None:
        await self.inner.aclose()


def _escape_breaks(data: bytes) -> bytes:
    """``data`` with U+0085, U+2028 and U+2029 as JSON escapes: Go's encoder leaves NEL raw in a
    string, and lightkube splits watch lines where ``str.splitlines`` does, at these too (a pod
    annotated with one failed the watch at each of its events)."""
    return data.replace(b"\xc2\x85", b"\\u0085").replace(b"\xe2\x80\xa8", b"\\u2028").replace(
        b"\xe2\x80\xa9", b"\\u2029")
