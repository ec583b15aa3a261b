"""`make demo`: the spec's two-turn example, end to end over gRPC on loopback.

Starts a server with the built-in actions and a ``file://`` resolver confined to a temporary
folder, sends turn one (a question plus a video streamed as two referenced parts), prints the
answer as it streams, then sends turn two, whose prompt reuses ``prompt_1`` and ``response_1``
by id without sending them again, and shuts everything down.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

from evergreen_trio import FileResolver, NodeRef, Output, Server, connect, inner, ref, text
from evergreen_trio.actions import register_builtin_actions


async def stream_answer(label: str, output: Output) -> None:
    print(f"{label}: ", end="", flush=True)
    async for chunk in output:
        async for piece in chunk:
            print(piece.decode(), end="", flush=True)
    print()


async def run_demo(root: Path) -> None:
    (root / "part1").write_bytes(b"\x00\x00\x00\x18ftypmp42 (first half of a tiny video)")
    (root / "part2").write_bytes(b"(second half of a tiny video)")
    server = Server(resolvers=[FileResolver([root])])
    register_builtin_actions(server)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        print(f"server: evergreen.v2 on 127.0.0.1:{port} (actions: {', '.join(sorted(server.actions))})")
        async with connect(f"127.0.0.1:{port}") as session:
            video = ref([f"file://{root}/part1", f"file://{root}/part2"], mimetype="video/mp4", id="video_1")
            prompt_1 = inner(text("Write a summary of this video: ", id="question_1"), video, id="prompt_1")
            print("client: GENERATE prompt_1 = [question_1, video_1 (2 streamed parts)] -> response_1")
            turn_1 = await session.run("GENERATE", {"prompt": prompt_1}, {"response": "response_1"})
            await stream_answer("response_1", turn_1["response"])
            prompt_2 = inner(NodeRef("prompt_1"), NodeRef("response_1"), text("Who's winning?", id="question_2"))
            print("client: GENERATE prompt_2 = [prompt_1, response_1 (reused by id), question_2] -> response_2")
            turn_2 = await session.run("GENERATE", {"prompt": prompt_2}, {"response": "response_2"})
            await stream_answer("response_2", turn_2["response"])
        nursery.cancel_scope.cancel()
    print("demo: session closed, server stopped")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="evergreen-demo-") as root:
        trio.run(run_demo, Path(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
