"""``passthrough-parser`` (llm-d-router's parsers/passthrough): any body, forwarded as received.

It claims no path, so it is the fallback for the paths no other listed parser claims (the last
of the default list). The request carries no model and no prompt: it is scheduled by the
endpoints' state alone (no prefix hashing, no model lookup or rewrite; an
``x-gateway-model-name-rewrite`` header still names the target model), and its response's usage
is not read.
"""

from __future__ import annotations

from collections.abc import Mapping

from evergreen_trio.picker.parsers.registry import RequestParser, forwarded, register_parser
from evergreen_trio.picker.request import InferenceRequest


def _parse(path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
    return forwarded(skip_response=False)


PASSTHROUGH = register_parser(RequestParser("passthrough-parser", (), _parse))
