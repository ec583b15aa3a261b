"""``slo-deadline-ordering-policy`` (llm-d-router's ordering/slodeadline), sans-IO.

A request's deadline is when its request headers came plus its ``x-llm-d-slo-ttft-ms`` header
(``x-slo-ttft-ms`` still accepted; the first present wins, even empty) in milliseconds: a
base-10 integer, signed or not, surrounded by whitespace or not, in 0..MaxInt64/10^6. Earliest
deadline first; a missing, empty or invalid header puts the request behind every valid one; equal
deadlines (all the invalid ones too) go first come, first served by arrival.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from evergreen_trio.picker.flow_control.key import first_header
from evergreen_trio.picker.gotext import GO_SPACE, atoi
from evergreen_trio.picker.plugins import Category, PluginType, register

SLO_DEADLINE = "slo-deadline-ordering-policy"
TTFT_SLO_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
# Go's time.Duration(ms) * time.Millisecond must not overflow int64.
MAX_TTFT_MS = (2**63 - 1) // 1_000_000


def ttft_slo_ms(headers: Mapping[str, str]) -> int | None:
    """The request's TTFT SLO in milliseconds, None when missing or invalid."""
    ms = atoi((first_header(headers, TTFT_SLO_HEADERS) or "").strip(GO_SPACE))
    return ms if ms is not None and 0 <= ms <= MAX_TTFT_MS else None


def rank(headers: Mapping[str, str], received_at: float) -> tuple[float, int]:
    """(deadline, arrival) in whole nanoseconds, to compare as the reference's times do; inf when
    there is no valid SLO."""
    received = round(received_at * 1e9)
    ms = ttft_slo_ms(headers)
    return (math.inf if ms is None else received + ms * 1_000_000, received)


register(SLO_DEADLINE, PluginType(Category.OTHER))
