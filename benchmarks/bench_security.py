"""Hostile peers (issue 11): each attack against a running server, with a legitimate client measuring the stall.

Rows come from ``benchmarks/security_picker.py``, ``security_picker_requests.py`` (issue 22, items
7-10), ``security_session.py``, ``security_http.py`` (issue 22: ``avp serve`` and ``sim``) and
``security_ipc.py`` (issue 22, items 11-12) (each exposes ``attacks(quick: bool) -> list[dict[str, object]]``).
Row keys:

- ``server``: ``picker``, ``session``, ``avp``, ``sim`` or ``ipc``.
- ``attack``: the issue item number and what the attacker sends.
- ``expected``: the answer the server should give the attacking connection.
- ``observed``: the answer it gave (GOAWAY / RST codes, grpc-status, what was accepted).
- ``idle_p50_ms``: a legitimate call's median latency on the same server, idle, before the attack.
- ``p50_ms``, ``max_ms``: the legitimate call's median and worst latency while the attack runs
  (on its own connection, opened before the attack); ``max_ms`` is the worst stall.
- ``rss_growth_mib``: the server's peak RSS during the attack minus its RSS before it.
- ``connections`` (optional, default 1): attacking connections at once; the RSS target is per connection.
- ``target_max_ms`` (optional): the stall target of a row whose attack stops the server by design
  (a frozen worker: probes that land on it wait for its replacement).

Targets: ``max_ms`` <= 100 on the picker, <= 250 on the session, AVP, simulator and IPC servers; RSS
growth <= 64 MiB per attacking connection. Writes ``benchmarks/results/security.json``.
"""

from __future__ import annotations

import json
import platform

from benchmarks import security_http, security_ipc, security_picker, security_picker_requests, security_session
from benchmarks._harness import RESULTS_DIR

COLUMNS = ("server", "attack", "expected", "observed", "idle_p50_ms", "p50_ms", "max_ms", "rss_growth_mib")
TARGET_MAX_MS = {"picker": 100.0, "session": 250.0, "avp": 250.0, "sim": 250.0, "ipc": 250.0}
TARGET_RSS_MIB = 64.0


def _cell(value: object) -> str:
    return "" if value is None else f"{value:,.3g}" if isinstance(value, float) else str(value)


def run(quick: bool = False) -> None:
    rows = (security_picker.attacks(quick) + security_picker_requests.attacks(quick)
            + security_session.attacks(quick) + security_http.attacks(quick) + security_ipc.attacks(quick))
    print("\n## Hostile peers: a legitimate call during each attack\n")
    print("| " + " | ".join(COLUMNS) + " | targets met |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for row in rows:
        worst = row.get("max_ms")
        target = float(str(row.get("target_max_ms", TARGET_MAX_MS.get(str(row["server"]), 100.0))))
        met = (isinstance(worst, float) and worst <= target
               and float(str(row["rss_growth_mib"])) <= TARGET_RSS_MIB * int(str(row.get("connections", 1))))
        print("| " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + f" | {'yes' if met else 'NO'} |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "security.json").write_text(json.dumps({
        "area": "security", "quick": quick,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "targets": {"max_ms": TARGET_MAX_MS, "rss_growth_mib": TARGET_RSS_MIB}, "rows": rows,
    }, indent=2) + "\n")
