"""``vllmgrpc-parser`` (llm-d-router's parsers/vllmgrpc): vLLM's gRPC engine API.

It claims ``vllm.grpc.engine.VllmEngine/Generate`` and ``/Embed``. The body must start with a
whole, uncompressed gRPC message (else 400, whatever the method). ``Generate``: a
``GenerateRequest`` whose input is a text (the prompt) or tokenized ids (the token prompt);
``stream`` and ``sampling_params.max_tokens`` (the output cap, 0 included) come from it.
``Embed``: an ``EmbedRequest`` with tokenized ids. Another method (by ``:path`` as sent) is
forwarded as received and its response not processed. The body is forwarded as received: the
request has no model (the rewrite header alone names a target). Each response message is a
``GenerateResponse`` (a stream chunk's or the completion's token counts) or an ``EmbedResponse``
(its prompt tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.message import DecodeError

from evergreen_trio._proto.vllm import vllm_engine_pb2 as pb
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.grpc import FrameError, grpc_payload
from evergreen_trio.picker.parsers.registry import RequestParser, forwarded, register_parser
from evergreen_trio.picker.request import Api, InferenceRequest
from evergreen_trio.picker.usage import ResponseFormat, Usage

GENERATE = "vllm.grpc.engine.VllmEngine/Generate"
EMBED = "vllm.grpc.engine.VllmEngine/Embed"


def _generate(payload: bytes) -> InferenceRequest:
    try:
        request = pb.GenerateRequest.FromString(payload)
    except DecodeError as exc:
        raise RequestError(400, f"unmarshaling GenerateRequest: {exc}") from None
    sampling = request.sampling_params
    cap = sampling.max_tokens if request.HasField("sampling_params") and sampling.HasField("max_tokens") else None
    kind = request.WhichOneof("input")
    if kind == "text":
        text = request.text
        return InferenceRequest(Api.COMPLETIONS, "", request.stream, text, {}, len(text.encode()), output_cap=cap,
                                rewritable=False, response=VLLM_GRPC_RESPONSES)
    if kind == "tokenized":
        return InferenceRequest(Api.COMPLETIONS, "", request.stream, "", {}, output_cap=cap, rewritable=False,
                                token_ids=list(request.tokenized.input_ids), response=VLLM_GRPC_RESPONSES)
    raise RequestError(400, "not supported request inputType")


def _embed(payload: bytes) -> InferenceRequest:
    try:
        request = pb.EmbedRequest.FromString(payload)
    except DecodeError as exc:
        raise RequestError(400, f"unmarshaling EmbedRequest: {exc}") from None
    if not request.HasField("tokenized"):
        raise RequestError(400, "missing tokenized input in EmbedRequest")
    return InferenceRequest(Api.EMBEDDINGS, "", False, "", {}, rewritable=False,
                            token_ids=list(request.tokenized.input_ids), response=VLLM_GRPC_RESPONSES)


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    try:
        payload = grpc_payload(body)
    except FrameError:
        raise RequestError(400, "invalid or unsupported gRPC payload") from None
    method = headers.get(":path", path)  # as sent: the reference matches the raw :path here
    if method.endswith(EMBED):
        return _embed(payload)
    if method.endswith(GENERATE):
        return _generate(payload)
    return forwarded(skip_response=True)


def vllm_grpc_usage(message: bytes) -> Usage | None:
    """Usage of one response message: a GenerateResponse, else an EmbedResponse (as the reference
    tries them); a count of 0 counts as none."""
    try:
        response = pb.GenerateResponse.FromString(message)
    except DecodeError:
        response = None
    kind = response.WhichOneof("response") if response is not None else None
    if response is not None and kind is not None:
        counts = response.chunk if kind == "chunk" else response.complete
        if counts.prompt_tokens or counts.completion_tokens:
            return Usage(counts.prompt_tokens or None, counts.completion_tokens or None, counts.cached_tokens)
        return None
    try:
        embedded = pb.EmbedResponse.FromString(message)
    except DecodeError:
        return None
    return Usage(embedded.prompt_tokens, None, None) if embedded.prompt_tokens else None


VLLM_GRPC_RESPONSES = ResponseFormat(usage=None, grpc_usage=vllm_grpc_usage)
VLLM_GRPC = register_parser(RequestParser("vllmgrpc-parser", (GENERATE, EMBED), _parse))
