"""Built-in actions: ECHO (makes flattening observable over the wire) and GENERATE.

GENERATE is a deterministic toy generator unless a handler is given, e.g. an OpenAI-compatible
backend's (``evergreen_trio.generate.open_backend``: a model server, or the gateway in front of a pool).

``Action.configs`` each action reads: ECHO none (any config is refused, INVALID_ARGUMENT); GENERATE
the keys of `evergreen_trio.generate.params` (``max_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``), all validated; the toy generator uses ``max_tokens`` (its word-sized pieces), the OpenAI
backend sends them all.
"""

from __future__ import annotations

import hashlib
import re

import trio

from evergreen_trio.dag import ProtocolViolationError
from evergreen_trio.generate.params import parse_configs
from evergreen_trio.nursery_session import ActionContext, Handler, describe
from evergreen_trio.serving.server import Server


async def echo(ctx: ActionContext) -> None:
    """Output ``output``: an inner node whose children are leaves carrying the flattened input's
    chunks in order, each with the same metadata and bytes, streamed as they arrive. Takes no configs."""
    if ctx.action.configs:
        got = ctx.action.configs[0].type_url
        raise ProtocolViolationError(f"{describe(ctx.action)}: ECHO takes no configs, got {got!r}")
    output = ctx.output("output")
    async for chunk in ctx.input("input"):
        # Final fragments as soon as they are known (the input's last chunk, its final bytes), so a
        # one-chunk ECHO sends two fragments, not two more empty ones to close its nodes.
        leaf = await output.child(last=chunk.last)
        wrote = False
        async for piece in chunk:
            await leaf.write(piece, metadata=chunk.metadata if not wrote else None, last=chunk.ended)
            wrote = True
        if not wrote:
            await leaf.write(b"", metadata=chunk.metadata, last=True)
        await leaf.close()


TOPIC_CHARS = 256
"""The toy's answer quotes at most this many of the prompt's last characters (a prompt may be one long word)."""


def toy_answer(prompt: str) -> list[str]:
    """A deterministic answer that quotes the prompt's last words, split into word-sized pieces."""
    return _toy_answer(last_words(prompt), hashlib.sha256(prompt.encode()).hexdigest())


def _toy_answer(tail: str, digest: str) -> list[str]:
    topic = " ".join(tail.split()[-8:])[-TOPIC_CHARS:]
    answer = (f"You asked: {topic or 'nothing'!r}. This toy model answers in streamed fragments "
              f"(prompt digest {digest[:8]}).")
    return re.findall(r"\S+\s*", answer)


def last_words(text: str, count: int = 9) -> str:
    """``text``'s last ``count`` words, space-separated, at most ``TOPIC_CHARS`` of the last one, and a
    trailing space if ``text`` ends in one: ``_toy_answer`` of ``last_words(last_words(a) + b)`` is
    that of ``last_words(a + b)``, so a prompt read chunk by chunk keeps only this much."""
    # Each word's last TOPIC_CHARS decide the topic's last TOPIC_CHARS, however the prompt is cut.
    words = text.rsplit(None, count)[-count:]
    return " ".join(word[-TOPIC_CHARS:] for word in words) + (" " if text[-1:].isspace() else "")


async def generate(ctx: ActionContext) -> None:
    """Input ``prompt`` (or ``text``), output ``response`` (or ``text``): streamed in several fragments,
    at most ``max_tokens`` of them when the configs say so.

    The prompt's text (its ``text/*`` chunks) is never held whole: only its digest and last words,
    so memory follows the largest chunk, not the flattened input (a shared chunk repeated 128 times).
    """
    params = parse_configs(ctx.action.configs, where=describe(ctx.action))
    digest, tail = hashlib.sha256(), ""
    async for chunk in ctx.input("prompt", "text"):
        data = await chunk.read()
        if chunk.mimetype.startswith("text/"):
            text = data.decode("utf-8", errors="replace")
            digest.update(text.encode())
            tail = last_words(tail + text)
    response = ctx.output("response", "text")
    pieces = _toy_answer(tail, digest.hexdigest())[: params.max_tokens]
    for index, piece in enumerate(pieces):
        await response.write(piece, last=index == len(pieces) - 1)
        await trio.lowlevel.checkpoint()


def register_builtin_actions(server: Server, *, generate_handler: Handler = generate) -> None:
    """ECHO, and GENERATE served by ``generate_handler`` (the toy generator by default)."""
    server.add_action("ECHO", echo, inputs=["input"], outputs=["output"])
    server.add_action("GENERATE", generate_handler, inputs=["prompt", "text"], outputs=["response", "text"])
