"""What a run found, as data (``results.json``) and as the measured part of ``RESULTS.md``.

A scenario hands back a ``Scenario``: its set-up in sentences built from its parameters,
a table of figures, the checks (budget or correctness, each judged from the figures),
and every raw run. Nothing here writes a sentence that is not computed from those: a
check says PASS or MISS because the numbers do, and prose outside the generated block of
``RESULTS.md`` (the investigation notes) is left as it is.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "RESULTS.md"
BEGIN = "<!-- python -m bench: measured results begin -->"
END = "<!-- python -m bench: measured results end -->"
FOREIGN_MARKERS = ("orchestrator.cli", "worker_agent.", "pytest", "python -m bench")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    budget: bool = True
    """A performance budget (advisory under ``--quick``); False for a correctness check."""


@dataclass
class Scenario:
    name: str
    title: str
    setup: list[str]
    table: list[tuple[str, str]]
    checks: list[Check]
    runs: list[str]
    data: dict[str, Any] = field(default_factory=dict)


def ms(secs: float | None) -> str:
    return "-" if secs is None else f"{secs * 1000:.0f}"


def ms_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(ms(v) for v in values) + "] ms"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def at_most(name: str, value: float, budget: float, unit: str = "") -> Check:
    return Check(f"{name} ≤ {budget:g}{unit}", value <= budget, f"{value:.2f}{unit}")


def foreign_processes() -> int:
    """Processes of tests, benchmarks or caliban-drain on this machine not started by this
    run: they compete for the same cores and disks."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.children(recursive=True))}
    count = 0
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] not in mine and any(m in cmdline for m in FOREIGN_MARKERS):
            count += 1
    return count


def machine() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "kernel": f"{platform.system()} {platform.release()}",
        "load_1min_at_start": round(os.getloadavg()[0], 2),
        "foreign_processes_at_start": foreign_processes(),
    }


def machine_line(host: dict[str, Any]) -> str:
    return (
        f"nproc {host['nproc']}, RAM {host['ram_gib']} GiB, Python {host['python']}, "
        f"{host['kernel']}; 1-min load {host['load_1min_at_start']} and "
        f"{host['foreign_processes_at_start']} processes of other tests, benchmarks or "
        "caliban-drain runs at the start"
    )


def verdict(check: Check, quick: bool) -> str:
    if check.ok:
        return "PASS"
    return "MISS (advisory under --quick)" if quick and check.budget else "FAIL"


def render(scenarios: list[Scenario], command: str, host: dict[str, Any], quick: bool) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Measured results",
        "",
        f"- Command: `{command}`",
        f"- Date: {when}",
        f"- Machine: {machine_line(host)}",
    ]
    for s in scenarios:
        lines += ["", f"### {s.title}", "", *(f"- {sentence}" for sentence in s.setup), ""]
        lines += ["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in s.table)]
        lines += ["", "Checks:", ""]
        lines += [f"- {verdict(c, quick)}: {c.name} ({c.detail})" for c in s.checks]
        lines += ["", "Every run:", "", *(f"- {run}" for run in s.runs)]
    return "\n".join(lines)


def write(scenarios: list[Scenario], command: str, host: dict[str, Any], quick: bool) -> None:
    """``results.json`` in full; the measured block of ``RESULTS.md`` replaced."""
    document = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": host,
        "quick": quick,
        "scenarios": {
            s.name: {"data": s.data, "checks": [asdict(c) for c in s.checks]} for s in scenarios
        },
    }
    RESULTS_JSON.write_text(json.dumps(document, indent=2, default=str) + "\n")
    block = f"{BEGIN}\n{render(scenarios, command, host, quick)}\n{END}"
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        text = head + block + rest.partition(END)[2]
    else:
        title, _, body = text.partition("\n")
        text = f"{title}\n\n{block}\n{body}"
    RESULTS_MD.write_text(text)
