"""`make demo`: the whole stack on one machine, then the spec's two-turn example through it.

Starts three simulated model servers, the picker and a real Envoy (``run_gateway``), and an
Evergreen server whose GENERATE is backed by the gateway (``evergreen_trio.generate``) with a
``file://`` resolver confined to a temporary folder. Turn one sends a question plus a video
streamed as two referenced parts (the video is not text, so only the question goes upstream);
turn two's prompt reuses ``prompt_1`` and ``response_1`` by id without sending them again. Each
answer is printed as it streams, with the model server that served it (the ``x-served-by``
header, carried in the output's metadata). Then everything stops, Envoy included.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import trio

from evergreen_trio import FileResolver, NodeRef, Output, Server, connect, inner, ref, text
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.generate import BackendSettings, open_backend, served_by
from evergreen_trio.picker import EnvoyError, find_envoy
from evergreen_trio.serving.signals import run_until_signal
from evergreen_trio.sim import SimConfig
from evergreen_trio.stack.gateway import GatewayInfo, GatewaySettings, run_gateway

MODEL = "sim-model"
SIMULATED_SERVERS = 3
MAX_TOKENS = 24
DEMO_SIM = SimConfig(model=MODEL, decode_ms_per_token=20.0)
"""20 ms a token: slow enough to watch the answer stream, 24 tokens in about half a second."""


async def stream_answer(label: str, output: Output, names: dict[str, str]) -> None:
    """Print the output as it streams, after the model server its first chunk's metadata names."""
    async for chunk in output:
        address = served_by(chunk.metadata)
        server = f"{names.get(address, '?')} at {address}" if address else "an unnamed server"
        print(f"{label} (served by {server}):", end="", flush=True)
        async for piece in chunk:
            print(piece.decode(), end="", flush=True)
    print()


async def two_turns(port: int, root: Path, names: dict[str, str]) -> None:
    """The spec's example: turn two reuses turn one's prompt and answer by id."""
    async with connect(f"127.0.0.1:{port}") as session:
        video = ref([f"file://{root}/part1", f"file://{root}/part2"], mimetype="video/mp4", id="video_1")
        prompt_1 = inner(text("Write a summary of this video: ", id="question_1"), video, id="prompt_1")
        print("client: GENERATE prompt_1 = [question_1, video_1 (2 streamed parts)] -> response_1")
        turn_1 = await session.run("GENERATE", {"prompt": prompt_1}, {"response": "response_1"})
        await stream_answer("response_1", turn_1["response"], names)
        prompt_2 = inner(NodeRef("prompt_1"), NodeRef("response_1"), text("Who's winning?", id="question_2"))
        print("client: GENERATE prompt_2 = [prompt_1, response_1 (reused by id), question_2] -> response_2")
        turn_2 = await session.run("GENERATE", {"prompt": prompt_2}, {"response": "response_2"})
        await stream_answer("response_2", turn_2["response"], names)


async def run_demo(root: Path) -> None:
    (root / "part1").write_bytes(b"\x00\x00\x00\x18ftypmp42 (first half of a tiny video)")
    (root / "part2").write_bytes(b"(second half of a tiny video)")
    async with trio.open_nursery() as stack:
        print(f"gateway: starting {SIMULATED_SERVERS} simulated model servers, the picker and Envoy ...", flush=True)
        gateway = GatewaySettings(simulate=SIMULATED_SERVERS, listen="127.0.0.1:0", sim=DEMO_SIM)
        info: GatewayInfo = await stack.start(run_gateway, gateway)
        names = {address: f"sim-{index + 1}" for index, address in enumerate(info.endpoints)}
        print(f"gateway: Envoy on {info.url}, routed by the picker (ext_proc on :{info.picker.grpc}) to")
        for address, name in names.items():
            print(f"  {name}  http://{address}  (model {MODEL})")
        backend = BackendSettings(info.url, MODEL, max_tokens=MAX_TOKENS)
        server = Server(resolvers=[FileResolver([root])])
        async with open_backend(backend) as generate, trio.open_nursery() as serving:
            register_builtin_actions(server, generate_handler=generate.generate)
            port = await serving.start(server.serve, "127.0.0.1", 0)
            print(f"server: evergreen.v2 on 127.0.0.1:{port}, GENERATE -> {backend.endpoint} (model {MODEL})")
            await two_turns(port, root, names)
            serving.cancel_scope.cancel()
        stack.cancel_scope.cancel()
    print("demo: session closed; Evergreen server, Envoy, picker and simulated servers stopped")


async def interruptible_demo(root: Path) -> int:
    """``run_demo``, stopped cleanly (Envoy included) by Ctrl-C or SIGTERM: exit status 130 then."""
    if await run_until_signal(run_demo, root):
        return 0
    print("\ndemo: interrupted; everything stopped")
    return 130


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s", stream=sys.stderr)
    try:
        find_envoy()
    except EnvoyError as error:
        print(f"demo: {error}; `make demo` installs it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="evergreen-demo-") as root:
        return trio.run(interruptible_demo, Path(root))


if __name__ == "__main__":
    sys.exit(main())
