"""Pipeline benchmark: a drain through Celery and the ledger, against its floor; fan-out.

Run as ``.venv/bin/python bench/pipeline.py [--write] [--daemons 200] [--repeat R]``.

Everything is real: Redis on 127.0.0.1:6379 (a dedicated database, flushed), a ledger
migrated to head (SQLite in a temp dir, or ``--database-url`` PostgreSQL), the
orchestrator worker (``python -m orchestrator.cli worker``) and ``drainctl daemon
--queue caliband.<ns>.<name>`` processes, each running its own Celery consumer child
and its scripted agents. One run measures:

1. **chain latency**: one daemon with 10 scripted agents (``turns=100000,turn_ms=50``,
   each with at least one completed turn), drained through ``start_drain`` with
   ``grace_secs=30``; timed from the call until ``ledger.get_operation`` (polled every
   10 ms) says ``recorded``. Between repetitions the checkpoint is resumed
   (``start_resume``, waited on) and every agent completes a new turn, so each
   repetition drains live agents. Median of R, after one untimed warm-up.
2. **floor**, in the same run, measured while the agents are drained (a quiet machine):
   (a) ``bench/drain.py``'s floor for 10 agents — 10 bare Python processes that on
   SIGTERM write a session file atomically and durably and exit, SIGTERM → all reaped;
   (b) a no-op two-task Celery chain on the same broker with the same Celery
   configuration (``orchestrator.pipeline.app.make_app``), one queue per task like the
   daemon queue → orchestrator queue hop, served by a real worker subprocess; timed
   ``chain(first.s(), second.s()).apply_async().get()``. Floor = median(a) + median(b);
   ratio = chain latency / floor; budget ratio <= 2.
3. **fan-out**: ``--daemons N`` daemons with one scripted agent each, started in batches
   while watching memory (start-up is not measured; if N does not fit, the largest N
   that does is measured and the report says so), then ``start_drain`` for all of them
   and a wait until every operation is ``recorded``: drains/s = N / (first
   ``start_drain`` → last ``recorded`` seen). Zero lost turns is checked for every
   checkpoint agent: ledger turns == ``session.json`` turns == ``turn_complete`` events.

Exit 0 when every budget is met, 1 when one is missed, 2 on a correctness failure (a lost
turn, an operation not recorded) or an error. Every process started is stopped in
``finally`` blocks (SIGTERM, then SIGKILL for stragglers and their children).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import drain as drain_bench  # bench/drain.py: the bare-process floor and small helpers
import psutil
import redis
import sqlalchemy as sa
from celery import Celery, chain

from orchestrator.ledger import CheckpointReason, CheckpointView, Ledger, OperationView
from orchestrator.ledger.migrate import upgrade
from orchestrator.pipeline.app import make_app
from orchestrator.pipeline.start import start_drain, start_resume, wait_for_operation
from orchestrator.settings import Settings
from worker_agent.client import SupervisorClient
from worker_agent.proto import AgentRecord, AgentStatus
from worker_agent.session import SessionError, count_completed_turns, load_session

BenchFailure = drain_bench.BenchFailure
wait_until = drain_bench.wait_until

RATIO_BUDGET = 2.0
CHAIN_AGENTS = 10
CHAIN_MODEL = "turns=100000,turn_ms=50"
FANOUT_MODEL = "turns=100000,turn_ms=1000"
GRACE_SECS = 30.0
OP_POLL_SECS = 0.010
FANOUT_POLL_SECS = 0.050
OP_TIMEOUT_SECS = 180.0
HEARTBEAT_INTERVAL_SECS = 600.0
HEARTBEAT_POLL_SECS = 5.0
DEFAULT_REDIS_DB = 13
CHAIN_NS, CHAIN_NAME = "bench", "chain"
FANOUT_NS = "bench-fan"
NOOP_FIRST = "bench.noop_first"
NOOP_SECOND = "bench.noop_second"
NOOP_QUEUES = ("bench-noop.daemon", "bench-noop.orchestrator")
"""One queue per no-op task, like the daemon queue → orchestrator queue hop."""
GIB = 1024**3
MIB = 1024**2
MEMORY_RESERVE_BYTES = 3 * GIB
"""Fan-out start-up stops while less than this much memory would stay available."""
FIRST_DAEMON_ESTIMATE_BYTES = 160 * MIB
"""Assumed proportional memory of one daemon + consumer + agent until one is measured."""
PG_LEDGER_TABLES = ("checkpoint_agents", "checkpoints", "operations", "daemon_activity")
RESULTS_FILE = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN_MARK = "<!-- bench/pipeline.py results: begin -->"
END_MARK = "<!-- bench/pipeline.py results: end -->"


def ms(secs: float | None) -> str:
    return "-" if secs is None else f"{secs * 1000:.0f}"


def log(message: str) -> None:
    print(message, flush=True)


# ------------------------------------------------------------------------- environment


@dataclass(frozen=True)
class Stack:
    """The broker and ledger every process of one run shares."""

    broker: str
    database: str

    def settings(self) -> Settings:
        return Settings(
            broker_url=self.broker,
            result_backend=self.broker,
            database_url=self.database,
            heartbeat_interval_secs=HEARTBEAT_INTERVAL_SECS,
            heartbeat_poll_secs=HEARTBEAT_POLL_SECS,
        )

    def child_env(self) -> dict[str, str]:
        """The environment of every child: the bench's ``DRAIN_*`` settings and no other."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_")}
        env.update(
            DRAIN_BROKER_URL=self.broker,
            DRAIN_RESULT_BACKEND=self.broker,
            DRAIN_DATABASE_URL=self.database,
            DRAIN_HEARTBEAT_INTERVAL_SECS=str(HEARTBEAT_INTERVAL_SECS),
            DRAIN_HEARTBEAT_POLL_SECS=str(HEARTBEAT_POLL_SECS),
            PYTHONUNBUFFERED="1",
        )
        return env


def flushed_redis(db: int) -> str:
    client = redis.Redis(host="127.0.0.1", port=6379, db=db, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.ConnectionError:
        raise BenchFailure(
            "Redis is not reachable on 127.0.0.1:6379; start it with: redis-server "
            '--daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no'
        ) from None
    finally:
        client.close()
    return f"redis://127.0.0.1:6379/{db}"


def fresh_ledger(url: str | None, root: Path) -> str:
    """A migrated, empty ledger: SQLite under ``root``, or ``url`` with the ledger dropped."""
    if url is None:
        url = f"sqlite:///{root / 'ledger.db'}"
    elif not url.startswith("sqlite"):
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                for table in (*PG_LEDGER_TABLES, "alembic_version"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {table} CASCADE"))
        finally:
            engine.dispose()
    upgrade(url)
    return url


# --------------------------------------------------------------------------- processes


def stop_popen(proc: subprocess.Popen[bytes], within: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(within)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Daemon:
    """``drainctl daemon --queue …`` as a subprocess, with its consumer child and agents.

    Every descendant ever seen is remembered, so ``stop`` can SIGKILL whatever the
    daemon leaves behind (its consumer and agents run in sessions of their own)."""

    def __init__(self, root: Path, namespace: str, name: str, env: dict[str, str]) -> None:
        self.root = root
        self.namespace = namespace
        self.name = name
        self.env = env
        self.store = root / "store"
        self.socket = root / "ctl.sock"
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.tree: dict[int, psutil.Process] = {}

    def launch(self) -> None:
        """Start the process without waiting for it (see ``ready``)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "orchestrator.cli", "daemon",
                    "--store", str(self.store), "--socket", str(self.socket),
                    "--drain-grace", str(GRACE_SECS),
                    "--queue", f"caliband.{self.namespace}.{self.name}",
                ],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env,
            )  # fmt: skip

    def ready(self) -> bool:
        """The control socket answers (raises if the daemon died)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise BenchFailure(f"daemon {self.name} exited {self.proc.returncode}:\n{self.tail()}")
        if not self.socket.exists():
            return False
        try:
            with self.client(timeout=10) as client:
                client.status()
        except OSError:
            return False
        return True

    def client(self, timeout: float = 180.0) -> SupervisorClient:
        return SupervisorClient(socket_path=self.socket, timeout=timeout)

    def records(self) -> dict[str, AgentRecord]:
        with self.client() as client:
            return {r.id: r for r in client.agents()}

    def spawn(self, count: int, model: str) -> list[str]:
        with self.client() as client:
            ids = [client.spawn(provider="scripted", model=model).id for _ in range(count)]
        self.note_tree()
        return ids

    def note_tree(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.tree.setdefault(child.pid, child)

    def pss_bytes(self) -> int:
        """Proportional memory of the daemon and all its descendants."""
        assert self.proc is not None
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += proc.memory_full_info().pss
        return total

    def drained(self) -> tuple[float, float]:
        """(start in Unix seconds, duration) of the latest drain, from the daemon's
        ``ts=… event=drained … secs=…`` log line: it starts the drain by SIGTERMing the
        agents, and logs when the refs are ready."""
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            if "event=drained " in line and " secs=" in line and line.startswith("ts="):
                secs = float(line.rsplit(" secs=", 1)[1].split()[0])
                stamp = datetime.datetime.strptime(line[3:26], "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp() - secs, secs  # asctime is local time
        raise BenchFailure(f"daemon {self.name} logged no drain:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def send_stop(self) -> None:
        self.note_tree()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        """Wait for the daemon until ``deadline`` (then SIGKILL it); SIGKILL every
        descendant still alive. Answer how many processes had to be killed."""
        killed = 0
        if self.proc is not None:
            try:
                self.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed += 1
        return killed + drain_bench.kill_all(list(self.tree.values()))


def stop_daemons(daemons: Iterable[Daemon], within: float = 90.0) -> int:
    """SIGTERM all (they stop in parallel), then reap; answer how many were SIGKILLed."""
    daemons = list(daemons)
    for daemon in daemons:
        with contextlib.suppress(ProcessLookupError):
            daemon.send_stop()
    deadline = time.monotonic() + within
    killed = sum(daemon.reap(deadline) for daemon in daemons)
    if killed:
        log(f"warning: SIGKILLed {killed} process(es) left behind by daemons")
    return killed


def start_daemons(daemons: list[Daemon], timeout: float = 180.0) -> None:
    for daemon in daemons:
        daemon.launch()
    deadline = time.monotonic() + timeout
    for daemon in daemons:
        wait_until(daemon.ready, max(1.0, deadline - time.monotonic()), f"{daemon.name} up", 0.1)
        daemon.note_tree()


def start_orchestrator_worker(root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with (root / "orchestrator-worker.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "worker"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


# --------------------------------------------------------------- the no-op chain floor


def noop_app(settings: Settings) -> Celery:
    """The pipeline's Celery configuration with two trivial tasks, one per queue."""
    app = make_app(settings)

    @app.task(name=NOOP_FIRST)
    def noop_first(op_id: str) -> dict[str, Any]:
        return {"op_id": op_id, "refs": [], "error": None}

    @app.task(name=NOOP_SECOND)
    def noop_second(result: dict[str, Any], op_id: str) -> dict[str, Any]:
        return {"op_id": op_id, "checkpoint_ref": None, "agents": len(result["refs"])}

    return app


def serve_noop_worker() -> None:
    """The no-op worker subprocess: consumes both no-op queues, like a daemon's consumer
    (solo pool, task events, no gossip or mingle). Configured from ``DRAIN_*``."""
    app = noop_app(Settings())
    app.worker_main(
        [
            "worker", "--queues", ",".join(NOOP_QUEUES), "--pool", "solo",
            "--hostname", "bench-noop@%h", "--loglevel", "WARNING", "--task-events",
            "--without-gossip", "--without-mingle",
        ]
    )  # fmt: skip


def start_noop_worker(root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with (root / "noop-worker.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve-noop-worker"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip


def measure_noop_chain(app: Celery, rep: int) -> float:
    first = app.tasks[NOOP_FIRST].s(op_id=f"noop-{rep}").set(queue=NOOP_QUEUES[0])
    second = app.tasks[NOOP_SECOND].s(op_id=f"noop-{rep}").set(queue=NOOP_QUEUES[1])
    started = time.perf_counter()
    value = chain(first, second).apply_async().get(timeout=120)
    secs = time.perf_counter() - started
    if not isinstance(value, dict) or value.get("op_id") != f"noop-{rep}":
        raise BenchFailure(f"no-op chain answered {value!r}")
    return secs


# ------------------------------------------------------------------------- correctness


@dataclass
class Audit:
    """Checkpoint agents checked against their session files and transcripts."""

    agents: int = 0
    turns: int = 0
    lost_turns: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: Audit) -> None:
        self.agents += other.agents
        self.turns += other.turns
        self.lost_turns += other.lost_turns
        self.problems += other.problems


def audit_checkpoint(
    ledger: Ledger, op: OperationView, store: Path, expected_ids: list[str]
) -> Audit:
    """Every agent of the operation's checkpoint: ledger turns == session.json turns ==
    ``turn_complete`` events, clean, sha256 matching; exactly the expected agents."""
    audit = Audit()
    where = f"{op.namespace}/{op.name} op {op.id}"
    if op.state != "recorded" or op.checkpoint_ref is None:
        audit.problems.append(f"{where}: state {op.state}, error {op.error!r}")
        return audit
    checkpoint: CheckpointView | None = ledger.get_checkpoint(op.checkpoint_ref)
    if checkpoint is None:
        audit.problems.append(f"{where}: checkpoint {op.checkpoint_ref} is not in the ledger")
        return audit
    got = sorted(a.agent_id for a in checkpoint.agents)
    if got != sorted(expected_ids):
        audit.problems.append(f"{where}: checkpoint agents {got}, expected {sorted(expected_ids)}")
    if not checkpoint.verified:
        audit.problems.append(f"{where}: checkpoint {checkpoint.ref} is not verified")
    for agent in checkpoint.agents:
        directory = store / agent.session_dir
        audit.agents += 1
        audit.turns += agent.turns
        try:
            session = load_session(directory)
        except SessionError as exc:
            audit.problems.append(f"{where} agent {agent.agent_id}: {exc}")
            continue
        announced = count_completed_turns(directory)
        audit.lost_turns += max(0, max(session.turns, announced) - agent.turns)
        if not agent.turns == session.turns == announced:
            audit.problems.append(
                f"{where} agent {agent.agent_id}: ledger {agent.turns} turns, session.json "
                f"{session.turns}, {announced} turn_complete events"
            )
        if agent.session_sha256 != session.sha256 or not agent.clean:
            audit.problems.append(
                f"{where} agent {agent.agent_id}: clean={agent.clean} exit={agent.exit} "
                f"error={agent.error!r}, sha256 matches: {agent.session_sha256 == session.sha256}"
            )
    return audit


# --------------------------------------------------------------------- chain latency


def agent_stops(store: Path, ids: Iterable[str], sigterm_at: float) -> tuple[float, float]:
    """(when the last agent wrote its final ``stopped`` event, how long after the SIGTERM
    the last in-flight turn completed — 0 if none was in flight), in seconds."""
    stopped_at: list[float] = []
    turn_wait = 0.0
    for agent_id in ids:
        events = drain_bench.transcript_events(store / "agents" / agent_id)
        stamps = [e.get("ts") for e in events if e.get("type") == "stopped"]
        stamp = stamps[-1] if stamps else None
        if not isinstance(stamp, int | float):
            raise BenchFailure(f"agent {agent_id}: no timed 'stopped' event after the drain")
        stopped_at.append(float(stamp))
        for event in reversed(events):
            ts = event.get("ts")
            if event.get("type") == "turn_complete" and isinstance(ts, int | float):
                turn_wait = max(turn_wait, float(ts) - sigterm_at)
                break
    return max(stopped_at), turn_wait


@dataclass
class ChainDrain:
    """One timed drain through the pipeline, with where its time went."""

    latency: float
    op: OperationView
    daemon_internal: float
    """The daemon's own ``drained ... secs=`` figure (SIGTERMs → refs)."""
    hop_in: float
    """``start_drain`` → the daemon starts its drain (SIGTERMs the agents)."""
    agents: float
    """SIGTERM → the last agent's ``stopped`` event (in-flight turn finished, saved)."""
    turn_wait: float
    """SIGTERM → the last in-flight turn completed (the worker contract finishes a turn
    that fits in half the grace; the floor processes have no turn in flight)."""
    hop_out: float
    """Last ``stopped`` → ``recorded`` seen in the ledger."""
    turns: int


@dataclass
class ChainRep:
    drain: ChainDrain
    floor_agents: float
    floor_chain: float

    @property
    def latency(self) -> float:
        return self.drain.latency


class ChainBench:
    """One daemon with 10 agents; each repetition drains them live through the pipeline."""

    def __init__(self, stack: Stack, app: Celery, ledger: Ledger, daemon: Daemon) -> None:
        self.stack = stack
        self.settings = stack.settings()
        self.app = app
        self.ledger = ledger
        self.daemon = daemon
        self.ids: list[str] = []
        self.audit = Audit()

    def setup(self) -> None:
        start_daemons([self.daemon])
        self.ids = self.daemon.spawn(CHAIN_AGENTS, CHAIN_MODEL)
        self.wait_live({agent_id: 0 for agent_id in self.ids})
        wait_until(self.consumer_reported, 90, "the chain daemon's consumer heartbeat", 0.2)

    def consumer_reported(self) -> bool:
        """The consumer is consuming (its heartbeat thread starts on worker_ready) and
        the orchestrator worker recorded what it saw: every agent."""
        activity = self.ledger.get_activity(CHAIN_NS, CHAIN_NAME)
        return activity is not None and activity.agents_total == len(self.ids)

    def wait_live(self, turns_before: dict[str, int]) -> None:
        """Until every agent runs and has completed a turn after ``turns_before``."""

        def live() -> bool:
            records = self.daemon.records()
            return all(
                records[i].status in (AgentStatus.RUNNING, AgentStatus.IDLE)
                and records[i].turns > turns_before[i]
                for i in self.ids
            )

        wait_until(live, 120, f"{len(self.ids)} agents running with a new turn", 0.05)
        self.daemon.note_tree()

    def drain(self) -> ChainDrain:
        wall_start = time.time()
        started = time.perf_counter()
        op = start_drain(
            self.app, self.ledger, self.settings, namespace=CHAIN_NS, name=CHAIN_NAME,
            grace_secs=GRACE_SECS, reason=CheckpointReason.MANUAL,
        )  # fmt: skip
        deadline = time.monotonic() + OP_TIMEOUT_SECS
        view = op
        while not view.state.terminal and time.monotonic() < deadline:
            time.sleep(OP_POLL_SECS)
            current = self.ledger.get_operation(op.id)
            assert current is not None
            view = current
        secs = time.perf_counter() - started
        audit = audit_checkpoint(self.ledger, view, self.daemon.store, self.ids)
        self.audit.add(audit)
        if audit.problems:
            raise BenchFailure("; ".join(audit.problems) + f"\n{self.daemon.tail()}")
        sigterm_at, internal = self.daemon.drained()
        stopped_at, turn_wait = agent_stops(self.daemon.store, self.ids, sigterm_at)
        return ChainDrain(
            latency=secs,
            op=view,
            daemon_internal=internal,
            hop_in=sigterm_at - wall_start,
            agents=stopped_at - sigterm_at,
            turn_wait=max(0.0, turn_wait),
            hop_out=wall_start + secs - stopped_at,
            turns=audit.turns,
        )

    def resume(self, drained: OperationView) -> None:
        assert drained.checkpoint_ref is not None
        checkpoint = self.ledger.get_checkpoint(drained.checkpoint_ref)
        assert checkpoint is not None
        op = start_resume(
            self.app, self.ledger, self.settings, namespace=CHAIN_NS, name=CHAIN_NAME,
            checkpoint_ref=drained.checkpoint_ref,
        )  # fmt: skip
        view = wait_for_operation(self.ledger, op.id, OP_TIMEOUT_SECS)
        if view.state != "resumed" or view.error:
            raise BenchFailure(f"resume {view.id}: {view.state} {view.error!r}")
        self.wait_live({a.agent_id: a.turns for a in checkpoint.agents})


# --------------------------------------------------------------------------- fan-out


@dataclass
class Fanout:
    requested: int
    started: int = 0
    stopped_by: str | None = None
    """Why fewer than ``requested`` daemons were started (None when all were)."""
    secs: float = 0.0
    send_secs: float = 0.0
    send_calls: list[float] = field(default_factory=list)
    load_at_drain: float = 0.0
    foreign_at_drain: list[str] = field(default_factory=list)
    ledger_secs: float = 0.0
    latencies: list[float] = field(default_factory=list)
    pss_per_daemon_mb: float = 0.0
    available_gib_min: float = 0.0
    startup_secs: float = 0.0
    audit: Audit = field(default_factory=Audit)
    failed_ops: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.started / self.secs if self.secs else 0.0


def run_fanout(
    stack: Stack,
    app: Celery,
    ledger: Ledger,
    root: Path,
    requested: int,
    batch: int,
    model: str,
    daemons: list[Daemon],
) -> Fanout:
    """Start up to ``requested`` daemons (into ``daemons``, which the caller stops), one
    agent each; drain them all at once and audit every checkpoint."""
    result = Fanout(requested)
    env = stack.child_env()
    settings = stack.settings()
    began = time.monotonic()
    estimate = FIRST_DAEMON_ESTIMATE_BYTES
    result.available_gib_min = psutil.virtual_memory().available / GIB
    agents: dict[str, list[str]] = {}
    measured: list[int] = []
    while len(daemons) < requested:
        count = min(batch, requested - len(daemons))
        available = psutil.virtual_memory().available
        result.available_gib_min = min(result.available_gib_min, available / GIB)
        if available - count * estimate < MEMORY_RESERVE_BYTES:
            result.stopped_by = (
                f"memory: {available / GIB:.1f} GiB available, {count} more daemons at "
                f"~{estimate / MIB:.0f} MB each would leave less than "
                f"{MEMORY_RESERVE_BYTES / GIB:.0f} GiB"
            )
            break
        fresh = [
            Daemon(root / f"f{len(daemons) + i:03d}", FANOUT_NS, f"d{len(daemons) + i:03d}", env)
            for i in range(count)
        ]
        daemons.extend(fresh)
        start_daemons(fresh)
        for daemon in fresh:
            agents[daemon.name] = daemon.spawn(1, model)
        # Consumers import Celery after the socket is up: let the batch settle before
        # measuring it, so the next memory check sees what it really costs.
        wait_until(all_reported(ledger, fresh), 300, "the batch's consumers to report", 0.2)
        sample = [d.pss_bytes() for d in fresh[:3]]
        measured.extend(sample)
        estimate = int(max(sample) * 1.1) if len(daemons) == count else max(estimate, *sample)
        if len(daemons) % (batch * 5) == 0 or len(daemons) == requested:
            log(
                f"  fan-out: {len(daemons)} daemons up, "
                f"{psutil.virtual_memory().available / GIB:.1f} GiB available, "
                f"~{statistics.mean(measured) / MIB:.0f} MB PSS per daemon+consumer+agent, "
                f"load {os.getloadavg()[0]:.1f}"
            )
    result.started = len(daemons)
    if measured:
        result.pss_per_daemon_mb = statistics.mean(measured) / MIB
    if not daemons:
        return result

    def all_turned() -> bool:
        for daemon in daemons:
            records = daemon.records()
            if not all(r.status.live and r.turns >= 1 for r in records.values()):
                return False
        return True

    wait_until(all_turned, 300, "every fan-out agent to complete a turn", 0.5)
    for daemon in daemons:
        daemon.note_tree()
    result.available_gib_min = min(
        result.available_gib_min, psutil.virtual_memory().available / GIB
    )
    result.startup_secs = time.monotonic() - began
    log(f"  fan-out: {len(daemons)} daemons ready after {result.startup_secs:.0f}s; draining")

    result.load_at_drain = os.getloadavg()[0]
    result.foreign_at_drain = foreign_processes()
    for line in result.foreign_at_drain:
        log(f"  warning: not ours, running during the fan-out drain: {line}")
    wall_start = datetime.datetime.now(datetime.UTC)
    started = time.perf_counter()
    ops = []
    for daemon in daemons:
        call = time.perf_counter()
        op = start_drain(
            app, ledger, settings, namespace=FANOUT_NS, name=daemon.name, grace_secs=GRACE_SECS
        )
        ops.append(op)
        result.send_calls.append(time.perf_counter() - call)
    result.send_secs = time.perf_counter() - started
    wanted = {op.id for op in ops}
    deadline = time.monotonic() + OP_TIMEOUT_SECS + len(daemons)
    views: dict[str, OperationView] = {}
    while True:
        for view in ledger.list_operations(namespace=FANOUT_NS, limit=2 * len(daemons) + 10):
            if view.id in wanted:
                views[view.id] = view
        if len(views) == len(wanted) and all(v.state.terminal for v in views.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(FANOUT_POLL_SECS)
    result.secs = time.perf_counter() - started
    finished = [v.finished_at for v in views.values() if v.finished_at is not None]
    if finished:
        result.ledger_secs = (max(finished) - wall_start).total_seconds()
    result.latencies = sorted(
        (v.finished_at - v.created_at).total_seconds()
        for v in views.values()
        if v.finished_at is not None
    )
    by_name = {d.name: d for d in daemons}
    for op_id in wanted:
        found = views.get(op_id) or ledger.get_operation(op_id)
        assert found is not None
        view = found
        if view.state != "recorded":
            result.failed_ops.append(f"{view.name}: {view.state} {view.error!r}")
            continue
        daemon = by_name[view.name]
        result.audit.add(audit_checkpoint(ledger, view, daemon.store, agents[daemon.name]))
    return result


def all_reported(ledger: Ledger, daemons: list[Daemon]) -> Callable[[], bool]:
    """A condition: every daemon's consumer sent a heartbeat counting its one agent."""

    def check() -> bool:
        for daemon in daemons:
            activity = ledger.get_activity(daemon.namespace, daemon.name)
            if activity is None or activity.agents_total != 1:
                return False
        return True

    return check


# ---------------------------------------------------------------------------- report


@dataclass
class Results:
    reps: list[ChainRep]
    warmup: ChainRep
    fanout: Fanout
    chain_audit: Audit
    foreign_during_chain: int
    """The most processes not started by this run seen during a chain repetition."""

    @property
    def latency(self) -> float:
        return statistics.median(r.latency for r in self.reps)

    @property
    def floor_agents(self) -> float:
        return statistics.median(r.floor_agents for r in self.reps)

    @property
    def floor_chain(self) -> float:
        return statistics.median(r.floor_chain for r in self.reps)

    @property
    def floor(self) -> float:
        return self.floor_agents + self.floor_chain

    @property
    def ratio(self) -> float:
        return self.latency / self.floor

    @property
    def internal(self) -> float:
        return statistics.median(r.drain.daemon_internal for r in self.reps)

    def median(self, part: Callable[[ChainDrain], float]) -> float:
        return statistics.median(part(r.drain) for r in self.reps)


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def verdicts(res: Results) -> list[Verdict]:
    fan = res.fanout
    lost = res.chain_audit.lost_turns + fan.audit.lost_turns
    problems = len(res.chain_audit.problems) + len(fan.audit.problems) + len(fan.failed_ops)
    return [
        Verdict(
            f"chain latency <= {RATIO_BUDGET:g} x floor",
            res.ratio <= RATIO_BUDGET,
            f"ratio {res.ratio:.2f}",
        ),
        Verdict(
            "zero lost turns, every operation recorded and every checkpoint agent consistent",
            lost == 0 and problems == 0,
            f"{lost} lost turns, {problems} problems over "
            f"{res.chain_audit.agents + fan.audit.agents} checkpoint agents",
        ),
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return sorted(values)[index]


def table(res: Results) -> str:
    fan = res.fanout
    rows = [
        "| measure | value |",
        "|---|---:|",
        f"| chain latency: `start_drain` → ledger `recorded`, 10 live agents (median) "
        f"| {ms(res.latency)} ms |",
        f"| &nbsp;&nbsp;`start_drain` → daemon SIGTERMs the agents (median) "
        f"| {ms(res.median(lambda d: d.hop_in))} ms |",
        f"| &nbsp;&nbsp;SIGTERM → last agent stopped: in-flight turn finished, saved (median) "
        f"| {ms(res.median(lambda d: d.agents))} ms |",
        f"| &nbsp;&nbsp;&nbsp;&nbsp;of which the last in-flight turn completing after SIGTERM "
        f"(median) | {ms(res.median(lambda d: d.turn_wait))} ms |",
        f"| &nbsp;&nbsp;last agent stopped → `recorded` seen in the ledger (median) "
        f"| {ms(res.median(lambda d: d.hop_out))} ms |",
        f"| &nbsp;&nbsp;the daemon's own drain, SIGTERMs → refs (`drained secs=`, median) "
        f"| {ms(res.internal)} ms |",
        f"| &nbsp;&nbsp;pipeline overhead: chain latency minus the daemon's own drain (median) "
        f"| {ms(res.median(lambda d: d.latency - d.daemon_internal))} ms |",
        f"| floor (a): 10 bare processes, SIGTERM → durable save → all reaped (median) "
        f"| {ms(res.floor_agents)} ms |",
        f"| floor (b): no-op two-task Celery chain, same broker and config (median) "
        f"| {ms(res.floor_chain)} ms |",
        f"| floor = (a) + (b) | {ms(res.floor)} ms |",
        f"| **ratio** chain latency / floor (budget ≤ {RATIO_BUDGET:g}) | **{res.ratio:.2f}** |",
        f"| fan-out N (daemons x 1 agent; requested {fan.requested}) | {fan.started} |",
        f"| fan-out wall: first `start_drain` → last `recorded` seen | {fan.secs:.2f} s |",
        f"| &nbsp;&nbsp;of which sending all `start_drain`, one after another "
        f"| {fan.send_secs:.2f} s |",
        f"| &nbsp;&nbsp;one `start_drain` call p50 / max "
        f"| {ms(percentile(fan.send_calls, 0.5))} / {ms(percentile(fan.send_calls, 1.0))} ms |",
        f"| &nbsp;&nbsp;last `finished_at` in the ledger after the first send "
        f"| {fan.ledger_secs:.2f} s |",
        f"| **fan-out drains/s** | **{fan.rate:.1f}** |",
        f"| fan-out per-drain latency p50 / p95 / max (ledger created → finished) "
        f"| {percentile(fan.latencies, 0.5):.2f} / {percentile(fan.latencies, 0.95):.2f} / "
        f"{percentile(fan.latencies, 1.0):.2f} s |",
        f"| lost turns (chain: {res.chain_audit.agents} + fan-out: {fan.audit.agents} "
        f"checkpoint agents) | {res.chain_audit.lost_turns + fan.audit.lost_turns} |",
    ]
    return "\n".join(rows)


def breakdown(d: ChainDrain) -> str:
    return f"{ms(d.hop_in)}/{ms(d.agents)} ({ms(d.turn_wait)})/{ms(d.hop_out)}"


def raw_runs(res: Results) -> str:
    def join(values: Iterable[float]) -> str:
        return ", ".join(ms(v) for v in values)

    w = res.warmup
    return "\n".join(
        [
            f"- chain latency [{join(r.latency for r in res.reps)}] ms "
            f"(untimed warm-up: {ms(w.latency)} ms)",
            f"- in / agents (in-flight turn) / out "
            f"[{'; '.join(breakdown(r.drain) for r in res.reps)}] ms",
            f"- daemon-internal drain [{join(r.drain.daemon_internal for r in res.reps)}] ms",
            f"- floor (a) [{join(r.floor_agents for r in res.reps)}] ms",
            f"- floor (b) [{join(r.floor_chain for r in res.reps)}] ms "
            f"(warm-up: {ms(w.floor_chain)} ms)",
            f"- turns drained per repetition (10 agents): {[r.drain.turns for r in res.reps]}",
        ]
    )


def machine() -> str:
    vm = psutil.virtual_memory()
    return (
        f"nproc {os.cpu_count()}, RAM {vm.total / GIB:.1f} GiB, Python "
        f"{platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}, /tmp on "
        f"{drain_bench.filesystem_of(Path('/tmp'))}, 1-min load {os.getloadavg()[0]:.2f} "
        "at the start"
    )


FOREIGN_MARKERS = ("bench/drain.py", "orchestrator.cli", "worker_agent.", "pytest")


def foreign_processes() -> list[str]:
    """Benchmarks, tests and caliban-drain processes on this machine that this run did
    not start: they compete for the same two cores and disks."""
    me = psutil.Process(os.getpid())
    mine = {me.pid, *(child.pid for child in me.children(recursive=True))}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] not in mine and any(m in cmdline for m in FOREIGN_MARKERS):
            found.append(f"{proc.info['pid']}: {cmdline[:160]}")
    return found


def report(
    res: Results,
    checks: list[Verdict],
    command: str,
    host: str,
    args: argparse.Namespace,
    foreign_at_start: int,
) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    fan = res.fanout
    ledger_kind = "PostgreSQL" if args.database_url else "SQLite (temp dir)"
    lines = [
        "## Pipeline benchmark (`bench/pipeline.py`)",
        "",
        "Chain latency: one daemon with 10 scripted agents (`model="
        f"{CHAIN_MODEL!r}`, each with ≥ 1 completed turn, resumed through `start_resume` "
        "before every repetition), timed from `start_drain(grace_secs=30)` until "
        "`ledger.get_operation` (polled every 10 ms) says `recorded`. Floor, measured in the "
        "same run while the agents are drained: (a) `bench/drain.py`'s floor for 10 — bare "
        "processes that write a session file atomically and durably on SIGTERM, timed "
        "SIGTERM → all reaped; (b) a no-op two-task Celery chain (`bench.noop_first` on one "
        "queue → `bench.noop_second` on another, like daemon queue → orchestrator queue) "
        "with the pipeline's Celery configuration, one real solo-pool worker, timed "
        "`chain(...).apply_async().get()`. Fan-out: N daemons (supervisor + Celery "
        f"consumer child) with 1 agent each (`model={args.fanout_model!r}`), all drained at "
        "once; start-up is outside the window. Every checkpoint agent is audited: ledger "
        "turns == `session.json` turns == `turn_complete` events, clean, sha256 matching.",
        "",
        f"- Command: `{command}`",
        f"- Date: {when}",
        f"- Machine: {host}",
        f"- Broker: Redis 127.0.0.1:6379 db {args.redis_db} (flushed); ledger: {ledger_kind}; "
        "orchestrator worker `python -m orchestrator.cli worker` (default concurrency 4, "
        "threads); heartbeats every 600 s / polled every 5 s",
        f"- Medians of {len(res.reps)} repetitions after one untimed warm-up",
        f"- Fan-out start-up (not measured): {fan.startup_secs:.0f} s for {fan.started} "
        f"daemons in batches of {args.batch}; ~{fan.pss_per_daemon_mb:.0f} MB PSS per "
        f"daemon + consumer + agent; lowest available memory seen "
        f"{fan.available_gib_min:.1f} GiB; 1-min load {fan.load_at_drain:.1f} when the "
        "fan-out drain began",
        f"- Processes of other benchmarks, tests or caliban-drain runs not started by this "
        f"run: {foreign_at_start} at the start, at most {res.foreign_during_chain} during the "
        f"chain repetitions, {len(fan.foreign_at_drain)} when the fan-out drain began",
        "",
        table(res),
        "",
        *interpretation(res),
        "",
        "Budgets and checks:",
        "",
    ]
    for check in checks:
        lines.append(f"- {'PASS' if check.ok else 'FAIL'}: {check.name} ({check.detail})")
    if fan.started < fan.requested:
        lines += [
            "",
            f"N={fan.requested} was not feasible on this machine ({fan.stopped_by}); the "
            f"fan-out above is the largest N that was: {fan.started}.",
        ]
    lines += ["", "Every run:", "", raw_runs(res)]
    return "\n".join(lines)


def interpretation(res: Results) -> list[str]:
    fan = res.fanout
    return [
        "Where the time goes (medians): "
        f"`start_drain` → SIGTERMs {ms(res.median(lambda d: d.hop_in))} ms; SIGTERM → last "
        f"agent stopped {ms(res.median(lambda d: d.agents))} ms, which is the last in-flight "
        f"scripted turn completing ({ms(res.median(lambda d: d.turn_wait))} ms; the worker "
        "contract finishes a turn that fits in half the grace, and floor (a)'s processes "
        "have no turn in flight); last agent stopped → `recorded` "
        f"{ms(res.median(lambda d: d.hop_out))} ms (the daemon reaps, verifies and syncs, the "
        "consumer journals the refs, the result and the `record_checkpoint` hop, the ledger "
        "transaction, up to 10 ms of polling). Part by part: the daemon's own drain is "
        f"{ms(res.internal)} ms against floor (a)'s {ms(res.floor_agents)} ms; the rest, "
        "Celery and the ledger, is "
        f"{ms(res.median(lambda d: d.latency - d.daemon_internal))} ms against the no-op "
        f"chain's {ms(res.floor_chain)} ms.",
        "",
        f"Fan-out: {fan.send_secs:.1f} s of the {fan.secs:.1f} s window is the "
        f"{fan.started} `start_drain` calls made one after another (each a ledger insert, a "
        "publish and a ledger update); the drains themselves keep up with the sending. With "
        f"{fan.started} daemons, consumers and agents (1 turn/s each) running, the two "
        f"cores were saturated: 1-min load {fan.load_at_drain:.1f} when the drain began.",
    ]


def write_results(section: str) -> None:
    """Replace (or append) this bench's own section; other sections are left as they are."""
    block = f"{BEGIN_MARK}\n{section}\n{END_MARK}\n"
    text = RESULTS_FILE.read_text() if RESULTS_FILE.exists() else ""
    if BEGIN_MARK in text and END_MARK in text:
        head, _, rest = text.partition(BEGIN_MARK)
        _, _, tail = rest.partition(END_MARK)
        text = head + block + tail.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    RESULTS_FILE.write_text(text)


# ------------------------------------------------------------------------------ main


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(f"stopped by signal {signum}")


@contextlib.contextmanager
def guarded(name: str, stop: Callable[[], object]) -> Iterator[None]:
    """Run ``stop`` on the way out whatever happens, reporting (not raising) its errors."""
    try:
        yield
    finally:
        try:
            stop()
        except Exception:
            log(f"warning: stopping {name} failed:\n{traceback.format_exc()}")


def run(args: argparse.Namespace, root: Path) -> Results:
    stack = Stack(flushed_redis(args.redis_db), fresh_ledger(args.database_url, root))
    settings = stack.settings()
    env = stack.child_env()
    app = make_app(settings)
    noop = noop_app(settings)
    ledger = Ledger.from_url(stack.database)
    fan_daemons: list[Daemon] = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(ledger.dispose)
        worker = start_orchestrator_worker(root, env)
        cleanup.enter_context(guarded("the orchestrator worker", lambda: stop_popen(worker, 30)))
        noop_worker = start_noop_worker(root, env)
        noop_guard = contextlib.ExitStack()
        cleanup.enter_context(noop_guard)
        noop_guard.enter_context(guarded("the no-op worker", lambda: stop_popen(noop_worker, 30)))
        chain_daemon = Daemon(root / "chain", CHAIN_NS, CHAIN_NAME, env)
        chain_guard = contextlib.ExitStack()
        cleanup.enter_context(chain_guard)
        chain_guard.enter_context(guarded("the chain daemon", lambda: stop_daemons([chain_daemon])))
        cleanup.enter_context(guarded("the fan-out daemons", lambda: stop_daemons(fan_daemons)))

        bench = ChainBench(stack, app, ledger, chain_daemon)
        bench.setup()
        log(f"chain: daemon up, {CHAIN_AGENTS} agents running, consumer reporting")
        reps: list[ChainRep] = []
        warmup: ChainRep | None = None
        foreign_during_chain = 0
        for rep in range(args.repeat + 1):
            drained = bench.drain()
            floor_agents = drain_bench.measure_floor(CHAIN_AGENTS).secs
            floor_chain = measure_noop_chain(noop, rep)
            run_ = ChainRep(drained, floor_agents, floor_chain)
            if foreign := foreign_processes():
                foreign_during_chain = max(foreign_during_chain, len(foreign))
                log(f"  warning: {len(foreign)} processes not ours running, e.g. {foreign[0]}")
            label = "warm-up" if rep == 0 else f"rep {rep}/{args.repeat}"
            log(
                f"{label:>9}: chain {ms(drained.latency):>4} ms = in {ms(drained.hop_in)} + "
                f"agents {ms(drained.agents)} (turn {ms(drained.turn_wait)}) + out "
                f"{ms(drained.hop_out)} (daemon drain "
                f"{ms(drained.daemon_internal)})  floor a {ms(floor_agents):>3} + b "
                f"{ms(floor_chain):>3} ms  ratio "
                f"{drained.latency / (floor_agents + floor_chain):.2f}  turns {drained.turns}"
            )
            if rep == 0:
                warmup = run_
            else:
                reps.append(run_)
            if rep < args.repeat:
                bench.resume(drained.op)
        assert warmup is not None
        chain_guard.close()  # the chain daemon and the no-op worker are done
        noop_guard.close()

        log(f"fan-out: starting up to {args.daemons} daemons in batches of {args.batch}")
        fanout = run_fanout(
            stack, app, ledger, root / "fan", args.daemons, args.batch, args.fanout_model,
            fan_daemons,
        )  # fmt: skip
        log(
            f"fan-out: N={fanout.started} drained in {fanout.secs:.2f}s "
            f"({fanout.rate:.1f} drains/s), lost turns {fanout.audit.lost_turns}, "
            f"problems {len(fanout.audit.problems) + len(fanout.failed_ops)}"
        )
        for problem in [*fanout.failed_ops, *fanout.audit.problems][:20]:
            log(f"  problem: {problem}")
        return Results(reps, warmup, fanout, bench.audit, foreign_during_chain)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/pipeline.py", description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="chain repetitions (median)")
    parser.add_argument("--daemons", type=int, default=200, help="fan-out daemons (N)")
    parser.add_argument("--batch", type=int, default=20, help="fan-out daemons started at once")
    parser.add_argument("--fanout-model", default=FANOUT_MODEL, help="fan-out agents' model")
    parser.add_argument("--redis-db", type=int, default=DEFAULT_REDIS_DB, help="flushed first")
    parser.add_argument(
        "--database-url",
        default=None,
        help="ledger URL, e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test (its ledger "
        "tables are dropped and migrated again); default SQLite in a temp dir",
    )
    parser.add_argument("--write", action="store_true", help=f"update {RESULTS_FILE.name}")
    parser.add_argument("--serve-noop-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_noop_worker:
        serve_noop_worker()
        return 0
    args.repeat = max(1, args.repeat)
    args.daemons = max(1, args.daemons)
    args.batch = max(1, args.batch)
    signal.signal(signal.SIGTERM, _terminate)
    command = " ".join([".venv/bin/python", "bench/pipeline.py", *sys.argv[1:]])
    host = machine()
    log(f"# pipeline bench: {args.repeat} repetitions, fan-out N={args.daemons}; {host}")
    foreign_at_start = foreign_processes()
    for line in foreign_at_start:
        log(f"warning: not ours, running and competing with this run: {line}")
    began = time.monotonic()
    try:
        with drain_bench.short_tmp("cdp-") as root:
            res = run(args, root)
    except BenchFailure as exc:
        print(f"\nBENCH FAILED (correctness): {exc}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("\nBENCH FAILED (error above)", file=sys.stderr)
        return 2
    checks = verdicts(res)
    section = report(res, checks, command, host, args, len(foreign_at_start))
    log("")
    log(section)
    log(f"\n(total {time.monotonic() - began:.0f}s)")
    if args.write:
        write_results(section)
        log(f"wrote {RESULTS_FILE}")
    if not checks[1].ok:
        return 2
    return 0 if checks[0].ok else 1


if __name__ == "__main__":
    sys.exit(main())
