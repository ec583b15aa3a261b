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

from evergreen_trio.picker.config import ModelConfig, PickerConfig
from evergreen_trio.picker.errors import RequestError

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


def check_json_cost(body: bytes, items: int = MAX_BODY_JSON_ITEMS,
                    containers: int = MAX_BODY_JSON_CONTAINERS) -> None:
    """Raise RequestError(413) when ``body`` holds more than ``items`` JSON items or ``containers``
    objects and arrays (see :data:`MAX_BODY_JSON_ITEMS`), before any parsing.

    A body of at most ``containers`` bytes passes at once; one with many strings passes if it
    holds no more of those bytes anywhere. Otherwise it is split on ``"`` (more than ``items + 1``
    strings are too many items anyway, as each string but the first follows one; escaped quotes
    are found from the pieces that end in a backslash) and the bytes outside strings are counted.
    Each step is a C-speed pass over the bytes (about 10-20 ms for 16 MiB), at most six in all,
    whatever the body holds.
    """
    if len(body) <= containers:
        return
    quotes = body.count(b'"')
    if quotes > _FEW_QUOTES:  # many short strings: splitting costs a Python object per piece
        totals = _Counts(body)
        if totals.containers() <= containers and totals.items() <= items:
            return
    if quotes // 2 <= items + 1:
        outside, inside = _split_strings(body.split(b'"'), escaped=b"\\" in body)
        # Count whichever side is smaller: the outside, or the whole body less the inside.
        if sum(map(len, outside)) <= len(body) // 2:
            counts = _Counts(b"".join(outside))
            if counts.containers() <= containers and counts.items() <= items:
                return
        else:
            totals, within = _Counts(body), _Counts(b"".join(inside))
            if (totals.containers() - within.containers() <= containers
                    and totals.items() - within.items() <= items):
                return
    raise RequestError(413, f"request body has more than {items} JSON items (MAX_BODY_JSON_ITEMS) or "
                            f"{containers} objects and arrays (MAX_BODY_JSON_CONTAINERS)")


_FEW_QUOTES = 4096


class _Counts:
    """``[{`` and ``,:[{`` bytes in ``data``, each counted once, when first asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._containers: int | None = None
        self._items: int | None = None

    def containers(self) -> int:
        if self._containers is None:
            self._containers = len(self.data) - len(self.data.translate(None, b"[{"))
        return self._containers

    def items(self) -> int:
        if self._items is None:
            self._items = len(self.data) - len(self.data.translate(None, b",:[{"))
        return self._items


def _split_strings(parts: list[bytes], *, escaped: bool) -> tuple[list[bytes], list[bytes]]:
    """The pieces outside and inside strings, of a body split on ``"``.

    With ``escaped`` (the body holds a backslash), a quote is escaped when the piece before it
    ends in an odd number of backslashes: the string goes on past it.
    """
    if not escaped:
        return parts[::2], parts[1::2]
    outside: list[bytes] = []
    inside: list[bytes] = []
    in_string = False
    for part in parts:
        (inside if in_string else outside).append(part)
        if not (in_string and (len(part) - len(part.rstrip(b"\\"))) % 2):
            in_string = not in_string
    return outside, inside


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
