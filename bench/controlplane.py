"""Scenario ``controlplane``: the operator's control plane alone, N tasks deleted at once.

The embedded Kubernetes API (``drainctl dev cluster``), ``drainctl operator`` (managing
the tasks' Sandboxes, PVCs and drains), one ``drainctl worker``, Redis and a PostgreSQL
ledger are real, every setting the default. The tasks' daemon side is light: one real
Celery worker (``bench.responder``) consumes every task's queue and answers drains and
resumes from a session prepared on disk for each task, and a load generator sends each
task's heartbeat as its consumer would (``fleet.Daemons``, each task from its creation).
No agent runs and no pod exists, so the machine's CPU goes to the control plane and to
nothing a real cluster would run elsewhere.

For each N: N tasks are created and wait for ``Running`` (not timed); then every task is
deleted at once (DELETEs from a thread pool, a watch opened before the first one sees
each go). Measured over that window: deletions per second (N / first DELETE → last
gone), the operator's CPU ms per deletion (user + system, from /proc), the API requests
per deletion by client (counted by the embedded API by ``User-Agent``: kopf's and the
operator's own), the ledger's transactions per deletion (``pg_stat_database``; the
operator's and the worker's), the operator's peak RSS.

The floor, in the same run, on the same stack with the operator's work done by a bare
script at full concurrency: N ConfigMaps holding a finalizer, DELETEd the same way; one
``start_drains`` for all N through the same worker and responder (the drain → record
chain), waited for in the ledger; then for each object as many GETs and writes as the
operator made per deletion, the last write removing the finalizer. Budgets at the
largest N: the operator's rate ≥ 2/3 of the floor's, ≥ 100 deletions/s where the floor
allows it (its rate x 2/3 ≥ 100), the operator's RSS < 400 MB; every task leaves
exactly one recorded checkpoint.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa
from kubernetes import client, config

from bench import responder
from bench.audit_cost import ApiServer, ensure_database
from bench.fanout import SENDERS, delete_all
from bench.fleet import Daemons, Operator, free_port, phases, process_cpu
from bench.report import Check, Scenario
from orchestrator.devcluster.emulator import REQUESTS_PATH
from orchestrator.ledger import Ledger, OperationState
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.pipeline.start import DrainStart, start_drains, wait_for_operations
from orchestrator.settings import Settings
from orchestrator.testing import WorkerProcess, flushed_redis, pipeline_env
from worker_agent.contract import BrokerSettings, daemon_queue, make_celery
from worker_agent.testing import Subprocess, child_env

NAMESPACE = "default"
SIZES, QUICK_SIZES = (200, 1000), (10,)
REDIS_DB = 9
DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_controlplane"
BENCH_AGENT = "caliban-drain-bench"
"""The User-Agent of this benchmark's own API requests (not counted as the operator's)."""
KOPF_AGENT, CLIENT_AGENT = "kopf/", "OpenAPI-Generator/"
"""The operator's clients, as the embedded API sees them: kopf, and its own calls
through the official client (the worker and the responder make none)."""
RATE_SHARE, RATE_GOAL, RSS_BUDGET_MB = 2 / 3, 100.0, 400.0
HOLD = "bench.caliban.ai/hold"
XACTS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)
RUNNING_SECS = 900.0
"""How long N created tasks may take to be Running."""
SETTLE_SECS = 3.0
"""After the last task is gone: the statistics collector and the last passes catch up."""


class Responder(Subprocess):
    what = "the responder"
    ready_timeout = 60.0

    def __init__(self, root: Path, queues: list[str], env: dict[str, str]) -> None:
        listed = root / "queues.txt"
        listed.write_text("\n".join(queues) + "\n")
        argv = [sys.executable, "-m", "bench.responder", "--store", str(root / "stores"),
                "--queues", str(listed)]  # fmt: skip
        super().__init__(argv, root / "responder.log", child_env(env))

    def ready(self) -> bool:
        self.check_alive(self.what)
        return responder.READY in self.log_text()


def requests_by_agent(url: str) -> Counter[str]:
    with urllib.request.urlopen(url + REQUESTS_PATH, timeout=10) as response:
        return Counter(json.loads(response.read()))


def operator_requests(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """The requests kopf and the operator's own client made between two counts, by
    ``"METHOD client"``."""
    out: dict[str, int] = {}
    for key, count in (after - before).items():
        method, _, agent = key.partition(" ")
        for prefix, label in ((KOPF_AGENT, "kopf"), (CLIENT_AGENT, "client")):
            if agent.startswith(prefix):
                out[f"{method} {label}"] = out.get(f"{method} {label}", 0) + count
    return out


def transactions(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        value = conn.scalar(sa.text(XACTS))
    return int(value or 0)


class Peak(threading.Thread):
    """The largest RSS of a process, sampled every second."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.rss = self.process.memory_info().rss
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                self.rss = max(self.rss, self.process.memory_info().rss)
            except psutil.NoSuchProcess:
                return


class Bench:
    def __init__(self, kubeconfig: Path, api_url: str, ledger: Ledger, broker: str) -> None:
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = SENDERS
        api_client = client.ApiClient(configuration)
        api_client.user_agent = BENCH_AGENT
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.api_url = api_url
        self.ledger = ledger
        self.app = make_celery(BrokerSettings(broker_url=broker))

    def create_tasks(self, names: list[str], daemons: Daemons) -> None:
        def create(name: str) -> None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "CalibanTask",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"task": {"agents": 1, "model": "turns=3"}},
            }  # fmt: skip
            made = self.custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, body
            )
            with daemons.lock:
                daemons.tasks[name] = made["metadata"]["uid"]
            daemons.send(name)  # a daemon's first heartbeat, as it starts

        with ThreadPoolExecutor(SENDERS) as pool:
            list(pool.map(create, names))
        deadline, said = time.monotonic() + RUNNING_SECS, 0.0
        while True:
            now = phases(self.custom)
            counts = Counter(str(now.get(name)) for name in names)
            if counts["Running"] == len(names):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(names)} tasks not all Running: {dict(counts)}")
            if time.monotonic() - said > 30:
                print(f"  controlplane: {dict(counts)}", flush=True)
                said = time.monotonic()
            time.sleep(1.0)

    def delete_tasks(self, names: list[str], daemons: Daemons) -> float:
        with daemons.lock:  # a deleted task's daemon says nothing more
            for name in names:
                daemons.tasks.pop(name, None)
        _, window, _ = delete_all(
            names,
            lambda n: self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, n
            ),
            lambda: set(self.task_names()),
            lambda **kw: self.custom.list_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL, **kw
            ),
        )
        return window

    def task_names(self) -> list[str]:
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        return [str(item["metadata"]["name"]) for item in listed["items"]]

    def floor(self, names: list[str], reads: int, writes: int) -> tuple[float, dict[str, float]]:
        """The operator's deletion work by a bare script (see the module): the window, and
        how long each part took (the DELETEs, the drain chains, the API calls after)."""

        def hold(name: str) -> None:
            body = {"metadata": {"name": name, "finalizers": [HOLD]}, "data": {"k": "v"}}
            self.core.create_namespaced_config_map(NAMESPACE, body)

        with ThreadPoolExecutor(SENDERS) as pool:
            list(pool.map(hold, names))
        settings = Settings()

        def finish(name: str) -> None:
            for _ in range(reads):
                self.core.read_namespaced_config_map(name, NAMESPACE)
            for index in range(writes - 1):
                self.core.patch_namespaced_config_map(
                    name, NAMESPACE, {"metadata": {"annotations": {"bench/write": str(index)}}}
                )
            self.core.patch_namespaced_config_map(
                name, NAMESPACE, {"metadata": {"finalizers": None}}
            )

        deleted = threading.Event()
        sent: list[str] = []
        spans: dict[str, float] = {}
        failures: list[BaseException] = []
        began = time.perf_counter()

        def delete(name: str) -> None:
            self.core.delete_namespaced_config_map(name, NAMESPACE)
            sent.append(name)
            if len(sent) == len(names):
                spans["deletes"] = time.perf_counter() - began
                deleted.set()

        def drain_then_finish() -> None:
            try:
                deleted.wait(600)
                chains = time.perf_counter()
                ops = start_drains(self.app, self.ledger, settings, [
                    DrainStart(NAMESPACE, n, task_uid=f"floor-{n}") for n in names])  # fmt: skip
                done = wait_for_operations(self.ledger, [op.id for op in ops], 600)
                failed = [op for op in done if op.state is not OperationState.RECORDED]
                if failed:
                    raise AssertionError(f"floor: {len(failed)} drains not recorded: {failed[0]}")
                calls = time.perf_counter()
                spans["chains"] = calls - chains
                with ThreadPoolExecutor(SENDERS) as pool:
                    list(pool.map(finish, names))
                spans["calls"] = time.perf_counter() - calls
            except BaseException as exc:  # raised again below, where the bench waits
                failures.append(exc)

        worker = threading.Thread(target=drain_then_finish, daemon=True)
        worker.start()
        _, window, _ = delete_all(
            names,
            delete,
            lambda: {
                str(m.metadata.name) for m in self.core.list_namespaced_config_map(NAMESPACE).items
            },
            lambda **kw: self.core.list_namespaced_config_map(NAMESPACE, **kw),
        )
        worker.join(60)
        if failures:
            raise failures[0]
        return window, spans


def run(quick: bool, root: Path, redis_port: int) -> Scenario:
    sizes = QUICK_SIZES if quick else SIZES
    broker = flushed_redis(redis_port, REDIS_DB)
    url = ensure_database(DATABASE_URL)
    engine = sa.create_engine(url)
    tasks_of = {n: [f"cp{n}-{i:04d}" for i in range(n)] for n in sizes}
    floors_of = {n: [f"fl{n}-{i:04d}" for i in range(n)] for n in sizes}
    every = [name for n in sizes for name in (*tasks_of[n], *floors_of[n])]
    responder.prepare(root / "stores", every)
    api = ApiServer(root).start()
    metrics_port = free_port()
    env = pipeline_env(
        broker, url, KUBECONFIG=str(api.kubeconfig), DRAIN_METRICS_PORT=str(metrics_port),
        DRAIN_METRICS_HOST="127.0.0.1",
    )  # fmt: skip
    worker = WorkerProcess(root / "worker.log", {**env, "DRAIN_WORKER_METRICS_PORT": "0"})
    answering = Responder(root, [daemon_queue(NAMESPACE, n) for n in every], env)
    operator = Operator(root / "operator.log", env, free_port())
    settings = Settings()
    daemons = Daemons(broker, settings.heartbeat_interval_secs)
    ledger = Ledger.from_url(url)
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    peak: Peak | None = None
    try:
        worker.start()
        answering.start()
        operator.start()
        api_url = _server_url(api.kubeconfig)
        bench = Bench(api.kubeconfig, api_url, ledger, broker)
        peak = Peak(operator.pid)
        peak.start()
        daemons.start()
        for n in sizes:
            names = tasks_of[n]
            bench.create_tasks(names, daemons)
            time.sleep(SETTLE_SECS)
            counted0, tx0 = requests_by_agent(api_url), transactions(engine)
            cpu0, worker0 = process_cpu(operator.pid), process_cpu(worker.pid)
            window = bench.delete_tasks(names, daemons)
            cpu1, worker1 = process_cpu(operator.pid), process_cpu(worker.pid)
            time.sleep(SETTLE_SECS)
            calls = operator_requests(counted0, requests_by_agent(api_url))
            tx = transactions(engine) - tx0
            stored = ledger.list_checkpoints(namespace=NAMESPACE, limit=10 * n)
            checkpoints = Counter(c.name for c in stored if c.name in set(names))
            wrong = [m for m in names if checkpoints.get(m) != 1]
            if wrong:
                problems.append(f"N={n}: {len(wrong)} tasks without exactly one checkpoint, "
                                f"e.g. {wrong[0]}: {checkpoints.get(wrong[0], 0)}")  # fmt: skip
            reads = sum(v for k, v in calls.items() if k.startswith("GET "))
            writes = sum(calls.values()) - reads
            per_reads, per_writes = round(reads / n), max(1, round(writes / n))
            ftx0 = transactions(engine)
            floor_window, floor_spans = bench.floor(floors_of[n], per_reads, per_writes)
            time.sleep(SETTLE_SECS)
            floor_tx = transactions(engine) - ftx0
            results.append({
                "n": n, "window": window, "rate": n / window,
                "floor_window": floor_window, "floor_rate": n / floor_window,
                "floor_spans": floor_spans,
                "operator_cpu_ms": (cpu1 - cpu0) * 1000 / n,
                "worker_cpu_ms": (worker1 - worker0) * 1000 / n,
                "calls": calls, "calls_per_deletion": sum(calls.values()) / n,
                "reads_per_deletion": reads / n, "writes_per_deletion": writes / n,
                "floor_reads": per_reads, "floor_writes": per_writes,
                "transactions_per_deletion": tx / n, "floor_transactions_per_deletion":
                floor_tx / n, "operator_rss_mb": peak.rss / 2**20,
            })  # fmt: skip
            print(f"  controlplane N={n}: {n / window:.1f} deletions/s, floor "
                  f"{n / floor_window:.1f}/s", flush=True)  # fmt: skip
    finally:
        daemons.stopping.set()
        if peak is not None:
            peak.stopping.set()
        ledger.dispose()
        engine.dispose()
        for process in (operator, answering, worker, api):
            process.stop()
    return report(results, problems, quick)


def _server_url(kubeconfig: Path) -> str:
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return str(configuration.host)


def report(results: list[dict[str, Any]], problems: list[str], quick: bool) -> Scenario:
    last = results[-1]
    table: list[tuple[str, str]] = []
    for r in results:
        n = r["n"]
        table += [
            (f"N={n}: deletions/s, operator (first DELETE → last gone)", f"{r['rate']:.1f}"),
            (f"N={n}: deletions/s, floor (bare script, same calls and chains)",
             f"{r['floor_rate']:.1f}"),
            (f"N={n}: **operator / floor rate**", f"**{r['rate'] / r['floor_rate']:.2f}**"),
            (f"N={n}: floor's parts: DELETEs / drain chains / API calls after",
             " / ".join(f"{r['floor_spans'].get(k, 0.0):.1f} s"
                        for k in ("deletes", "chains", "calls"))),
            (f"N={n}: operator CPU per deletion", f"{r['operator_cpu_ms']:.1f} ms"),
            (f"N={n}: worker CPU per deletion", f"{r['worker_cpu_ms']:.1f} ms"),
            (f"N={n}: API requests per deletion (kopf + own client; reads / writes)",
             f"{r['calls_per_deletion']:.1f} ({r['reads_per_deletion']:.1f} / "
             f"{r['writes_per_deletion']:.1f})"),
            (f"N={n}: ledger transactions per deletion, operator / floor",
             f"{r['transactions_per_deletion']:.1f} / "
             f"{r['floor_transactions_per_deletion']:.1f}"),
        ]  # fmt: skip
    table.append(("operator peak RSS", f"{last['operator_rss_mb']:.0f} MB"))
    share = last["rate"] / last["floor_rate"]
    goal_applies = last["floor_rate"] * RATE_SHARE >= RATE_GOAL
    checks = [
        Check("every deleted task: exactly one recorded checkpoint", not problems,
              "; ".join(problems) or f"{sum(r['n'] for r in results)} tasks", budget=False),
        Check(f"N={last['n']}: operator rate ≥ {RATE_SHARE:.2f} x the floor's", share >= RATE_SHARE,
              f"{share:.2f} ({last['rate']:.1f} / {last['floor_rate']:.1f} per s)"),
        Check(f"N={last['n']}: ≥ {RATE_GOAL:g} deletions/s where the floor allows it",
              last["rate"] >= RATE_GOAL or not goal_applies,
              f"{last['rate']:.1f}/s" + ("" if goal_applies else
              f" (floor x {RATE_SHARE:.2f} = {last['floor_rate'] * RATE_SHARE:.1f}/s: n/a)")),
        Check(f"operator RSS < {RSS_BUDGET_MB:g} MB", last["operator_rss_mb"] < RSS_BUDGET_MB,
              f"{last['operator_rss_mb']:.0f} MB"),
    ]  # fmt: skip
    sizes = ", ".join(str(r["n"]) for r in results)
    return Scenario(
        name="controlplane",
        title="The control plane alone: N tasks deleted at once, no pods",
        setup=[
            "Embedded API, `drainctl operator`, one `drainctl worker`, Redis, a PostgreSQL "
            "ledger, every setting the default; the daemon side is one Celery worker "
            "answering drains from prepared sessions (`bench.responder`) and a heartbeat "
            "load generator: no agents, no pods.",
            f"N = {sizes}; every task deleted at once from {SENDERS} threads, a watch "
            "timing each go. Floor: the same chains and as many API reads and writes per "
            "object, by a bare script on ConfigMaps holding a finalizer.",
        ],
        table=table,
        checks=checks,
        runs=[f"N={r['n']}: requests by client {r['calls']}" for r in results],
        data={"results": results, "problems": problems, "quick": quick},
    )
