"""An agent server: custom actions, one action calling another in-process (``ctx.call``), and a
tool call to the client (``ctx.session.run``).

Actions:

- ``AGENT`` (input ``question``, output ``answer``): asks the client to run its ``SEARCH`` tool
  on the question, has ``SUMMARIZE`` condense what came back (in-process), and streams the answer.
- ``SUMMARIZE`` (input ``text``, output ``summary``): the first sentence of the text, one word
  at a time.

Run it with the operator's options (TLS, tokens, metrics, workers, drain)::

    cd examples && evergreen-trio serve --app agent_server:make_server --port 50051

or as a plain script (``python examples/agent_server.py --port 50051``), which serves until
SIGINT or SIGTERM and then drains. ``agent_tool_client.py`` is a client offering ``SEARCH``.
"""

from __future__ import annotations

import argparse
import re
from functools import partial

import trio

from evergreen_trio import ActionContext, NodeRef, Server
from evergreen_trio.serving.signals import run_until_signal


async def summarize(ctx: ActionContext) -> None:
    """The first sentence of ``text``, streamed word by word."""
    content = await ctx.input("text").read_text()
    sentence = re.split(r"(?<=[.!?])\s", content.strip(), maxsplit=1)[0]
    summary = ctx.output("summary")
    for word in re.findall(r"\S+\s*", sentence):
        await summary.write(word)
    await summary.close()


async def agent(ctx: ActionContext) -> None:
    """A tool call to the client, then an in-process call, then the answer."""
    question = NodeRef(ctx.input("question").node_id)  # already in the session: not sent again
    search = await ctx.session.run("SEARCH", {"query": question}, ["results"])
    found = await ctx.call("SUMMARIZE", {"text": search["results"]}, ["summary"])
    answer = ctx.output("answer")
    await answer.write("From what your tool found: ")
    async for chunk in found["summary"]:  # streamed on as SUMMARIZE writes it
        async for piece in chunk:
            await answer.write(piece)
    await answer.close()


def make_server() -> Server:
    """The agent's Server: what ``serve --app agent_server:make_server`` serves."""
    server = Server()
    server.add_action("AGENT", agent, inputs=["question"], outputs=["answer"])
    server.add_action("SUMMARIZE", summarize, inputs=["text"], outputs=["summary"])
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--drain-grace", type=float, default=30.0, help="seconds open sessions get on SIGTERM")
    args = parser.parse_args()
    server = make_server()

    def started(port: int) -> None:
        print(f"agent serving on {args.host}:{port}", flush=True)

    # What `serve` does: the first signal drains (new sessions refused, open ones finish), a second stops.
    trio.run(partial(run_until_signal, server.serve, args.host, args.port, started=started,
                     drain=partial(server.drain, args.drain_grace)))


if __name__ == "__main__":
    main()
