"""A client script: stream an input in and the output out, reuse a node by id, and cancel a session.

    evergreen-trio serve --port 50051 &
    python examples/client_script.py 127.0.0.1:50051

It runs against any server offering ECHO and GENERATE (``evergreen-trio serve`` does). With
``--forever`` it then streams words through ECHO until Ctrl-C, which ends it with a plain
``KeyboardInterrupt``.
"""

from __future__ import annotations

import argparse
import itertools

import trio

from evergreen_trio import Client, NodeRef, SessionAbortedError


async def main(target: str, forever: bool) -> None:
    # One connection for every session below; each session is a gRPC stream on it.
    async with Client(target, timeout=60, retries=3) as client:
        async with client.session() as session:
            # Streaming input: a leaf named in the action first, written in pieces afterwards.
            prompt = session.open_leaf()
            echo = await session.run("ECHO", {"input": NodeRef(prompt.id)}, ["output"])
            for word in ("streamed ", "in ", "pieces"):
                await prompt.write(word)
            await prompt.close()
            # Streaming output: each chunk, and each piece of it, as it arrives.
            async for chunk in echo["output"]:
                async for piece in chunk:
                    print(f"echo piece: {piece.decode()!r}")
            # Reuse by id: ECHO's output is GENERATE's prompt, without sending it again.
            answer = await session.run("GENERATE", {"prompt": echo["output"].ref}, ["response"])
            print("generate:", await answer["response"].read_text())

        # Cancellation: a session given up after 0.5 s (its input never ends) is reset: the server
        # sees CANCELLED and keeps serving; the connection stays usable.
        with trio.move_on_after(0.5) as gave_up:
            async with client.session() as session:
                unfinished = session.open_leaf()
                call = await session.run("ECHO", {"input": NodeRef(unfinished.id)}, ["output"])
                await unfinished.write("never finished")
                await call["output"].read_text()
        print("cancelled:", gave_up.cancelled_caught)

        # A server abort is a plain SessionAbortedError naming its status.
        try:
            async with client.session() as session:
                call = await session.run("NO_SUCH_ACTION", {}, ["output"])
                await call["output"].read_bytes()
        except SessionAbortedError as error:
            print("aborted:", error.code.name)

        if forever:
            async with client.session() as session:
                words = session.open_leaf()
                echo = await session.run("ECHO", {"input": NodeRef(words.id)}, ["output"])
                async with trio.open_nursery() as nursery:

                    async def write_words() -> None:
                        for count in itertools.count():
                            await words.write(f"word{count} ")
                            await trio.sleep(0.02)

                    nursery.start_soon(write_words)
                    async for chunk in echo["output"]:
                        async for piece in chunk:
                            print("streaming:", piece.decode(), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="host:port of the server")
    parser.add_argument("--forever", action="store_true", help="then stream through ECHO until Ctrl-C")
    args = parser.parse_args()
    trio.run(main, args.target, args.forever)
