"""What one client request may cost the picker, and what it may choose: bounded JSON work, rewrite
targets the configuration allows, and metric labels from a bounded set. Sans-IO.

Model names come from clients, so they never become label values unchecked: a configured name
(a model or one of its target models) is its own series; when no models are configured the first
:data:`MAX_UNLISTED_MODEL_LABELS` names of at most :data:`MAX_MODEL_LABEL_CHARS` characters are
too; every other name folds into :data:`OTHER_MODEL`, and at most :data:`MAX_MODEL_LABEL_PAIRS`
(model, target model) pairs get series of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from evergreen_trio.picker.errors import RequestError

if TYPE_CHECKING:  # config imports the request parsers, which import this module
    from evergreen_trio.picker.config import ModelConfig, PickerConfig

log = logging.getLogger(__name__)

MAX_BODY_JSON_ITEMS = 262_144
"""``,``, ``:``, ``[`` and ``{`` outside strings that a request body may hold (every JSON value
but the first follows one of them); past it the body is answered 413 before it is parsed. A
prompt of 200k token ids fits."""

MAX_BODY_JSON_CONTAINERS = 32_768
"""``[`` and ``{`` outside strings that a request body may hold (objects and arrays cost the most,
to parse and to walk for the prompt); past it the body is answered 413 before it is parsed."""

MAX_UNLISTED_MODEL_LABELS = 32
"""Model names that get a metric series of their own when no models are configured (first seen)."""

MAX_MODEL_LABEL_CHARS = 128
"""A longer model name is never a label value: it folds into :data:`OTHER_MODEL`."""

MAX_MODEL_LABEL_PAIRS = 64
"""(model, target model) label pairs with series of their own; later pairs fold into ``other``."""

OTHER_MODEL = "other"
"""The label value every unlisted or surplus model name folds into."""

MAX_FAIRNESS_LABEL_VALUES = 1000
"""Distinct ``fairness_id`` label values (llm-d-router's ``maxFairnessLabelValues``); later ones
fold into :data:`OTHER_MODEL`, the reference's ``overflowValue``."""


def check_json_cost(body: bytes, items: int = MAX_BODY_JSON_ITEMS,
                    containers: int = MAX_BODY_JSON_CONTAINERS) -> None:
    """Raise RequestError(413) when ``body`` holds more than ``items`` JSON items or ``containers``
    objects and arrays (see :data:`MAX_BODY_JSON_ITEMS`), before any parsing.

    A body of at most ``containers`` bytes passes at once. Otherwise the bytes outside strings
    are counted with ``bytes.count`` over each stretch between strings (no copy); the strings are
    found quote by quote when there are few of them, else by splitting the body on ``"`` (after
    counting everywhere first: most such bodies pass then). More than ``items + 1`` strings are too
    many items anyway, as each string but the first follows one. Each step is a C-speed pass over
    the bytes (about 5-15 ms for 16 MiB), at most eight in all, whatever the body holds.
    """
    if len(body) <= containers:
        return
    quotes = body.count(b'"')
    if quotes // 2 > items + 1:
        raise _too_costly(items, containers)
    if quotes <= _FEW_QUOTES:
        ranges = _outside_strings(body)
    elif _within(body, [(0, len(body))], items, containers):
        return
    else:  # many short strings: split (a Python object per piece, at most 2 * items + 5 of them)
        ranges = _outside_pieces(body.split(b'"'), escaped=b"\\" in body)
    if not _within(body, ranges, items, containers):
        raise _too_costly(items, containers)


_FEW_QUOTES = 4096


def _too_costly(items: int, containers: int) -> RequestError:
    return RequestError(413, f"request body has more than {items} JSON items (MAX_BODY_JSON_ITEMS) or "
                             f"{containers} objects and arrays (MAX_BODY_JSON_CONTAINERS)")


def _within(body: bytes, ranges: list[tuple[int, int]], items: int, containers: int) -> bool:
    """Whether the stretches ``body[start:end]`` hold at most ``containers`` of ``[{`` and
    ``items`` of ``,:[{`` together (``,`` and ``:`` are counted only when the first holds)."""
    found = sum(body.count(char, start, end) for char in (b"[", b"{") for start, end in ranges)
    if found > containers:
        return False
    found += sum(body.count(char, start, end) for char in (b",", b":") for start, end in ranges)
    return found <= items


def _outside_strings(body: bytes) -> list[tuple[int, int]]:
    """The stretches of ``body`` outside strings, found quote by quote.

    A quote inside a string is escaped when an odd number of backslashes comes before it; the
    stretch since the last quote is copied only then (so at most the body once in all).
    """
    ranges: list[tuple[int, int]] = []
    start = previous = 0
    in_string = False
    quote = body.find(b'"')
    while quote >= 0:
        escaped = False
        if in_string and body[quote - 1] == 0x5C:
            stretch = body[previous:quote]
            escaped = (len(stretch) - len(stretch.rstrip(b"\\"))) % 2 == 1
        if not escaped:
            if in_string:
                start = quote + 1
            else:
                ranges.append((start, quote))
            in_string = not in_string
        previous = quote + 1
        quote = body.find(b'"', previous)
    if not in_string:
        ranges.append((start, len(body)))
    return ranges


def _outside_pieces(parts: list[bytes], *, escaped: bool) -> list[tuple[int, int]]:
    """The stretches outside strings of the body that ``parts`` (split on ``"``) came from.

    With ``escaped`` (the body holds a backslash), a quote is escaped when the piece before it
    ends in an odd number of backslashes: the string goes on past it.
    """
    ranges: list[tuple[int, int]] = []
    position = 0
    in_string = False
    for part in parts:
        end = position + len(part)
        if not in_string:
            ranges.append((position, end))
        if not (escaped and in_string and (len(part) - len(part.rstrip(b"\\"))) % 2):
            in_string = not in_string
        position = end + 1
    return ranges


def rewrite_allowed(config: PickerConfig, model: ModelConfig | None, target: str) -> bool:
    """Whether a client's ``x-gateway-model-name-rewrite`` to ``target`` may be honoured.

    With no models configured every name is accepted anyway; otherwise only the requested model
    itself or one of its configured target models.
    """
    if not config.models:
        return True
    return model is not None and (target == model.name or any(t.name == target for t in model.target_models))


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (``"\\ud800"`` in the JSON) is a 400 and one log line."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        log.info("picker.request_refused status=400 reason=lone surrogate in the %s at character %d", what, exc.start)
        raise RequestError(400, f"request {what} holds a lone surrogate at character {exc.start}") from None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class BoundedLabel:
    """A client-chosen label value bounded as llm-d-router's ``boundedLabel`` bounds it: the first
    ``cap`` distinct values are themselves, every later one is ``other``; "" stays "" (no slot).
    A value once admitted always returns itself, so paired gauge updates stay balanced."""

    __slots__ = ("_cap", "_seen")

    def __init__(self, cap: int = MAX_FAIRNESS_LABEL_VALUES) -> None:
        self._cap = cap
        self._seen: set[str] = set()

    def bound(self, value: str) -> str:
        seen = self._seen
        if value in seen or not value:
            return value
        if len(seen) >= self._cap:
            return OTHER_MODEL
        seen.add(value)
        return value


class ModelLabels:
    """Folds client-chosen model names into a bounded set of metric label values."""

    def __init__(self, listed: Iterable[str] = (), *, unlisted: int = MAX_UNLISTED_MODEL_LABELS,
                 pairs: int = MAX_MODEL_LABEL_PAIRS) -> None:
        self._listed = frozenset(listed)
        # A configured list is the allow-list: names outside it never get a series.
        self._unlisted_cap = 0 if self._listed else unlisted
        self._unlisted: set[str] = set()
        self._pairs_cap = pairs
        self._pairs: set[tuple[str, str]] = set()

    @classmethod
    def for_config(cls, config: PickerConfig) -> ModelLabels:
        """Configured model names and their target models are listed."""
        names = [m.name for m in config.models] + [t.name for m in config.models for t in m.target_models]
        return cls(names)

    def name(self, model: str) -> str:
        """``model`` itself, or :data:`OTHER_MODEL`. A name once given a series keeps it."""
        if model in self._listed or model in self._unlisted:
            return model
        if (len(model) <= MAX_MODEL_LABEL_CHARS and len(self._unlisted) < self._unlisted_cap
                and model.isprintable() and _encodes(model)):
            self._unlisted.add(model)
            return model
        return OTHER_MODEL

    def pair(self, model: str, target: str) -> tuple[str, str]:
        """The (model, target model) label values, folded; surplus pairs become (other, other)."""
        labels = (self.name(model), self.name(target))
        if labels in self._pairs:
            return labels
        if len(self._pairs) < self._pairs_cap:
            self._pairs.add(labels)
            return labels
        return OTHER_MODEL, OTHER_MODEL
