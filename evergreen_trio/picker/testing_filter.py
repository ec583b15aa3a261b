"""``header-based-testing-filter``, sans-IO, as llm-d-router's
``scheduling/test/filter/request_header_based_filter.go``: a filter for tests that keeps the
endpoints the ``test-epp-endpoint-selection`` header names.

The header is a comma-separated list of ``IP`` (any port of that host) or ``IP:port`` (that port
only; IPv6 bracketed). Endpoints come out in the header's order, each host at most once; a request
without the header (or with a blank one) keeps none. The type takes no parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from evergreen_trio.picker.gotext import trim_space
from evergreen_trio.picker.plugins import Category, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

HEADER_BASED_TESTING_FILTER = "header-based-testing-filter"
SELECTION_HEADER = "test-epp-endpoint-selection"


def split_host_port(item: str) -> tuple[str, str] | None:
    """Go's ``net.SplitHostPort``: (host, port), or None where it returns an error."""
    i = item.rfind(":")
    if i < 0:
        return None
    j = k = 0
    if item.startswith("["):
        end = item.find("]")
        if end < 0 or end + 1 != i:  # no "]", nothing after it, or something but a lone ":" port
            return None
        host, j, k = item[1:end], 1, end + 1
    else:
        host = item[:i]
        if ":" in host:
            return None
    if "[" in item[j:] or "]" in item[k:]:
        return None
    return host, item[i + 1:]


def _bare(host: str) -> str:
    return host.strip("[]")


def select(header: str, endpoints: Sequence[tuple[str, str]]) -> list[int]:
    """Indexes into ``endpoints`` ((host, port) pairs) that ``header`` selects, in its order."""
    if not trim_space(header):
        return []
    by_host: dict[str, int] = {}
    by_host_port: dict[str, int] = {}
    for position, (host, port) in enumerate(endpoints):
        ip = _bare(host.strip())
        if not ip:
            continue
        by_host[ip] = position  # the last endpoint of a host answers for a bare IP, as the reference's map
        if port.strip():
            by_host_port[f"{ip}:{port.strip()}"] = position
    chosen: list[int] = []
    seen: set[str] = set()  # hosts already selected: one endpoint per host
    for raw in header.split(","):
        item = trim_space(raw)  # Go's strings.TrimSpace, as the reference
        if not item:
            continue
        split = split_host_port(item)
        host, port = (_bare(split[0]), split[1]) if split is not None else (_bare(item), "")
        index = by_host_port.get(f"{host}:{port}") if port else by_host.get(host)
        if index is not None:
            ip = _bare(endpoints[index][0])
            if ip not in seen:
                seen.add(ip)
                chosen.append(index)
    return chosen


def _testing_filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                    params: object) -> list[EndpointState]:
    # Only a header present counts: the reference reads it with its exact (lower case) name.
    header = request.headers.get(SELECTION_HEADER, "")
    pairs = [(s.endpoint.host, str(s.endpoint.port)) for s in candidates]
    return [candidates[i] for i in select(header, pairs)]


register(HEADER_BASED_TESTING_FILTER, PluginType(Category.FILTER))
TESTING_FILTERS = {HEADER_BASED_TESTING_FILTER: _testing_filter}
