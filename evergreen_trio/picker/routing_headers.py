"""The routing headers the picker sets on the upstream request for llm-d's routing sidecar, and
``disagg-headers-handler`` (also ``prefill-header-handler``), sans-IO, as llm-d-router's
(ebab68792, ``profilehandler/disagg/disagg_headers_handler.go``, both deprecated there).

- ``x-prefiller-host-port``: the first endpoint the prefill profile picked (P/D);
- ``x-encoder-hosts-ports``: every endpoint the encode profile picked, comma-separated (E/PD);
- ``x-data-parallel-host-port``: the picked endpoint, when ``data-parallel-profile-handler`` sends
  the request to the pod's primary port;
- ``x-kv-cache-source-host-port``: a peer to pull the prompt's KV blocks from
  (``p2p-source-producer``, :mod:`evergreen_trio.picker.p2p_source`).

A client-sent value of any of them is removed, never forwarded (the reference forwards one that
no plugin of its overwrites).

Data parallelism (:func:`at_primary_port`): the request goes to the picked pod's primary port,
where a proxy reads ``x-data-parallel-host-port`` for the rank (the picked ``ip:port``).

The P/D headers are set by :class:`DisaggHeaders`: the ``disagg-profile-handler``'s (and our
``pd-profile-handler``'s, where the reference's sets none: its configs pair it with a headers
handler), then each declared headers handler's in declaration order. Each clears both headers and
sets them from its own profiles' picks, so the last one decides (the reference runs them in its
plugin map's order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from evergreen_trio.picker.plugins import Category, Params, PluginType, register

PREFILL_HEADER = "x-prefiller-host-port"
ENCODERS_HEADER = "x-encoder-hosts-ports"
DATA_PARALLEL_HEADER = "x-data-parallel-host-port"
KV_CACHE_SOURCE_HEADER = "x-kv-cache-source-host-port"
ROUTING_HEADERS = (PREFILL_HEADER, ENCODERS_HEADER, DATA_PARALLEL_HEADER, KV_CACHE_SOURCE_HEADER)
DISAGG_HEADERS_HANDLER = "disagg-headers-handler"
PREFILL_HEADER_HANDLER = "prefill-header-handler"


@dataclass(frozen=True)
class DisaggHeaders:
    """Whose picks go in the P/D headers: the prefill and the encode profiles, by name."""

    prefill_profile: str = "prefill"
    encode_profile: str = "encode"

    def apply(self, profiles: Mapping[str, Sequence[str]], headers: dict[str, str]) -> str | None:
        """Clear both headers in ``headers`` and set them from ``profiles`` (each profile's picks,
        best first; a profile that did not run is absent); the prefill endpoint, or None."""
        headers.pop(PREFILL_HEADER, None)
        headers.pop(ENCODERS_HEADER, None)
        prefill = profiles.get(self.prefill_profile)
        if prefill:
            headers[PREFILL_HEADER] = prefill[0]
        encoders = profiles.get(self.encode_profile)
        if encoders:
            headers[ENCODERS_HEADER] = ",".join(encoders)
        return prefill[0] if prefill else None


def at_primary_port(picked: Sequence[str], port: int, headers: dict[str, str]) -> list[str]:
    """``picked`` (``host:port`` addresses, best first) at ``port`` instead, the first one named in
    the data-parallel header, as llm-d-router's data-parallel and P/D handlers rewrite them."""
    headers[DATA_PARALLEL_HEADER] = picked[0]
    return [f"{address.rpartition(':')[0]}:{port}" for address in picked]


def _headers_handler(params: Params) -> DisaggHeaders:
    # An empty name is kept, as the reference keeps it: it names no profile, so sets no header.
    return DisaggHeaders(params.text("prefillProfile", "prefill"), params.text("encodeProfile", "encode"))


for _type in (DISAGG_HEADERS_HANDLER, PREFILL_HEADER_HANDLER):
    register(_type, PluginType(Category.PRE_REQUEST, ("prefillProfile", "encodeProfile"), _headers_handler,
                               replaced_by="disagg-profile-handler"))
