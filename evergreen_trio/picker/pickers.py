"""Pickers, sans-IO: a profile's last step, from its candidates' weighted scores to the addresses it returns.

``max-score-picker`` and ``random-picker`` are registered with the other core types in
:mod:`evergreen_trio.picker.plugins`. Each picker returns at most ``count`` addresses, first the
one the request goes to.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

# A picker: (rng, weighted score by candidate address, count) -> addresses, best first.
PickerFunction = Callable[[random.Random, Mapping[str, float], int], list[str]]


def max_score(rng: random.Random, scores: Mapping[str, float], count: int) -> list[str]:
    """The highest scores first; ties broken at random."""
    return sorted(scores, key=lambda a: (scores[a], rng.random()), reverse=True)[:count]


def uniform_random(rng: random.Random, scores: Mapping[str, float], count: int) -> list[str]:
    """``count`` candidates drawn uniformly, scores ignored."""
    return rng.sample(list(scores), min(count, len(scores)))


PICKERS: dict[str, PickerFunction] = {
    "max-score-picker": max_score,
    "random-picker": uniform_random,
}
