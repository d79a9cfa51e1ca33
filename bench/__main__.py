"""``python -m bench``: run the benchmarks, print the report, optionally record it.

``python -m bench [--scenario NAME ...] [--quick]
[--write]``. ``--write`` records the scenarios run in ``results.json`` and ``RESULTS.md``
and keeps the others' results; it draws each scenario's PNG (latency against scale, with
the floor) into ``bench/plots/``. Without ``--write`` the PNGs are drawn into a temporary
directory and deleted, so a plain or ``--quick`` run (CI) still draws them and leaves the
tree as it was. Exit 0 when every check passes (under ``--quick`` the budgets are advisory:
small N and one repetition say nothing about them, so only correctness decides), 1 when
a budget is missed, 2 when a correctness check fails or a scenario errors.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import (
    audit_cost,
    delete,
    drain,
    fanout,
    fleet,
    ledger,
    pipeline,
    plot,
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
)


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
        return delete.run(args.quick, root, args.redis_port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="run only this scenario (repeatable; default all)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    parser.add_argument("--write", action="store_true", help="write results.json and RESULTS.md")
    parser.add_argument(
        "--redis-port",
        type=int,
        default=int(os.environ.get("DRAIN_TEST_REDIS_PORT", "6379")),
        help="the Redis on 127.0.0.1 to use (default $DRAIN_TEST_REDIS_PORT or 6379)",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="pipeline ledger (its tables are dropped); default SQLite",
    )
    parser.add_argument(
        "--audit-database-url",
        default=None,
        help=f"audit ledger (created if missing, its tables dropped); default "
        f"{audit_cost.DATABASE_URL}",
    )
    parser.add_argument(
        "--fleet-database-url",
        default=None,
        help=f"fleet scenario's ledger (created if missing, its tables dropped); default "
        f"{fleet.DATABASE_URL}",
    )
    parser.add_argument(
        "--audit-fleet",
        type=int,
        action="append",
        metavar="N",
        help="audit fleet size (repeatable; default "
        f"{', '.join(map(str, audit_cost.SIZES))}, --quick "
        f"{', '.join(map(str, audit_cost.QUICK_SIZES))})",
    )
    parser.add_argument(
        "--ledger-database-url",
        default=None,
        help=f"ledger scenario's database (created if missing; one schema per size, kept "
        f"between runs); default {ledger.DATABASE_URL}",
    )
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    host = report.machine()
    print(f"# {command}: {report.machine_line(host)}", flush=True)
    scenarios, failed = [], False
    for name in args.scenario or SCENARIOS:
        began = time.monotonic()
        try:
            scenarios.append(run_one(name, args))
        except Exception:
            traceback.print_exc()
            print(f"scenario {name} FAILED (error above)", file=sys.stderr)
            failed = True
        print(f"  ({name}: {time.monotonic() - began:.0f} s)", flush=True)
    print("\n" + report.render(scenarios, command, host, args.quick))
    try:
        if args.write and scenarios:
            drawn = report.write(scenarios, command, host, args.quick)
            print(f"\nwrote {report.RESULTS_JSON}, {report.RESULTS_MD} and {len(drawn)} PNGs")
        else:
            with tempfile.TemporaryDirectory(prefix="bench-plots-") as directory:
                drawn = report.plots(scenarios, Path(directory))
                print(f"\ndrew {len(drawn)} PNGs (not kept without --write)")
    except plot.CurvesError as exc:
        print(f"cannot draw: {exc}", file=sys.stderr)
        failed = True
    checks = [c for s in scenarios for c in s.checks]
    if failed or any(not c.ok and not c.budget for c in checks):
        return 2
    return 0 if args.quick or all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
