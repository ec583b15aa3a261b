"""Request parsers: llm-d-router's ``requestHandler.parsers`` plugin types (one module each,
sans-IO), and the registry that picks one by the request's path (:mod:`.registry`).

Importing this package registers every parser type.
"""

from evergreen_trio.picker.parsers.anthropic import ANTHROPIC
from evergreen_trio.picker.parsers.openai import OPENAI
from evergreen_trio.picker.parsers.passthrough import PASSTHROUGH
from evergreen_trio.picker.parsers.registry import ParserRegistry, RequestParser
from evergreen_trio.picker.parsers.sglanghttp import SGLANG_HTTP
from evergreen_trio.picker.parsers.vertexai import VERTEX_AI
from evergreen_trio.picker.parsers.vllmgrpc import VLLM_GRPC
from evergreen_trio.picker.parsers.vllmhttp import VLLM_HTTP
from evergreen_trio.picker.plugins import Plugin

PARSERS: tuple[RequestParser, ...] = (
    OPENAI, ANTHROPIC, VLLM_HTTP, SGLANG_HTTP, VERTEX_AI, VLLM_GRPC, PASSTHROUGH)
"""Every parser type this picker implements."""

DEFAULT_PARSERS = (OPENAI, ANTHROPIC, VLLM_HTTP, PASSTHROUGH)
"""The parsers of a config that lists none, in order (the reference's ensureParsers)."""

DEFAULT_REGISTRY = ParserRegistry([Plugin(parser.type, parser.type, parser) for parser in DEFAULT_PARSERS])
"""The registry of :data:`DEFAULT_PARSERS`."""
