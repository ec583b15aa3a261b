"""A client of ``agent_server.py`` that offers the ``SEARCH`` tool the agent calls back.

    python examples/agent_tool_client.py 127.0.0.1:50051 "What is Trio?"
"""

from __future__ import annotations

import sys

import trio

from evergreen_trio import ActionContext, connect, text

ENCYCLOPEDIA = {
    "trio": "Trio is a Python library for structured concurrency. It has nurseries and cancel scopes.",
    "evergreen": "Evergreen is a session protocol for generative AI. Nodes and actions flow both ways.",
}


async def ask(address: str, question: str) -> str:
    """Ask AGENT ``question``, serving its SEARCH calls from a tiny encyclopedia."""
    async with connect(address, timeout=30) as session:

        @session.action("SEARCH", inputs=["query"], outputs=["results"])
        async def search(ctx: ActionContext) -> None:
            query = (await ctx.input("query").read_text()).lower()
            hits = [entry for key, entry in ENCYCLOPEDIA.items() if key in query]
            await ctx.output("results").write(" ".join(hits) or "Nothing found.", last=True)

        call = await session.run("AGENT", {"question": text(question)}, ["answer"])
        return await call["answer"].read_text()


if __name__ == "__main__":
    print(trio.run(ask, sys.argv[1], sys.argv[2]))
