"""Scenario ``burst``: healthy tasks' heartbeats while others are created and deleted at once.

``drainctl dev up`` on its embedded defaults (embedded API and broker, SQLite ledger),
every setting the default, as a new user runs it. ``STEADY`` tasks work undisturbed;
``DELETED`` more are started beside them (not timed). Then the burst: ``CREATED`` new
tasks created and the ``DELETED`` deleted, all at once from a thread pool (on 2 cores,
new pods starting and drains, snapshots and checkpoints recorded all compete for the
CPU). The burst window runs from the first request until every new task is Running
with a completed turn and every deleted one is gone, plus ``TAIL_INTERVALS`` heartbeat
intervals.

Measured for each steady task, by reading the ledger's heartbeat table every
``SAMPLE_SECS``: its **silence** (now - when its newest heartbeat reached the ledger),
the largest seen; and each heartbeat's **transit** (reached the ledger - sent by the
daemon). The floor is the same measure over ``REST_INTERVALS`` heartbeat intervals at
rest just before the burst, in the same run (a heartbeat every interval: the floor's
silence is about one interval). The operator calls a daemon silent after
``HEARTBEATS_MISSED_BEFORE_SILENT`` intervals; the bound is that no steady task's silence
reaches it, so no steady task leaves ``Running`` (its phase and ``status.disruption``
are read every second too).
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
from kubernetes.client.exceptions import ApiException

from bench.fanout import NAMESPACE, SENDERS, Fleet
from bench.report import Check, Scenario, median
from orchestrator.ledger import Ledger
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.operator.lifecycle.availability import HEARTBEATS_MISSED_BEFORE_SILENT
from orchestrator.settings import Settings
from orchestrator.testing import DevStackProcess
from worker_agent.testing import wait_until

STEADY, CREATED, DELETED = 12, 17, 16
"""The burst the issue met on 2 cores: 12 healthy tasks, 17 created and 16 deleted."""
QUICK_STEADY, QUICK_CREATED, QUICK_DELETED = 2, 3, 3
REST_INTERVALS = 4
TAIL_INTERVALS = 2
QUICK_REST_INTERVALS = 2
SAMPLE_SECS = 0.5
INTERVAL = Settings().heartbeat_interval_secs
SILENT_AFTER = HEARTBEATS_MISSED_BEFORE_SILENT * INTERVAL


@dataclass
class Window:
    """What the steady tasks' heartbeats did over one window."""

    silence: dict[str, float] = field(default_factory=dict)
    """Per steady task: the longest time without a new heartbeat in the ledger (s)."""
    transit: list[float] = field(default_factory=list)
    """Every heartbeat that arrived in the window: reached the ledger - sent (s)."""
    left_running: dict[str, str] = field(default_factory=dict)
    """Steady task → the first phase or disruption other than Running it showed."""
    secs: float = 0.0

    @property
    def worst(self) -> float:
        return max(self.silence.values(), default=0.0)


class Sampler(threading.Thread):
    """Reads the steady tasks' heartbeats (every ``SAMPLE_SECS``) and phases (every
    second) into the current window until stopped."""

    def __init__(self, fleet: Fleet, ledger: Ledger, steady: list[str]) -> None:
        super().__init__(name="burst-sampler", daemon=True)
        self.fleet, self.ledger, self.steady = fleet, ledger, set(steady)
        self.window = Window()
        self.seen: dict[str, datetime] = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.began = time.monotonic()

    def begin(self) -> None:
        """A new window, measured from now (a silence counts from its window's start)."""
        with self.lock:
            self.window, self.began = Window(), time.monotonic()

    def end(self) -> Window:
        with self.lock:
            done = self.window
            done.secs = time.monotonic() - self.began
            self.window = Window()
        return done

    def run(self) -> None:
        next_phases = 0.0
        while not self.stopped.wait(SAMPLE_SECS):
            try:
                self.sample(read_phases=time.monotonic() >= next_phases)
            except Exception as exc:  # a failed read is reported, not fatal
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if time.monotonic() >= next_phases:
                    next_phases = time.monotonic() + 1.0

    def sample(self, *, read_phases: bool) -> None:
        activities = {a.name: a for a in self.ledger.list_activities() if a.name in self.steady}
        tasks = self.fleet.tasks() if read_phases else {}
        now = datetime.now(UTC)
        with self.lock:
            window, began = self.window, self.began
            since_begin = time.monotonic() - began
            for name in self.steady:
                activity = activities.get(name)
                arrived = None if activity is None else activity.received_at
                if arrived is not None and self.seen.get(name) != arrived:
                    self.seen[name] = arrived
                    sent = activity.reported_at if activity is not None else None
                    if sent is not None:
                        window.transit.append((arrived - sent).total_seconds())
                silence = (now - arrived).total_seconds() if arrived is not None else since_begin
                # A silence that began before this window counts only from its start.
                silence = min(silence, since_begin)
                window.silence[name] = max(window.silence.get(name, 0.0), silence)
                status = (tasks.get(name) or {}).get("status") or {} if read_phases else {}
                if read_phases and name not in window.left_running:
                    phase, disruption = status.get("phase"), status.get("disruption")
                    if phase != "Running" or disruption:
                        window.left_running[name] = f"{phase} ({disruption or 'no disruption'})"


def create_quietly(fleet: Fleet, name: str) -> None:
    fleet.create(name)


def delete_quietly(fleet: Fleet, name: str) -> None:
    try:
        fleet.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def start(fleet: Fleet, names: list[str]) -> None:
    for name in names:
        fleet.create(name)
    wait_until(functools.partial(fleet.working, names), 900, f"{len(names)} tasks working", 0.5)


def run(quick: bool, root: Path, broker: str | None = None) -> Scenario:
    """``broker``: a Redis URL for the stack (its broker and result backend), else the
    embedded one."""
    steady_n, created_n, deleted_n = (
        (QUICK_STEADY, QUICK_CREATED, QUICK_DELETED) if quick else (STEADY, CREATED, DELETED)
    )
    rest_intervals = QUICK_REST_INTERVALS if quick else REST_INTERVALS
    steady = [f"steady-{i:02d}" for i in range(steady_n)]
    doomed = [f"doomed-{i:02d}" for i in range(deleted_n)]
    new = [f"new-{i:02d}" for i in range(created_n)]
    env = None if broker is None else {"DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker}
    stack = DevStackProcess(root, env=env)  # otherwise the embedded defaults
    stack.start(120)
    ledger = Ledger.from_url(f"sqlite:///{stack.state / 'ledger.db'}")
    sampler: Sampler | None = None
    try:
        fleet = Fleet(stack, ledger)
        start(fleet, steady + doomed)
        sampler = Sampler(fleet, ledger, steady)
        sampler.start()
        sampler.begin()
        time.sleep(rest_intervals * INTERVAL)
        rest = sampler.end()
        load = psutil.getloadavg()[0]
        sampler.begin()
        began = time.monotonic()
        with ThreadPoolExecutor(SENDERS) as pool:
            requests = [pool.submit(create_quietly, fleet, n) for n in new]
            requests += [pool.submit(delete_quietly, fleet, n) for n in doomed]
            for request in requests:
                request.result()
        sent = time.monotonic() - began
        wait_until(functools.partial(fleet.working, new), 900, "the new tasks working", 0.5)
        wait_until(lambda: not set(doomed) & set(fleet.tasks()), 900, "the deleted gone", 0.5)
        settled = time.monotonic() - began
        time.sleep(TAIL_INTERVALS * INTERVAL)
        burst = sampler.end()
        peak_load = psutil.getloadavg()[0]
    finally:
        if sampler is not None:
            sampler.stopped.set()
            sampler.join(10)
        ledger.dispose()
        stack.stop(180)
    errors = sampler.errors if sampler is not None else []
    ratio = burst.worst / rest.worst if rest.worst else float("inf")
    print(f"  burst: worst silence {burst.worst:.1f} s (rest {rest.worst:.1f} s, "
          f"{ratio:.2f}x), {len(burst.left_running)} steady tasks left Running")  # fmt: skip
    return Scenario(
        name="burst",
        title=(
            f"Burst: {steady_n} healthy tasks' heartbeats while {created_n} tasks are "
            f"created and {deleted_n} deleted at once"
        ),
        setup=[
            "`drainctl dev up` on its embedded defaults (embedded API and broker, SQLite "
            "ledger), every setting the default; each task a real daemon, its consumer and "
            "1 scripted agent working a turn a second.",
            f"{steady_n} steady tasks and {deleted_n} to delete started and working (not "
            f"timed); the floor: {rest_intervals} heartbeat intervals ({INTERVAL:g} s each) "
            f"at rest; then {created_n} creates and {deleted_n} deletes sent at once from "
            f"{SENDERS} threads, the window lasting until every new task works and every "
            f"deleted one is gone, plus {TAIL_INTERVALS} intervals.",
            f"Silence: now - the steady task's newest heartbeat in the ledger, read every "
            f"{SAMPLE_SECS:g} s; the operator calls a daemon silent after "
            f"{SILENT_AFTER:g} s ({HEARTBEATS_MISSED_BEFORE_SILENT} intervals).",
        ],
        table=[
            ("floor: worst silence of a steady task at rest", f"{rest.worst:.1f} s"),
            ("burst: worst silence of a steady task", f"{burst.worst:.1f} s"),
            (
                "burst: median of the steady tasks' worst silences",
                f"{median(list(burst.silence.values())):.1f} s",
            ),
            ("**burst / floor, worst silence**", f"**{ratio:.2f}x**"),
            (
                "heartbeat transit (sent → in the ledger) at rest: median / max",
                f"{median(rest.transit):.2f} / {max(rest.transit, default=0):.2f} s",
            ),
            (
                "heartbeat transit during the burst: median / max",
                f"{median(burst.transit):.2f} / {max(burst.transit, default=0):.2f} s",
            ),
            ("burst: requests sent / all settled", f"{sent:.1f} s / {settled:.1f} s"),
            ("1-min load before / after the burst", f"{load:.1f} / {peak_load:.1f}"),
            ("steady tasks that left Running", f"{len(burst.left_running)} of {steady_n}"),
        ],
        checks=[
            Check(
                f"no steady task silent for {SILENT_AFTER:g} s (what the operator calls silent)",
                burst.worst < SILENT_AFTER,
                f"worst {burst.worst:.1f} s",
            ),
            Check(
                "every steady task stayed Running, no disruption",
                not burst.left_running and not rest.left_running,
                ", ".join(f"{k}: {v}" for k, v in sorted(burst.left_running.items())) or "all",
                budget=False,
            ),
            Check(
                "every heartbeat read (no failed sample)",
                not errors,
                "; ".join(errors[:3]) or f"{len(rest.transit) + len(burst.transit)} arrivals",
                budget=False,
            ),
        ],
        runs=[
            "worst silence per steady task in the burst: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(burst.silence.items()))
        ],
        data={
            "rest": rest.__dict__,
            "burst": burst.__dict__,
            "sent_secs": sent,
            "settled_secs": settled,
            "load": [load, peak_load],
            "errors": errors,
        },
    )
