"""``destination-endpoint-served-verifier``, sans-IO, as llm-d-router's
(``requestcontrol/test/responsereceived``): a plugin for conformance tests that tells the client
which endpoint served its request.

When the response headers come, Envoy's ``envoy.lb`` metadata names the endpoint that served
(``x-gateway-destination-endpoint-served``); the plugin copies that string into the response
header ``x-conformance-test-served-endpoint``, or says why it cannot: ``fail: missing envoy lb
metadata`` (no such namespace), ``fail: missing destination endpoint served metadata`` (no such
key, or not a string). A value no header can carry (a control or non-ASCII character, or over
:data:`MAX_VALUE_CHARS`) is ``fail: invalid destination endpoint served metadata`` here, where
the reference copies it as it is. The type takes no parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import struct_pb2

from evergreen_trio.picker.plugins import Category, PluginType, register

DESTINATION_ENDPOINT_SERVED_VERIFIER = "destination-endpoint-served-verifier"
SERVED_ENDPOINT_HEADER = "x-conformance-test-served-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MISSING_NAMESPACE = "fail: missing envoy lb metadata"
MISSING_KEY = "fail: missing destination endpoint served metadata"
INVALID_VALUE = "fail: invalid destination endpoint served metadata"
MAX_VALUE_CHARS = 1024


def served_verdict(lb: Mapping[str, struct_pb2.Value] | None) -> str:
    """The header's value from the response's ``envoy.lb`` metadata fields (None: no such namespace)."""
    if lb is None:
        return MISSING_NAMESPACE
    value = lb.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return MISSING_KEY
    served = value.string_value
    if len(served) > MAX_VALUE_CHARS or not all(" " <= c <= "~" for c in served):
        return INVALID_VALUE
    return served


register(DESTINATION_ENDPOINT_SERVED_VERIFIER, PluginType(Category.RESPONSE_PROCESSOR))
