"""The Trio shell of the ``vllm`` token backend: POST a render to vLLM over plain HTTP/1.1.

One connection per render (h11 over a Trio TCP stream), closed after it: renders are rare next
to the picker's other work and a fresh connection needs no state kept. The whole exchange runs
under the render's timeout; the reply's body is read up to
:data:`~evergreen_trio.picker.vllm_render.MAX_RENDER_REPLY_BYTES`. Every failure is a
:class:`~evergreen_trio.picker.vllm_render.RenderError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import h11
import trio

from evergreen_trio._http import read_response
from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.processor import StartRender
from evergreen_trio.picker.token_estimate import TokenizedPrompt
from evergreen_trio.picker.vllm_render import (
    MAX_RENDER_REPLY_BYTES,
    RenderCall,
    RenderError,
    VllmRender,
    render_reply,
)

log = logging.getLogger(__name__)


async def post_render(backend: VllmRender, call: RenderCall) -> tuple[int, bytes]:
    """``(status, body)`` of the render ``call``; RenderError on a timeout, a refused or lost
    connection, a malformed reply, or one over the size limit."""
    authority = f"[{backend.host}]:{backend.port}" if ":" in backend.host else f"{backend.host}:{backend.port}"
    try:
        with trio.fail_after(call.timeout_s):
            stream = await trio.open_tcp_stream(backend.host, backend.port)
            async with stream:
                return await _exchange(stream, authority, call)
    except trio.TooSlowError:
        raise RenderError(f"post {call.path}: no reply within {call.timeout_s:g}s") from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        raise RenderError(f"post {call.path}: {type(exc).__name__}: {exc}") from None


async def _exchange(stream: trio.SocketStream, authority: str, call: RenderCall) -> tuple[int, bytes]:
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="POST", target=call.path, headers=[
        ("host", authority), ("content-type", "application/json"), ("content-length", str(len(call.body))),
        ("connection", "close")])
    await stream.send_all(conn.send(request) + conn.send(h11.Data(data=call.body)) + conn.send(h11.EndOfMessage()))
    return await read_response(conn, stream, MAX_RENDER_REPLY_BYTES)


async def render(backend: VllmRender, call: RenderCall, body: Mapping[str, Any]) -> TokenizedPrompt | None:
    """The tokens of the render ``call`` for a request of ``body`` (None when there are none);
    RenderError when the render fails."""
    status, data = await post_render(backend, call)
    return render_reply(call, status, data, body)


async def _render_then(backend: VllmRender, call: RenderCall, body: Mapping[str, Any],
                       done: Callable[[TokenizedPrompt | None], None]) -> None:
    try:
        tokens = await render(backend, call, body)
    except RenderError as exc:
        # As the reference's director: the producer's error is logged and the request goes on
        # without tokens (the deciders and scorers fall back to their own estimates).
        log.warning("picker.render_failed backend=vllm error=%s", peer_text(str(exc), 300))
        tokens = None
    done(tokens)


def render_starter(nursery: trio.Nursery, backend: VllmRender) -> StartRender:
    """What the picker calls to start a render: a task in ``nursery`` that calls back when done."""

    def start(call: RenderCall, body: Mapping[str, Any], done: Callable[[TokenizedPrompt | None], None]) -> None:
        nursery.start_soon(_render_then, backend, call, body, done)

    return start
