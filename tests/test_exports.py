"""Each package's public face, pinned (as trio's ``_tests/test_exports.py`` pins trio's).

Adding or removing a public name is a decision: update ``PINNED`` with it. Every name in
``__all__`` must exist and, when it is a class or a function, carry its own docstring.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PINNED = {
    "evergreen_trio": {
        "ActionContext", "Call", "ChunkReader", "Client", "ClientSession", "ConfigurationError", "EvergreenTrioError",
        "FileResolver", "InputStream", "LimitExceededError", "NodeRef", "Output", "OutputNode",
        "ProtocolViolationError", "RefResolver", "Server", "SessionAbortedError", "SessionError",
        "SessionLimits", "StatusCode", "blob", "connect", "inner", "ref", "text",
    },
    "evergreen_trio.avp": {
        "AVPChecksumError", "AVPCompressionError", "AVPDecoder", "AVPDeviceError", "AVPEncodeError",
        "AVPEnumError", "AVPError", "AVPFormatError", "AVPHandshakeError", "AVPHeader", "AVPInconsistentError",
        "AVPLengthError", "AVPLimitError", "AVPLimits", "AVPMagicError", "AVPMessage", "AVPMetadata",
        "AVPMetadataError", "AVPTruncatedError", "AVPVersionError", "CommunicationMode", "DEFAULT_LIMITS",
        "DataType", "KVCacheHeader", "PayloadType", "avp_fragments", "decode", "encode", "encode_buffers",
        "encode_into", "pack_kv", "unpack_kv",
    },
    "evergreen_trio.dag": {
        "ActionFailedError", "FlattenCursor", "FlattenEvent", "FragmentBuilder", "LeafBytes", "LeafEnd", "LeafPart",
        "LeafStart",
        "LimitExceededError", "Node", "NodeKind", "NotTextError", "Pause", "ProtocolViolationError",
        "RefRejectedError",
        "SessionAbortedError", "SessionError", "SessionGraph", "SessionLimits", "StatusCode",
        "UnknownActionError", "UnknownTargetError", "Wait",
    },
    "evergreen_trio.generate": {
        "APIS", "Api", "BackendConfigError", "BackendError", "BackendSettings", "GenerateConfigError",
        "GenerateParams", "OpenAIBackend", "PromptPart",
        "PromptTooLargeError", "ResponseTooLargeError", "SSEDecoder", "SSEError", "SSEEvent",
        "StreamFormatError", "StreamParser", "UpstreamStatusError", "UpstreamTimeoutError",
        "UpstreamUnavailableError", "open_backend", "read_prompt", "request_body", "response_metadata",
        "served_by", "status_code", "generate_config", "parse_configs",
    },
    "evergreen_trio.ipc": {
        "BodyMismatchError", "BufferPool", "Catalog", "ConnectionLostError", "DEFAULT_LIMITS",
        "FlatbufferError", "FramingError", "IpcClient", "IpcError", "IpcLimits", "IpcStream", "IpcUri",
        "LimitExceededError",
        "RequestRefusedError", "Role", "SequenceError", "ServeOptions", "SharedMemoryError", "TransportError",
        "UnknownTicketError", "UriError", "connect", "fetch", "fetch_table", "parse_uri", "serve",
    },
    "evergreen_trio.picker": {
        "ConfigError", "Endpoint", "EnvoyError", "MetricsError", "Picker", "PickerConfig", "PickerDrain", "PickerError",
        "PickerPorts", "PoolConfig", "PoolSnapshot", "find_envoy", "gateway_config", "load_config", "parse_config",
        "parse_engine_metrics", "run_envoy", "run_picker", "write_gateway_config",
    },
    "evergreen_trio.sim": {
        "Engine", "SERVED_BY_HEADER", "SimConfig", "SimConfigError", "SimError", "SimRequest",
        "SimRequestError", "SimServer", "run_sim",
    },
}


@pytest.mark.parametrize("package", sorted(PINNED))
def test_all_is_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert len(module.__all__) == len(set(module.__all__)), "a name is listed twice"
    assert set(module.__all__) == PINNED[package]


@pytest.mark.parametrize("package", sorted(PINNED))
def test_every_public_name_exists_and_says_what_it_is(package: str) -> None:
    module = importlib.import_module(package)
    assert (module.__doc__ or "").strip(), f"{package} has no docstring"
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name} is in __all__ but missing"
        value = getattr(module, name)
        if inspect.isclass(value):
            doc = vars(value).get("__doc__")
            # A dataclass without a docstring gets a generated "Name(field, ...)" one.
            assert doc and not doc.startswith(f"{name}("), f"{package}.{name} has no docstring"
        elif inspect.isroutine(value):
            assert (value.__doc__ or "").strip(), f"{package}.{name} has no docstring"
