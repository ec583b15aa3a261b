"""Routing: the picker against Envoy's round robin over the same 4 simulated vLLM servers.

One gateway process (``evergreen-trio gateway --simulate 4 --round-robin-port 0``) per run, so
every run starts from cold caches: the same Envoy serves the picker route and the round-robin
listener. The load generator (this process, httpx on Trio) sends open-loop Poisson arrivals of
streaming chat completions: 16 long system prompts (apps), each with its model (half the base
model, half one of 4 LoRA adapters), and a fresh user message per request. The rates are 0.5x,
0.8x, 1.0x and 1.2x of the pool's saturation rate, measured first with a closed loop through
round robin (the capacity of the pool without smart routing). Each run sends 48 requests that
warm the caches (3 per app) and 112 measured ones; each (policy, load) runs 3 times with the same
arrivals for both policies, and the table shows each metric's median.

The burst comparison sends 100 requests at once (all arrive between two metric scrapes: the
pool is scraped every 500 ms there) to a cold pool, through the picker scoring scraped metrics
only, then through the picker that also counts its own in-flight requests
(``active-request-scorer``, weight 2): with scraped metrics only, every pick of the burst sees the
same numbers.

The simulated servers model a GPU (50 us per uncached prompt token, 5 ms per decode step, a
KV cache of 512 blocks) slowed down 8x (``time_scale``), so Python's own per-request cost on a
small machine stays small beside the simulated work.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import trio

from benchmarks._harness import RESULTS_DIR, Row, percentile, print_table, write_results

T = TypeVar("T")
AREA = "routing"
SERVERS = 4
LOADS = (0.5, 0.8, 1.0, 1.2)
APPS = 16
SYSTEM_PROMPT_CHARS = 4800  # about 1200 tokens
BASE_MODEL = "llama"
ADAPTERS = ("lora-a", "lora-b", "lora-c", "lora-d")
SIM_ARGS = (
    "--sim-max-batch", "16", "--sim-kv-blocks", "512", "--sim-prefill-us-per-token", "50",
    "--sim-decode-ms-per-token", "5", "--sim-decode-batch-factor", "0.03", "--sim-max-loras", "2",
    "--sim-lora-load-ms", "25", "--sim-time-scale", "8",
)
WEIGHTS = "queue: 2, kv-cache: 2, prefix-cache: 3, lora-affinity: 1"


def pool_yaml(weights: str = WEIGHTS, refresh: str = "50ms") -> str:
    """The gateway's picker config: the models, ``weights`` and the scrape interval."""
    return "\n".join([
        f"pool: {{name: bench, endpoints: [127.0.0.1:1], refreshMetricsInterval: {refresh}}}",
        "models:",
        *(f"  - {{name: {name}, criticality: Standard}}" for name in (BASE_MODEL, *ADAPTERS)),
        f"scheduler: {{weights: {{{weights}}}}}",
        "",
    ])


POOL_YAML = pool_yaml()
BURST = 100
BURST_REFRESH = "500ms"
# Burst variants: name -> scheduler weights.
BURST_POLICIES = {"scraped only": WEIGHTS + ", active-request: 0", "in-flight": WEIGHTS + ", active-request: 2"}
_WORDS = ("alpha", "river", "stone", "green", "cloud", "tree", "light", "quiet", "model", "route", "token")


@dataclass
class Outcome:
    """One request as the client saw it (seconds from the run's start)."""

    sent: float
    status: int = 0
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    served_by: str = ""
    error: str = ""


@dataclass
class Result:
    policy: str
    load: float
    rate: float
    completed_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p90_ms: float
    status_429: int
    errors: int
    unfinished: int
    prefix_hit_rate: float
    requests: int
    busiest_server_share: float
    """The share of requests the busiest server got (0.25 is perfectly even over 4)."""
    error_kinds: dict[str, int] = field(default_factory=dict)
    extra: dict[str, list[float]] = field(default_factory=dict)


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


class Workload:
    """Deterministic requests: app k has system prompt k and model k's; each user message is new."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.prompts = [f"You are assistant #{k}. " + _text(rng, SYSTEM_PROMPT_CHARS) for k in range(APPS)]
        self.models = [BASE_MODEL if k % 2 == 0 else ADAPTERS[(k // 2) % len(ADAPTERS)] for k in range(APPS)]
        self.rng = random.Random(seed + 1)

    def body(self, index: int) -> dict[str, object]:
        app = self.rng.randrange(APPS)
        user = f"user {index}: " + _text(self.rng, self.rng.randint(200, 500))
        return {
            "model": self.models[app],
            "messages": [{"role": "system", "content": self.prompts[app]}, {"role": "user", "content": user}],
            "max_tokens": self.rng.randint(8, 16),
            "stream": True,
            "stream_options": {"include_usage": True},
        }


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object], outcome: Outcome, start: float) -> None:
    try:
        async with client.stream("POST", url, json=body) as response:
            outcome.status = response.status_code
            outcome.served_by = response.headers.get("x-served-by", "")
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode(errors="replace")[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if outcome.first_token is None and '"choices":[{' in line:
                    outcome.first_token = trio.current_time() - start
                elif line == "data: [DONE]":
                    outcome.done = trio.current_time() - start
                elif '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
                    outcome.prompt_tokens = usage["prompt_tokens"]
                    outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    except httpx.HTTPError as error:
        outcome.status = -1
        outcome.error = f"{type(error).__name__}: {error}"


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=2000))


async def open_loop(url: str, rate: float, count: int, drain: float, seed: int) -> list[Outcome]:
    """``count`` Poisson arrivals at ``rate``, then up to ``drain`` s for the last ones to finish."""
    workload = Workload(seed)
    arrivals_rng = random.Random(seed + 2)
    outcomes: list[Outcome] = []
    endpoint = f"{url}/v1/chat/completions"
    async with _client() as client, trio.open_nursery() as nursery:
        start = trio.current_time()
        at = 0.0
        for index in range(count):
            at += arrivals_rng.expovariate(rate)
            await trio.sleep_until(start + at)
            outcome = Outcome(sent=at)
            outcomes.append(outcome)
            nursery.start_soon(_one, client, endpoint, workload.body(index), outcome, start)
        nursery.cancel_scope.deadline = start + at + drain
    return outcomes


async def burst(url: str, count: int, drain: float, seed: int) -> list[Outcome]:
    """``count`` requests sent at once, then up to ``drain`` s for them to finish."""
    workload = Workload(seed)
    outcomes = [Outcome(sent=0.0) for _ in range(count)]
    endpoint = f"{url}/v1/chat/completions"
    async with _client() as client, trio.open_nursery() as nursery:
        start = trio.current_time()
        for index, outcome in enumerate(outcomes):
            nursery.start_soon(_one, client, endpoint, workload.body(index), outcome, start)
        nursery.cancel_scope.deadline = start + drain
    return outcomes


@dataclass
class BurstResult:
    policy: str
    requests: int
    ok: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    last_done_ms: float
    busiest_server_share: float
    per_server: list[int]
    """Requests each server got, most first."""


def summarize_burst(policy: str, outcomes: list[Outcome]) -> BurstResult:
    ok = [o for o in outcomes if o.status == 200 and o.done is not None]
    ttft = [(o.first_token or 0.0) - o.sent for o in ok]
    counts = sorted(Counter(o.served_by for o in ok).values(), reverse=True)
    return BurstResult(policy, len(outcomes), len(ok), 1000 * percentile(ttft, 50), 1000 * percentile(ttft, 90),
                       1000 * max((o.done or 0.0 for o in ok), default=0.0),
                       counts[0] / max(len(ok), 1) if counts else 0.0, counts)


def plot_burst(results: list[BurstResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (share, latency) = plt.subplots(1, 2, figsize=(9, 4))
    names = [r.policy for r in results]
    for rank in range(SERVERS):
        bottoms = [sum(r.per_server[:rank]) for r in results]
        heights = [r.per_server[rank] if rank < len(r.per_server) else 0 for r in results]
        share.bar(names, heights, bottom=bottoms, label=f"server #{rank + 1} (busiest first)")
    share.set_ylabel("requests served")
    share.set_title(f"{BURST} requests between two scrapes")
    share.legend(fontsize=7)
    x = range(len(results))
    latency.bar([i - 0.2 for i in x], [r.ttft_p50_ms for r in results], 0.4, label="TTFT p50")
    latency.bar([i + 0.2 for i in x], [r.ttft_p90_ms for r in results], 0.4, label="TTFT p90")
    latency.set_xticks(list(x), names)
    latency.set_ylabel("ms")
    latency.set_title("burst latency")
    latency.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_burst(workdir: Path, repeats: int) -> list[BurstResult]:
    """Each burst policy ``repeats`` times on a fresh gateway; the run with the median TTFT p90."""
    results = []
    for policy, weights in BURST_POLICIES.items():
        config = workdir / f"burst-{len(results)}.yaml"
        config.write_text(pool_yaml(weights, BURST_REFRESH))
        runs = []
        for repeat in range(repeats):
            gateway = Gateway(config)
            try:
                outcomes = trio.run(partial(burst, gateway.picker_url, BURST, 120.0, seed=11 + repeat))
            finally:
                gateway.close()
            runs.append(summarize_burst(policy, outcomes))
            print(f"  burst {policy:12} served {runs[-1].per_server} TTFT p90 {runs[-1].ttft_p90_ms:.0f} ms",
                  flush=True)
        results.append(sorted(runs, key=lambda r: r.ttft_p90_ms)[len(runs) // 2])
    return results


async def closed_loop(url: str, concurrency: int, duration: float, warmup: float, seed: int) -> float:
    """Completed requests/s with ``concurrency`` requests always in flight (after ``warmup``)."""
    workload = Workload(seed)
    finished: list[float] = []
    endpoint = f"{url}/v1/chat/completions"

    async def worker(start: float) -> None:
        while True:
            outcome = Outcome(sent=trio.current_time() - start)
            await _one(client, endpoint, workload.body(len(finished)), outcome, start)
            if outcome.done is not None:
                finished.append(outcome.done)

    async with _client() as client, trio.open_nursery() as nursery:
        start = trio.current_time()
        for _ in range(concurrency):
            nursery.start_soon(worker, start)
        nursery.cancel_scope.deadline = start + duration
    return sum(1 for t in finished if t >= warmup) / (duration - warmup)


class Gateway:
    """``evergreen-trio gateway`` in a child process; its URLs come from the lines it prints."""

    def __init__(self, config: Path) -> None:
        command = [sys.executable, "-m", "evergreen_trio.cli", "--log-level", "WARNING", "gateway",
                   "--config", str(config), "--simulate", str(SERVERS), "--listen", "127.0.0.1:0",
                   "--round-robin-port", "0", *SIM_ARGS]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.process.stdout is not None
        lines = []
        for line in self.process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        else:
            raise RuntimeError(f"gateway exited with {self.process.wait()}: {''.join(lines)}")
        urls = {line[:12].strip(): line[12:].split()[0] for line in lines if line[:12].strip()}
        self.picker_url = urls["gateway"]
        self.round_robin_url = urls["round robin"]
        self.endpoints = [line.split()[1] for line in lines if line.startswith("endpoint ")]

    def close(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def summarize(policy: str, load: float, rate: float, everything: list[Outcome], warmup: int) -> Result:
    """Latencies of the requests after the first ``warmup``; throughput = completions while those were sent."""
    outcomes = everything[warmup:]
    start, end = outcomes[0].sent, outcomes[-1].sent
    window = end - start
    completed = sum(1 for o in everything if o.done is not None and start <= o.done <= end)
    ok = [o for o in outcomes if o.status == 200 and o.done is not None]
    ttft = [(o.first_token or 0.0) - o.sent for o in ok]
    e2e = [(o.done or 0.0) - o.sent for o in ok]
    prompt = sum(o.prompt_tokens for o in ok)
    return Result(
        policy=policy, load=load, rate=rate,
        completed_per_s=completed / window,
        ttft_p50_ms=1000 * percentile(ttft, 50), ttft_p90_ms=1000 * percentile(ttft, 90),
        ttft_p99_ms=1000 * percentile(ttft, 99), e2e_p90_ms=1000 * percentile(e2e, 90),
        status_429=sum(1 for o in outcomes if o.status == 429),
        errors=sum(1 for o in outcomes if o.status not in (200, 429)),
        unfinished=sum(1 for o in outcomes if o.status == 200 and o.done is None),
        prefix_hit_rate=sum(o.cached_tokens for o in ok) / prompt if prompt else float("nan"),
        requests=len(outcomes),
        busiest_server_share=max(Counter(o.served_by for o in ok).values(), default=0) / max(len(ok), 1),
        error_kinds=dict(Counter(f"{o.status} {o.error[:100]}" for o in outcomes if o.status not in (200, 429))),
    )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for policy, style in (("picker", "o-"), ("round robin", "s--")):
        points = sorted((r.load, r.ttft_p90_ms) for r in results if r.policy == policy)
        axes.plot([p[0] for p in points], [p[1] for p in points], style, label=policy)
    axes.set_yscale("log")
    axes.set_xlabel("offered load (x saturation rate of the round-robin pool)")
    axes.set_ylabel("TTFT p90 (ms)")
    axes.set_title(f"{SERVERS} simulated vLLM servers behind one Envoy")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


async def _drive(gateway: Gateway, *, policy: str, rate: float, count: int, drain: float, seed: int) -> list[Outcome]:
    url = gateway.picker_url if policy == "picker" else gateway.round_robin_url
    return await open_loop(url, rate, count, drain, seed=seed)


def median_result(runs: list[Result]) -> Result:
    """Each metric's median over repeated runs of one (policy, load); every run's value kept in ``extra``."""
    numbers = ("completed_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p90_ms", "prefix_hit_rate",
               "busiest_server_share")
    first = runs[0]
    merged = Result(
        policy=first.policy, load=first.load, rate=first.rate,
        status_429=sum(r.status_429 for r in runs), errors=sum(r.errors for r in runs),
        unfinished=sum(r.unfinished for r in runs), requests=sum(r.requests for r in runs),
        error_kinds={k: v for r in runs for k, v in r.error_kinds.items()},
        **{name: statistics.median(getattr(r, name) for r in runs) for name in numbers},
    )
    merged.extra = {f"{name}_runs": [getattr(r, name) for r in runs] for name in numbers}
    return merged


PD_CONFIG = """pool:
  name: pd
  endpoints:
  - {address: '10.0.0.1:8000', labels: {llm-d.ai/role: prefill}}
  - {address: '10.0.0.2:8000', labels: {llm-d.ai/role: prefill}}
  - {address: '10.0.0.3:8000', labels: {llm-d.ai/role: decode}}
  - {address: '10.0.0.4:8000', labels: {llm-d.ai/role: decode}}
---
%s"""
# llm-d-router's deploy/config/pd-epp-config.yaml (ebab68792) and, for the baseline, its chart default.
PD_EPP = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: approx-prefix-cache-producer, parameters: {maxPrefixTokensToMatch: 16384, lruCapacityPerServer: 31250}}
- {type: prefix-cache-scorer}
- {type: queue-scorer}
- {type: prefill-filter}
- {type: decode-filter}
- {type: max-score-picker}
- {type: disagg-profile-handler, parameters: {deciders: {prefill: prefix-based-pd-decider}}}
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 16}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: max-score-picker}, {pluginRef: prefix-cache-scorer, weight: 2},
            {pluginRef: queue-scorer, weight: 1}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: max-score-picker}, {pluginRef: prefix-cache-scorer, weight: 2},
            {pluginRef: queue-scorer, weight: 1}]
"""
SINGLE_EPP = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins: [{type: queue-scorer}, {type: kv-cache-utilization-scorer}, {type: prefix-cache-scorer}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2}, {pluginRef: kv-cache-utilization-scorer, weight: 2},
            {pluginRef: prefix-cache-scorer, weight: 3}]
"""


def pd_scenario(quick: bool = False) -> list[Row]:
    """P/D decisions and their cost, in process (the picker's sans-IO core, no servers): llm-d's
    pd-epp-config.yaml over 2 prefill and 2 decode pods, 16 apps with a ~1200-token system
    prompt and a short fresh user message. An app's first request is disaggregated (all its
    tokens are uncached on the decode pod); later ones find the system prompt cached there and
    stay on the decode pod when the uncached rest is under 16 tokens. The cost is microseconds
    per routing decision against the chart's one-profile default on the same pods."""
    from evergreen_trio.picker import Picker, PoolSnapshot, parse_config, parse_engine_metrics

    rounds, repeats = (4, 1) if quick else (12, 3)
    rng = random.Random(11)
    prompts = [_text(rng, SYSTEM_PROMPT_CHARS) for _ in range(APPS)]
    requests = [(app, json.dumps({"model": BASE_MODEL, "prompt": prompts[app] + " " + _text(rng, chars)}).encode())
                for _ in range(rounds) for app in range(APPS) for chars in (rng.choice((20, 40, 200, 400)),)]

    def measure(epp: str) -> tuple[float, Counter[str]]:
        config = parse_config(PD_CONFIG % epp)
        snapshot = PoolSnapshot(config.pool.endpoints, 2.0, time.monotonic)
        for i, endpoint in enumerate(config.pool.endpoints):
            snapshot.update(endpoint.address, parse_engine_metrics("vllm", (
                f"vllm:num_requests_waiting {i % 3}\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n"
                'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1\n')))
        picker = Picker(config, snapshot, rng=random.Random(3))
        seen: set[int] = set()
        outcomes: Counter[str] = Counter()
        started = time.perf_counter()
        for app, body in requests:
            route = picker.route("/v1/completions", {}, body, None)
            kind = "first" if app not in seen else "repeat"
            seen.add(app)
            outcomes[f"{kind} {'P/D' if route.prefill else 'decode only'}"] += 1
        return (time.perf_counter() - started) / len(requests) * 1e6, outcomes

    pd_runs, single_runs = [], []
    for _ in range(repeats):  # interleaved, so load on the machine hits both alike
        pd_runs.append(measure(PD_EPP))
        single_runs.append(measure(SINGLE_EPP))
    pd_us = statistics.median(us for us, _ in pd_runs)
    single_us = statistics.median(us for us, _ in single_runs)
    outcomes = pd_runs[0][1]
    firsts = outcomes["first P/D"] + outcomes["first decode only"]
    repeats_total = outcomes["repeat P/D"] + outcomes["repeat decode only"]
    rows = [
        Row("P/D route decision", pd_us, "us", "one profile", pd_us / single_us, extra={"one_profile_us": single_us}),
        Row("P/D: first request of an app disaggregated", outcomes["first P/D"] / firsts, "fraction"),
        Row("P/D: repeat request disaggregated", outcomes["repeat P/D"] / repeats_total, "fraction"),
    ]
    print_table("routing P/D (llm-d pd-epp-config.yaml, in process; ratio: P/D / one-profile cost)", rows)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / f"{AREA}_pd.png"
    _plot_pd(outcomes, png)
    write_results(f"{AREA}_pd", rows, quick=quick, repeats=repeats, requests=len(requests),
                  outcomes=dict(outcomes), plot=png.name, generated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    return rows


def _plot_pd(outcomes: Counter[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    kinds = ("first", "repeat")
    pd = [outcomes[f"{k} P/D"] for k in kinds]
    alone = [outcomes[f"{k} decode only"] for k in kinds]
    axes.bar(kinds, pd, label="prefill pod + decode pod (x-prefiller-host-port)")
    axes.bar(kinds, alone, bottom=pd, label="decode pod only")
    axes.set_xlabel("request of an app (1200-token system prompt)")
    axes.set_ylabel("requests")
    axes.set_title("P/D decisions, prefix-based-pd-decider (nonCachedTokens 16)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(quick: bool = False, *, only_burst: bool = False) -> None:
    """The P/D scenario, the load sweep, then the burst comparison (``only_burst``: the burst alone)."""
    if not only_burst:
        pd_scenario(quick)
    # The first `warmup` requests (3 per app) fill the caches and are not measured.
    repeats, warmup, measured, drain = (1, 32, 64, 20.0) if quick else (3, 48, 112, 60.0)
    saturation_s, saturation_warmup = (8.0, 3.0) if quick else (20.0, 5.0)
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as workdir:
        bursts = run_burst(Path(workdir), repeats)
        if only_burst:
            _report_burst(bursts, quick, repeats)
            return
        config = Path(workdir) / "pool.yaml"
        config.write_text(POOL_YAML)

        def with_gateway(measure: Callable[[Gateway], Awaitable[T]]) -> T:
            gateway = Gateway(config)
            try:
                return trio.run(measure, gateway)
            finally:
                gateway.close()

        concurrency = SERVERS * 16 * 2
        saturation = with_gateway(lambda g: closed_loop(g.round_robin_url, concurrency, saturation_s,
                                                        saturation_warmup, seed=99))
        print(f"saturation rate (round robin, closed loop, {concurrency} in flight): {saturation:.2f} req/s")
        results: list[Result] = []
        for load in LOADS:
            rate = saturation * load
            runs: dict[str, list[Result]] = {"round robin": [], "picker": []}
            for repeat in range(repeats):
                for policy, policy_runs in runs.items():
                    measure = partial(_drive, policy=policy, rate=rate, count=warmup + measured, drain=drain,
                                      seed=7 + repeat)
                    result = summarize(policy, load, rate, with_gateway(measure), warmup)
                    policy_runs.append(result)
                    print(f"  {policy:11} {load:.1f}x {rate:5.2f} req/s: done {result.completed_per_s:.2f}/s "
                          f"TTFT p90 {result.ttft_p90_ms:.0f} ms hit {result.prefix_hit_rate:.0%} "
                          f"errors {result.errors}", flush=True)
            results += [median_result(policy_runs) for policy_runs in runs.values()]
    _report(results, saturation, quick, repeats, bursts)


def _burst_table(bursts: list[BurstResult]) -> None:
    print(f"\n## Burst: {BURST} requests at once to a cold pool, scraped every {BURST_REFRESH}\n")
    print("| picker | ok | TTFT p50 ms | TTFT p90 ms | last done ms | busiest server | per server |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for b in bursts:
        print(f"| {b.policy} | {b.ok}/{b.requests} | {b.ttft_p50_ms:.0f} | {b.ttft_p90_ms:.0f} | {b.last_done_ms:.0f} "
              f"| {b.busiest_server_share:.0%} | {b.per_server} |")


def _report_burst(bursts: list[BurstResult], quick: bool, repeats: int) -> None:
    _burst_table(bursts)
    png = RESULTS_DIR / f"{AREA}_burst.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot_burst(bursts, png)
    path = write_results(f"{AREA}_burst", [], quick=quick, repeats=repeats, servers=SERVERS, burst=BURST,
                         refresh=BURST_REFRESH, sim_args=list(SIM_ARGS), bursts=[asdict(b) for b in bursts],
                         plot=png.name, load_average=os.getloadavg(), cpus=os.cpu_count(),
                         generated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(f"wrote {path} and {png}")


def _report(results: list[Result], saturation: float, quick: bool, repeats: int,
            bursts: list[BurstResult]) -> None:
    print(f"\n## Routing: picker vs round robin, {SERVERS} simulated servers (saturation {saturation:.2f} req/s, "
          f"median of {repeats} runs)\n")
    print("| policy | load | offered req/s | completed req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
          "| e2e p90 ms | 429s | errors | prefix hit | busiest server |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.policy} | {r.load:.1f}x | {r.rate:.2f} | {r.completed_per_s:.2f} | {r.ttft_p50_ms:.0f} "
              f"| {r.ttft_p90_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.e2e_p90_ms:.0f} | {r.status_429} | {r.errors} "
              f"| {r.prefix_hit_rate:.0%} | {r.busiest_server_share:.0%} |")
    rows: list[Row] = []
    by = {(r.policy, r.load): r for r in results}
    for load in LOADS:
        picker, baseline = by[("picker", load)], by[("round robin", load)]
        improvement = baseline.ttft_p90_ms / picker.ttft_p90_ms if picker.ttft_p90_ms > 0 else math.inf
        rows.append(Row(f"TTFT p90 picker @{load:.1f}x", picker.ttft_p90_ms, "ms", "round robin", improvement,
                        extra={"round_robin_ms": baseline.ttft_p90_ms}))
        rows.append(Row(f"completed picker @{load:.1f}x", picker.completed_per_s, "req/s", "round robin",
                        picker.completed_per_s / baseline.completed_per_s if baseline.completed_per_s else None,
                        extra={"round_robin": baseline.completed_per_s}))
    print_table("routing (ratio: round robin TTFT p90 / picker's; picker throughput / round robin's)", rows)
    targets = {
        f"ttft_p90_{load}x_at_least_3x_lower": by[("round robin", load)].ttft_p90_ms
        >= 3 * by[("picker", load)].ttft_p90_ms
        for load in (1.0, 1.2)
    } | {
        f"throughput_{load}x_not_less": by[("picker", load)].completed_per_s
        >= 0.97 * by[("round robin", load)].completed_per_s
        for load in (1.0, 1.2)
    }
    print("\ntargets:", ", ".join(f"{name}={'met' if met else 'MISSED'}" for name, met in targets.items()))
    _burst_table(bursts)
    png = RESULTS_DIR / f"{AREA}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    plot_burst(bursts, RESULTS_DIR / f"{AREA}_burst.png")
    path = write_results(
        AREA, rows, quick=quick, repeats=repeats, saturation_req_per_s=saturation, servers=SERVERS,
        sim_args=list(SIM_ARGS), bursts=[asdict(b) for b in bursts], burst_plot=f"{AREA}_burst.png",
        results=[asdict(r) for r in results], targets=targets, plot=png.name,
        load_average=os.getloadavg(), cpus=os.cpu_count(), generated=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    print(f"wrote {path} and {png}")
