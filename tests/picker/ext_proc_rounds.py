"""One streamed request through a started picker's ext_proc, played as Envoy plays it over grpcio."""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from test_processor import Mode, request_body, request_headers, response_body, response_headers, set_headers

from evergreen_trio.picker.processor import DESTINATION

Respond = Callable[[str, Callable[[bytes], None]], None]
"""Given the destination and a sink for response body chunks, play the response's body."""


def streamed_round(port: int, path: str, body: bytes, respond: Respond,
                   extra: list[tuple[str, str]] | None = None) -> str | None:
    """The request (buffered) routed by the picker, then a streamed response's headers, the chunks
    ``respond`` gives, and its end, each through the picker. The destination, or None when the
    picker answered itself (before its first scrapes)."""
    later: queue.Queue[ep.ProcessingRequest | None] = queue.Queue()

    def messages() -> Iterator[ep.ProcessingRequest]:
        yield request_headers(path, request_mode=Mode.BUFFERED, response_mode=Mode.FULL_DUPLEX_STREAMED,
                              extra=[("content-type", "application/json"), *(extra or [])])
        yield request_body(body)
        while (message := later.get()) is not None:
            yield message

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                                     request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        replies = call(messages(), timeout=30)
        try:
            next(replies)  # the request headers' (buffered: nothing yet)
            decision = next(replies)
            if decision.HasField("immediate_response"):
                return None
            destination = str(set_headers(decision.request_body.response.header_mutation)[DESTINATION])
            later.put(response_headers("text/event-stream"))
            respond(destination, lambda chunk: later.put(response_body(chunk, end=False)))
            later.put(response_body(b"", end=True))
            list(replies)
        finally:
            later.put(None)
    return destination


def completion(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "stream": True}).encode()
