"""``python -m bench``: run the benchmarks, print the report, optionally record it.

``python -m bench [--scenario NAME ...] [--quick]
[--write]``. ``--write`` records the scenarios run in ``results.json`` and ``RESULTS.md``
and keeps the others' results; it draws each scenario's PNG (latency against scale, with
the floor) into ``bench/plots/``. Without ``--write`` the PNGs are drawn into a temporary
directory and deleted, so a plain or ``--quick`` run (CI) still draws them and leaves the
tree as it was. Exit 0 when every check passes (under ``--quick`` the budgets are advisory:
small N and one repetition say nothing about them, so only correctness decides), 1 when
a budget is missed, 2 when a correctness check fails or a scenario errors.

``--jobs N`` runs N scenarios side by side, each in a process of its own (its own
directory, Redis database, ports and PostgreSQL database, so they share nothing but the
machine). A measurement wants the machine to itself, so the default is one at a time;
``--quick``, which checks that every scenario still runs and is right rather than how
fast, defaults to :data:`QUICK_JOBS`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from bench import audit_cost, fleet, ledger, plot, report
from bench.scenarios import QUICK_JOBS, SCENARIOS, run_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="run only this scenario (repeatable; default all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: every scenario small, {QUICK_JOBS} side by side",
    )
    parser.add_argument("--write", action="store_true", help="write results.json and RESULTS.md")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help=f"run N scenarios side by side (default 1; --quick {QUICK_JOBS})",
    )
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
    jobs = args.jobs if args.jobs is not None else (QUICK_JOBS if args.quick else 1)
    if jobs < 1:
        parser.error(f"--jobs must be at least 1, not {jobs}")
    command = shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])
    host = report.machine()
    print(f"# {command}: {report.machine_line(host)}", flush=True)
    names = list(dict.fromkeys(args.scenario or SCENARIOS))
    ran = run_all(names, args, jobs)
    scenarios = [scenario for scenario in ran if scenario is not None]
    failed = len(scenarios) < len(ran)
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
