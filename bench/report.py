"""What a run found, as data (``results.json``), as the measured part of ``RESULTS.md``,
and as PNGs (``plots/``, drawn by ``plot``).

A scenario hands back a ``Scenario``: its set-up in sentences built from its parameters,
a table of figures, the checks (budget or correctness, each judged from the figures),
and every raw run. Nothing here writes a sentence that is not computed from those: a
check says PASS or MISS because the numbers do, and prose outside the generated block of
``RESULTS.md`` (the investigation notes) is left as it is. ``write`` records only the
scenarios of this run and keeps the others': each section carries the command, date and
machine of the run that measured it.
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
PLOTS = "plots"
"""The PNGs' directory, beside ``results.json`` (``bench/plots/<scenario>.png``)."""
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
    """Everything measured, as JSON; ``data["curves"]``, if there, is drawn (``plot``)."""
    blocks: list[tuple[str, str]] = field(default_factory=list)
    """(heading, preformatted text) shown after the runs: query plans, profiles."""


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


def now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def plots(scenarios: list[Scenario], directory: Path) -> dict[str, Path]:
    """Each scenario's PNG (``bench/plot.py``: latency against scale, with the floor) in
    ``directory``, for those whose ``data`` has ``curves``: scenario name → path. A
    malformed ``curves`` raises ``plot.CurvesError`` naming the scenario."""
    from bench import plot

    drawn = {s.name: plot.curves(s.name, s.data["curves"]) for s in scenarios if "curves" in s.data}
    titles = {s.name: s.title for s in scenarios}
    return {
        name: plot.draw(titles[name], curves, directory / f"{name}.png")
        for name, curves in drawn.items()
    }


def section(
    s: Scenario,
    command: str,
    host: dict[str, Any],
    quick: bool,
    when: datetime.datetime,
    plot: str | None = None,
) -> str:
    """One scenario's part of the report, with the run that measured it."""
    lines = [
        f"### {s.title}",
        "",
        f"- Command: `{command}`",
        f"- Date: {when:%Y-%m-%d %H:%M UTC}",
        f"- Machine: {machine_line(host)}",
        *(f"- {sentence}" for sentence in s.setup),
        "",
    ]
    lines += ["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in s.table)]
    if plot is not None:
        lines += ["", f"![{s.name}: latency against scale, with the floor]({plot})"]
    lines += ["", "Checks:", ""]
    lines += [f"- {verdict(c, quick)}: {c.name} ({c.detail})" for c in s.checks]
    lines += ["", "Every run:", "", *(f"- {run}" for run in s.runs)]
    for heading, text in s.blocks:
        lines += ["", f"#### {heading}", "", "```", text, "```"]
    return "\n".join(lines)


def render(scenarios: list[Scenario], command: str, host: dict[str, Any], quick: bool) -> str:
    when = now_utc()
    parts = ["## Measured results"]
    parts += [section(s, command, host, quick, when) for s in scenarios]
    return "\n\n".join(parts)


def write(
    scenarios: list[Scenario],
    command: str,
    host: dict[str, Any],
    quick: bool,
    results_json: Path = RESULTS_JSON,
    results_md: Path = RESULTS_MD,
) -> dict[str, Path]:
    """Record ``scenarios`` in ``results.json`` and in the measured block of
    ``RESULTS.md``, with their PNGs under ``plots/`` beside them; the scenarios this run
    did not measure keep their results, their sections and the command, date and machine
    of the run that measured them. The PNGs drawn: scenario name → path."""
    when = now_utc()
    drawn = plots(scenarios, results_json.parent / PLOTS)
    old = json.loads(results_json.read_text()) if results_json.exists() else {}
    kept = _kept_sections(old, results_md)
    recorded: dict[str, Any] = dict(old.get("scenarios") or {})
    for s in scenarios:
        plot = f"{PLOTS}/{drawn[s.name].name}" if s.name in drawn else None
        recorded[s.name] = {
            "command": command,
            "date": when.isoformat(timespec="seconds"),
            "machine": host,
            "quick": quick,
            "data": s.data,
            "checks": [asdict(c) for c in s.checks],
            "plot": plot,
            "section": section(s, command, host, quick, when, plot),
        }
    for name, entry in recorded.items():
        if "section" not in entry and name in kept:
            entry.update(kept[name])
    document = {
        "command": command,
        "date": when.isoformat(timespec="seconds"),
        "machine": host,
        "quick": quick,
        "scenarios": recorded,
    }
    results_json.write_text(json.dumps(document, indent=2, default=str) + "\n")
    intro = (
        "## Measured results\n\nEach scenario says the command, date and machine of the run "
        "that measured it (`python -m bench --scenario X --write` replaces only X)."
    )
    sections = [e["section"] for e in recorded.values() if "section" in e]
    block = "\n\n".join([BEGIN, intro, *sections, END])
    text = results_md.read_text() if results_md.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        text = head + block + rest.partition(END)[2]
    else:
        title, _, body = text.partition("\n")
        text = f"{title}\n\n{block}\n{body}"
    results_md.write_text(text)
    return drawn


def _kept_sections(old: dict[str, Any], results_md: Path) -> dict[str, dict[str, Any]]:
    """From a ``results.json`` written before scenarios carried their own sections: each
    scenario's section cut from the measured block of ``RESULTS.md`` (in the order the
    document lists them), with the document's command, date and machine put in it."""
    names = [n for n, e in (old.get("scenarios") or {}).items() if "section" not in e]
    text = results_md.read_text() if results_md.exists() else ""
    if not names or BEGIN not in text or END not in text:
        return {}
    block = text.partition(BEGIN)[2].partition(END)[0]
    parts = block.split("\n### ")[1:]
    if len(parts) != len(names):
        return {}
    date = old.get("date")
    when = f"{datetime.datetime.fromisoformat(date):%Y-%m-%d %H:%M UTC}" if date else "-"
    run = (
        f"- Command: `{old.get('command')}`\n- Date: {when}\n"
        f"- Machine: {machine_line(old['machine']) if old.get('machine') else '-'}\n"
    )
    out = {}
    for name, part in zip(names, parts, strict=True):
        title, _, body = part.partition("\n\n")
        out[name] = {"section": f"### {title}\n\n{run}{body}".rstrip()}
    return out
