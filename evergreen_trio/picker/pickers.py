"""Pickers, sans-IO: a profile's last step, from its candidates' weighted scores to the addresses it returns.

``max-score-picker`` and ``random-picker`` are registered with the other core types in
:mod:`evergreen_trio.picker.plugins`; ``weighted-random-picker`` (llm-d-router's
``picker/weightedrandom``) is registered here. Each picker returns at most ``count`` addresses,
first the one the request goes to.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from evergreen_trio.picker.plugins import Category, PluginType, picker_params, register

WEIGHTED_RANDOM = "weighted-random-picker"
# The key of a draw of exactly 0, which would tie with the zero-score endpoints (the reference's value).
_SMALLEST_DRAW = 1e-10

# A picker: (rng, weighted score by candidate address, count) -> addresses, best first.
PickerFunction = Callable[[random.Random, Mapping[str, float], int], list[str]]


def max_score(rng: random.Random, scores: Mapping[str, float], count: int) -> list[str]:
    """The highest scores first; ties broken at random (a draw per candidate, in their order)."""
    draw = rng.random
    keys = {address: (score, draw()) for address, score in scores.items()}
    return sorted(keys, key=keys.__getitem__, reverse=True)[:count]


def uniform_random(rng: random.Random, scores: Mapping[str, float], count: int) -> list[str]:
    """``count`` candidates drawn uniformly, scores ignored."""
    return rng.sample(list(scores), min(count, len(scores)))


def weighted_random(rng: random.Random, scores: Mapping[str, float], count: int) -> list[str]:
    """A-Res weighted sampling without replacement: key = U^(1/score), the largest keys first.

    The first address is drawn with probability score / sum of scores. Candidates scoring 0 or
    less get key 0, so they come only after every positive one (when ``count`` reaches them);
    when none scores above 0 the pick is :func:`uniform_random`, as the reference delegates to
    its random picker.
    """
    if not any(score > 0 for score in scores.values()):
        return uniform_random(rng, scores, count)
    keys = {}
    for address, score in scores.items():
        keys[address] = (rng.random() or _SMALLEST_DRAW) ** (1.0 / score) if score > 0 else 0.0
    return sorted(keys, key=keys.__getitem__, reverse=True)[:count]


PICKERS: dict[str, PickerFunction] = {
    "max-score-picker": max_score,
    "random-picker": uniform_random,
    WEIGHTED_RANDOM: weighted_random,
}

register(WEIGHTED_RANDOM, PluginType(Category.PICKER, ("maxNumOfEndpoints",), picker_params))
