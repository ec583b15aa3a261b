"""Which request parser reads a request: llm-d-router's ParserRegistry (pkg/epp/handlers/parsers.go).

A parser type claims path suffixes (or none: it is then a fallback). An ``EndpointPickerConfig``
lists parsers under ``requestHandler.parsers`` (the package's ``DEFAULT_PARSERS`` when it lists
none); the registry takes them in order, skips one of a type already taken, and stops at the
first claiming no path, the fallback. A request's path (:func:`request_path`) goes to the parser
with the longest claimed suffix it ends with (the first taken on a tie), else to the fallback,
else it is answered 400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.gotext import GO_SPACE
from evergreen_trio.picker.plugins import Category, Plugin, PluginType, register
from evergreen_trio.picker.request import Api, InferenceRequest, trimmed_path
from evergreen_trio.picker.usage import ResponseFormat

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RequestParser:
    """One parser type: the path suffixes it claims (none: a fallback for every path) and how it
    reads a request from its path (``request_path``), headers and body (RequestError(400) for one
    it refuses)."""

    type: str
    paths: tuple[str, ...]
    parse: Callable[[str, Mapping[str, str], bytes], InferenceRequest]


def register_parser(parser: RequestParser) -> RequestParser:
    """Make ``parser.type`` a plugin type (it takes no parameters): a declared plugin of it is ``parser``."""
    register(parser.type, PluginType(Category.PARSER, (), lambda params: parser))
    return parser


NO_USAGE = ResponseFormat(usage=None)
"""Responses whose usage is not read."""


def forwarded(*, skip_response: bool) -> InferenceRequest:
    """A request forwarded as received, without a model or a prompt to schedule by."""
    return InferenceRequest(Api.OTHER, "", False, "", {}, rewritable=False, skip_response=skip_response,
                            response=NO_USAGE)


def request_path(headers: Mapping[str, str]) -> str:
    """The path a request is parsed by (the reference's GetRequestPath): the first set of
    ``:path``, ``x-original-path`` and ``x-forwarded-path`` without its query, else
    ``/v1/completions``."""
    for key in (":path", "x-original-path", "x-forwarded-path"):
        path = headers.get(key, "")
        if path:
            return path.split("?", 1)[0]
    return "/v1/completions"


MAX_RESOLVED_PATHS = 256


def _suffix(claim: str) -> str:
    return claim.strip(GO_SPACE).strip("/")


def match_path_suffix(path: str, suffix: str) -> bool:
    """The reference's MatchPathSuffix: ``path`` (trimmed, one trailing ``/`` off) ends with
    ``suffix`` (trimmed, no ``/`` at either end)."""
    return trimmed_path(path).endswith(_suffix(suffix))


class ParserRegistry:
    """The configured parsers, resolved by path (see the module docstring)."""

    def __init__(self, plugins: Sequence[Plugin]) -> None:
        self.parsers: list[RequestParser] = []
        self.fallback: RequestParser | None = None
        self._claims: list[tuple[RequestParser, tuple[str, ...]]] = []
        # Paths come from clients: resolved ones are kept in a bounded map, cleared when full.
        self._resolved: dict[str, RequestParser] = {}
        taken: set[str] = set()
        for index, plugin in enumerate(plugins):
            parser = plugin.params
            assert isinstance(parser, RequestParser)
            first = parser.type not in taken
            taken.add(parser.type)
            if not first:
                log.warning("picker.parser_skipped parser=%s type=%s reason=a parser of this type is listed before",
                            plugin.name, parser.type)
            elif parser.paths:
                self._claims.append((parser, tuple(_suffix(p) for p in parser.paths)))
            if first:
                self.parsers.append(parser)
            if not parser.paths:
                self.fallback = parser
                for skipped in plugins[index + 1 :]:
                    log.warning("picker.parser_skipped parser=%s reason=listed after the fallback parser %s",
                                skipped.name, plugin.name)
                break

    def resolve(self, path: str) -> RequestParser:
        """The parser of ``path``; RequestError(400) when none claims it and there is no fallback."""
        parser = self._resolved.get(path)
        if parser is None:
            parser = self._resolve(path)
            if len(self._resolved) >= MAX_RESOLVED_PATHS:
                self._resolved.clear()
            self._resolved[path] = parser
        return parser

    def _resolve(self, path: str) -> RequestParser:
        best, best_length = None, 0
        trimmed = trimmed_path(path)  # once, where match_path_suffix would trim it per suffix
        for parser, suffixes in self._claims:
            for suffix in suffixes:
                if len(suffix) > best_length and trimmed.endswith(suffix):
                    best, best_length = parser, len(suffix)
        if best is not None:
            return best
        if self.fallback is not None:
            return self.fallback
        raise RequestError(400, f"no parser registered matching path suffix for: {path[:256]}")

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
        """The request as the parser of ``path`` (its ``request_path``) reads it."""
        return (self._resolved.get(path) or self.resolve(path)).parse(path, headers, body)
