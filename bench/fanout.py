"""Scenario ``fanout``: N CalibanTasks deleted at once through the Kubernetes API.

``drainctl dev up`` (embedded Kubernetes API, kopf operator, orchestrator worker,
stand-in Sandbox controller and CSI driver) on Redis and a SQLite ledger. N tasks, each
with a real daemon (and its Celery consumer) and one scripted agent, are created in
batches while memory allows (not timed) and wait for ``Running`` and a completed turn
from every agent. Then every task is deleted at once, the DELETE calls sent concurrently
from a thread pool (their own span is measured apart), and a watch started before the
first DELETE sees each task go (the finalizer released after drain, record, snapshot).
drains/s = N / (first DELETE sent → last task gone). Every task must leave exactly one
verified checkpoint whose agent matches its files: zero lost turns.

Floor, in the same run: as many ConfigMaps (no finalizer, nothing to drain) deleted the
same way, first DELETE → last gone: what the API and this client alone cost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from bench.audit import Audit
from bench.report import Check, Scenario, median, ms, percentile
from orchestrator.ledger import Ledger
from orchestrator.operator.crd import GROUP, PLURAL, VERSION
from orchestrator.testing import DevStackProcess, flushed_redis, fresh_ledger, pipeline_env
from worker_agent import layout
from worker_agent.children import descendants
from worker_agent.session import count_completed_turns
from worker_agent.testing import wait_until

MODEL = "turns=100000,turn_ms=1000"
SIZES, QUICK_SIZES = (50, 200), (5,)
RATE_BUDGET = 50.0
"""drains/s at the largest N (the requirement is set at N = 200)."""
BATCH = 20
SENDERS = 32
"""Threads sending the DELETEs (the client's connection pool is sized to match)."""
MEMORY_RESERVE_GIB = 3.0
"""Start-up stops while less than this would stay available."""
FIRST_ESTIMATE_MIB = 200
"""What the first batch is assumed to take per task; each later batch is assumed to take
what the one before took (the fall of available memory, or the pods' PSS if larger)
with ``ESTIMATE_MARGIN``."""
ESTIMATE_MARGIN = 1.2
NAMESPACE = "default"
REDIS_DB = 11


@dataclass
class Round:
    requested: int
    started: int = 0
    stopped_by: str | None = None
    per_task_mib: float = 0.0
    """The largest mean PSS of a task's pod (reaper, daemon, consumer, agent) seen."""
    send: float = 0.0
    """First DELETE sent → last DELETE answered."""
    window: float = 0.0
    """First DELETE sent → last task gone."""
    gone: list[float] = field(default_factory=list)
    """Per task: first DELETE sent → that task gone."""
    floor_send: float = 0.0
    floor_window: float = 0.0
    load_at_delete: float = 0.0

    @property
    def rate(self) -> float:
        return self.started / self.window if self.window else 0.0

    @property
    def floor_rate(self) -> float:
        return self.started / self.floor_window if self.floor_window else 0.0


def delete_all(
    names: list[str],
    delete: Callable[[str], object],
    list_names: Callable[[], set[str]],
    watch_list: Callable[..., Any],
) -> tuple[float, float, list[float]]:
    """Delete ``names`` at once; (DELETE span, window, per-name gone) in seconds from
    the first DELETE sent. A watch opened before the first DELETE sees each go."""
    resource_version = watch_list(_preload_content=False)
    version = _list_version(resource_version)
    left = set(names)
    gone_at: dict[str, float] = {}
    opened = threading.Event()
    finished = threading.Event()
    started = 0.0

    def follow() -> None:
        # watch="true" spelled out: the client's Watch sends True, which the dev API,
        # like ParseBool's stricter readers, does not take for a watch.
        stream = watch_list(watch="true", resource_version=version, timeout_seconds=600,
                            _preload_content=False)  # fmt: skip
        opened.set()
        try:
            for line in iter_resp_lines(stream):
                event = json.loads(line)
                name = str(event["object"]["metadata"].get("name"))
                if event["type"] == "DELETED" and name in left:
                    gone_at[name] = time.perf_counter()
                    left.discard(name)
                    if not left:
                        break
        finally:
            stream.close()
            finished.set()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    opened.wait(10)
    with ThreadPoolExecutor(SENDERS) as pool:
        started = time.perf_counter()
        list(pool.map(delete, names))
        sent = time.perf_counter() - started
    if not finished.wait(600) or left:
        raise TimeoutError(f"{len(left)} of {len(names)} still there: {sorted(left)[:5]}")
    follower.join(5)
    missing = set(names) & list_names()
    if missing:
        raise AssertionError(f"the watch saw {sorted(missing)[:5]} go, a list still has them")
    gone = sorted(at - started for at in gone_at.values())
    return sent, gone[-1], gone


class Fleet:
    def __init__(self, stack: DevStackProcess, ledger: Ledger) -> None:
        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(stack.kubeconfig), client_configuration=configuration
        )
        configuration.connection_pool_maxsize = SENDERS
        self.api_client = client.ApiClient(configuration)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.stack = stack
        self.ledger = ledger

    def create(self, name: str) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "CalibanTask",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"task": {"agents": 1, "model": MODEL}},
        }
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)

    def tasks(self) -> dict[str, dict[str, Any]]:
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        return {str(item["metadata"]["name"]): item for item in listed["items"]}

    def volume(self, task: dict[str, Any]) -> Path:
        pvc = str((task.get("status") or {})["pvcName"])
        return self.stack.state / "sandboxes" / "volumes" / NAMESPACE / pvc

    def working(self, names: list[str]) -> bool:
        """Every task Running, its agent with a completed turn."""
        tasks = self.tasks()
        for name in names:
            status = (tasks.get(name) or {}).get("status") or {}
            if status.get("phase") != "Running":
                return False
            agents = layout.agents_dir(self.volume(tasks[name]))
            dirs = list(agents.iterdir()) if agents.is_dir() else []
            if len(dirs) != 1 or count_completed_turns(dirs[0]) < 1:
                return False
        return True

    def delete_tasks(self, names: list[str]) -> tuple[float, float, list[float]]:
        return delete_all(
            names,
            lambda n: self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE,
                                                                  PLURAL, n),
            lambda: set(self.tasks()),
            lambda **kw: self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE,
                                                                   PLURAL, **kw),
        )  # fmt: skip

    def floor(self, n: int, tag: str) -> tuple[float, float]:
        """N ConfigMaps created, then deleted like the tasks: (DELETE span, window)."""
        names = [f"floor-{tag}-{i:03d}" for i in range(n)]
        with ThreadPoolExecutor(SENDERS) as pool:
            list(pool.map(lambda n: self.core.create_namespaced_config_map(
                NAMESPACE, {"metadata": {"name": n}, "data": {"k": "v"}}), names))  # fmt: skip
        sent, window, _ = delete_all(
            names,
            lambda n: self.core.delete_namespaced_config_map(n, NAMESPACE),
            lambda: {
                c.metadata.name for c in self.core.list_namespaced_config_map(NAMESPACE).items
            },
            lambda **kw: self.core.list_namespaced_config_map(NAMESPACE, **kw),
        )
        return sent, window


def _list_version(response: Any) -> str:
    return str(json.loads(response.data)["metadata"]["resourceVersion"])


def pod_pss(stack: DevStackProcess) -> float:
    """Mean proportional memory of one pod's process tree (the stand-in controller runs
    each under ``worker_agent.reaper``: the daemon, its consumer and its agent)."""
    pods: list[int] = []
    for pid in descendants(stack.pid):
        with contextlib.suppress(psutil.Error):
            if "worker_agent.reaper" in psutil.Process(pid).cmdline():
                pods.append(pid)
    total = 0
    for pid in [p for pod in pods for p in (pod, *descendants(pod))]:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().pss
    return total / len(pods) if pods else 0.0


def start_fleet(fleet: Fleet, round_: Round, tag: str) -> list[str]:
    """Tasks created in batches while memory allows; every one Running with a turn."""
    names: list[str] = []
    estimate = FIRST_ESTIMATE_MIB * 1024**2
    while len(names) < round_.requested:
        count = min(BATCH, round_.requested - len(names))
        available = psutil.virtual_memory().available
        if available - count * estimate < MEMORY_RESERVE_GIB * 1024**3:
            round_.stopped_by = f"{available / 1024**3:.1f} GiB available"
            break
        batch = [f"fan-{tag}-{len(names) + i:03d}" for i in range(count)]
        for name in batch:
            fleet.create(name)
        wait_until(functools.partial(fleet.working, batch), 600, f"{len(batch)} tasks working", 0.5)
        names += batch
        cost = pod_pss(fleet.stack)
        taken = (available - psutil.virtual_memory().available) / count
        estimate = int(max(cost, taken) * ESTIMATE_MARGIN)
        round_.per_task_mib = max(round_.per_task_mib, cost / 1024**2)
        print(f"  fanout {tag}: {len(names)}/{round_.requested} tasks working")
    round_.started = len(names)
    return names


def audit_round(fleet: Fleet, names: list[str], volumes: dict[str, Path], audit: Audit) -> None:
    for name in names:
        checkpoints = fleet.ledger.list_checkpoints(NAMESPACE, name)
        if len(checkpoints) != 1:
            audit.problems.append(f"{name}: {len(checkpoints)} checkpoints, not one")
            continue
        checkpoint = checkpoints[0]
        if len(checkpoint.agents) != 1 or not checkpoint.verified:
            audit.problems.append(f"{name}: checkpoint {checkpoint.ref} {checkpoint}")
            continue
        if checkpoint.snapshot_cut_at is None:
            audit.problems.append(f"{name}: checkpoint {checkpoint.ref} has no cut snapshot")
        agent = checkpoint.agents[0]
        audit.agent(f"{name}/{agent.agent_id}", volumes[name] / agent.session_dir, agent.turns,
                    agent.session_sha256, agent.clean)  # fmt: skip


def table(r: Round) -> list[tuple[str, str]]:
    n = f"N={r.started}"
    stopped = f" (stopped: {r.stopped_by})" if r.stopped_by else ""
    return [
        (f"N={r.requested}: tasks started", f"{r.started}{stopped}"),
        (f"{n}: memory per task (daemon + consumer + agent)", f"{r.per_task_mib:.0f} MiB"),
        (f"{n}: first DELETE → last gone", f"{ms(r.window)} ms"),
        (f"{n}: of which sending every DELETE", f"{ms(r.send)} ms"),
        (f"{n}: per task gone p50 / p95",
         f"{ms(median(r.gone))} / {ms(percentile(r.gone, 95))} ms"),
        (f"{n}: floor, {r.started} ConfigMaps deleted → gone",
         f"{ms(r.floor_window)} ms ({r.floor_rate:.0f}/s)"),
        (f"{n}: 1-min load when the DELETEs began", f"{r.load_at_delete:.1f}"),
        (f"**{n}: drains/s**", f"**{r.rate:.1f}**"),
    ]  # fmt: skip


def run(quick: bool, root: Path, redis_port: int) -> Scenario:
    sizes = QUICK_SIZES if quick else SIZES
    broker = flushed_redis(redis_port, REDIS_DB)
    database = fresh_ledger(f"sqlite:///{root / 'ledger.db'}")
    stack = DevStackProcess(root, env=pipeline_env(broker, database))
    ledger = Ledger.from_url(database)
    audit = Audit()
    rounds: list[Round] = []
    try:
        stack.start(120)
        fleet = Fleet(stack, ledger)
        for n in sizes:
            round_ = Round(n)
            rounds.append(round_)
            names = start_fleet(fleet, round_, str(n))
            tasks = fleet.tasks()
            volumes = {name: fleet.volume(tasks[name]) for name in names}
            round_.load_at_delete = psutil.getloadavg()[0]
            round_.send, round_.window, round_.gone = fleet.delete_tasks(names)
            audit_round(fleet, names, volumes, audit)
            round_.floor_send, round_.floor_window = fleet.floor(len(names), str(n))
            print(f"  fanout N={len(names)}: {round_.rate:.1f} drains/s (floor "
                  f"{round_.floor_rate:.0f}/s), DELETEs sent in {ms(round_.send)} ms")  # fmt: skip
    finally:
        ledger.dispose()
        stack.stop(180)
    last = rounds[-1]
    return Scenario(
        name="fanout",
        title=f"Fan-out: {last.started} CalibanTasks deleted at once through the API",
        setup=[
            "Path, per task: DELETE → finalizer → drain (daemon queue) → record_checkpoint "
            "(orchestrator queue) → VolumeSnapshot until cut (the stand-in CSI driver "
            "copies the volume, ready at the cut) → checkpointRef, PVC retained → gone (a "
            "watch opened before the first DELETE sees it).",
            f"Each task: a real daemon, its Celery consumer and 1 scripted agent "
            f"`model={MODEL!r}`, Running with a completed turn; started in batches of "
            f"{BATCH} while {MEMORY_RESERVE_GIB:g} GiB would stay available (not timed).",
            f"The DELETEs sent from {SENDERS} threads; N = "
            f"{', '.join(str(r.requested) for r in rounds)} requested, one round each, on "
            "one stack. Floor: as many ConfigMaps deleted the same way.",
        ],
        table=[row for r in rounds for row in table(r)],
        checks=[
            Check(
                f"≥ {RATE_BUDGET:g} drains/s at N={last.started}",
                last.rate >= RATE_BUDGET,
                f"{last.rate:.1f}/s",
            ),
            Check(
                f"every task reached (N={last.started} of {last.requested})",
                last.started == last.requested,
                last.stopped_by or "all started",
            ),
            Check(
                "every task gone with one verified checkpoint matching the files",
                audit.ok and audit.agents == sum(r.started for r in rounds),
                audit.summary() + ("; " + "; ".join(audit.problems[:3]) if audit.problems else ""),
                budget=False,
            ),
        ],
        runs=[
            f"N={r.started}: gone {ms(r.gone[0])}..{ms(r.gone[-1])} ms, DELETEs {ms(r.send)} "
            f"ms; floor DELETEs {ms(r.floor_send)} ms, gone {ms(r.floor_window)} ms"
            for r in rounds
        ],
        data={
            "rounds": [r.__dict__ for r in rounds],
            "audit": audit.__dict__,
            "curves": {
                "x_label": "tasks deleted at once (N)",
                "y_label": "first DELETE → last gone (s)",
                "series": {
                    "caliban-drain": [[r.started, r.window] for r in rounds],
                    "floor": [[r.started, r.floor_window] for r in rounds],
                },
            },
        },
    )
