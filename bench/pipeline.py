"""Scenario ``pipeline``: a drain through Celery and the ledger, and a fan-out of many.

Chain: one daemon (with its Celery consumer) and 10 live scripted agents, drained with
``start_drain`` and timed until the ledger says ``recorded`` (``wait_for_operation``,
polled every 5 ms); the
checkpoint is resumed before the next repetition. the budgets: the pipeline overhead
(chain latency - the daemon's own drain) ≤ 2 x the no-op chain; this bench also keeps
its earlier budget, chain latency ≤ 2 x (bare processes + no-op chain).

Fan-out: N daemons with one agent each, started in batches while memory allows (not
timed), drained all at once with one ``start_drains`` call and waited for with one
``wait_for_operations``: drains/s = N / (``start_drains`` called → last terminal seen).
the budgets: ≥ 50 drains/s for 200, zero lost turns.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil

from bench import floors
from bench.audit import Audit
from bench.report import Check, Scenario, at_most, median, ms, ms_list, percentile
from orchestrator.ledger import CheckpointReason, Ledger, OperationState, OperationView
from orchestrator.pipeline.app import make_app
from orchestrator.pipeline.start import (
    DrainStart,
    start_drain,
    start_drains,
    start_resume,
    wait_for_operation,
    wait_for_operations,
)
from orchestrator.settings import Settings
from orchestrator.testing import WorkerProcess, flushed_redis, fresh_ledger, pipeline_env
from worker_agent.children import descendants
from worker_agent.proto import AgentStatus
from worker_agent.testing import DaemonProcess, stop_all, wait_until

CHAIN_AGENTS, CHAIN_MODEL = 10, "turns=100000,turn_ms=50"
FANOUT_MODEL = "turns=100000,turn_ms=1000"
GRACE_SECS = 30.0
OVERHEAD_BUDGET, CHAIN_BUDGET, FANOUT_RATE_BUDGET = 2.0, 2.0, 50.0
BATCH = 20
FANOUT_POLL = 0.05
"""The fan-out's wait reads every unfinished operation at once, this often (on SQLite each
read takes the write lock the worker's records wait for, so not more often)."""
MEMORY_RESERVE_GIB = 3.0
"""Fan-out start-up stops while less than this would stay available."""
REDIS_DB = 13


@dataclass
class ChainRun:
    latency: float
    internal: float
    floor_agents: float
    floor_chain: float


@dataclass
class Fanout:
    requested: int
    started: int = 0
    stopped_by: str | None = None
    window: float = 0.0
    send: float = 0.0
    latencies: list[float] = field(default_factory=list)
    finished: list[float] = field(default_factory=list)
    """Seconds from the first send until each operation finished (the ledger's clock)."""
    load_at_drain: float = 0.0

    @property
    def rate(self) -> float:
        return self.started / self.window if self.window else 0.0


class Pipeline:
    def __init__(self, root: Path, broker: str, database: str) -> None:
        self.root = root
        self.settings = Settings(
            broker_url=broker,
            result_backend=broker,
            database_url=database,
            heartbeat_interval_secs=600,
            heartbeat_poll_secs=5,
        )
        self.env = pipeline_env(
            broker, database, DRAIN_HEARTBEAT_INTERVAL_SECS="600", DRAIN_HEARTBEAT_POLL_SECS="5"
        )
        self.app = make_app(self.settings)
        self.ledger = Ledger.from_url(database)
        self.audit = Audit()

    def daemon(self, directory: str, namespace: str, name: str) -> DaemonProcess:
        return DaemonProcess(
            self.root / directory,
            drain_grace=GRACE_SECS,
            queue=f"caliband.{namespace}.{name}",
            env=self.env,
        )

    def reported(self, namespace: str, name: str, agents: int) -> bool:
        activity = self.ledger.get_activity(namespace, name)
        return activity is not None and activity.agents_total == agents

    def drain(self, namespace: str, name: str) -> tuple[float, OperationView]:
        started = time.perf_counter()
        op = start_drain(
            self.app,
            self.ledger,
            self.settings,
            namespace=namespace,
            name=name,
            grace_secs=GRACE_SECS,
            reason=CheckpointReason.MANUAL,
        )
        view = wait_for_operation(self.ledger, op.id, 180)
        return time.perf_counter() - started, view


def wait_turns(daemon: DaemonProcess, after: dict[str, int]) -> None:
    def live() -> bool:
        records = daemon.records()
        ok = (AgentStatus.RUNNING, AgentStatus.IDLE)
        return all(records[i].status in ok and records[i].turns > t for i, t in after.items())

    wait_until(live, 120, "every agent running with a new turn", interval=0.05)


def chain_runs(p: Pipeline, noop: floors.NoopChain, repeat: int) -> list[ChainRun]:
    daemon = p.daemon("chain", "bench", "chain").start()
    try:
        ids = daemon.spawn(CHAIN_AGENTS, CHAIN_MODEL)
        wait_turns(daemon, dict.fromkeys(ids, 0))
        wait_until(lambda: p.reported("bench", "chain", len(ids)), 90, "the consumer's heartbeat")
        runs = []
        for rep in range(repeat + 1):  # the first is an untimed warm-up
            latency, op = p.drain("bench", "chain")
            p.audit.checkpoint(p.ledger, op, daemon.store, ids)
            internal = daemon.drained_secs() or float("nan")
            run = ChainRun(latency, internal, floors.bare_processes(CHAIN_AGENTS), noop.measure())
            print(f"  chain {rep or 'warm-up'}: {ms(latency)} ms, daemon {ms(internal)} ms")
            if rep:
                runs.append(run)
            if rep < repeat and op.checkpoint_ref is not None:
                checkpoint = p.ledger.get_checkpoint(op.checkpoint_ref)
                assert checkpoint is not None
                resumed = start_resume(
                    p.app,
                    p.ledger,
                    p.settings,
                    namespace="bench",
                    name="chain",
                    checkpoint_ref=op.checkpoint_ref,
                )
                view = wait_for_operation(p.ledger, resumed.id, 180)
                if view.state != OperationState.RESUMED:
                    raise RuntimeError(f"resume {view.id}: {view.state} {view.error!r}")
                wait_turns(daemon, {a.agent_id: a.turns for a in checkpoint.agents})
        return runs
    finally:
        daemon.stop(60)


def fan_out(p: Pipeline, requested: int) -> Fanout:
    result = Fanout(requested)
    daemons: list[DaemonProcess] = []
    agents: dict[str, list[str]] = {}
    estimate = 160 * 1024**2
    try:
        while len(daemons) < requested:
            count = min(BATCH, requested - len(daemons))
            available = psutil.virtual_memory().available
            if available - count * estimate < MEMORY_RESERVE_GIB * 1024**3:
                result.stopped_by = f"{available / 1024**3:.1f} GiB available"
                break
            fresh = [
                p.daemon(f"f{len(daemons) + i:03d}", "bench-fan", f"d{len(daemons) + i:03d}")
                for i in range(count)
            ]
            daemons += fresh
            for daemon in fresh:
                daemon.launch()
            for daemon in fresh:
                daemon.wait_ready(180)
                agents[daemon.root.name] = daemon.spawn(1, FANOUT_MODEL)
            for daemon in fresh:
                name = f"d{daemon.root.name[1:]}"
                heartbeat = lambda name=name: p.reported("bench-fan", name, 1)  # noqa: E731
                wait_until(heartbeat, 300, f"{name}'s heartbeat", 0.2)
            sample = [pss(d) for d in fresh[:3]]
            estimate = max(estimate if len(daemons) > count else 0, int(max(sample) * 1.1))
        result.started = len(daemons)
        for daemon in daemons:
            turned = lambda d=daemon: all(r.turns >= 1 for r in d.records().values())  # noqa: E731
            wait_until(turned, 300, f"{daemon.root.name}'s agent to complete a turn")
            daemon.note_descendants()
        print(f"  fan-out: {len(daemons)} daemons ready; draining")
        result.load_at_drain = psutil.getloadavg()[0]
        drains = [
            DrainStart("bench-fan", f"d{d.root.name[1:]}", grace_secs=GRACE_SECS) for d in daemons
        ]
        started, first_sent = time.perf_counter(), datetime.now(UTC)
        ops = start_drains(p.app, p.ledger, p.settings, drains)
        result.send = time.perf_counter() - started
        views = wait_for_operations(p.ledger, [op.id for op in ops], 300, poll_secs=FANOUT_POLL)
        result.window = time.perf_counter() - started
        result.latencies = [
            (v.finished_at - v.created_at).total_seconds() for v in views if v.finished_at
        ]
        result.finished = sorted(
            (v.finished_at - first_sent).total_seconds() for v in views if v.finished_at
        )
        for daemon, view in zip(daemons, views, strict=True):
            p.audit.checkpoint(p.ledger, view, daemon.store, agents[daemon.root.name])
        return result
    finally:
        stop_all(daemons, 90)


def pss(daemon: DaemonProcess) -> int:
    """Proportional memory of a daemon and its descendants (consumer, agents)."""
    total = 0
    for pid in [daemon.pid, *descendants(daemon.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += psutil.Process(pid).memory_full_info().pss
    return total


def run(quick: bool, root: Path, redis_port: int, database_url: str | None) -> Scenario:
    repeat, fanout_n = (1, 3) if quick else (5, 200)
    broker = flushed_redis(redis_port, REDIS_DB)
    database = fresh_ledger(database_url or f"sqlite:///{root / 'ledger.db'}")
    p = Pipeline(root, broker, database)
    worker = WorkerProcess(root / "worker.log", p.env).start()
    noop = floors.NoopChain(root, broker).start()
    try:
        runs = chain_runs(p, noop, repeat)
        noop.stop()
        fan = fan_out(p, fanout_n)
    finally:
        noop.stop()
        worker.stop(30)
        p.ledger.dispose()
    latency = median([r.latency for r in runs])
    internal = median([r.internal for r in runs])
    overhead = median([r.latency - r.internal for r in runs])
    fa, fb = median([r.floor_agents for r in runs]), median([r.floor_chain for r in runs])
    table = [
        (
            f"chain latency, `start_drain` → `recorded`, {CHAIN_AGENTS} agents (median)",
            f"{ms(latency)} ms",
        ),
        ("the daemon's own drain (`drained secs=`, median)", f"{ms(internal)} ms"),
        (
            "pipeline overhead: chain latency - the daemon's own drain (median)",
            f"{ms(overhead)} ms",
        ),
        (f"floor (a): {CHAIN_AGENTS} bare processes (median)", f"{ms(fa)} ms"),
        ("floor (b): no-op two-task Celery chain (median)", f"{ms(fb)} ms"),
        ("**overhead / no-op chain**", f"**{overhead / fb:.2f}**"),
        ("**chain latency / (a + b)**", f"**{latency / (fa + fb):.2f}**"),
        (f"fan-out daemons x 1 agent (requested {fan.requested})", str(fan.started)),
        ("fan-out window: `start_drains` called → last terminal seen", f"{fan.window:.2f} s"),
        (
            f"of which `start_drains` (one ledger transaction, chains sent "
            f"{p.settings.send_concurrency} at a time, one transaction to `draining`)",
            f"{fan.send:.2f} s",
        ),
        ("**fan-out drains/s**", f"**{fan.rate:.1f}**"),
        (
            "fan-out per-drain latency p50 / p95 / max (ledger created → finished)",
            " / ".join(f"{percentile(fan.latencies, q):.2f}" for q in (0.5, 0.95, 1.0)) + " s",
        ),
        ("1-min load when the fan-out drain began", f"{fan.load_at_drain:.1f}"),
    ]
    checks = [
        at_most("pipeline overhead / no-op chain", overhead / fb, OVERHEAD_BUDGET),
        at_most(
            "chain latency / (bare processes + no-op chain)", latency / (fa + fb), CHAIN_BUDGET
        ),
        Check(
            f"fan-out ≥ {FANOUT_RATE_BUDGET:g} drains/s for {fan.started} daemons",
            fan.rate >= FANOUT_RATE_BUDGET,
            f"{fan.rate:.1f}/s",
        ),
        Check(
            "zero lost turns, every operation recorded and consistent",
            p.audit.ok,
            p.audit.summary(),
            budget=False,
        ),
    ]
    if fan.started < fan.requested:
        checks.append(
            Check(
                f"fan-out of {fan.requested} fits in memory",
                False,
                f"started {fan.started}: {fan.stopped_by}",
            )
        )
    return Scenario(
        name="pipeline",
        title="Pipeline: one drain through Celery and the ledger; fan-out",
        setup=[
            f"Broker Redis 127.0.0.1:{redis_port} db {REDIS_DB} (flushed); ledger "
            f"{'SQLite in a temp dir' if database_url is None else 'PostgreSQL'}; one "
            "`drainctl worker`; daemons with their Celery consumer.",
            f"Chain: {CHAIN_AGENTS} agents `model={CHAIN_MODEL!r}`, resumed between repetitions; "
            f"medians of {repeat} after one warm-up.",
            f"Fan-out: {fan.requested} daemons requested, 1 agent each `model={FANOUT_MODEL!r}`, "
            f"started in batches of {BATCH} (not timed).",
        ],
        table=table,
        checks=checks,
        runs=[
            f"chain latency {ms_list(r.latency for r in runs)}; daemon's own drain "
            f"{ms_list(r.internal for r in runs)}",
            f"floor (a) {ms_list(r.floor_agents for r in runs)}; floor (b) "
            f"{ms_list(r.floor_chain for r in runs)}",
        ],
        data={
            "curves": {
                "x_label": "seconds since `start_drains` was called",
                "y_label": "fan-out drains recorded (cumulative)",
                "series": {
                    f"{fan.started} daemons x 1 agent": [
                        [round(t, 3), i + 1] for i, t in enumerate(fan.finished)
                    ]
                    or [[0.0, 0]],
                    f"floor: the budget, {FANOUT_RATE_BUDGET:g} drains/s": [
                        [0.0, 0],
                        [round(fan.started / FANOUT_RATE_BUDGET, 3), fan.started],
                    ],
                },
            },
            "chain": [r.__dict__ for r in runs],
            "fanout": {**fan.__dict__, "rate": fan.rate},
            "audit": p.audit.__dict__,
        },
    )
