"""Scenario ``audit``: what the self-audit (``orchestrator.audit``) costs against the fleet.

For each fleet size N: the embedded Kubernetes API alone (``drainctl dev cluster``, a
subprocess), holding N CalibanTasks (Running, 2 agents, ``pvcName``, ``phaseSince``),
each with its Sandbox, its pod (controlled by the Sandbox, mounting the workspace) and
its workspace PVC (labelled and owned by the task); and a ledger on PostgreSQL with one
fresh heartbeat per task (its uid, 2 agents live, refreshed before every repetition)
and 10 recorded checkpoints per task (2 agents each, on the task's PVC), all through
the ``Ledger`` API. A consistent fleet: every audit must find nothing.

Measured in the same run, interleaved, medians of the repetitions after a warm-up:

- the floor: the reads the audit cannot avoid, one list of each kind it reads (tasks,
  Sandboxes at their storage version, pods, PVCs, VolumeSnapshots) with one API client,
  paged as ``observe`` pages, and ``Ledger.list_activities()``;
- ``observe.read_cluster()``, the audit's own read of the cluster;
- the one-shot audit, ``Auditor(...).run(everything=True, confirm=False)``;
- the periodic audit, ``run(everything=False, confirm=False)`` of one ``Auditor`` kept
  across repetitions (its rotation moves on), with the default settings;
- each one's checkpoint pass alone (``Auditor.checkpoint_checks``), one-shot and periodic.

Then the session contents: the newest checkpoint of one task in ten gets a ready
VolumeSnapshot (object and ledger record) whose copy under ``audit_volumes_dir`` holds
real session files (``worker_agent.session.save_session``, the worker's writer, the
sha256 and turns the checkpoints recorded). Measured: the one-shot and periodic audits
with ``audit_volumes_dir`` set, the checkpoints each run reads from the ledger, and the
audit's ``read_sessions`` over the readable checkpoints alone against a floor that reads,
hashes and parses the same files.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from hashlib import sha256
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from kubernetes import client, config

from bench.report import Check, Scenario, median, ms, ms_list
from orchestrator.audit import Auditor, AuditReport
from orchestrator.audit.observe import PAGE, read_cluster, read_sessions, sandbox_storage_version
from orchestrator.audit.observe import paged as observe_paged
from orchestrator.audit.runner import Rotation
from orchestrator.ledger import (
    CheckpointReason,
    CheckpointView,
    Ledger,
    OperationKind,
    create_ledger_engine,
)
from orchestrator.operator import crd
from orchestrator.settings import Settings
from orchestrator.testing import fresh_ledger
from worker_agent import layout
from worker_agent.contract import daemon_queue
from worker_agent.proto import ResumeRef
from worker_agent.session import Session, save_session, utc_timestamp
from worker_agent.testing import DRAINCTL, Subprocess, child_env

SIZES = (100, 1000)
QUICK_SIZES = (10, 50)
CHECKPOINTS_PER_TASK = 10
AGENTS = 2
SESSION_TASKS_ONE_IN = 10
"""The newest checkpoint of one task in this many gets a snapshot copy with its sessions."""
SESSION_TURNS, PROMPT_CHARS, REPLY_CHARS = 100, 200, 800
NAMESPACE = "default"
REPEAT, CONTENTS_REPEAT = 5, 3
THREADS = 8
"""Concurrent requests while the fleet is created (not while anything is measured)."""
DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_audit"
"""The ledger's database (its tables are dropped); created if the server lacks it."""

T = TypeVar("T")


class ApiServer(Subprocess):
    """``drainctl dev cluster``: the embedded Kubernetes API with the packaged CRDs (the
    snapshot ones included), ready once it has written its kubeconfig (it does so after
    it serves them)."""

    what = "drainctl dev cluster"
    ready_timeout = 60.0

    def __init__(self, root: Path) -> None:
        self.kubeconfig = root / "kubeconfig.yaml"
        argv = [*DRAINCTL, "dev", "cluster", "--kubeconfig", str(self.kubeconfig),
                "--log-level", "WARNING"]  # fmt: skip
        super().__init__(argv, root / "dev-cluster.log", child_env())

    def ready(self) -> bool:
        self.check_alive(self.what)
        return self.kubeconfig.exists()


class CountingLedger(Ledger):
    """The ledger, counting the restorable checkpoints the audit reads from it."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        self.checkpoints_read = 0
        self._lock = threading.Lock()

    def available_checkpoints_after(self, after_id: int, limit: int) -> list[CheckpointView]:
        batch = super().available_checkpoints_after(after_id, limit)
        with self._lock:
            self.checkpoints_read += len(batch)
        return batch


@dataclass
class Task:
    name: str
    uid: str
    pvc: str
    refs: list[str] = field(default_factory=list)
    """Its checkpoints' refs, oldest first."""


@dataclass
class Timing:
    """One kind of measurement at one fleet size: every repetition's seconds."""

    secs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.secs)


def timed(call: Callable[[], T]) -> tuple[float, T]:
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, value


def in_parallel(call: Callable[[T], object], items: Sequence[T]) -> None:
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(call, items))  # every result, so a failed call raises here


def ensure_database(url: str) -> str:
    """``url``'s PostgreSQL database created where the server lacks it; the ledger in it
    migrated afresh (``fresh_ledger``)."""
    create_database(url)
    return fresh_ledger(url)


def create_database(url: str) -> None:
    """``url``'s PostgreSQL database, created where the server lacks it."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.database:
        admin = sa.create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                query = sa.text("SELECT 1 FROM pg_database WHERE datname = :name")
                if conn.scalar(query, {"name": parsed.database}) is None:
                    conn.execute(sa.text(f'CREATE DATABASE "{parsed.database}"'))
        finally:
            admin.dispose()


def sessions(root: Path) -> dict[str, tuple[Session, str, int]]:
    """Each agent's session (the same for every checkpoint), written once by the worker's
    writer under ``root``: agent id → (session, its sha256, its size in bytes)."""
    out = {}
    for index in range(AGENTS):
        agent = f"agent-{index}"
        messages: list[dict[str, Any]] = []
        for turn in range(1, SESSION_TURNS + 1):
            messages.append({"role": "user", "content": f"{turn} " + "p" * PROMPT_CHARS})
            messages.append({"role": "assistant", "content": f"{turn} " + "r" * REPLY_CHARS})
        stamp = utc_timestamp()  # fixed, so the snapshot copies written later are these bytes
        extra = {"created_at": stamp, "updated_at": stamp, "model": "bench"}
        session = Session(agent, SESSION_TURNS, messages, extra, "")
        directory = layout.agent_dir(root, agent)
        directory.mkdir(parents=True)
        digest = save_session(directory, session)
        out[agent] = (session, digest, layout.session_file(directory).stat().st_size)
    return out


class Fleet:
    """The objects of one fleet size, created through the API and the ledger."""

    def __init__(self, n: int, ledger: CountingLedger, agents: dict[str, tuple[Session, str, int]]):
        self.n = n
        self.ledger = ledger
        self.agents = agents
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()
        self.tasks: list[Task] = []

    # -- the cluster

    def create_task(self, index: int) -> Task:
        name = f"fleet-{index:05d}"
        body = {
            "apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"task": {"agents": AGENTS, "model": "turns=100000,turn_ms=50"}},
        }  # fmt: skip
        made = self.custom.create_namespaced_custom_object(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, body
        )
        uid = str(made["metadata"]["uid"])
        task = Task(name, uid, f"{name}-ws-{uid[:8]}")
        owner = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name, "uid": uid,
                 "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        status = {"phase": "Running", "agents": AGENTS, "pvcName": task.pvc,
                  "phaseSince": datetime.now(UTC).isoformat()}  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            crd.GROUP, crd.VERSION, NAMESPACE, crd.PLURAL, name, {"status": status}
        )
        self.core.create_namespaced_persistent_volume_claim(NAMESPACE, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": task.pvc, "namespace": NAMESPACE,
                         "labels": {crd.TASK_LABEL: name}, "ownerReferences": [owner]},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}},
        })  # fmt: skip
        volumes = [{"name": "workspace", "persistentVolumeClaim": {"claimName": task.pvc}},
                   {"name": "run", "emptyDir": {}}]  # fmt: skip
        args = ["daemon", "--store", "/workspace", "--queue", daemon_queue(NAMESPACE, name),
                "--task-uid", uid, "--initial-agents", str(AGENTS)]  # fmt: skip
        group, _, version = crd.SANDBOX_V1ALPHA1.partition("/")
        sandbox = self.custom.create_namespaced_custom_object(group, version, NAMESPACE,
                                                              crd.SANDBOX_PLURAL, {
            "apiVersion": crd.SANDBOX_V1ALPHA1, "kind": crd.SANDBOX_KIND,
            "metadata": {"name": name, "namespace": NAMESPACE, "ownerReferences": [owner],
                         "labels": {crd.TASK_LABEL: name}},
            "spec": {"replicas": 1, "podTemplate": {
                "metadata": {"labels": {crd.TASK_LABEL: name}},
                "spec": {"containers": [{"name": "caliband", "image": "caliban-drain:dev",
                                         "command": ["drainctl"], "args": args}],
                         "volumes": volumes}}},
        })  # fmt: skip
        sandbox_uid = str(sandbox["metadata"]["uid"])
        self.core.create_namespaced_pod(NAMESPACE, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{sandbox_uid[:5]}", "namespace": NAMESPACE,
                         "labels": {crd.TASK_LABEL: name},
                         "ownerReferences": [{"apiVersion": crd.SANDBOX_V1ALPHA1,
                                              "kind": crd.SANDBOX_KIND, "name": name,
                                              "uid": sandbox_uid, "controller": True}]},
            "spec": {"containers": [{"name": "caliband", "image": "caliban-drain:dev"}],
                     "volumes": volumes},
        })  # fmt: skip
        return task

    def create(self) -> None:
        with ThreadPoolExecutor(THREADS) as pool:
            self.tasks = list(pool.map(self.create_task, range(self.n)))
        in_parallel(self.record_checkpoints, self.tasks)
        self.heartbeats()

    # -- the ledger

    def record_checkpoints(self, task: Task) -> None:
        refs = [ResumeRef(id=agent, session_dir=str(layout.agent_dir(Path(), agent)),
                          turns=session.turns, session_sha256=digest, clean=True, exit=0)
                for agent, (session, digest, _) in self.agents.items()]  # fmt: skip
        for index in range(CHECKPOINTS_PER_TASK):
            op = self.ledger.begin_operation(
                OperationKind.PAUSE, task_uid=task.uid, namespace=NAMESPACE, name=task.name,
                idempotency_key=f"bench-audit-{task.uid}-{index}",
            )  # fmt: skip
            checkpoint = self.ledger.record_checkpoint(
                op.id, refs, reason=CheckpointReason.PAUSE, pvc_name=task.pvc
            )
            task.refs.append(checkpoint.ref)

    def heartbeat(self, task: Task) -> None:
        now = datetime.now(UTC)
        self.ledger.record_activity(
            NAMESPACE, task.name, task_uid=task.uid, all_idle_since=None, agents_total=AGENTS,
            agents_live=AGENTS, agents_idle=0, seq=time.time_ns(), reported_at=now,
            idle_for_secs=None, received_at=now,
        )  # fmt: skip

    def heartbeats(self) -> None:
        """Every daemon's heartbeat, fresh (untimed, before each repetition)."""
        in_parallel(self.heartbeat, self.tasks)

    # -- the session subset

    def snapshot_newest(self, task: Task, volumes: Path) -> None:
        ref = task.refs[-1]
        made = self.custom.create_namespaced_custom_object(
            crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, NAMESPACE, crd.SNAPSHOT_PLURAL, {
                "apiVersion": crd.SNAPSHOT_API_VERSION, "kind": crd.SNAPSHOT_KIND,
                "metadata": {"name": ref, "namespace": NAMESPACE,
                             "labels": {crd.CHECKPOINT_LABEL: ref, crd.TASK_LABEL: task.name,
                                        crd.TASK_UID_LABEL: task.uid}},
                "spec": {"source": {"persistentVolumeClaimName": task.pvc}},
            },
        )  # fmt: skip
        uid = str(made["metadata"]["uid"])
        self.ledger.record_snapshot(ref, ref)
        self.ledger.record_snapshot(ref, ref, ready_at=datetime.now(UTC))
        copy = volumes / "snapshots" / uid
        for agent, (session, _, _) in self.agents.items():
            directory = layout.agent_dir(copy, agent)
            directory.mkdir(parents=True)
            save_session(directory, session)

    def add_session_subset(self, volumes: Path) -> int:
        subset = self.tasks[::SESSION_TASKS_ONE_IN]
        in_parallel(lambda t: self.snapshot_newest(t, volumes), subset)
        return len(subset)


# ------------------------------------------------------------------------ floors


def paged(list_call: Callable[..., Any], requests: list[int]) -> Iterator[Any]:
    """``observe.paged`` over ``list_call``, each request counted in ``requests[0]``."""

    def counted(**kwargs: Any) -> Any:
        requests[0] += 1
        return list_call(**kwargs)

    return observe_paged(counted)


def floor_read(custom: Any, core: Any, ledger: Ledger, sandboxes: str) -> tuple[int, int]:
    """The floor: one paged list of each kind the audit reads (Sandboxes at version
    ``sandboxes``), and the heartbeats; answers how many objects and rows were read,
    and the list requests made."""
    kinds = [
        (crd.GROUP, crd.VERSION, crd.PLURAL),
        (crd.SANDBOX_GROUP, sandboxes, crd.SANDBOX_PLURAL),
        (crd.SNAPSHOT_GROUP, crd.SNAPSHOT_VERSION, crd.SNAPSHOT_PLURAL),
    ]
    calls: list[Callable[..., Any]] = [
        core.list_pod_for_all_namespaces,
        core.list_persistent_volume_claim_for_all_namespaces,
    ]
    for group, version, plural in kinds:
        calls.append(lister(custom, group, version, plural))
    requests = [0]
    count = sum(1 for call in calls for _ in paged(call, requests))
    return count + len(ledger.list_activities()), requests[0]


def lister(custom: Any, group: str, version: str, plural: str) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        return custom.list_cluster_custom_object(group, version, plural, **kwargs)

    return call


def read_all(readable: Sequence[tuple[CheckpointView, Path, str]]) -> list[dict[str, Any]]:
    """The audit's ``read_sessions`` over each readable checkpoint."""
    return [read_sessions(directory, c) for c, directory, _ in readable]


def floor_sessions(files: Sequence[Path]) -> int:
    """The sessions floor: read, hash and parse each file; answers the bytes read."""
    total = 0
    for path in files:
        raw = path.read_bytes()
        sha256(raw).hexdigest()
        json.loads(raw)
        total += len(raw)
    return total


# ---------------------------------------------------------------------- one size


@dataclass
class SizeResult:
    n: int
    checkpoints: int
    setup_secs: float
    share: int
    """The periodic run's share of the checkpoints (``Rotation.share``)."""
    floor: Timing = field(default_factory=Timing)
    read_cluster: Timing = field(default_factory=Timing)
    oneshot: Timing = field(default_factory=Timing)
    periodic: Timing = field(default_factory=Timing)
    oneshot_pass: Timing = field(default_factory=Timing)
    periodic_pass: Timing = field(default_factory=Timing)
    floor_objects: int = 0
    floor_requests: int = 0
    sandbox_version: str = ""
    oneshot_checked: list[int] = field(default_factory=list)
    periodic_checked: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    # the session contents
    session_checkpoints: int = 0
    session_bytes: int = 0
    contents_oneshot: Timing = field(default_factory=Timing)
    contents_oneshot_plain: Timing = field(default_factory=Timing)
    contents_periodic: Timing = field(default_factory=Timing)
    contents_oneshot_sessions: list[int] = field(default_factory=list)
    contents_periodic_sessions: list[int] = field(default_factory=list)
    contents_periodic_read: list[int] = field(default_factory=list)
    """Checkpoints each periodic run with sessions read from the ledger."""
    periodic_read: list[int] = field(default_factory=list)
    """Checkpoints each periodic run without sessions read from the ledger."""
    read_sessions: Timing = field(default_factory=Timing)
    sessions_floor: Timing = field(default_factory=Timing)
    sessions_read: int = 0
    session_file_bytes: int = 0

    def note(self, report: AuditReport, what: str) -> None:
        self.findings += [f"N={self.n} {what}: {f.line()}" for f in report.findings]


CURVES: dict[str, Callable[[SizeResult], Timing]] = {
    "floor (the lists and ledger read the audit cannot avoid)": lambda r: r.floor,
    "read_cluster": lambda r: r.read_cluster,
    "one-shot audit": lambda r: r.oneshot,
    "periodic audit": lambda r: r.periodic,
}
"""What the PNG draws against the fleet size (``bench.plot``)."""


def measure_size(
    n: int, repeat: tuple[int, int], root: Path, database_url: str, settings: Settings
) -> SizeResult:
    api = ApiServer(root)
    ledger = CountingLedger(create_ledger_engine(ensure_database(database_url)))
    try:
        api.start()
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(api.kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = THREADS
        client.Configuration.set_default(cfg)
        agents = sessions(root / "template")
        fleet = Fleet(n, ledger, agents)
        setup_secs, _ = timed(fleet.create)
        total = ledger.count_available_checkpoints()
        s = settings
        share = Rotation.share(total, s.audit_checkpoint_batch, s.audit_interval_secs,
                               s.audit_full_pass_secs)  # fmt: skip
        result = SizeResult(n, total, setup_secs, share)
        result.session_file_bytes = max(size for _, _, size in agents.values())
        stored = sandbox_storage_version()
        assert stored is not None, "the embedded API serves the Sandbox CRD"
        result.sandbox_version = stored
        print(f"  audit N={n}: fleet of {n} tasks and {total} checkpoints in {setup_secs:.0f} s",
              flush=True)  # fmt: skip
        periodic = Auditor(ledger, settings, kubernetes=True)
        periodic_pass = Auditor(ledger, settings, kubernetes=True)
        api_client = client.ApiClient(cfg)
        custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
        for rep in range(repeat[0] + 1):  # the first is an untimed warm-up
            fleet.heartbeats()
            floor_secs, (result.floor_objects, result.floor_requests) = timed(
                partial(floor_read, custom, core, ledger, result.sandbox_version)
            )
            read_secs, cluster = timed(read_cluster)
            oneshot_secs, oneshot = timed(
                lambda: Auditor(ledger, settings).run(everything=True, confirm=False)
            )
            before = ledger.checkpoints_read
            periodic_secs, report = timed(lambda: periodic.run(everything=False, confirm=False))
            periodic_read = ledger.checkpoints_read - before
            oneshot_pass = Auditor(ledger, settings).checkpoint_checks
            oneshot_pass_secs, _ = timed(partial(oneshot_pass, cluster, total, True, {}))
            periodic_pass_secs, _ = timed(
                partial(periodic_pass.checkpoint_checks, cluster, total, False, {})
            )
            result.note(oneshot, "one-shot")
            result.note(report, "periodic")
            if not rep:
                continue
            result.floor.secs.append(floor_secs)
            result.read_cluster.secs.append(read_secs)
            result.oneshot.secs.append(oneshot_secs)
            result.periodic.secs.append(periodic_secs)
            result.oneshot_pass.secs.append(oneshot_pass_secs)
            result.periodic_pass.secs.append(periodic_pass_secs)
            result.oneshot_checked.append(oneshot.counts.get("checkpoints_checked", -1))
            result.periodic_checked.append(report.counts.get("checkpoints_checked", -1))
            result.periodic_read.append(periodic_read)
            result.counts = oneshot.counts
            print(
                f"  audit N={n} rep {rep}/{repeat[0]}: floor {ms(floor_secs)} ms, one-shot "
                f"{ms(oneshot_secs)} ms, periodic {ms(periodic_secs)} ms",
                flush=True,
            )
        measure_contents(result, fleet, ledger, settings, root / "volumes", repeat[1])
        return result
    finally:
        ledger.dispose()
        api.stop(30)


def measure_contents(
    result: SizeResult,
    fleet: Fleet,
    ledger: CountingLedger,
    settings: Settings,
    volumes: Path,
    repeat: int,
) -> None:
    """The session subset: audits with ``audit_volumes_dir``, and ``read_sessions`` alone
    against reading, hashing and parsing the same files."""
    result.session_checkpoints = fleet.add_session_subset(volumes)
    with_volumes = settings.model_copy(update={"audit_volumes_dir": volumes})
    periodic = Auditor(ledger, with_volumes, kubernetes=True)
    probe = Auditor(ledger, with_volumes, kubernetes=False)
    for rep in range(repeat + 1):
        fleet.heartbeats()
        plain_secs, plain = timed(lambda: Auditor(ledger, settings).run(confirm=False))
        oneshot_secs, oneshot = timed(lambda: Auditor(ledger, with_volumes).run(confirm=False))
        before = ledger.checkpoints_read
        periodic_secs, report = timed(lambda: periodic.run(everything=False, confirm=False))
        periodic_read = ledger.checkpoints_read - before
        cluster = read_cluster()
        batch = ledger.available_checkpoints_after(0, result.checkpoints)
        readable = probe.readable(batch, cluster)
        files = [layout.session_file(d / a.session_dir) for c, d, _ in readable for a in c.agents]
        read_secs, readings = timed(partial(read_all, readable))
        floor_secs, result.session_bytes = timed(partial(floor_sessions, files))
        for what, r in (("plain one-shot", plain), ("one-shot with sessions", oneshot),
                        ("periodic with sessions", report)):  # fmt: skip
            result.note(r, what)
        if not rep:
            continue
        result.contents_oneshot_plain.secs.append(plain_secs)
        result.contents_oneshot.secs.append(oneshot_secs)
        result.contents_periodic.secs.append(periodic_secs)
        result.contents_oneshot_sessions.append(oneshot.counts.get("sessions_checked", -1))
        result.contents_periodic_sessions.append(report.counts.get("sessions_checked", -1))
        result.contents_periodic_read.append(periodic_read)
        result.read_sessions.secs.append(read_secs)
        result.sessions_floor.secs.append(floor_secs)
        result.sessions_read = sum(len(r) for r in readings)
    print(f"  audit N={result.n} sessions: one-shot {ms(result.contents_oneshot.median)} ms "
          f"for {result.contents_oneshot_sessions[-1:]} sessions", flush=True)  # fmt: skip


# ------------------------------------------------------------------------ report


def growth(values: Sequence[float]) -> float:
    return values[-1] / values[0] if values and values[0] else float("nan")


def per_sec(count: float, secs: float) -> str:
    return f"{count / secs:,.0f}/s" if secs > 0 else "-"


def run(quick: bool, root: Path, database_url: str | None, sizes: Sequence[int] | None) -> Scenario:
    repeat = (1, 1) if quick else (REPEAT, CONTENTS_REPEAT)
    fleet_sizes = sorted(set(sizes or (QUICK_SIZES if quick else SIZES)))
    url = database_url or DATABASE_URL
    settings = Settings(database_url=url)
    results = []
    for n in fleet_sizes:
        directory = root / f"n{n}"
        directory.mkdir()
        results.append(measure_size(n, repeat, directory, url, settings))
    s = settings
    table: list[tuple[str, str]] = []
    for r in results:
        table += [
            (f"N={r.n}: floor (lists + heartbeats, median)", f"{ms(r.floor.median)} ms"),
            (f"N={r.n}: observe.read_cluster (median)", f"{ms(r.read_cluster.median)} ms"),
            (f"N={r.n}: one-shot audit (median)", f"{ms(r.oneshot.median)} ms"),
            (f"N={r.n}: periodic audit (median)", f"{ms(r.periodic.median)} ms"),
            (f"N={r.n}: **one-shot / floor**", f"**{r.oneshot.median / r.floor.median:.2f}**"),
            (f"N={r.n}: **periodic / floor**", f"**{r.periodic.median / r.floor.median:.2f}**"),
            (f"N={r.n}: checkpoints checked, one-shot / periodic run",
             f"{median(r.oneshot_checked):.0f} / {median(r.periodic_checked):.0f} of "
             f"{r.checkpoints}"),
            (f"N={r.n}: checkpoint pass alone, one-shot / periodic (median)",
             f"{ms(r.oneshot_pass.median)} / {ms(r.periodic_pass.median)} ms"),
            (f"N={r.n}: sessions, audit's read_sessions (median)",
             f"{per_sec(r.sessions_read, r.read_sessions.median)} "
             f"({r.sessions_read} sessions, {ms(r.read_sessions.median)} ms)"),
            (f"N={r.n}: sessions, floor: read + sha256 + parse (median)",
             f"{per_sec(r.sessions_read, r.sessions_floor.median)} "
             f"({r.session_bytes / 1e6:.1f} MB, {ms(r.sessions_floor.median)} ms)"),
            (f"N={r.n}: sessions, read_sessions / floor",
             f"{r.read_sessions.median / r.sessions_floor.median:.2f}"),
            (f"N={r.n}: one-shot with sessions / without (median)",
             f"{ms(r.contents_oneshot.median)} / {ms(r.contents_oneshot_plain.median)} ms, "
             f"{median(r.contents_oneshot_sessions):.0f} sessions"),
            (f"N={r.n}: sessions per second of the one-shot's added time",
             per_sec(median(r.contents_oneshot_sessions),
                     r.contents_oneshot.median - r.contents_oneshot_plain.median)),
            (f"N={r.n}: periodic with sessions (median)",
             f"{ms(r.contents_periodic.median)} ms, {median(r.contents_periodic_sessions):.0f} "
             f"sessions, {median(r.contents_periodic_read):.0f} checkpoints read from the "
             f"ledger (without sessions: {median(r.periodic_read):.0f})"),
        ]  # fmt: skip
    first, last = results[0], results[-1]
    fleet_growth = last.n / first.n
    grows = {
        "floor": growth([first.floor.median, last.floor.median]),
        "one-shot audit": growth([first.oneshot.median, last.oneshot.median]),
        "periodic audit": growth([first.periodic.median, last.periodic.median]),
        "periodic beyond the floor": growth([first.periodic.median - first.floor.median,
                                             last.periodic.median - last.floor.median]),
        "one-shot checkpoint pass": growth([first.oneshot_pass.median, last.oneshot_pass.median]),
        "periodic checkpoint pass": growth([first.periodic_pass.median,
                                            last.periodic_pass.median]),
        "checkpoints checked per periodic run": growth([median(first.periodic_checked),
                                                        median(last.periodic_checked)]),
    }  # fmt: skip
    if len(results) > 1:
        span = f"N={first.n} → {last.n} (fleet and ledger x {fleet_growth:g})"
        table += [(f"growth {span}: {what}", f"x {g:.2f}") for what, g in grows.items()]
    expected = {r.n: min(r.checkpoints, r.share) for r in results}
    sessions_ok = all(
        median(r.contents_oneshot_sessions) == r.session_checkpoints * AGENTS == r.sessions_read
        for r in results
    )
    checks = [
        Check(
            "every audit of the consistent fleet found nothing",
            not any(r.findings for r in results),
            f"{sum(len(r.findings) for r in results)} findings"
            + (
                f", first: {next(f for r in results for f in r.findings)}"
                if any(r.findings for r in results)
                else ""
            ),
            budget=False,
        ),
        Check(
            "the one-shot audit checked every checkpoint; each periodic run its share, "
            "min(checkpoints, Rotation.share)",
            all(
                set(r.oneshot_checked) == {r.checkpoints}
                and set(r.periodic_checked) == {expected[r.n]}
                for r in results
            ),
            "; ".join(
                f"N={r.n}: one-shot {sorted(set(r.oneshot_checked))} of {r.checkpoints}, "
                f"periodic {sorted(set(r.periodic_checked))} (share {expected[r.n]})"
                for r in results
            ),
            budget=False,
        ),
        Check(
            "the one-shot audit with audit_volumes_dir read every session of the subset",
            sessions_ok,
            "; ".join(
                f"N={r.n}: {sorted(set(r.contents_oneshot_sessions))} of "
                f"{r.session_checkpoints * AGENTS}"
                for r in results
            ),
            budget=False,
        ),
    ]
    if len(results) > 1:
        ledger_growth = last.checkpoints / first.checkpoints
        pass_growth = grows["periodic checkpoint pass"]
        checks.append(Check(
            f"the periodic run's checkpoint pass grows less than the ledger (N={first.n} → "
            f"{last.n}: x {ledger_growth:g} checkpoints)",
            pass_growth < ledger_growth, f"x {pass_growth:.2f}",
        ))  # fmt: skip
    setup = [
        f"Fleet sizes N = {', '.join(map(str, fleet_sizes))}: N CalibanTasks (status Running, "
        f"{AGENTS} agents, pvcName, phaseSince, via the status subresource), N Sandboxes "
        f"({crd.SANDBOX_V1ALPHA1}, owned by them), N pods (controlled by the Sandboxes, "
        "mounting the workspace) and N workspace PVCs (labelled, owned by the tasks) on the "
        "embedded Kubernetes API (`drainctl dev cluster`, a subprocess); a ledger on "
        f"{sa.make_url(url).get_backend_name()} with N fresh heartbeats and "
        f"{CHECKPOINTS_PER_TASK} recorded checkpoints per task ({AGENTS} agents each, on "
        "the task's PVC), created through the Ledger API.",
        "Fleet set-up (untimed): "
        + ", ".join(f"N={r.n} in {r.setup_secs:.0f} s" for r in results)
        + f"; heartbeats refreshed before each repetition; medians of {repeat[0]} "
        f"repetition(s) ({repeat[1]} for the sessions) after a warm-up, each kind measured "
        "in turn in every repetition.",
        "Floor: one paged list each of tasks, Sandboxes (at their storage version, "
        f"{', '.join(sorted({r.sandbox_version for r in results}))}, as observe lists them; "
        "its look-up of that version is not in the floor), pods, PVCs and VolumeSnapshots "
        "with one "
        f"API client, {PAGE} objects a page as observe asks, and "
        "`Ledger.list_activities()`: "
        + ", ".join(
            f"N={r.n}: {r.floor_objects} objects and rows in {r.floor_requests} list requests"
            for r in results
        )
        + ".",
        f"Settings: audit_checkpoint_batch {s.audit_checkpoint_batch}, audit_session_batch "
        f"{s.audit_session_batch}, audit_interval_secs {s.audit_interval_secs:g}, "
        f"audit_full_pass_secs {s.audit_full_pass_secs:g}; runs confirm=False (no settle "
        "sleep). The periodic Auditor is kept across repetitions (its rotation moves on); "
        "the checkpoint pass alone is `Auditor.checkpoint_checks` on a cluster read before.",
        f"Sessions: the newest checkpoint of one task in {SESSION_TASKS_ONE_IN} gets a ready "
        f"VolumeSnapshot whose copy holds its {AGENTS} sessions ({SESSION_TURNS} turns, "
        f"{last.session_file_bytes} bytes each, "
        "written by save_session, in the page cache): "
        + ", ".join(f"N={r.n}: {r.session_checkpoints} checkpoints" for r in results)
        + ". Floor: read, sha256 and json.loads of the same files.",
    ]
    runs = [
        f"N={r.n}: floor {ms_list(r.floor.secs)}; read_cluster {ms_list(r.read_cluster.secs)}; "
        f"one-shot {ms_list(r.oneshot.secs)}; periodic {ms_list(r.periodic.secs)}; passes "
        f"{ms_list(r.oneshot_pass.secs)} / {ms_list(r.periodic_pass.secs)}; with sessions "
        f"one-shot {ms_list(r.contents_oneshot.secs)}, periodic "
        f"{ms_list(r.contents_periodic.secs)}; read_sessions {ms_list(r.read_sessions.secs)}, "
        f"floor {ms_list(r.sessions_floor.secs)}"
        for r in results
    ]  # fmt: skip
    return Scenario(
        name="audit",
        title="Self-audit cost against the fleet size",
        setup=setup,
        table=table,
        checks=checks,
        runs=runs,
        data={
            "sizes": fleet_sizes,
            "repeat": repeat,
            "settings": {k: getattr(s, k) for k in ("audit_checkpoint_batch",
                                                    "audit_session_batch", "audit_interval_secs",
                                                    "audit_full_pass_secs")},
            "growth": grows,
            "results": [asdict(r) for r in results],
            "curves": {
                "x_label": "CalibanTasks in the fleet",
                "y_label": "median latency (ms)",
                "series": {
                    name: [[r.n, pick(r).median * 1000] for r in results]
                    for name, pick in CURVES.items()
                },
            },
        },
    )  # fmt: skip
