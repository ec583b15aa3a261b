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

import trio

from evergreen_trio._http import HttpPostError, post_once
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
    try:
        return await post_once(backend.host, backend.port, call.path, call.body, timeout_s=call.timeout_s,
                               max_body=MAX_RENDER_REPLY_BYTES)
    except HttpPostError as exc:
        raise RenderError(str(exc)) from None


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
