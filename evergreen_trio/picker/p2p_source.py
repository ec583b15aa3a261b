"""``p2p-source-producer``, sans-IO: llm-d-router's KV cache source header
(``requestcontrol/dataproducer/p2psource``).

Before scheduling (the reference's ``Produce``), :func:`choose_source` picks a pull source among
the candidates caching within one block of the most prompt tokens, sampled with weight
``1/(1+waiting queue)`` at the request's coordinate (:func:`spread_fraction` of its
``x-request-id``): ties spread over replicas instead of converging on one, a one-request-shorter
queue is mildly preferred, deep queues are starved. After scheduling (``PreRequest``),
:func:`source_header` names that source in ``x-kv-cache-source-host-port`` when it out-caches the
pod computing the prefix (the prefill pick under P/D, else the primary pick) by at least
``minCachedTokenDelta`` tokens, for the routing sidecar to pull the blocks over the P2P connector.

The matches come from the approximate prefix index (the reference's default producer), a
declared ``burst-prefix-cache-producer``, or a declared ``precise-prefix-cache-producer``. The
precise one knows each block's device tier: a source serves pulls from its CPU tier, so only its
leading CPU-tier blocks count as pull-servable, while the computing pod's local blocks count in any
tier. The others have no tiers, so every cached block counts (the reference's path for producers
without tier data).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import fnv_c

from evergreen_trio.picker.plugins import APPROX_PRODUCER, Category, Params, Plugin, PluginType, register

P2P_SOURCE_PRODUCER = "p2p-source-producer"
CPU_TIER = "cpu"
"""The device tier a pull is served from (the reference's ``cpuDeviceTier``)."""
REQUEST_ID_HEADER = "x-request-id"
# Bytes of x-request-id hashed: a request id is a UUID (36); a client's 60 KiB one would cost
# milliseconds of pure-Python hashing per request, so longer ones hash their first 256 bytes.
MAX_REQUEST_ID_BYTES = 256


@dataclass(frozen=True)
class P2PSourceParams:
    """The producer's parameters: whose matches it reads ("" the approximate prefix index, else a
    declared burst or precise producer's name), the least token lead that sets the header, and the P/D
    prefill profile whose pick computes the prefix."""

    producer: str = ""
    min_cached_token_delta: int = 1
    prefill_profile: str = "prefill"


def _p2p_source(params: Params) -> P2PSourceParams:
    producer = params.text("prefixMatchInfoProducerName", "")  # epp_config checks it names a declared producer
    delta = params.integer("minCachedTokenDelta", 1, minimum=1)
    prefill = params.text("prefillProfileName", "prefill") or "prefill"  # empty: the default, as the reference
    return P2PSourceParams("" if producer == APPROX_PRODUCER else producer, delta, prefill)


register(P2P_SOURCE_PRODUCER, PluginType(
    Category.PRODUCER, ("prefixMatchInfoProducerName", "minCachedTokenDelta", "prefillProfileName"), _p2p_source))


def p2p_sources(plugins: Mapping[str, Plugin]) -> list[P2PSourceParams]:
    """The declared producers' parameters, in declaration order."""
    return [p.params for p in plugins.values() if isinstance(p.params, P2PSourceParams)]


def reads_prefix_index(plugins: Mapping[str, Plugin]) -> bool:
    """Whether a declared producer reads the approximate prefix index (prompts must be hashed)."""
    return any(not params.producer for params in p2p_sources(plugins))


@dataclass(frozen=True)
class Peer:
    """A candidate as a pull source: its ``host:port``, the prompt tokens it could serve a pull
    from, its block size in tokens and its waiting queue (0 without metrics)."""

    address: str
    cached_tokens: int
    block_tokens: int
    waiting: float = 0.0


def spread_fraction(request_id: str) -> float:
    """``request_id``'s FNV-1a 32-bit hash over 2**32: a coordinate in [0, 1), the same for the
    same request (the bytes Envoy sent, the first :data:`MAX_REQUEST_ID_BYTES`; a value beyond
    latin-1 as UTF-8, as Go reads a string)."""
    try:
        data = request_id.encode("latin-1")
    except UnicodeEncodeError:
        data = request_id.encode()
    hashed: int = fnv_c.fnv1a_32(data[:MAX_REQUEST_ID_BYTES])
    return hashed / 2**32


def choose_source(peers: Sequence[Peer], coordinate: float) -> Peer | None:
    """The peer sampled at ``coordinate`` (in [0, 1)) among those within one block of the most
    cached tokens, weighted by ``1/(1+waiting)``; None when no peer caches anything."""
    cached = [p for p in peers if p.cached_tokens > 0]
    if not cached:
        return None
    most = max(p.cached_tokens for p in cached)
    band = [p for p in cached if p.cached_tokens + p.block_tokens >= most]
    weights = [1.0 / (1.0 + (p.waiting if p.waiting > 0 else 0.0)) for p in band]  # NaN or < 0: none
    target = coordinate * sum(weights)
    for peer, weight in zip(band, weights, strict=True):
        if target < weight:
            return peer
        target -= weight
    return band[-1]  # rounding left the coordinate past the last weight


def computing_endpoint(params: P2PSourceParams, profiles: Mapping[str, Sequence[str]],
                       primary: Sequence[str]) -> str | None:
    """The pod computing the prefix: the prefill profile's first pick when it picked one, else the
    primary profile's."""
    prefill = profiles.get(params.prefill_profile)
    chosen = prefill or primary
    return chosen[0] if chosen else None


def source_header(params: P2PSourceParams, source: Peer | None, computing: str | None,
                  computing_cached: int) -> str | None:
    """The header's value: ``source``'s address when it is not the computing pod and caches at
    least ``minCachedTokenDelta`` more tokens than that pod's ``computing_cached``; else None."""
    if source is None or computing is None or source.address == computing:
        return None
    if source.cached_tokens - computing_cached < params.min_cached_token_delta:
        return None
    return source.address
