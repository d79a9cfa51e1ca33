"""Scenario ``drain``: the daemon's drain of N agents against N bare processes (the budgets:
≤ 1.3 x the floor at N = 100 and at N = 300, parallel in N; the daemon under 80 MB RSS).

For each N and repetition: a ``drainctl daemon`` with N scripted agents mid-conversation
(every one live with at least one completed turn), ``drain`` timed request to reply,
every ``ResumeRef`` audited against the files; and the bare-process floor for N.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench import floors
from bench.audit import Audit
from bench.report import Check, Scenario, at_most, median, ms, ms_list
from worker_agent.proto import AgentStatus
from worker_agent.testing import DaemonProcess, short_tmp, wait_until

MODEL = "turns=100000,turn_ms=50"
GRACE_SECS = 30.0
RATIO_BUDGET = 1.3
BUDGET_SIZES = (100, 300)
"""The sizes the ratio budget holds at (those of a run's sizes that it measures)."""
RSS_BUDGET_MB = 80.0


@dataclass
class Run:
    n: int
    secs: float
    floor: float
    internal: float | None
    rss_mb: float


def status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"/proc/{pid}/status has no {key}")


def drain_once(n: int, audit: Audit) -> tuple[float, float | None, float]:
    with short_tmp("cdd-") as root:
        daemon = DaemonProcess(root, drain_grace=GRACE_SECS).start()
        try:
            ids = daemon.spawn(n, MODEL)

            def mid_turn() -> bool:
                records = daemon.records()
                live = (AgentStatus.RUNNING, AgentStatus.IDLE)
                return all(records[i].status in live and records[i].turns >= 1 for i in ids)

            wait_until(mid_turn, 180, f"{n} agents mid-conversation", interval=0.25)
            rss = status_mb(daemon.pid, "VmRSS")
            with daemon.client() as client:
                started = time.perf_counter()
                refs = client.drain(grace_secs=GRACE_SECS)
                secs = time.perf_counter() - started
            if sorted(r.id for r in refs) != sorted(ids):
                audit.problems.append(f"N={n}: drain answered {len(refs)} refs for {n} agents")
            for ref in refs:
                audit.agent(
                    f"N={n} agent {ref.id}",
                    daemon.store / ref.session_dir,
                    ref.turns,
                    ref.session_sha256,
                    ref.clean and ref.exit == 0,
                )
            return secs, daemon.drained_secs(), max(rss, status_mb(daemon.pid, "VmRSS"))
        finally:
            daemon.stop(60)


def run(quick: bool) -> Scenario:
    sizes, repeat = ([1, 10], 1) if quick else ([1, 10, 100, 300], 5)
    audit = Audit()
    runs: list[Run] = []
    for rep in range(repeat):
        for n in sizes:
            floor = floors.bare_processes(n)
            secs, internal, rss = drain_once(n, audit)
            runs.append(Run(n, secs, floor, internal, rss))
            print(f"  drain rep {rep + 1}/{repeat} N={n}: {ms(secs)} ms, floor {ms(floor)} ms")
    by_n = {n: [r for r in runs if r.n == n] for n in sizes}
    med = {
        n: (median([r.secs for r in rs]), median([r.floor for r in rs])) for n, rs in by_n.items()
    }
    table: list[tuple[str, str]] = []
    for n, rs in by_n.items():
        own = [r.internal for r in rs if r.internal is not None]
        table += [
            (f"N={n}: daemon drain, request → reply (median)", f"{ms(med[n][0])} ms"),
            (
                f"N={n}: the daemon's own drain (`drained secs=`, median)",
                f"{ms(median(own))} ms",
            ),
            (f"N={n}: floor, {n} bare processes (median)", f"{ms(med[n][1])} ms"),
            (f"N={n}: **ratio**", f"**{med[n][0] / med[n][1]:.2f}**"),
            (f"N={n}: daemon RSS (max)", f"{max(r.rss_mb for r in rs):.1f} MB"),
        ]
    small, large = sizes[0], sizes[-1]
    growth = med[large][0] / med[small][0], med[large][1] / med[small][1]
    budgeted = [n for n in sizes if n in BUDGET_SIZES] or [large]
    checks = [
        *(
            at_most(f"drain / floor at N={n}", med[n][0] / med[n][1], RATIO_BUDGET)
            for n in budgeted
        ),
        Check(
            f"daemon RSS < {RSS_BUDGET_MB:g} MB with {large} agents",
            max(r.rss_mb for r in by_n[large]) < RSS_BUDGET_MB,
            f"{max(r.rss_mb for r in by_n[large]):.1f} MB",
        ),
        Check(
            f"daemon growth N={small}→{large} no faster than the floor's",
            growth[0] <= growth[1],
            f"daemon x{growth[0]:.1f}, floor x{growth[1]:.1f}",
        ),
        Check(
            "zero lost turns, every ref clean and matching its files",
            audit.ok,
            audit.summary(),
            budget=False,
        ),
    ]
    return Scenario(
        name="drain",
        title="Daemon drain of N agents against N bare processes",
        setup=[
            f"Daemon: `drainctl daemon`, N scripted agents `model={MODEL!r}` each live with ≥ 1 "
            f"completed turn, `drain(grace_secs={GRACE_SECS:g})` timed request → reply.",
            f"Floor: N bare processes holding {floors.FLOOR_TURNS} turns that save atomically "
            "and durably on SIGTERM, timed first SIGTERM → all reaped.",
            f"N in {sizes}; medians of {repeat} repetition(s).",
        ],
        table=table,
        checks=checks,
        runs=[
            f"N={n}: daemon {ms_list(r.secs for r in rs)}; floor {ms_list(r.floor for r in rs)}"
            for n, rs in by_n.items()
        ],
        data={
            "sizes": sizes,
            "repeat": repeat,
            "runs": [r.__dict__ for r in runs],
            "audit": audit.__dict__,
            "curves": {
                "x_label": "agents",
                "y_label": "seconds",
                "series": {
                    "daemon drain": [[n, med[n][0]] for n in sizes],
                    "floor": [[n, med[n][1]] for n in sizes],
                },
            },
        },
    )
