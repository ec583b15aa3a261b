"""``program-aware-fairness`` (llm-d-router's fairness/program-aware), sans-IO.

A program is a fairness id. Each declared plugin is one :class:`ProgramAware`: the bands whose
``fairnessPolicyRef`` names it share it, and it follows every scheduled request whatever its band
(the reference's PreRequest and end-of-stream hooks): dispatched and in-flight counts, the mean
queue wait of the requests it picked itself, and (strategy ``las``, Least Attained Service) the
program's attained service, prompt tokens + 2 x completion tokens, halved every
``lasHalfLifeSeconds`` of wall time. :meth:`ProgramAware.pick` scores each flow
``lasWeightService`` x (1 - service range-normalised over the band's flows) + ``lasWeightHeadWait``
x (head wait in whole ms, range-normalised), a range of one value normalising to 0.5, and takes
the best (ties at random, as the reference's map order). A program with nothing in flight and no
completion for ``evictionTtlSeconds`` (0: never) is forgotten by a sweep every
``evictionSweepSeconds``, applied lazily: state only changes on calls, so sweeping once at the
last sweep time before a call forgets what the periodic sweeps would have.

Program ids come from clients (a fairness header, an agent identity), so a plugin keeps at most
:data:`MAX_PROGRAMS`: a new one past it makes the program longest without activity and nothing in
flight go first (the reference keeps every program until its TTL).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugin_state import finite
from evergreen_trio.picker.plugins import Category, Params, PluginType, register
from evergreen_trio.picker.usage import Usage

PROGRAM_AWARE = "program-aware-fairness"
STRATEGIES = ("las", "")  # "" is las too, as in the reference
_INPUT_TOKEN_WEIGHT, _OUTPUT_TOKEN_WEIGHT = 1, 2
MAX_PROGRAMS = 65_536


@dataclass(frozen=True)
class ProgramAwareParams:
    """The plugin's parameters (strategy ``las``, the only one), in seconds."""

    eviction_ttl_s: float = 3600.0
    eviction_sweep_s: float = 300.0
    weight_service: float = 0.8
    weight_head_wait: float = 0.2
    half_life_s: float = 60.0


def _params(params: Params) -> ProgramAwareParams:
    # The reference validates the numbers before the strategy: the same field is named first.
    ttl = params.number("evictionTtlSeconds", 3600.0)
    sweep = params.number("evictionSweepSeconds", 300.0)
    if sweep <= 0:
        raise ConfigError(params.where("evictionSweepSeconds"), "a number > 0", sweep)
    result = ProgramAwareParams(ttl, sweep, params.number("lasWeightService", 0.8),
                                params.number("lasWeightHeadWait", 0.2),
                                params.number("lasHalfLifeSeconds", 60.0))
    params.text("strategy", "las", choices=STRATEGIES)
    return result


register(PROGRAM_AWARE, PluginType(Category.OTHER, (
    "strategy", "evictionTtlSeconds", "evictionSweepSeconds", "lasWeightService", "lasWeightHeadWait",
    "lasHalfLifeSeconds"), _params))


@dataclass
class Program:
    """One program's metrics and attained service; ``decayed_at`` is when decay was last folded in."""

    last_completion: float
    in_flight: int = 0
    dispatched: int = 0
    wait_count: int = 0
    mean_wait_ms: float = 0.0
    service: float = 0.0
    decayed_at: float | None = None


def _range_normalize(value: float, low: float, high: float) -> float:
    return 0.5 if high == low else (value - low) / (high - low)


class ProgramAware:
    """One declared ``program-aware-fairness`` plugin's state; times are the queue's clock, seconds."""

    def __init__(self, params: ProgramAwareParams, now: float, rng: random.Random | None = None) -> None:
        self.params = params
        self.programs: dict[str, Program] = {}  # the least recently active first
        self.max_programs = MAX_PROGRAMS
        self.rng = rng or random.Random()
        self._sweep_origin = now
        self._sweeps = 0

    def program(self, program_id: str, now: float) -> Program:
        """The program's entry, made on first sight (its completion clock starts then, so a
        program that never completes is forgotten after the TTL too)."""
        self._sweep(now)
        entry = self.programs.pop(program_id, None)  # put back last: the most recently active
        if entry is None:
            entry = Program(last_completion=now)
            while len(self.programs) >= self.max_programs:
                # Passes over the ones in flight, no more of them than requests in flight.
                oldest = next((p for p, e in self.programs.items() if e.in_flight == 0), None)
                if oldest is None:
                    break
                del self.programs[oldest]
        self.programs[program_id] = entry
        return entry

    def service(self, entry: Program, now: float) -> float:
        """The attained service with the decay up to ``now`` folded in."""
        if entry.decayed_at is None:
            entry.decayed_at = now
        elif now > entry.decayed_at:
            if self.params.half_life_s > 0:
                entry.service *= math.exp2(-(now - entry.decayed_at) / self.params.half_life_s)
            entry.decayed_at = now
        return entry.service

    def pick(self, head_enqueued_at: Mapping[str, float], now: float) -> str | None:
        """The flow to serve next among a band's non-empty flows (id -> its head's enqueue time)."""
        scored = []
        for program_id, enqueued_at in head_enqueued_at.items():
            # Whole milliseconds, as the reference's Duration.Milliseconds().
            scored.append((program_id, self.service(self.program(program_id, now), now),
                           float(int((now - enqueued_at) * 1000))))
        if not scored:
            return None
        services = [service for _, service, _ in scored]
        waits = [wait for _, _, wait in scored]
        low_service, high_service, low_wait, high_wait = min(services), max(services), min(waits), max(waits)
        best: list[str] = []
        best_score = -math.inf
        for program_id, service, wait in scored:
            score = (self.params.weight_service * (1 - _range_normalize(service, low_service, high_service))
                     + self.params.weight_head_wait * _range_normalize(wait, low_wait, high_wait))
            if score > best_score:
                best, best_score = [program_id], score
            elif score == best_score:
                best.append(program_id)
        return self.rng.choice(best) if best else None

    def dispatched(self, program_id: str, picked_enqueued_at: float | None, now: float) -> None:
        """A request of the program was scheduled; ``picked_enqueued_at`` is its enqueue time when
        a program-aware pick chose it (its wait then counts in the mean)."""
        entry = self.program(program_id, now)
        entry.in_flight += 1
        entry.dispatched += 1
        if picked_enqueued_at is not None:
            entry.wait_count += 1
            entry.mean_wait_ms += (int((now - picked_enqueued_at) * 1000) - entry.mean_wait_ms) / entry.wait_count

    def completed(self, program_id: str, usage: Usage | None, now: float) -> None:
        """A scheduled request of the program ended (its response, or its stream): its tokens add
        to the program's service after the pending decay."""
        entry = self.program(program_id, now)
        prompt = (usage.prompt_tokens or 0) if usage is not None else 0
        completion = (usage.completion_tokens or 0) if usage is not None else 0
        self.service(entry, now)
        entry.service += _INPUT_TOKEN_WEIGHT * prompt + _OUTPUT_TOKEN_WEIGHT * completion
        entry.in_flight -= 1
        entry.last_completion = now

    def _sweep(self, now: float) -> None:
        ttl, interval = self.params.eviction_ttl_s, self.params.eviction_sweep_s
        if ttl <= 0:
            return
        sweeps = (now - self._sweep_origin) // interval
        if not math.isfinite(sweeps):  # an interval so small the count overflows: it sweeps all the time
            at = now
        elif sweeps > self._sweeps:
            self._sweeps = int(sweeps)
            at = self._sweep_origin + sweeps * interval
        else:
            return
        for program_id in [p for p, e in self.programs.items() if e.in_flight == 0 and at - e.last_completion > ttl]:
            del self.programs[program_id]

    def dump_state(self, now: float) -> dict[str, object]:
        """The reference's ``DumpState`` at ``now`` (the sweeps due by then applied first): how
        many programs it tracks, their requests in flight, and Jain's fairness index of their mean
        queue waits (the programs with a wait); never the program ids, which clients choose."""
        self._sweep(now)
        total, square, waited = 0.0, 0.0, 0
        for entry in self.programs.values():
            if entry.wait_count > 0:
                total, square, waited = total + entry.mean_wait_ms, square + entry.mean_wait_ms ** 2, waited + 1
        index = 1.0 if waited <= 1 or square == 0 else total * total / (waited * square)
        return {"totalPrograms": len(self.programs), "totalInFlight": sum(e.in_flight for e in self.programs.values()),
                "fairnessIndex": finite(index)}
