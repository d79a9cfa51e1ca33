"""Scenario ``resume``: the daemon's resume of N drained agents against a fresh spawn of
N agents on the same daemon, in the same repetition (budget: ≤ 1.5 x the spawn).

For each N and repetition, on a fresh ``drainctl daemon``:

1. fresh spawn: N scripted agents spawned one request after another on one control
   connection; timed from the first request until the last agent's turn 1 is complete;
2. the agents hold a conversation (every one ≥ ``MIN_TURNS`` turns), then a real drain
   answers one ``ResumeRef`` per agent, each audited against its files;
3. resume: each ref resumed the way a checkpoint's resume does it (``resume`` with the
   ref's turns and sha256 as the expectation, one request after another on one
   connection); timed from the first request until the last agent's turn ``turns + 1``
   is complete.

Both end points are read from the agents' transcripts (the ``ts`` of the
``TurnEnd`` record each worker appends once its session is saved), not from
polling, so the figures do not depend on how often the bench looks. Correctness: every
resumed agent marks ``resumed_from`` turn ``turns + 1`` of its ref, and its
transcript announces turns 1…k once each, in order, with ``session.json`` holding k
(nothing lost, nothing repeated).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.audit import Audit
from bench.recovery import announced_in_order
from bench.report import Check, Scenario, at_most, median, ms, ms_list, percentile
from worker_agent import layout, transcript
from worker_agent.proto import ResumeRef
from worker_agent.session import SessionError, load_session
from worker_agent.testing import DaemonProcess, short_tmp, wait_until

MODEL = "turns=100000,turn_ms=50"
MIN_TURNS = 3
"""Turns every agent completes before the drain: each resumes a real conversation."""
GRACE_SECS = 30.0
BUDGET = 1.5
SIZES, QUICK_SIZES = [10, 100], [1, 10]


@dataclass
class Run:
    n: int
    spawn: float
    resume: float


@dataclass
class Checker:
    audit: Audit = field(default_factory=Audit)
    problems: list[str] = field(default_factory=list)
    continued: int = 0
    """Resumed agents whose next turn was ``turns + 1`` with nothing lost or repeated."""


def events(directory: Path) -> list[dict[str, Any]]:
    found = []
    for line in layout.transcript_file(directory).read_bytes().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            found.append(event)
    return found


def completed_at(directory: Path, turn: int) -> float | None:
    """The wall-clock time the worker announced turn ``turn`` complete, if it has."""
    for event in events(directory):
        if transcript.completed_turn(event) == turn:
            return transcript.stamp(event)
    return None


def saved_turns(directory: Path) -> int:
    try:
        return load_session(directory).turns
    except (SessionError, OSError):
        return 0


def announced(directory: Path, turn: int) -> bool:
    """Whether the transcript holds the ``TurnEnd`` of ``turn``: a byte search, cheap
    enough to poll a hundred transcripts while they are measured."""
    needle = f'{{"type":"TurnEnd","turn_index":{turn - 1},'.encode()
    try:
        return needle in layout.transcript_file(directory).read_bytes()
    except OSError:
        return False


def until_turn(dirs: dict[str, Path], turn: dict[str, int], started: float, what: str) -> float:
    """Seconds from ``started`` (wall clock) until the last agent announced its ``turn``."""
    waiting = dict(dirs)

    def reached() -> bool:
        for agent in [a for a, d in waiting.items() if announced(d, turn[a])]:
            del waiting[agent]
        return not waiting

    wait_until(reached, 300, what, interval=0.05)
    stamps = [completed_at(d, turn[agent]) for agent, d in dirs.items()]
    if any(s is None for s in stamps):
        raise AssertionError(f"{what}: TurnEnd found, then not parsed")
    return max(s for s in stamps if s is not None) - started


def once(n: int, checker: Checker) -> Run:
    with short_tmp("cdr-") as root:
        daemon = DaemonProcess(root, drain_grace=GRACE_SECS).start()
        try:
            started = time.time()
            ids = daemon.spawn(n, MODEL)
            dirs = {agent: layout.agents_dir(daemon.store) / agent for agent in ids}
            spawn = until_turn(dirs, dict.fromkeys(ids, 1), started, f"{n} spawned agents' turn 1")
            until_turn(dirs, dict.fromkeys(ids, MIN_TURNS), time.time(), "a conversation")
            with daemon.client() as client:
                refs = client.drain(grace_secs=GRACE_SECS)
            check_refs(n, ids, refs, daemon.store, checker)
            started = time.time()
            with daemon.client() as client:
                for ref in refs:
                    client.resume(
                        ref.session_dir, expect_turns=ref.turns, expect_sha256=ref.session_sha256
                    )
            nxt = {ref.id: ref.turns + 1 for ref in refs}
            resume = until_turn(dirs, nxt, started, f"{n} resumed agents' next turn")
            with daemon.client() as client:
                client.drain(grace_secs=GRACE_SECS)
            check_continued(n, refs, dirs, checker)
            return Run(n, spawn, resume)
        finally:
            daemon.stop(60)


def check_refs(
    n: int, ids: list[str], refs: list[ResumeRef], store: Path, checker: Checker
) -> None:
    if sorted(r.id for r in refs) != sorted(ids):
        checker.problems.append(f"N={n}: the drain answered {len(refs)} refs for {n} agents")
    for ref in refs:
        checker.audit.agent(
            f"N={n} agent {ref.id}", store / ref.session_dir, ref.turns, ref.session_sha256,
            ref.clean and ref.exit == 0,
        )  # fmt: skip
        if ref.turns < MIN_TURNS:
            checker.problems.append(f"N={n} agent {ref.id}: drained at {ref.turns} turns")


def check_continued(n: int, refs: list[ResumeRef], dirs: dict[str, Path], checker: Checker) -> None:
    for ref in refs:
        directory = dirs[ref.id]
        resumed = [r for e in events(directory) if (r := transcript.resumed_from(e)) is not None]
        if resumed != [ref.turns + 1]:
            checker.problems.append(f"N={n} agent {ref.id}: resumed from {resumed}")
        elif not announced_in_order(directory):
            checker.problems.append(f"N={n} agent {ref.id}: turns lost or repeated")
        elif saved_turns(directory) <= ref.turns:
            checker.problems.append(f"N={n} agent {ref.id}: no turn after {ref.turns}")
        else:
            checker.continued += 1


def run(quick: bool) -> Scenario:
    sizes, repeat = (QUICK_SIZES, 1) if quick else (SIZES, 6)
    checker = Checker()
    runs: list[Run] = []
    for rep in range(repeat):
        for n in sizes:
            runs.append(once(n, checker))
            last = runs[-1]
            print(
                f"  resume rep {rep + 1}/{repeat} N={n}: resume {ms(last.resume)} ms, "
                f"fresh spawn {ms(last.spawn)} ms"
            )
    by_n = {n: [r for r in runs if r.n == n] for n in sizes}
    med = {
        n: (median([r.resume for r in rs]), median([r.spawn for r in rs])) for n, rs in by_n.items()
    }
    table: list[tuple[str, str]] = []
    for n, rs in by_n.items():
        resumes, spawns = [r.resume for r in rs], [r.spawn for r in rs]
        table += [
            (f"N={n}: resume → every agent's turn + 1 (median / p95)",
             f"{ms(med[n][0])} / {ms(percentile(resumes, 0.95))} ms"),
            (f"N={n}: fresh spawn → every agent's turn 1 (median / p95)",
             f"{ms(med[n][1])} / {ms(percentile(spawns, 0.95))} ms"),
            (f"N={n}: **resume / fresh spawn**", f"**{med[n][0] / med[n][1]:.2f}**"),
        ]  # fmt: skip
    total = sum(len(rs) * n for n, rs in by_n.items())
    checks = [
        *(at_most(f"resume / fresh spawn at N={n}", med[n][0] / med[n][1], BUDGET) for n in sizes),
        Check(
            "every drained ref clean and matching its files",
            checker.audit.ok,
            checker.audit.summary(),
            budget=False,
        ),
        Check(
            "every resumed agent continued at turns + 1, no turn lost or repeated",
            not checker.problems and checker.continued == total,
            "; ".join(checker.problems) or f"{checker.continued} of {total} agents continued",
            budget=False,
        ),
    ]
    return Scenario(
        name="resume",
        title="Daemon resume of N drained agents against a fresh spawn of N",
        setup=[
            f"One `drainctl daemon` per N and repetition; N scripted agents `model={MODEL!r}`. "
            "Fresh spawn: N `spawn` requests one after another on one connection, timed from "
            "the first request until the last agent's turn 1 is complete.",
            f"Then every agent reaches ≥ {MIN_TURNS} turns and a real `drain(grace_secs="
            f"{GRACE_SECS:g})` answers the refs; resume: N `resume` requests (the ref's turns "
            "and sha256 as the expectation, as a checkpoint's resume sends them) one after "
            "another on one connection, timed from the first request until the last agent's "
            "turn `turns + 1` is complete.",
            "Both end points are the `caliban_drain.ts` of the `TurnEnd` record in the agents' "
            "transcripts (written once the session is saved), not a polling time.",
            f"N in {sizes}; medians and p95 of {repeat} repetition(s).",
        ],
        table=table,
        checks=checks,
        runs=[
            f"N={n}: resume {ms_list(r.resume for r in rs)}; fresh spawn "
            f"{ms_list(r.spawn for r in rs)}"
            for n, rs in by_n.items()
        ],
        data={
            "sizes": sizes,
            "repeat": repeat,
            "runs": [r.__dict__ for r in runs],
            "audit": checker.audit.__dict__,
            "problems": checker.problems,
            "curves": {
                "x_label": "agents",
                "y_label": "seconds",
                "series": {
                    "daemon resume": [[n, med[n][0]] for n in sizes],
                    "fresh spawn": [[n, med[n][1]] for n in sizes],
                },
            },
        },
    )
