"""Scenario ``fleet``: the operator with N CalibanTasks, at rest and reacting to causes.

The embedded Kubernetes API (``drainctl dev cluster``), ``drainctl operator``, one
``drainctl worker``, Redis and the ledger are real; the N daemons are stood in for by a
load generator that sends exactly what a daemon's consumer sends: one
``caliban.orchestrator.activity`` heartbeat per task every ``heartbeat_interval_secs``
(the default), with the same payload and expiry. Every setting is the default.

Measured: the operator's CPU (user + system, from /proc) over a window with the whole
fleet Running and nothing happening, its peak RSS; then, one cause at a time, the time
from the cause to the operator's first action:

- delete: the DELETE → the operator's drain operation stored in the ledger;
- wake: ``spec.lifecycle.suspend`` set false on a task created suspended → the task's
  status phase Provisioning;
- idle deadline: the moment a task's idle timeout falls due (its stored heartbeat's
  idle measure plus the time since it arrived, ``lifecycle.idle_secs``) → the pause
  operation stored in the ledger.

The floor for delete and wake is the cause's own API round trip (the request answered:
the operator cannot act before the API has the change); for the idle deadline it is
zero. A wake's action is seen by GETs every 10 ms, each counted at its midpoint.
Budgets: CPU at rest < 5 % of one core, RSS < 400 MB, p95 cause → action < 500 ms; 300
tasks waiting for their daemon add < 5 % of one core (measured before any cause, so no
operation is on its way), and a waiting task is Running within 1 s of its first heartbeat.
With the ledger down, each task fails no more passes than its backoff allows and each
failure is one log line.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psutil
from kubernetes import client, config

from bench.audit_cost import ApiServer, ensure_database
from bench.report import Check, Scenario, at_most, median, ms, percentile
from orchestrator.ledger import ActivityView, Ledger, OperationKind, OperationView
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.operator.pacing import failure_backoff
from orchestrator.settings import Settings
from orchestrator.testing import WorkerProcess, flushed_redis, pipeline_env
from worker_agent.contract import (
    ACTIVITY,
    ORCHESTRATOR_QUEUE,
    ActivityReport,
    BrokerSettings,
    make_celery,
)
from worker_agent.testing import DRAINCTL, Subprocess, child_env, wait_until

NAMESPACE = "default"
SIZE, QUICK_SIZE = 1000, 20
SAMPLES, QUICK_SAMPLES = 20, 3
"""Causes of each kind, one after another."""
REST_SECS, QUICK_REST_SECS = 60.0, 3.0
SETTLE_SECS, QUICK_SETTLE_SECS = 10.0, 1.0
"""After the last task is Running, before the rest window: the last passes finish."""
IDLE_TIMEOUT_SECS = 600.0
IDLE_DUE_IN_SECS = 3.0
"""An idle sample's heartbeat says the task has been idle this long short of its timeout."""
CPU_BUDGET, RSS_BUDGET_MB, P95_BUDGET = 0.05, 400.0, 0.5
WAITING, QUICK_WAITING = 300, 10
"""Tasks created with no daemon's heartbeat: Provisioning, waiting for it."""
LEAVE_BUDGET_SECS = 1.0
"""A waiting task's first heartbeat stored → its phase Running."""
LOG_SLACK_LINES = 2
"""Failures counted and not yet logged when the counter is read (a pass counts its
failure, then logs it)."""
OUTAGE_SECS, QUICK_OUTAGE_SECS = 60.0, 8.0
"""How long the ledger refuses connections under the fleet."""
REDIS_DB = 4
DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_fleet"
THREADS = 8
POLL_SECS = 0.01
T = TypeVar("T")


class Operator(Subprocess):
    """``drainctl operator`` (daemons' Sandboxes not managed: the load generator is the
    fleet's daemons), ready once its liveness probe answers."""

    what = "drainctl operator"
    ready_timeout = 90.0

    def __init__(self, log: Path, env: dict[str, str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/healthz"
        super().__init__([*DRAINCTL, "operator", "--liveness", self.url], log, child_env(env))

    def ready(self) -> bool:
        import urllib.request

        self.check_alive(self.what)
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                return int(response.status) == 200
        except OSError:
            return False


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Daemons(threading.Thread):
    """The load generator: each task's heartbeat every interval, spread over it."""

    def __init__(self, broker: str, interval: float) -> None:
        super().__init__(daemon=True, name="fleet-daemons")
        self.app = make_celery(BrokerSettings(broker_url=broker))
        self.interval = interval
        self.tasks: dict[str, str] = {}
        """name → uid, of the tasks whose daemon runs."""
        self.idle_since: dict[str, float] = {}
        """name → since when (``time.monotonic``) its agent is idle (absent: not idle):
        each heartbeat says how long, as a daemon's idle clock does."""
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.sent = 0

    def send(self, name: str) -> None:
        with self.lock:
            uid, since = self.tasks[name], self.idle_since.get(name)
        idle_for = None if since is None else time.monotonic() - since
        now = time.time()
        report = ActivityReport(
            namespace=NAMESPACE, name=name, task_uid=uid, seq=time.time_ns(), reported_at=now,
            agents_total=1, agents_live=1, agents_idle=1 if idle_for is not None else 0,
            all_idle_since=None if idle_for is None else now - idle_for, idle_for_secs=idle_for,
        )  # fmt: skip
        self.app.send_task(ACTIVITY, kwargs=report.model_dump(mode="json"),
                           queue=ORCHESTRATOR_QUEUE, expires=self.interval * 4)  # fmt: skip
        self.sent += 1

    def run(self) -> None:
        """Every task's first heartbeat at once (a daemon sends one as it starts), then
        each again within every interval, spread evenly over it; a task added meanwhile
        joins at the next interval, one removed stops."""
        with self.lock:
            names = list(self.tasks)
        for name in names:
            self.send(name)
        while not self.stopping.is_set():
            began = time.monotonic()
            with self.lock:
                names = list(self.tasks)
            if not names and self.stopping.wait(self.interval):
                return
            for index, name in enumerate(names, start=1):
                at = began + self.interval * index / len(names)
                if self.stopping.wait(max(0.0, at - time.monotonic())):
                    return
                with self.lock:
                    if name not in self.tasks:
                        continue
                self.send(name)


def task_body(name: str, *, suspended: bool) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "CalibanTask",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "task": {"agents": 1, "provider": "scripted", "model": "turns=100000,turn_ms=1000"},
            "lifecycle": {"idleTimeout": f"{IDLE_TIMEOUT_SECS:.0f}s", "suspend": suspended},
        },
    }  # fmt: skip


def phase_of(custom: client.CustomObjectsApi, name: str) -> str | None:
    task = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
    return (task.get("status") or {}).get("phase")


def phases(custom: client.CustomObjectsApi) -> dict[str, str | None]:
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
    return {t["metadata"]["name"]: (t.get("status") or {}).get("phase") for t in listed["items"]}


def in_phase(custom: client.CustomObjectsApi, names: list[str], phase: str) -> Callable[[], bool]:
    def check() -> bool:
        now = phases(custom)
        return all(now.get(n) == phase for n in names)

    return check


def operation(ledger: Ledger, name: str, kind: OperationKind) -> Callable[[], OperationView | None]:
    def check() -> OperationView | None:
        return next((o for o in ledger.list_operations(NAMESPACE, name) if o.kind is kind), None)

    return check


def idle_stored(ledger: Ledger, name: str) -> Callable[[], ActivityView | None]:
    def check() -> ActivityView | None:
        activity = ledger.get_activity(NAMESPACE, name)
        if activity is None or activity.idle_for_secs is None or activity.received_at is None:
            return None
        return activity

    return check


CAUSES = ("start", "event", "ledger", "clock")


def _metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
        return str(got.read().decode())


def passes(port: int) -> dict[str, float]:
    """The operator's ``caliban_drain_operator_passes_total`` by cause."""
    found: dict[str, float] = {}
    for line in _metrics(port).splitlines():
        if line.startswith("caliban_drain_operator_passes_total{"):
            labels, _, number = line.rpartition(" ")
            cause = labels.split('cause="', 1)[1].split('"', 1)[0]
            found[cause] = float(number)
    return found


def counter(port: int, name: str) -> float:
    """The operator's counter ``name`` (``…_total``), 0 before its first count."""
    for line in _metrics(port).splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.rpartition(" ")[2])
    return 0.0


def set_connections(url: str, allowed: bool) -> None:
    """The ledger's database takes new connections, or refuses them and ends its own."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    admin = create_engine(parsed.set(database="postgres"), poolclass=NullPool,
                          isolation_level="AUTOCOMMIT")  # fmt: skip
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{parsed.database}" ALLOW_CONNECTIONS '
                              f"{'true' if allowed else 'false'}"))  # fmt: skip
            if not allowed:
                conn.execute(
                    text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = :db AND pid <> pg_backend_pid()"),
                    {"db": parsed.database},
                )  # fmt: skip
    finally:
        admin.dispose()


def lines_of(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def lines_after(path: Path, skip: int) -> list[str]:
    with path.open("rb") as handle:
        return [line.decode(errors="replace") for n, line in enumerate(handle) if n >= skip]


def kinds_of(lines: list[str]) -> Counter[str]:
    """Log lines by what they say: ``event=`` (or their first word), a traceback's lines
    as ``traceback``."""
    kinds: Counter[str] = Counter()
    for line in lines:
        if line.startswith(("Traceback", " ", "\t")):
            kinds["traceback"] += 1
            continue
        found = re.search(r"\bevent=(\S+)", line)
        kinds[found.group(1) if found else (line.split() or ["(empty)"])[0]] += 1
    return kinds


def cpu_over(pid: int, secs: float) -> tuple[float, float]:
    """The process's CPU share over ``secs`` of wall time (user + system), and the window."""
    cpu0, t0 = process_cpu(pid), time.monotonic()
    time.sleep(secs)
    window = time.monotonic() - t0
    return (process_cpu(pid) - cpu0) / window, window


def process_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def failures_allowed(window: float) -> int:
    """The most passes one task can fail within ``window`` seconds when each failure
    waits ``failure_backoff`` before the next: the first at once, then 1 s, 2 s, 4 s…"""
    attempts, at = 0, 0.0
    while at <= window:
        attempts += 1
        at += failure_backoff(attempts)
    return attempts


def wait_for(what: str, timeout: float, check: Callable[[], T | None]) -> T:
    found: T = wait_until(check, timeout, what, interval=0.05)
    return found


def run(quick: bool, root: Path, redis_port: int, database_url: str | None) -> Scenario:
    n = QUICK_SIZE if quick else SIZE
    samples = QUICK_SAMPLES if quick else SAMPLES
    rest_secs = QUICK_REST_SECS if quick else REST_SECS
    broker = flushed_redis(redis_port, REDIS_DB)
    url = ensure_database(database_url or DATABASE_URL)
    settings = Settings()
    api = ApiServer(root).start()
    metrics_port = free_port()
    env = pipeline_env(
        broker, url, KUBECONFIG=str(api.kubeconfig), DRAIN_METRICS_PORT=str(metrics_port),
        DRAIN_METRICS_HOST="127.0.0.1",
    )  # fmt: skip
    worker_env = {**env, "DRAIN_WORKER_METRICS_PORT": "0"}
    worker = WorkerProcess(root / "worker.log", worker_env)
    operator = Operator(root / "operator.log", env, free_port())
    daemons = Daemons(broker, settings.heartbeat_interval_secs)
    ledger = Ledger.from_url(url)
    try:
        worker.start()
        operator.start()
        config.load_kube_config(config_file=str(api.kubeconfig))
        custom = client.CustomObjectsApi()
        held = [f"held-{i:03d}" for i in range(samples)]
        running = [f"task-{i:05d}" for i in range(n)]

        def create(name: str) -> None:
            made = custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, task_body(name, suspended=name in held)
            )
            if name not in held:
                with daemons.lock:
                    daemons.tasks[name] = made["metadata"]["uid"]

        began = time.monotonic()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(create, [*running, *held]))
        created_secs = time.monotonic() - began
        daemons.start()
        wait_until(in_phase(custom, running, "Running"), 600, f"{n} tasks Running", interval=1)
        wait_until(in_phase(custom, held, "Suspended"), 60, "the held tasks Suspended", interval=1)
        to_running_secs = time.monotonic() - began
        time.sleep(QUICK_SETTLE_SECS if quick else SETTLE_SECS)

        # -- at rest
        proc = psutil.Process(operator.pid)
        rss = [proc.memory_info().rss]
        passes0 = passes(metrics_port)
        cpu0, worker0, t0 = process_cpu(operator.pid), process_cpu(worker.pid), time.monotonic()
        while time.monotonic() - t0 < rest_secs:
            time.sleep(1.0)
            rss.append(proc.memory_info().rss)
        window = time.monotonic() - t0
        cpu = (process_cpu(operator.pid) - cpu0) / window
        worker_cpu = (process_cpu(worker.pid) - worker0) / window
        passes1 = passes(metrics_port)
        at_rest = {cause: passes1.get(cause, 0) - passes0.get(cause, 0) for cause in CAUSES}
        sent_during_rest = daemons.sent

        # -- waiting for their daemons: Provisioning, no heartbeat yet
        waiting = [f"wait-{i:03d}" for i in range(QUICK_WAITING if quick else WAITING)]
        uids: dict[str, str] = {}

        def create_waiting(name: str) -> None:
            made = custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, task_body(name, suspended=False)
            )
            uids[name] = made["metadata"]["uid"]

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(create_waiting, waiting))
        wait_until(in_phase(custom, waiting, "Provisioning"), 300,
                   f"{len(waiting)} tasks Provisioning", interval=1)  # fmt: skip
        time.sleep(QUICK_SETTLE_SECS if quick else SETTLE_SECS)
        passes_w0 = passes(metrics_port)
        waiting_cpu, waiting_window = cpu_over(operator.pid, rest_secs)
        passes_w1 = passes(metrics_port)
        waiting_passes = sum(passes_w1.values()) - sum(passes_w0.values())

        # -- a waiting task's first heartbeat stored → Running
        leaves = []
        for name in waiting[:samples]:
            with daemons.lock:
                daemons.tasks[name] = uids[name]
            daemons.send(name)
            stored = wait_for(f"{name}'s first heartbeat stored", 30,
                              partial(ledger.get_activity, NAMESPACE, name))  # fmt: skip
            assert stored.received_at is not None
            while True:  # each GET's midpoint: when it saw what it answers
                asked = time.time()
                if phase_of(custom, name) == "Running":
                    leaves.append((asked + time.time()) / 2 - stored.received_at.timestamp())
                    break
                if asked - stored.received_at.timestamp() > 60:
                    raise TimeoutError(f"{name}: not Running 60 s after its first heartbeat")
                time.sleep(POLL_SECS)

        # -- causes, one at a time
        wakes, wake_floor = [], []
        for name in held:
            at = time.perf_counter()
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, name,
                {"spec": {"lifecycle": {"suspend": False}}},
            )  # fmt: skip
            wake_floor.append(time.perf_counter() - at)
            while True:  # each GET's midpoint: when it saw what it answers
                asked = time.perf_counter()
                if phase_of(custom, name) == "Provisioning":
                    wakes.append((asked + time.perf_counter()) / 2 - at)
                    break
                if asked - at > 60:
                    raise TimeoutError(f"{name}: no Provisioning 60 s after its wake")
                time.sleep(POLL_SECS)

        deletes, delete_floor = [], []
        for name in running[:samples]:
            at = time.time()
            custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
            delete_floor.append(time.time() - at)
            op = wait_for(f"{name}'s delete drain in the ledger", 60,
                          operation(ledger, name, OperationKind.DELETE_DRAIN))  # fmt: skip
            deletes.append(op.created_at.timestamp() - at)

        idles = []
        for name in running[samples : 2 * samples]:
            with daemons.lock:
                daemons.idle_since[name] = time.monotonic() - (IDLE_TIMEOUT_SECS - IDLE_DUE_IN_SECS)
            daemons.send(name)
            activity = wait_for(f"{name}'s idle heartbeat stored", 30, idle_stored(ledger, name))
            assert activity.received_at is not None and activity.idle_for_secs is not None
            due = activity.received_at.timestamp() + IDLE_TIMEOUT_SECS - activity.idle_for_secs
            op = wait_for(f"{name}'s idle pause in the ledger", 60,
                          operation(ledger, name, OperationKind.PAUSE))  # fmt: skip
            idles.append(op.created_at.timestamp() - due)

        # -- the ledger down under the fleet
        outage_secs = QUICK_OUTAGE_SECS if quick else OUTAGE_SECS
        lines0 = lines_of(root / "operator.log")
        calls0 = counter(metrics_port, "caliban_drain_operator_api_calls")
        failed0 = counter(metrics_port, "caliban_drain_operator_pass_failures")
        set_connections(url, False)
        try:
            outage_cpu, outage_window = cpu_over(operator.pid, outage_secs)
            # A failure is counted, then logged: the log read between two reads of the
            # counter holds at least the first's failures and at most the second's.
            failed_before = counter(metrics_port, "caliban_drain_operator_pass_failures")
            said = kinds_of(lines_after(root / "operator.log", lines0))
            outage_failures = (
                counter(metrics_port, "caliban_drain_operator_pass_failures") - failed0
            )
            logged_at_least = failed_before - failed0
            outage_lines = sum(said.values())
            outage_calls = counter(metrics_port, "caliban_drain_operator_api_calls") - calls0
        finally:
            set_connections(url, True)
    finally:
        daemons.stopping.set()
        for proc_ in (operator, worker, api):
            proc_.stop()
        ledger.dispose()

    rss_mb = max(rss) / 1024**2
    backoff_bound = failures_allowed(outage_window)
    unpaced = outage_window / settings.reconcile_interval_secs
    tasks_in_outage = n - 2 * samples + len(waiting)
    table = [
        ("CalibanTasks (Running, each with a stand-in daemon's heartbeats)", str(n)),
        ("created through the API (8 threads)", f"{created_secs:.1f} s"),
        ("creation → every task Running", f"{to_running_secs:.1f} s"),
        (f"operator CPU at rest over {window:.0f} s", f"{cpu * 100:.2f} % of one core"),
        ("operator RSS (max at rest)", f"{rss_mb:.0f} MB"),
        ("orchestrator worker CPU at rest (storing the heartbeats)", f"{worker_cpu * 100:.2f} %"),
        ("heartbeats sent by then", str(sent_during_rest)),
        (
            "operator passes at rest, by cause (" + ", ".join(CAUSES) + ")",
            " / ".join(f"{at_rest[c]:.0f}" for c in CAUSES),
        ),
    ]
    table += [
        (f"{len(waiting)} more tasks waiting for their daemon (Provisioning, no heartbeat): "
         f"operator CPU over {waiting_window:.0f} s, with the fleet at rest",
         f"{waiting_cpu * 100:.2f} % of one core"),
        ("… of which the waiting tasks (over the fleet at rest alone)",
         f"{(waiting_cpu - cpu) * 100:+.2f} %"),
        ("operator passes in that window (all causes)", f"{waiting_passes:.0f}"),
        ("a waiting task's first heartbeat stored → Running, median / p95 / max (ms)",
         f"{ms(median(leaves))} / {ms(percentile(leaves, 0.95))} / {ms(max(leaves))}"),
        (f"ledger refusing connections for {outage_window:.0f} s under {tasks_in_outage} "
         "tasks: operator log lines per second", f"{outage_lines / outage_window:.2f}"),
        ("… failed passes per second (each backing off 1 s doubling to 5 min)",
         f"{outage_failures / outage_window:.2f}"),
        ("… log lines by what they say",
         ", ".join(f"{kind} {count}" for kind, count in said.most_common())),
        ("… operator API calls per second", f"{outage_calls / outage_window:.2f}"),
        ("… operator CPU", f"{outage_cpu * 100:.2f} % of one core"),
    ]  # fmt: skip
    latencies = {"delete": (deletes, delete_floor), "wake": (wakes, wake_floor),
                 "idle deadline": (idles, None)}  # fmt: skip
    for kind, (values, floor) in latencies.items():
        figures = f"{ms(median(values))} / {ms(percentile(values, 0.95))} / {ms(max(values))}"
        table.append((f"{kind} → first action, median / p95 / max (ms)", figures))
        if floor is not None:
            table.append((f"floor: the {kind} request's own round trip, median / p95 (ms)",
                          f"{ms(median(floor))} / {ms(percentile(floor, 0.95))}"))  # fmt: skip
    checks = [
        at_most("operator CPU at rest", cpu * 100, CPU_BUDGET * 100, " % of one core"),
        at_most("operator RSS", rss_mb, RSS_BUDGET_MB, " MB"),
        *(at_most(f"p95 {kind} → first action", percentile(v, 0.95) * 1000,
                  P95_BUDGET * 1000, " ms") for kind, (v, _) in latencies.items()),
        at_most(f"operator CPU the {len(waiting)} waiting tasks add to the fleet at rest",
                (waiting_cpu - cpu) * 100, CPU_BUDGET * 100, " % of one core"),
        at_most("p95 first heartbeat → Running", percentile(leaves, 0.95) * 1000,
                LEAVE_BUDGET_SECS * 1000, " ms"),
        Check("failing passes back off: no more than the backoff allows each task "
              f"({backoff_bound} failures in {outage_window:.0f} s)",
              outage_failures <= tasks_in_outage * backoff_bound,
              f"{outage_failures:.0f} failed passes of {tasks_in_outage} tasks, at most "
              f"{tasks_in_outage * backoff_bound}; {tasks_in_outage * unpaced:.0f} if each "
              f"were retried every {settings.reconcile_interval_secs:g} s", budget=False),
        Check("one log line per failed pass",
              logged_at_least - LOG_SLACK_LINES <= said["pass_failed"] <= outage_failures,
              f"{said['pass_failed']} pass_failed lines; {logged_at_least:.0f} failed passes "
              f"counted before the log was read, {outage_failures:.0f} after",
              budget=False),
        Check("no traceback at the default level", said["traceback"] == 0,
              f"{said['traceback']} traceback lines", budget=False),
        Check("every cause acted on (one operation or phase each)",
              len(deletes) == len(wakes) == len(idles) == samples,
              f"{len(deletes)} deletes, {len(wakes)} wakes, {len(idles)} idle deadlines "
              f"of {samples}", budget=False),
    ]  # fmt: skip
    setup = [
        f"`drainctl dev cluster`, `drainctl operator` and one `drainctl worker`, every setting "
        f"the default (heartbeat every {settings.heartbeat_interval_secs:g} s, follow-up "
        f"{settings.reconcile_interval_secs:g} s, feed {settings.event_feed_interval_secs:g} s, "
        f"resync {settings.resync_interval_secs:g} s); broker Redis 127.0.0.1:{redis_port} db "
        f"{REDIS_DB}; ledger {url.split('@')[-1]}.",
        f"{n} CalibanTasks with a stand-in daemon each (one `caliban.orchestrator.activity` "
        f"heartbeat per interval, as a daemon's consumer sends) and {len(held)} created "
        "suspended; nothing else runs.",
        f"At rest: {window:.0f} s with every task Running, "
        f"{QUICK_SETTLE_SECS if quick else SETTLE_SECS:g} s after the last became so.",
        f"Then {len(waiting)} tasks created without a daemon (Provisioning, waiting for "
        f"its heartbeat) over the fleet at rest, measured over as long a window once they "
        f"were all Provisioning (and {QUICK_SETTLE_SECS if quick else SETTLE_SECS:g} s more), "
        f"before any cause; then {samples} of them sent their first heartbeat, one at a time.",
        f"Then the causes: {samples} of each kind, one at a time; then the ledger's database "
        f"refusing connections (and its connections ended) for {outage_secs:g} s.",
    ]
    data = {
        "n": n, "cpu_at_rest": cpu, "passes_at_rest": at_rest, "rss_mb": rss_mb,
        "worker_cpu_at_rest": worker_cpu,
        "delete": deletes, "delete_floor": delete_floor, "wake": wakes,
        "wake_floor": wake_floor, "idle_deadline": idles,
        "waiting": len(waiting), "cpu_waiting": waiting_cpu, "passes_waiting": waiting_passes,
        "leave_provisioning": leaves, "outage_secs": outage_window,
        "outage_log_lines": outage_lines, "outage_log_kinds": dict(said),
        "outage_failed_passes": outage_failures,
        "outage_api_calls": outage_calls, "outage_cpu": outage_cpu,
    }  # fmt: skip
    runs = [
        f"{kind}: [{', '.join(ms(v) for v in values)}] ms"
        for kind, (values, _) in latencies.items()
    ]
    return Scenario("fleet", f"The operator with {n} CalibanTasks: at rest, and cause → action",
                    setup, table, checks, runs, data)  # fmt: skip
