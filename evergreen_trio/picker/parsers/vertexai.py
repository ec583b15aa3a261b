"""``vertexai-parser`` (llm-d-router's parsers/vertexai): Vertex AI's gRPC PredictionService.

It claims the ``PredictionService/ChatCompletions``, ``/StreamRawPredict`` and ``/RawPredict``
methods (any version of the service). Their request, one gRPC message, wraps an ``HttpBody``
whose data is an OpenAI-style JSON body, read as the reference's openai parser reads
``/chat/completions`` (ChatCompletions: a non-empty ``messages``) or ``/responses`` (the raw
predicts: an ``input``), each field of the type it checks. ``model``, ``stream`` and the output
cap come from it, the prompt from the messages (or the instructions and input); the gRPC body is
forwarded as received, so the target model comes from the rewrite header alone. Another method
(by ``:path`` as sent) is forwarded as received and its response not processed. Each response
message is an ``HttpBody`` whose data carries OpenAI-style usage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from google.protobuf.message import DecodeError

from evergreen_trio._proto.vertexai import vertexai_pb2 as pb
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers import gojson
from evergreen_trio.picker.parsers.grpc import FrameError, grpc_payload
from evergreen_trio.picker.parsers.openai import read_request
from evergreen_trio.picker.parsers.registry import RequestParser, forwarded, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest, content_text
from evergreen_trio.picker.usage import ResponseFormat, Usage, usage_of


def _openai_body(api: Api, data: bytes, name: str) -> InferenceRequest:
    """The HttpBody's JSON as the reference's openai parser reads it at ``api``'s path."""
    try:
        doc, _, _ = gojson.load(data)
    except RequestError as exc:
        raise RequestError(exc.status, f"parsing {name}: {exc.message}") from None
    try:
        request = read_request("chat/completions" if api is Api.CHAT else "responses", doc)
    except RequestError as exc:
        raise RequestError(exc.status, f"parsing {name}: {exc.message}") from None
    if api is Api.CHAT:
        prompt = content_text(request["messages"])
        cap = gojson.max_output_tokens(doc, "max_completion_tokens", "max_tokens")
    else:
        prompt = content_text(request.get("instructions")) + content_text(request["input"])
        cap = gojson.max_output_tokens(doc, "max_output_tokens")
    model = doc.get("model")
    prompt = gojson.text(prompt)
    return InferenceRequest(api, gojson.text(model) if isinstance(model, str) else "", doc.get("stream") is True,
                            prompt, {}, len(prompt) if prompt.isascii() else len(prompt.encode()), output_cap=cap,
                            rewritable=False, response=VERTEX_RESPONSES)


_METHODS = (
    ("PredictionService/ChatCompletions", pb.ChatCompletionsRequest, Api.CHAT),
    ("PredictionService/StreamRawPredict", pb.StreamRawPredictRequest, Api.RESPONSES),
    ("PredictionService/RawPredict", pb.RawPredictRequest, Api.RESPONSES),
)


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    method = headers.get(":path", path)  # as sent: the reference matches the raw :path here
    found = next(((message_type, api) for suffix, message_type, api in _METHODS if method.endswith(suffix)), None)
    if found is None:
        return forwarded(skip_response=True)
    message_type, api = found
    name = message_type.DESCRIPTOR.name
    try:
        message = message_type.FromString(grpc_payload(body))
    except FrameError as exc:
        raise RequestError(400, f"invalid or unsupported gRPC payload: {exc}") from None
    except DecodeError as exc:
        raise RequestError(400, f"unmarshaling {name}: {exc}") from None
    if not message.HasField("http_body"):
        raise RequestError(400, f"{name} has no HttpBody")
    return _openai_body(api, message.http_body.data, name)


def vertex_usage(message: bytes) -> Usage | None:
    """Usage of one response message: an HttpBody of OpenAI-style JSON."""
    try:
        data = pb.HttpBody.FromString(message).data
        return usage_of(json.loads(data)) if data else None
    except (DecodeError, ValueError, RecursionError):
        return None


VERTEX_RESPONSES = ResponseFormat(usage=None, grpc_usage=vertex_usage)
VERTEX_AI = register_parser(RequestParser("vertexai-parser", (
    "PredictionService/ChatCompletions", "PredictionService/StreamRawPredict", "PredictionService/RawPredict"), _parse))
