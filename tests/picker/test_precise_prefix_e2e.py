"""The precise prefix cache end to end: stand-in vLLMs publish real ZMQ KV events (a pyzmq PUB
socket, msgpack in vLLM's format), `evergreen-trio picker` runs as a subprocess with the
simulator's render endpoints as its token producer, and grpcio plays Envoy."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from test_token_producer import first_route, upstream_chat

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.processor import DESTINATION
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.render import render_chat
from evergreen_trio.sim.server import run_sim

zmq = pytest.importorskip("zmq", reason="needs pyzmq (extra picker): pip install 'evergreen-trio[picker]'")
msgpack = pytest.importorskip("msgpack", reason="needs msgpack (extra picker): pip install 'evergreen-trio[picker]'")

HOT, COLD = "127.0.0.2", "127.0.0.3"  # two loopback hosts: each engine's KV-event port is the same number
BLOCK = 16


def _loopback_aliases() -> bool:
    try:
        with socket.socket() as probe:
            probe.bind((HOT, 0))
        return True
    except OSError:
        return False


async def serve_engine(host: str, waiting: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
                       ) -> None:
    """A model server on ``host`` that serves vLLM ``/metrics`` with ``waiting`` requests queued."""
    text = render_metrics("vllm", EndpointMetrics(waiting=waiting)).encode()

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], text)

    await serve_http(handle, host, 0, task_status=task_status)


def block_stored(tokens: list[int], seq: int, pod: str, model: str) -> list[bytes]:
    """One vLLM KV-event message: BlockStored for ``tokens``' full blocks, engine hashes as bytes."""
    count = len(tokens) // BLOCK
    hashes = [(1000 + i).to_bytes(32, "big") for i in range(count)]
    event = ["BlockStored", hashes, None, tokens[: count * BLOCK], BLOCK, None, "GPU"]
    batch = [time.time(), [event], None]
    return [f"kv@{pod}@{model}".encode(), seq.to_bytes(8, "big"), msgpack.packb(batch, use_bin_type=True)]


@pytest.mark.skipif(not _loopback_aliases(), reason="needs 127.0.0.2 and 127.0.0.3 (Linux loopback)")
async def test_a_request_goes_where_the_published_kv_blocks_match_its_prefix(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    hot = f"{HOT}:{await nursery.start(serve_engine, HOT, 5)}"  # busier: the queue scorer prefers the cold one
    cold = f"{COLD}:{await nursery.start(serve_engine, COLD, 0)}"
    renderer = await nursery.start(run_sim, SimConfig(model="m"))
    context = zmq.Context()
    hot_pub, cold_pub = context.socket(zmq.PUB), context.socket(zmq.PUB)
    port = hot_pub.bind_to_random_port(f"tcp://{HOT}")
    cold_pub.bind(f"tcp://{COLD}:{port}")
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool:
  name: precise
  endpoints: ['{hot}', '{cold}']
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: token-producer, parameters: {{modelName: m, vllm: {{url: 'http://127.0.0.1:{renderer}'}}}}}}
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {{blockSize: 64}}
    kvEventsConfig: {{podDiscoveryConfig: {{socketPort: {port}}}}}
- {{type: prefix-cache-scorer, parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}}}
- {{type: queue-scorer}}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: prefix-cache-scorer, weight: 3}}, {{pluginRef: queue-scorer, weight: 1}}]
""")
    chat: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "tell me a story " * 80}]}
    tokens = json.loads(render_chat(json.dumps(chat).encode(), SimConfig(model="m")))["token_ids"]
    assert len(tokens) >= 4 * 64  # four blocks of the producer's size
    try:
        async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
            await wait_health("127.0.0.1", picker.health, "readiness")
            with trio.fail_after(10):
                first = await first_route(picker.grpc, json.dumps(chat).encode())
            assert first[DESTINATION] == cold  # nothing cached anywhere: the shorter queue wins
            routed = first
            with trio.fail_after(20):
                seq = 0
                while routed[DESTINATION] != hot:  # a SUB joins late: publish until the picker has it
                    hot_pub.send_multipart(block_stored(tokens, seq, hot, "m"))
                    seq += 1
                    await trio.sleep(0.1)
                    routed = await trio.to_thread.run_sync(upstream_chat, picker.grpc, chat)
            other = {"model": "m", "messages": [{"role": "user", "content": "something else entirely " * 30}]}
            assert (await trio.to_thread.run_sync(upstream_chat, picker.grpc, other))[DESTINATION] == cold
            cleared = [f"kv@{hot}@m".encode(), (10_000).to_bytes(8, "big"),
                       msgpack.packb([time.time(), [["AllBlocksCleared"]]])]
            with trio.fail_after(20):
                while routed[DESTINATION] != cold:  # the engine reset its cache: the match is gone
                    hot_pub.send_multipart(cleared)
                    await trio.sleep(0.1)
                    routed = await trio.to_thread.run_sync(upstream_chat, picker.grpc, chat)
    finally:
        hot_pub.close(0)
        cold_pub.close(0)
        context.term()
