"""The benchmark's floor: a do-nothing ext_proc server on our own wire, no picker behind it.

It speaks the same message pattern Envoy needs in FULL_DUPLEX_STREAMED (request headers held,
then one header response that sets the destination and the body sent back unchanged, then the
OK trailers) with nothing decided: the destination alternates between the given endpoints, no
metrics, no scheduling, no parsing of the body. Served by the picker's own HTTP/2 connection and
Trio shell (:mod:`evergreen_trio._grpc.server`), so the row measures Envoy's ext_proc
machinery plus our wire; the picker's row minus this one is the picker's decision.
Run: ``python -m benchmarks.noop_ext_proc --port 9002 --endpoint 127.0.0.1:8000 ...``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence
from functools import partial

import trio
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from evergreen_trio._grpc.server import serve_grpc
from evergreen_trio._grpc.server_wire import SyncBidiMethod
from evergreen_trio.picker.processor import DESTINATION
from evergreen_trio.picker.runtime import PROCESS_PATH


def _route(endpoint: str) -> ep.ProcessingResponse:
    header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()))
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=[header]))))


class Noop:
    """One stream: CONTINUE every phase, route the request to the next endpoint."""

    def __init__(self, routes: Iterator[ep.ProcessingResponse]) -> None:
        self.routes = routes
        self.routed = False
        self.finished = False

    def on_message(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.finished = message.request_headers.end_of_stream
            return [next(self.routes)] if self.finished else []
        if kind != "request_body":
            raise ValueError(f"expected request headers and body, got {kind}")
        chunk = message.request_body
        self.finished = chunk.end_of_stream
        replies = [] if self.routed else [next(self.routes)]
        self.routed = True
        replies.append(ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                body=chunk.body, end_of_stream=chunk.end_of_stream))))))
        return replies

    def on_end(self) -> Sequence[ep.ProcessingResponse]:
        return ()


def noop_method(endpoints: Sequence[str]) -> SyncBidiMethod[ep.ProcessingRequest, ep.ProcessingResponse]:
    """The ext_proc ``Process`` method served by :class:`Noop` streams, routing to ``endpoints`` in turn."""
    routes = itertools.cycle([_route(e) for e in endpoints])
    return SyncBidiMethod(PROCESS_PATH, ep.ProcessingRequest, partial(Noop, routes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", action="append", required=True)
    args = parser.parse_args()
    trio.run(partial(serve_grpc, [noop_method(args.endpoint)], "127.0.0.1", args.port))


if __name__ == "__main__":
    main()
