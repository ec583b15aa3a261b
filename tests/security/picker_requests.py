"""Issue 22, picker items 7-10: hostile request bodies and headers through the picker's ext_proc port.

Shared by ``tests/security/test_picker_requests.py`` and ``benchmarks/security_picker_requests.py``:
a fake model server (its ``/metrics`` says ready), an ext_proc call made with grpcio (the way
Envoy sends a buffered request: headers, then the whole body), and each attack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
REWRITE = "x-gateway-model-name-rewrite"
MiB = 1 << 20
LEGIT_BODY = json.dumps({"model": "sim-model", "prompt": "hello"}).encode()


async def serve_fake_engine(waiting: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A model server that only serves vLLM ``/metrics`` with ``waiting`` requests queued (the
    picker never calls it)."""
    text = render_metrics("vllm", EndpointMetrics(waiting=waiting)).encode()

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], text)

    await serve_http(handle, "127.0.0.1", 0, task_status=task_status)


def config_text(engine_port: int, models: str = "") -> str:
    return f"pool:\n  name: attack\n  endpoints: ['127.0.0.1:{engine_port}']\n{models}"


LISTED = """models:
  - name: sim-model
    targetModels: [{name: sim-lora, weight: 1}]
  - name: internal-only-adapter
"""


@dataclass(frozen=True)
class Answer:
    """What the picker answered one request: an HTTP status it gave itself, or routed (200)."""

    status: int
    body_model: str | None = None  # the model in the rewritten body, when it was rewritten
    message: str = ""
    endpoint: str | None = field(default=None, compare=False)  # where a routed request goes (envoy.lb)


Headers = Mapping[str, str] | Sequence[tuple[str, str | bytes]]
"""Request headers: a mapping, or pairs (a name may repeat; a value may be raw bytes)."""


def channel(port: int) -> grpc.Channel:
    """A grpcio channel to the ext_proc port that may send a 16 MiB body."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 32 * MiB)])


def headers_message(headers: Headers | None = None, path: str = "/v1/completions") -> ep.ProcessingRequest:
    """The request_headers message Envoy sends for a POST to ``path`` with ``headers`` (as raw values)."""
    extra = list(headers.items()) if isinstance(headers, Mapping) else list(headers or ())
    pairs = [(":path", path), (":method", "POST"), ("content-type", "application/json"), *extra]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode() if isinstance(v, str) else v) for k, v in pairs])))


def ext_proc(target: int | grpc.Channel, body: bytes, headers: Headers | None = None, *,
             path: str = "/v1/completions", timeout: float = 30.0) -> Answer:
    """One buffered request through the ext_proc port (a port: on its own connection) (blocking:
    run it in a thread)."""
    if isinstance(target, int):
        with channel(target) as own:
            return ext_proc(own, body, headers, path=path, timeout=timeout)
    first = headers_message(headers, path)
    second = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    call = target.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                response_deserializer=ep.ProcessingResponse.FromString)
    for reply in call(iter([first, second]), timeout=timeout):
        if reply.HasField("immediate_response"):
            immediate = reply.immediate_response
            return Answer(immediate.status.code, message=immediate.body.decode(errors="replace"))
        if reply.HasField("request_body"):
            mutation = reply.request_body.response.body_mutation
            model = json.loads(mutation.body)["model"] if mutation.body else None
            lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            return Answer(200, model, endpoint=lb["x-gateway-destination-endpoint"].string_value or None)
    raise AssertionError("the picker ended the stream without answering the body")


async def wait_routable(port: int) -> None:
    """Until the picker at ``port`` routes a legitimate request (its first scrape marked an endpoint
    ready; it answers 503 before)."""
    with trio.fail_after(10):
        while (await trio.to_thread.run_sync(ext_proc, port, LEGIT_BODY)).status == 503:  # noqa: ASYNC110
            await trio.sleep(0.05)


def deep_objects_body(size: int = 16 * MiB - 1024) -> bytes:
    """Item 9: a body of ``{},{},...`` (the issue's 16 MiB: about 5.6 million objects)."""
    head, tail = b'{"model":"sim-model","prompt":[', b"]}"
    count = (size - len(head) - len(tail)) // 3
    return head + b",".join([b"{}"] * count) + tail


def many_prompts_body(count: int = 250_000) -> bytes:
    """A completions body of ``count`` 2-byte prompts (250,000: 1.5 MB, near the JSON item cap)."""
    return json.dumps({"model": "sim-model", "prompt": ["ab"] * count}).encode()


def surrogate_body() -> bytes:
    """Item 10: a lone surrogate escaped in the prompt."""
    return b'{"model":"sim-model","prompt":"a\\ud800b"}'


def model_names(count: int, chars: int = 200) -> list[str]:
    """Item 7: unique, long model names."""
    return [f"{i:08d}".ljust(chars, "m") for i in range(count)]
