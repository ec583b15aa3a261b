"""``context-length-aware``, sans-IO, with llm-d-router's semantics (ebab68792,
``scorer/contextlengthaware``): routes by the request's context length against each endpoint's
``min-max`` token range, read from its ``label`` (``llm-d.ai/context-length-range``).

As a scorer (always): an endpoint without the label scores 0.5, one whose label does not parse
0; in range scores in (0.3, 1], higher for a narrower range and more headroom; out of range
below 0.3, higher the nearer the range. As a filter (``enableFiltering``, off by default): keeps
the unlabelled endpoints and those whose range holds the length; an unparsable label drops it.
A profile listing the plugin runs it in both roles, as the reference's does.

The context length is the prompt's token estimate (its bytes / ``charsPerToken``, rounded up):
the reference's default ``token-producer`` backend packs 4 bytes a token the same way; no body
is length 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.gotext import GO_SPACE, atoi
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

CONTEXT_LENGTH = "context-length-aware"
DEFAULT_LABEL = "llm-d.ai/context-length-range"
UNLABELLED_SCORE = 0.5
MAX_FALLBACK_SCORE = 0.3


@dataclass(frozen=True)
class ContextLengthParams:
    """``context-length-aware``: the range label's key, and whether it filters too."""

    label: str = DEFAULT_LABEL
    enable_filtering: bool = False


def _context_length(params: Params) -> ContextLengthParams:
    label = params.text("label", DEFAULT_LABEL)
    if not label:
        raise ConfigError(params.where("label"), "a pod label key (not empty)", label)
    return ContextLengthParams(label, params.boolean("enableFiltering", False))


def parse_range(text: str) -> tuple[int, int] | None:
    """A ``min-max`` label value as the reference parses it; None when it does not parse or min > max."""
    bounds = text.split("-")
    if len(bounds) != 2:
        return None
    low, high = (atoi(bound.strip(GO_SPACE)) for bound in bounds)
    if low is None or high is None:
        return None
    return (low, high) if low <= high else None


def range_score(length: int, low: int, high: int) -> float:
    """How well ``low-high`` fits ``length``: in range (0.3, 1], out of range [0, 0.3)."""
    if low <= length <= high:
        width = high - low
        if width == 0:
            return 1.0
        width_score = 1.0 / (1.0 + float(width) / 10000.0)
        position_score = float(high - length) / float(width)
        raw = 0.7 * width_score + 0.3 * position_score
        # 0.7 is the reference's 1 - 0.3, a Go constant computed exactly (1.0 - 0.3 is not 0.7 in floats).
        return MAX_FALLBACK_SCORE + raw * 0.7
    distance = length - high if length > high else low - length
    return MAX_FALLBACK_SCORE / (1.0 + float(distance) / 1000.0)


def context_scores(params: ContextLengthParams, length: int,
                   labels: Mapping[str, Mapping[str, str]]) -> dict[str, float]:
    """The score of each address, from its pod labels."""
    scores = {}
    for address, pod in labels.items():
        value = pod.get(params.label)
        if value is None:
            scores[address] = UNLABELLED_SCORE
            continue
        bounds = parse_range(value)
        scores[address] = range_score(length, *bounds) if bounds is not None else 0.0
    return scores


def context_filter(params: ContextLengthParams, length: int, labels: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The addresses kept, in order: all unless ``enable_filtering``; else the unlabelled and in-range ones."""
    if not params.enable_filtering:
        return list(labels)
    kept = []
    for address, pod in labels.items():
        value = pod.get(params.label)
        bounds = parse_range(value) if value is not None else None
        if value is None or (bounds is not None and bounds[0] <= length <= bounds[1]):
            kept.append(address)
    return kept


def _labels(candidates: Sequence[EndpointState]) -> dict[str, Mapping[str, str]]:
    return {s.endpoint.address: s.endpoint.label_map for s in candidates}


def _scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    assert isinstance(params, ContextLengthParams)
    return context_scores(params, scheduler.prompt_tokens(request), _labels(candidates))


def _filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            params: object) -> list[EndpointState]:
    assert isinstance(params, ContextLengthParams)
    by_address = {s.endpoint.address: s for s in candidates}
    return [by_address[a] for a in context_filter(params, scheduler.prompt_tokens(request), _labels(candidates))]


register(CONTEXT_LENGTH, PluginType(Category.SCORER, ("label", "enableFiltering"), _context_length,
                                    also_filter=True))

CONTEXT_SCORERS = {CONTEXT_LENGTH: _scorer}
CONTEXT_FILTERS = {CONTEXT_LENGTH: _filter}
