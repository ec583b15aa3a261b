"""``burst-prefix-cache-producer``, sans-IO: llm-d-router's burst co-location
(``requestcontrol/dataproducer/burstprefix``).

Requests arriving within ``windowDurationMs`` are batched (:class:`BurstWindow`) and, once the
window seals, assigned jointly by :func:`assign` (a port of the reference's ``assign.go``): requests
with an identical prompt prefix form a unit kept on one replica (up to ``maxPerReplica`` per
replica), prefix-sharing single requests (``minColocateBlocks``) attach to replicas already holding
their prefix while under their fair share, and everything else is balanced by request count or
prefix blocks (``balanceBy``). A ``prefix-cache-scorer`` whose ``prefixMatchInfoProducerName``
names the producer then sees a full match on the assigned replica and none elsewhere
(:func:`burst_match`). A request that shares nothing in its window gets no affinity.

The Trio shell seals each window on time (:func:`evergreen_trio.picker.burst_shell.seal_windows`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register
from evergreen_trio.picker.precise_prefix import PRECISE_PRODUCER, check_precise

BURST_PREFIX_PRODUCER = "burst-prefix-cache-producer"
UNLIMITED = -1  # maxPerReplica / maxBatchSize: no cap
MAX_WINDOW_MS = 10_000
DEFAULT_MAX_PREFIX_BLOCKS = 2048
BALANCE_MODES = ("requests", "tokens")
# The request attribute a sealed window leaves: (data type, producer name) -> "<tokens>@<address>".
MATCH_INFO_TYPE = "PrefixCacheMatchInfo"
PREFIX_SCORERS = ("prefix-cache-scorer", "multicluster-prefix-cache-scorer")  # the second: the first, renamed
# The plugin types whose prefixMatchInfoProducerName names the producer of their matches, and the
# parameters' field holding it.
PRODUCER_READERS = {**dict.fromkeys(PREFIX_SCORERS, "producer"), "p2p-source-producer": "producer",
                    "predicted-latency-producer": "prefix_producer", "latency-scorer": "prefix_producer"}
PRODUCE_TIMEOUT_MARGIN_S = 0.3  # the reference's produceTimeoutMargin: a request waits at most window + this


@dataclass(frozen=True)
class BurstParams:
    """The producer's parameters, checked as the reference's ``newDataProducer`` checks them."""

    window_ms: int = 100
    max_per_replica: int = UNLIMITED
    block_size_tokens: int = 64
    max_prefix_tokens: int = 0
    min_colocate_blocks: int = 0
    max_batch_size: int = 1000
    balance_by: str = "requests"

    @property
    def max_blocks(self) -> int:
        """Leading blocks hashed per prompt: ``maxPrefixTokensToMatch / blockSizeTokens``, or 2048."""
        return self.max_prefix_tokens // self.block_size_tokens if self.max_prefix_tokens else DEFAULT_MAX_PREFIX_BLOCKS


def _unlimited_or_positive(params: Params, key: str, default: int) -> int:
    value = params.integer(key, default, minimum=UNLIMITED)
    if value == 0:
        raise ConfigError(params.where(key), "-1 (unlimited) or an integer >= 1", value)
    return value


def _burst(params: Params) -> BurstParams:
    window = params.integer("windowDurationMs", 100, minimum=1, maximum=MAX_WINDOW_MS)
    per_replica = _unlimited_or_positive(params, "maxPerReplica", UNLIMITED)
    block = params.integer("blockSizeTokens", 64, minimum=1)
    max_tokens = params.integer("maxPrefixTokensToMatch", 0)
    if 0 < max_tokens < block:
        raise ConfigError(params.where("maxPrefixTokensToMatch"), f"0 or >= blockSizeTokens ({block})", max_tokens)
    colocate = params.integer("minColocateBlocks", 0)
    batch = _unlimited_or_positive(params, "maxBatchSize", 1000)
    balance = params.text("balanceBy", "requests") or "requests"
    if balance not in BALANCE_MODES:
        raise ConfigError(params.where("balanceBy"), " | ".join(BALANCE_MODES), balance)
    return BurstParams(window, per_replica, block, max_tokens, colocate, batch, balance)


register(BURST_PREFIX_PRODUCER, PluginType(
    Category.PRODUCER, ("windowDurationMs", "maxPerReplica", "blockSizeTokens", "maxPrefixTokensToMatch",
                        "minColocateBlocks", "maxBatchSize", "balanceBy"), _burst))


def burst_producers(plugins: Mapping[str, Plugin]) -> dict[str, BurstParams]:
    """The declared burst producers by plugin name."""
    return {name: p.params for name, p in plugins.items() if isinstance(p.params, BurstParams)}


# -- the assignment (assign.go) -------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """A candidate endpoint as the assignment sees it: its address and running requests (ties)."""

    address: str
    running: float = 0.0


@dataclass(eq=False)
class BurstEntry:
    """One request in a window: its prefix block hashes, its candidates, and (once sealed) the
    replica it is steered to (None: no affinity). ``on_sealed`` is called once the window seals."""

    hashes: tuple[int, ...]
    replicas: tuple[Replica, ...]
    assigned: str | None = None
    on_sealed: Callable[[BurstEntry], None] | None = None


def _shared_prefix_keys(groups: Mapping[tuple[int, ...], list[BurstEntry]], min_colocate: int) -> set[tuple[int, ...]]:
    """The group keys sharing at least ``min_colocate`` leading blocks with another request."""
    if min_colocate <= 0:
        return set()
    count: dict[tuple[int, ...], int] = {}
    signature: dict[tuple[int, ...], tuple[int, ...]] = {}
    for key, members in groups.items():
        if len(key) < min_colocate:
            continue
        signature[key] = key[:min_colocate]
        count[key[:min_colocate]] = count.get(key[:min_colocate], 0) + len(members)
    return {key for key, sig in signature.items() if count[sig] >= 2}


class _BatchIndex:
    """Which replicas hold each block placed so far in this batch (a whole prefix is added at
    once, so holding block i implies holding blocks 0..i)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}

    def add(self, hashes: Sequence[int], replica: str) -> None:
        for h in hashes:
            self.holders.setdefault(h, set()).add(replica)

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        result: dict[str, int] = {}
        for h in hashes:
            holders = self.holders.get(h)
            if not holders:
                break
            for name in holders:
                result[name] = result.get(name, 0) + 1
        return result


def assign(entries: Sequence[BurstEntry], max_per_replica: int, min_colocate: int, by_tokens: bool) -> None:
    """Set each entry's ``assigned`` replica so prompt-sharing requests co-locate (assign.go).

    Identical groups (two or more requests, one prompt prefix) are units; so is a single request
    sharing ``min_colocate`` leading blocks with another one (when ``min_colocate`` > 0). Units are
    placed longest prefix first, groups before singles; the replicas are the first prefixed entry's.
    """
    groups: dict[tuple[int, ...], list[BurstEntry]] = {}
    replicas: tuple[Replica, ...] = ()
    for entry in entries:
        if not entry.hashes:
            continue
        groups.setdefault(entry.hashes, []).append(entry)
        if not replicas:
            replicas = entry.replicas
    if not replicas:
        return
    shared = _shared_prefix_keys(groups, min_colocate)
    group_units = [key for key, members in groups.items() if len(members) >= 2]
    single_units = [key for key, members in groups.items() if len(members) < 2 and key in shared]
    if not group_units and not single_units:
        return
    # Longest prefix first (stable): a longer prefix seeds more blocks for shorter units to match.
    group_units.sort(key=len, reverse=True)
    single_units.sort(key=len, reverse=True)
    total = sum(len(key) if by_tokens else len(groups[key]) for key in (*group_units, *single_units))
    max_share = -(-total // len(replicas))  # ceil: the fair share per replica
    index = _BatchIndex()
    load: dict[str, int] = {}
    for key in (*group_units, *single_units):
        _place(groups[key], replicas, max_per_replica, min_colocate, max_share, index, load, by_tokens)


def _place(members: list[BurstEntry], replicas: Sequence[Replica], k: int, min_colocate: int, max_share: int,
           index: _BatchIndex, load: dict[str, int], by_tokens: bool) -> None:
    """Place one unit: its first replica by prefix preference under the fair share, the rest
    (when ``k`` caps it) on the least loaded; then record its blocks."""
    hashes = members[0].hashes
    prefer = min_colocate > 0
    matches = index.longest_prefix(hashes) if prefer or by_tokens else {}
    per_replica: dict[str, int] = {}
    i = 0
    while i < len(members):
        target = _pick(replicas, per_replica, k, load, matches, min_colocate, max_share, prefer)
        run = len(members) - i
        if k != UNLIMITED:
            run = min(run, max(k - per_replica.get(target, 0), 1))  # over k * replicas: one, then rebalance
        for member in members[i : i + run]:
            member.assigned = target
        first_touch = per_replica.get(target, 0) == 0
        per_replica[target] = per_replica.get(target, 0) + run
        if not by_tokens:
            load[target] = load.get(target, 0) + run
        elif first_touch:  # the prefix is charged once per replica, less the blocks already held there
            load[target] = load.get(target, 0) + max(len(hashes) - matches.get(target, 0), 0)
        i += run
        prefer = False  # only the unit's first replica gets the prefix preference
    for member in members:
        if member.assigned is not None:
            index.add(hashes, member.assigned)


def _pick(replicas: Sequence[Replica], per_replica: Mapping[str, int], k: int, load: Mapping[str, int],
          matches: Mapping[str, int], min_colocate: int, max_share: int, prefer: bool) -> str:
    if prefer:
        best: Replica | None = None
        best_match = 0
        for replica in replicas:
            name = replica.address
            if (k != UNLIMITED and per_replica.get(name, 0) >= k) or load.get(name, 0) >= max_share:
                continue
            match = matches.get(name, 0)
            if match < min_colocate:
                continue
            if best is None or match > best_match or (match == best_match and _less(replica, best, load)):
                best, best_match = replica, match
        if best is not None:
            return best.address
    open_ = [r for r in replicas if k == UNLIMITED or per_replica.get(r.address, 0) < k]
    chosen = open_[0] if open_ else replicas[0]
    for replica in open_ or replicas:
        if _less(replica, chosen, load):
            chosen = replica
    return chosen.address


def _less(a: Replica, b: Replica, load: Mapping[str, int]) -> bool:
    """Whether ``a`` is preferred: lower batch load, then fewer running requests, then lower name."""
    return (load.get(a.address, 0), a.running, a.address) < (load.get(b.address, 0), b.running, b.address)


# -- the window ---------------------------------------------------------------------------------


@dataclass
class BurstWindow:
    """One producer's batching: requests join the open window; :meth:`seal` (the shell calls it at
    :attr:`deadline`) assigns the batch and tells each entry. ``clock`` is in seconds."""

    name: str
    params: BurstParams
    clock: Callable[[], float]
    entries: list[BurstEntry] = field(default_factory=list)
    deadline: float | None = None  # when the open window seals (None: no window open)
    on_open: Callable[[], None] | None = None  # the shell's wake-up, called when a window opens

    def join(self, hashes: Sequence[int], replicas: Sequence[Replica],
             on_sealed: Callable[[BurstEntry], None]) -> BurstEntry | None:
        """Add a request to the open window (opening one); None when the window holds
        ``maxBatchSize`` requests already (the reference's producer error: no affinity, no wait)."""
        limit = self.params.max_batch_size
        if limit != UNLIMITED and len(self.entries) >= limit:
            return None
        entry = BurstEntry(tuple(hashes), tuple(replicas), on_sealed=on_sealed)
        self.entries.append(entry)
        if self.deadline is None:
            self.deadline = self.clock() + self.params.window_ms / 1000
            if self.on_open is not None:
                self.on_open()
        return entry

    def seal(self) -> list[BurstEntry]:
        """Close the window: assign its entries, call each one's ``on_sealed``, return them."""
        entries, self.entries, self.deadline = self.entries, [], None
        assign(entries, self.params.max_per_replica, self.params.min_colocate_blocks,
               self.params.balance_by == "tokens")
        for entry in entries:
            callback, entry.on_sealed = entry.on_sealed, None
            if callback is not None:
                callback(entry)
        return entries

    def match_attribute(self, entry: BurstEntry) -> dict[tuple[str, str], str]:
        """The request attribute that readers naming this producer read once its window sealed: the
        prompt's tokens in its blocks, matched in full on the assigned replica and nowhere else (no
        replica: no affinity), as the reference's producer puts its match info on every candidate."""
        tokens = len(entry.hashes) * self.params.block_size_tokens
        return {(MATCH_INFO_TYPE, self.name): f"{tokens}@{entry.assigned or ''}"}


def burst_info(attributes: Mapping[tuple[str, str], str], producer: str) -> tuple[str, int] | None:
    """(the replica assigned, "" for none; the prompt's tokens in its blocks) that burst producer
    ``producer`` left on a request, if its window sealed with the request in it."""
    value = attributes.get((MATCH_INFO_TYPE, producer))
    if value is None:
        return None
    tokens, _, address = value.partition("@")
    return address, int(tokens)


def burst_match(attributes: Mapping[tuple[str, str], str], producer: str) -> tuple[str, int] | None:
    """(assigned address, matched tokens) that producer ``producer`` left on a request, if it
    assigned one."""
    info = burst_info(attributes, producer)
    return info if info is not None and info[0] else None


def check_producers(plugins: Mapping[str, Plugin], where: Callable[[str], str]) -> None:
    """At most one burst producer, and each ``prefixMatchInfoProducerName`` of a
    :data:`PRODUCER_READERS` type names the approximate producer or a declared burst or precise
    producer; ``where(name)`` is the plugin's parameters path."""
    bursts = burst_producers(plugins)
    if len(bursts) > 1:
        raise ConfigError(where(list(bursts)[1]), f"at most one {BURST_PREFIX_PRODUCER} (this picker runs one)",
                          list(bursts))
    precise = check_precise(plugins, where)
    for name, plugin in plugins.items():
        field_name = PRODUCER_READERS.get(plugin.type)
        producer = getattr(plugin.params, field_name, "") if field_name else ""
        if producer and producer not in bursts and producer not in precise:
            raise ConfigError(f"{where(name)}.prefixMatchInfoProducerName",
                              f"approx-prefix-cache-producer or a declared {BURST_PREFIX_PRODUCER}'s or "
                              f"{PRECISE_PRODUCER}'s name", producer)
