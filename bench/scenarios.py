"""The scenarios of ``python -m bench`` by name, run one at a time or side by side.

Apart from ``__main__`` so that a scenario run in a process of its own (``--jobs``,
``spawn``) finds these functions by their module's name.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

from bench import (
    audit_cost,
    burst,
    controlplane,
    delete,
    drain,
    fanout,
    fleet,
    ledger,
    pipeline,
    recovery,
    report,
    resume,
    wake,
)
from worker_agent.testing import short_tmp

SCENARIOS = (
    "drain",
    "resume",
    "pipeline",
    "delete",
    "recovery",
    "wake",
    "audit",
    "ledger",
    "fleet",
    "fanout",
    "burst",
    "controlplane",
)


QUICK_JOBS = 4
"""Quick scenarios side by side: most of a quick run is waiting (stacks starting, a
fleet at rest), so four finish in about half the time of one after another."""
LONGEST_FIRST = (
    "fleet", "pipeline", "recovery", "burst", "wake", "delete", "audit", "fanout", "resume",
    "drain", "ledger", "controlplane",
)  # fmt: skip
"""The order side-by-side scenarios start in: their quick durations on a 2-core machine,
longest first, so the last to start are short ones."""


def run_timed(name: str, args: argparse.Namespace) -> tuple[report.Scenario | None, float]:
    """``run_one``, its traceback printed (None) if it raised, and its duration."""
    began = time.monotonic()
    try:
        scenario: report.Scenario | None = run_one(name, args)
    except Exception:
        traceback.print_exc()
        print(f"scenario {name} FAILED (error above)", file=sys.stderr, flush=True)
        scenario = None
    secs = time.monotonic() - began
    print(f"  ({name}: {secs:.0f} s)", flush=True)
    return scenario, secs


def run_all(names: list[str], args: argparse.Namespace, jobs: int) -> list[report.Scenario | None]:
    """Every scenario of ``names``, ``jobs`` at a time; the results in the order of
    ``names``."""
    if jobs <= 1 or len(names) <= 1:
        return [run_timed(name, args)[0] for name in names]
    order = sorted(names, key=lambda n: LONGEST_FIRST.index(n))
    # spawn: a scenario's process starts clean (no threads, clients or Celery apps of
    # the parent's), as ``python -m bench --scenario X`` would.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(names)), mp_context=context) as pool:
        futures = {name: pool.submit(run_timed, name, args) for name in order}
        return [futures[name].result()[0] for name in names]


def run_one(name: str, args: argparse.Namespace) -> report.Scenario:
    if name == "drain":
        return drain.run(args.quick)
    if name == "ledger":
        return ledger.run(args.quick, args.ledger_database_url)
    if name == "resume":
        return resume.run(args.quick)
    with short_tmp(f"cd-{name[:3]}-") as root:
        if name == "pipeline":
            return pipeline.run(args.quick, root, args.redis_port, args.database_url)
        if name == "recovery":
            return recovery.run(args.quick, root, args.redis_port)
        if name == "fleet":
            return fleet.run(args.quick, root, args.redis_port, args.fleet_database_url)
        if name == "wake":
            return wake.run(args.quick, root, args.redis_port)
        if name == "audit":
            return audit_cost.run(args.quick, root, args.audit_database_url, args.audit_fleet)
        if name == "fanout":
            return fanout.run(args.quick, root, args.redis_port)
        if name == "burst":
            return burst.run(args.quick, root)
        if name == "controlplane":
            return controlplane.run(args.quick, root, args.redis_port)
        return delete.run(args.quick, root, args.redis_port)
