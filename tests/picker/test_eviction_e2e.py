"""In-flight eviction over a real socket: a started picker, grpcio playing Envoy on one HTTP/2
connection, a high-priority request blocked by saturation making the picker evict a sheddable
running one (429 ``evicted`` on its stream), and the picker serving on; bad config through the
``evergreen-trio picker`` command."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from functools import partial

import grpc
import pytest
import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from picker_cli import run_cli
from picker_fakes import FakeModelServer, free_port, wait_serving
from test_envoy_e2e import picker_metrics
from test_flow_control import dropped
from test_processor import request_body, request_headers, response_body, response_headers

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.runtime import PROCESS_PATH, PickerPorts, run_picker

EPP = """
objectives: [{name: urgent, priority: 5}, {name: bulk, priority: -1}]
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 2}}
flowControl:
  saturationDetector: {pluginRef: concurrency-detector}
  enableEviction: true
"""
BODY = b'{"model": "plain", "prompt": "hi"}'


class EnvoyStream:
    """One ext_proc stream on a shared grpcio channel, run in a thread: messages go in with
    :meth:`send` (``None`` half-closes), replies are collected as they come."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.requests: queue.Queue[ep.ProcessingRequest | None] = queue.Queue()
        self.replies: list[ep.ProcessingResponse] = []
        self.code: grpc.StatusCode | None = None
        self.done = threading.Event()
        self._changed = threading.Condition()
        self._call = channel.stream_stream(PROCESS_PATH, request_serializer=ep.ProcessingRequest.SerializeToString,
                                           response_deserializer=ep.ProcessingResponse.FromString)

    def _outgoing(self) -> Iterator[ep.ProcessingRequest]:
        yield from iter(self.requests.get, None)

    def run(self) -> None:
        call = self._call(self._outgoing(), timeout=30)
        try:
            for reply in call:
                with self._changed:
                    self.replies.append(reply)
                    self._changed.notify_all()
            self.code = call.code()
        except grpc.RpcError as exc:
            self.code = exc.code()
        finally:
            self.requests.put(None)  # the request thread reads no more
            with self._changed:
                self.done.set()
                self._changed.notify_all()

    def send(self, *messages: ep.ProcessingRequest | None) -> None:
        for message in messages:
            self.requests.put(message)

    async def wait_replies(self, count: int) -> None:
        def wait() -> bool:
            with self._changed:
                return self._changed.wait_for(lambda: len(self.replies) >= count or self.done.is_set(), 10)

        await trio.to_thread.run_sync(wait)
        assert len(self.replies) >= count, self.replies

    async def wait_done(self) -> None:
        assert await trio.to_thread.run_sync(self.done.wait, 10)


async def test_a_blocked_urgent_request_evicts_a_sheddable_in_flight_one_over_grpc(nursery: trio.Nursery) -> None:
    engine = FakeModelServer(free_port())
    await nursery.start(engine.serve)
    config = parse_config(f"pool: {{name: evict, endpoints: ['{engine.address}']}}\n{EPP}")
    bound: PickerPorts = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0))
    await wait_serving(bound.health)
    with grpc.insecure_channel(f"127.0.0.1:{bound.grpc}") as channel:

        async def stream(objective: str | None = None) -> EnvoyStream:
            extra = (("x-llm-d-inference-objective", objective),) if objective else ()
            envoy = EnvoyStream(channel)
            nursery.start_soon(partial(trio.to_thread.run_sync, envoy.run, abandon_on_cancel=True))
            envoy.send(request_headers(extra=extra), request_body(BODY))
            return envoy

        plain = await stream()
        await plain.wait_replies(2)  # routed: the header decision and the body
        bulk = await stream("bulk")
        await bulk.wait_replies(2)  # the pool is full now (2 of 2)
        urgent = await stream("urgent")
        await bulk.wait_done()
        assert bulk.code == grpc.StatusCode.OK and dropped(bulk.replies[2:]) == (429, "evicted")
        await urgent.wait_replies(2)  # the bulk request's slot went to it
        assert urgent.replies[0].HasField("request_headers") and not plain.done.is_set()
        for envoy in (plain, urgent):  # the others run to their ends
            envoy.send(response_headers(), response_body(b"{}", end=True))
            await envoy.wait_done()
            assert envoy.code == grpc.StatusCode.OK and not envoy.replies[-1].HasField("immediate_response")
        later = await stream("bulk")  # the picker keeps serving
        await later.wait_replies(2)
        later.send(None)
        await later.wait_done()
        assert later.code == grpc.StatusCode.OK
    samples = await picker_metrics(bound)
    assert samples[("llm_d_epp_flow_control_revocations_issued_total",
                    (("inference_pool", "evict"), ("priority", "5")))] == 1
    assert samples[("llm_d_epp_flow_control_revocations_total",
                    (("inference_pool", "evict"), ("outcome", "confirmed")))] == 1


HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\n"


@pytest.mark.parametrize(("text", "message"), [
    (HEAD + "flowControl: {enableEviction: sometimes}\n",
     "flowControl.enableEviction: expected true or false, got 'sometimes'"),
    (HEAD + "flowControl: {enableEviction: 1}\n", "flowControl.enableEviction: expected true or false, got 1"),
    (HEAD + "plugins: [{type: sheddable-eviction-filter, parameters: {threshold: 0}}]\n",
     "plugins[0].parameters.threshold: expected a sheddable-eviction-filter parameter (none)"),
    (HEAD + "plugins: [{type: priority-then-time-eviction-order-policy}]\n",
     "(type 'priority-then-time-eviction-order-policy') has Alpha stability level"),
])
def test_bad_eviction_config_is_one_line_and_exit_2(text: str, message: str) -> None:
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert message in line, line
