"""The audit's judgements: pure functions from what was observed to findings.

``observe`` reads the cluster and the ledger into the plain values below; nothing here
does I/O, so every rule is tested with values (``tests/unit/test_audit_checks.py``)
and holds the same in the one-shot ``drainctl audit`` and the periodic auditor.

Every rule that compares two things written at different moments (a heartbeat and the
status the operator derives from it, a phase and the Sandbox it patches) waits for them
to settle: :class:`Thresholds` derives each wait from the settings the operator, the
worker and the daemons run with, so a healthy system, in any of its normal transient
states, audits clean.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from orchestrator.audit.findings import Finding, FindingKind
from orchestrator.ledger import (
    ActivityView,
    CheckpointView,
    DrainRecordProblem,
    OperationView,
    UnsettledSnapshotView,
)
from orchestrator.operator import crd
from orchestrator.operator.lifecycle import (
    HEARTBEATS_MISSED_BEFORE_SILENT,
    ORPHANED_ASK_GRACE_SECS,
    Phase,
    snapshot_deadline,
)
from orchestrator.settings import Settings
from worker_agent.contract import TaskNameError, daemon_queue
from worker_agent.metrics import lost_turns

DAEMON_PHASES = frozenset({Phase.RUNNING, Phase.PROVISIONING, Phase.RESUMING})
"""Phases in which a task's daemon must be heartbeating."""


@dataclass(frozen=True)
class Thresholds:
    heartbeat_silent_secs: float
    """A heartbeat older than this means the daemon is gone (the operator's own rule)."""
    status_settle_secs: float
    """How long after a heartbeat the operator has certainly written it into the status:
    a run confirms what it finds after this long (``runner``), so a status that has not
    caught up with the newest heartbeat yet is not a finding."""
    phase_settle_secs: float
    """How long after a phase change its side effects (a Sandbox patched, a pod gone, a
    last heartbeat stored) have certainly happened."""
    first_heartbeat_secs: float
    """How long a new task may wait for its pod's first heartbeat (image pulls)."""
    overdue_slack_secs: float
    """How long past its deadline an operation may stay open before the sweeper closes it."""
    snapshot_cut_secs: float
    """How long after its checkpoint a snapshot may stay not cut before the ledger must say
    it failed: the operator's cut timeout, and the time its follower takes to notice."""
    snapshot_ready_secs: float
    """Likewise for a cut snapshot to become ready (the operator's ready timeout)."""

    @classmethod
    def of(cls, settings: Settings) -> Thresholds:
        reconcile = settings.reconcile_interval_secs
        silent = HEARTBEATS_MISSED_BEFORE_SILENT * settings.heartbeat_interval_secs
        noticed = 2 * settings.snapshot_follow_interval_secs + 30
        return cls(
            heartbeat_silent_secs=silent,
            status_settle_secs=2 * reconcile + settings.heartbeat_poll_secs + 5,
            phase_settle_secs=settings.heartbeat_gap_secs + 2 * reconcile + 5,
            first_heartbeat_secs=max(settings.audit_first_heartbeat_secs, silent),
            overdue_slack_secs=2 * settings.sweep_interval_secs + 30,
            snapshot_cut_secs=settings.snapshot_cut_timeout_secs
            + ORPHANED_ASK_GRACE_SECS
            + noticed,
            snapshot_ready_secs=settings.snapshot_ready_timeout_secs + noticed,
        )


@dataclass(frozen=True)
class TaskState:
    namespace: str
    name: str
    uid: str
    phase: str | None
    phase_since: datetime | None
    created_at: datetime | None
    agents: int | None
    checkpoint_ref: str | None
    pvc_name: str | None
    deleting: bool
    disruption: str | None = None
    """``status.disruption``: what the operator saw go wrong (``DaemonSilent``, …)."""
    consistent: tuple[str, str, str] | None = None
    """Its ``Consistent`` condition as (status, reason, message), if it has one."""
    sandbox_name: str | None = None
    """``status.sandboxName``: the Sandbox it runs in."""
    resume_from: str | None = None
    """``spec.resumeFrom.checkpointRef``: the checkpoint it is (or was) restored from."""

    @property
    def restoring(self) -> bool:
        """Whether it has not started from ``resume_from`` yet: not past its restore's
        ``Resuming`` (a wake's ``Resuming`` resumes its own pause checkpoint instead)."""
        if self.resume_from is None:
            return False
        if self.phase in (None, Phase.PENDING, Phase.PROVISIONING):
            return True
        return self.phase == Phase.RESUMING and self.checkpoint_ref == self.resume_from


@dataclass(frozen=True)
class SandboxState:
    namespace: str
    name: str
    uid: str
    suspended: bool
    owner_uid: str | None
    """The uid of the CalibanTask that owns it, if one does."""
    queue: str | None
    """The daemon's ``--queue`` argument in its pod template."""
    task_uid: str | None
    """The daemon's ``--task-uid`` argument."""


@dataclass(frozen=True)
class PodState:
    namespace: str
    name: str
    pvcs: tuple[str, ...]
    controller_uid: str | None
    terminating: bool


@dataclass(frozen=True)
class PvcState:
    namespace: str
    name: str
    owner_uids: tuple[str, ...]
    """Uids of the CalibanTasks among its owners."""
    workspace: bool
    """Labelled as a task's workspace by the operator (``crd.TASK_LABEL``)."""
    terminating: bool


@dataclass(frozen=True)
class SnapshotState:
    namespace: str
    name: str
    uid: str
    checkpoint: str | None
    """Its ``crd.CHECKPOINT_LABEL``: the checkpoint it was taken for."""
    terminating: bool


@dataclass
class Cluster:
    """The Kubernetes side of one audit, listed once."""

    tasks: list[TaskState] = field(default_factory=list)
    sandboxes: list[SandboxState] = field(default_factory=list)
    pods: list[PodState] = field(default_factory=list)
    pvcs: list[PvcState] = field(default_factory=list)
    snapshots: list[SnapshotState] = field(default_factory=list)
    snapshots_served: bool = True
    sandboxes_served: bool = True
    """Whether the cluster serves the Sandbox API (``sandboxes`` lists them all)."""

    def task_by_uid(self) -> dict[str, TaskState]:
        return {t.uid: t for t in self.tasks}

    def pvc_keys(self) -> set[tuple[str, str]]:
        return {(p.namespace, p.name) for p in self.pvcs if not p.terminating}

    def snapshot_keys(self) -> set[tuple[str, str]]:
        return {(s.namespace, s.name) for s in self.snapshots if not s.terminating}


def _age(now: datetime, moment: datetime | None) -> float | None:
    return None if moment is None else (now - moment).total_seconds()


def _arrived(activity: ActivityView) -> datetime:
    return activity.received_at or activity.reported_at


# ---------------------------------------------------------------------- tasks


def check_tasks(
    cluster: Cluster,
    activities: Mapping[tuple[str, str], ActivityView],
    known_refs: Mapping[str, str | None],
    now: datetime,
    limits: Thresholds,
) -> list[Finding]:
    """Each task's phase and ``status.agents`` against its daemon's heartbeat, its
    Sandbox and pod, and its ``checkpointRef`` and restore against the ledger.
    ``known_refs``: the refs the ledger holds, each with why it is unavailable (None:
    restorable)."""
    found: list[Finding] = []
    sandboxes = {(s.namespace, s.name): s for s in cluster.sandboxes}
    pods_of: dict[str, list[PodState]] = defaultdict(list)
    for pod in cluster.pods:
        if pod.controller_uid is not None and not pod.terminating:
            pods_of[pod.controller_uid].append(pod)
    sandbox_uids = _sandbox_uids(cluster)
    for task in cluster.tasks:

        def finding(kind: FindingKind, message: str, *, t: TaskState = task) -> Finding:
            return Finding(
                kind, f"calibantask {t.namespace}/{t.name}", message, t.namespace, t.name
            )

        if task.checkpoint_ref and task.checkpoint_ref not in known_refs:
            found.append(
                finding(
                    FindingKind.UNKNOWN_CHECKPOINT,
                    f"status.checkpointRef {task.checkpoint_ref} is not in the ledger: the task "
                    "cannot be resumed or restored from it",
                )
            )
        if task.deleting:
            continue  # the drain finalizer owns it now
        stuck = _restore_stuck(task, known_refs, now, limits)
        if stuck is not None:
            found.append(finding(FindingKind.RESTORE_STUCK, stuck))
        activity = activities.get((task.namespace, task.name))
        mine = activity if activity is not None and activity.task_uid in (None, task.uid) else None
        age = None if mine is None else _age(now, _arrived(mine))
        phase_age = _age(now, task.phase_since)
        if task.phase in DAEMON_PHASES:
            heard = mine
            if (
                heard is not None
                and task.phase != Phase.RUNNING
                and task.disruption != "DaemonSilent"
                and task.phase_since is not None
                and _arrived(heard) < task.phase_since
            ):
                # The old pod's last word: this phase waits for a new pod's first
                # heartbeat, as the operator does; unless the operator is in it because
                # that very daemon went silent.
                heard = None
            if (
                heard is not None
                and age is not None
                and (age > limits.heartbeat_silent_secs + limits.phase_settle_secs)
            ):
                found.append(
                    finding(
                        FindingKind.DAEMON_SILENT,
                        f"phase {task.phase}, but its daemon's last heartbeat reached the ledger "
                        f"{age:.0f}s ago (silent after {limits.heartbeat_silent_secs:g}s)",
                    )
                )
            elif heard is None:
                waited = _age(now, task.phase_since or task.created_at)
                if waited is not None and waited > limits.first_heartbeat_secs:
                    found.append(
                        finding(
                            FindingKind.DAEMON_SILENT,
                            f"phase {task.phase}, and no heartbeat from its daemon in the "
                            f"{waited:.0f}s since the phase began",
                        )
                    )
        if (
            task.phase == Phase.RUNNING
            and mine is not None
            and age is not None
            and age <= limits.heartbeat_silent_secs
            and phase_age is not None
            and phase_age > limits.status_settle_secs
            and task.agents != mine.agents_live
        ):
            found.append(
                finding(
                    FindingKind.STATUS_DISAGREES,
                    f"status says {task.agents} agents live; its daemon's heartbeat of "
                    f"{age:.0f}s ago says {mine.agents_live} live of {mine.agents_total} "
                    f"({mine.agents_interrupted} interrupted)",
                )
            )
        if (
            # A Completed task released its compute as a paused one did: same claim.
            task.phase in (Phase.SUSPENDED, Phase.COMPLETED)
            and phase_age is not None
            and (phase_age > limits.phase_settle_secs)
        ):
            problems = []
            sandbox = sandboxes.get((task.namespace, crd.sandbox_name(task.name)))
            if sandbox is not None and not sandbox.suspended:
                problems.append(f"its Sandbox {task.namespace}/{sandbox.name} is not suspended")
            pods = [p.name for uid in sandbox_uids.get(task.uid, ()) for p in pods_of[uid]]
            if pods:
                problems.append(f"pod {', '.join(sorted(pods))} still runs")
            after = None if mine is None else _age(_arrived(mine), task.phase_since)
            if (
                mine is not None
                and mine.agents_live
                and after is not None
                and after > limits.phase_settle_secs
                and age is not None
                and age <= limits.heartbeat_silent_secs
            ):
                problems.append(
                    f"its daemon reported {mine.agents_live} live agents {age:.0f}s ago"
                )
            if problems:
                found.append(
                    finding(
                        FindingKind.SUSPENDED_NOT_STOPPED,
                        f"phase {task.phase} for {phase_age:.0f}s, but {'; '.join(problems)}",
                    )
                )
    return found


def _restore_stuck(
    task: TaskState, known_refs: Mapping[str, str | None], now: datetime, limits: Thresholds
) -> str | None:
    """Why ``task``'s restore can only fail, once it has waited past a phase's settling
    time: its checkpoint is gone from the ledger or released (the operator refuses such
    a restore at its next pass, so a finding means it is not acting on the task)."""
    if not task.restoring or task.resume_from is None:
        return None
    waited = _age(now, task.phase_since or task.created_at)
    if waited is None or waited <= limits.phase_settle_secs:
        return None
    ref = task.resume_from
    if ref not in known_refs:
        why = "is not in the ledger"
    elif (gone := known_refs[ref]) is not None:
        why = f"is unavailable ({gone})"
    else:
        return None
    return (
        f"phase {task.phase or 'none'} for {waited:.0f}s, restoring checkpoint {ref} "
        f"(spec.resumeFrom), which {why}: the restore can only fail, and the task was not "
        "failed; is the operator running?"
    )


def check_task_children(cluster: Cluster, now: datetime, limits: Thresholds) -> list[Finding]:
    """A task past its phase's settling time that runs, or is kept to run again, on a
    workspace PVC that does not exist or is being deleted (its agents' work goes with
    its pod; a wake can only fail), or that is Running while its Sandbox does not
    exist (the operator re-creates it once the daemon is silent)."""
    found: list[Finding] = []
    pvcs = {(p.namespace, p.name): p for p in cluster.pvcs}
    sandboxes = {(s.namespace, s.name) for s in cluster.sandboxes}
    for task in cluster.tasks:
        if task.deleting or task.phase not in (*DAEMON_PHASES, Phase.SUSPENDED):
            continue
        phase_age = _age(now, task.phase_since)
        if phase_age is None or phase_age <= limits.phase_settle_secs:
            continue
        problems = []
        if task.pvc_name:
            pvc = pvcs.get((task.namespace, task.pvc_name))
            if pvc is None or pvc.terminating:
                state = "does not exist" if pvc is None else "is being deleted"
                problems.append(f"its workspace PVC {task.pvc_name} {state}")
        if (
            task.phase == Phase.RUNNING
            and cluster.sandboxes_served
            and task.sandbox_name
            and (task.namespace, task.sandbox_name) not in sandboxes
        ):
            problems.append(f"its Sandbox {task.sandbox_name} does not exist")
        if problems:
            found.append(
                Finding(
                    FindingKind.TASK_CHILD_GONE,
                    f"calibantask {task.namespace}/{task.name}",
                    f"phase {task.phase} for {phase_age:.0f}s, but {'; '.join(problems)}",
                    task.namespace,
                    task.name,
                )
            )
    return found


def _sandbox_uids(cluster: Cluster) -> dict[str, list[str]]:
    """Task uid → the uids of the Sandboxes it owns (pods are controlled by Sandboxes)."""
    owned: dict[str, list[str]] = defaultdict(list)
    for sandbox in cluster.sandboxes:
        if sandbox.owner_uid is not None:
            owned[sandbox.owner_uid].append(sandbox.uid)
    return owned


# -------------------------------------------------------------------- daemons


def check_daemons(
    cluster: Cluster,
    activities: Mapping[tuple[str, str], ActivityView],
    now: datetime,
    limits: Thresholds,
) -> list[Finding]:
    """One daemon per workspace; each daemon bound to its own task's queue and uid."""
    found: list[Finding] = []
    tasks = {(t.namespace, t.name): t for t in cluster.tasks}
    by_uid = cluster.task_by_uid()
    mounting: dict[tuple[str, str], list[PodState]] = defaultdict(list)
    for pod in cluster.pods:
        for pvc in pod.pvcs:
            mounting[(pod.namespace, pvc)].append(pod)
    owners = {(p.namespace, p.name): p.owner_uids for p in cluster.pvcs}
    workspaces = {(p.namespace, p.name) for p in cluster.pvcs if p.workspace}
    workspaces |= {(t.namespace, t.pvc_name) for t in cluster.tasks if t.pvc_name}
    for (namespace, pvc), pods in sorted(mounting.items()):
        if len(pods) < 2 or (namespace, pvc) not in workspaces:
            continue  # another application's shared volume is none of the audit's business
        owner = next((by_uid[u] for u in owners.get((namespace, pvc), ()) if u in by_uid), None)
        names = ", ".join(
            f"{p.name}{' (terminating)' if p.terminating else ''}"
            for p in sorted(pods, key=lambda p: p.name)
        )
        found.append(
            Finding(
                FindingKind.DUPLICATE_DAEMON,
                f"pvc {namespace}/{pvc}",
                f"{len(pods)} pods mount workspace PVC {pvc}: {names}; two daemons on one "
                "store overwrite each other's sessions",
                namespace,
                owner.name if owner is not None else None,
            )
        )
    for sandbox in cluster.sandboxes:
        task = by_uid.get(sandbox.owner_uid or "")
        if task is None:
            continue
        try:
            queue = daemon_queue(task.namespace, task.name)
        except TaskNameError:
            continue
        wrong = []
        if sandbox.queue is not None and sandbox.queue != queue:
            wrong.append(f"--queue {sandbox.queue} (its task's queue is {queue})")
        if sandbox.task_uid is not None and sandbox.task_uid != task.uid:
            wrong.append(f"--task-uid {sandbox.task_uid} (its task's uid is {task.uid})")
        if wrong:
            found.append(
                Finding(
                    FindingKind.QUEUE_MISMATCH,
                    f"sandbox {sandbox.namespace}/{sandbox.name}",
                    f"the daemon of task {task.namespace}/{task.name} is started with "
                    f"{' and '.join(wrong)}",
                    task.namespace,
                    task.name,
                )
            )
    for (namespace, name), activity in sorted(activities.items()):
        owner = tasks.get((namespace, name))
        age = _age(now, _arrived(activity))
        if (
            owner is None
            or owner.deleting
            or activity.task_uid in (None, owner.uid)
            or age is None
            or age > limits.heartbeat_silent_secs
        ):
            continue
        found.append(
            Finding(
                FindingKind.QUEUE_MISMATCH,
                f"queue {namespace}/{name}",
                f"a daemon bound to task uid {activity.task_uid} heartbeats on task "
                f"{namespace}/{name}'s queue {age:.0f}s ago; the task's uid is {owner.uid}",
                namespace,
                name,
            )
        )
    return found


# ----------------------------------------------------------------- operations


def check_operations(
    overdue: Sequence[OperationView],
    drain_problems: Sequence[DrainRecordProblem],
    now: datetime,
    limits: Thresholds,
    live_tasks: Mapping[tuple[str, str], TaskState],
) -> list[Finding]:
    """``overdue``: unfinished operations past their deadline, as the ledger lists them."""
    found: list[Finding] = []
    for op in overdue:
        late = _age(now, op.deadline_at)
        if late is None or late <= limits.overdue_slack_secs:
            continue
        task = live_tasks.get((op.namespace, op.name))
        found.append(
            Finding(
                FindingKind.OPERATION_OVERDUE,
                f"operation {op.id}",
                f"{op.kind} of {op.namespace}/{op.name} is still {op.state} {late:.0f}s past its "
                f"deadline; the deadline sweeper (drainctl worker) closes such operations within "
                f"{limits.overdue_slack_secs:g}s",
                op.namespace,
                task.name if task is not None and task.uid == op.task_uid else None,
            )
        )
    for problem in drain_problems:
        found.append(
            Finding(FindingKind.DRAIN_RECORD, f"ledger: {problem.subject}", problem.message)
        )
    return found


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class SessionReading:
    """An agent's session as read from a checkpoint's workspace."""

    turns: int | None
    sha256: str | None
    error: str | None = None

    @classmethod
    def missing(cls) -> SessionReading:
        """No session file where the checkpoint puts the agent's session."""
        return cls(None, None, SESSION_MISSING)


SESSION_MISSING = "is missing"


def check_snapshots(
    unsettled: Iterable[UnsettledSnapshotView],
    now: datetime,
    limits: Thresholds,
    live_tasks: Mapping[tuple[str, str], TaskState],
) -> list[Finding]:
    """A checkpoint snapshot the ledger says is on its way is no problem until its
    deadline (not cut: ``snapshot_cut_secs`` after the checkpoint; cut and not ready:
    ``snapshot_ready_secs``), by when the operator has recorded it ready or failed. Past
    it, the snapshot never came and nothing said so: a finding."""
    found: list[Finding] = []
    for u in unsettled:
        cut = u.snapshot_cut_at is not None
        allowed = limits.snapshot_ready_secs if cut else limits.snapshot_cut_secs
        deadline = snapshot_deadline(u.created_at, allowed)
        late = _age(now, deadline)
        if late is None or late <= 0:
            continue
        state = (
            f"cut at {u.snapshot_cut_at:%Y-%m-%dT%H:%M:%SZ} and not readyToUse"
            if cut
            else "not cut"
        )
        task = live_tasks.get((u.namespace, u.name))
        found.append(
            Finding(
                FindingKind.SNAPSHOT_OVERDUE,
                f"checkpoint {u.ref}",
                f"of task {u.namespace}/{u.name}: the ledger still says its VolumeSnapshot "
                f"{u.snapshot_name} is on its way ({state}) {allowed:g}s after the checkpoint, "
                f"{late:.0f}s past the moment the operator records such a snapshot failed; is "
                "the operator running (with --manage-sandbox)?",
                u.namespace,
                task.name if task is not None and task.uid == u.task_uid else None,
            )
        )
    return found


RELEASE_STALLED_SECS = 600.0
"""How long a prune's mark may stay on a checkpoint before it is a finding: a batch is
marked, looked at and released in seconds, so a mark this old is a prune that stopped."""


def check_releases(stalled: Iterable[CheckpointView], now: datetime) -> list[Finding]:
    """Each checkpoint a prune marked as being released ``RELEASE_STALLED_SECS`` ago or
    more (``Ledger.stalled_releases``) and never released or kept."""
    found: list[Finding] = []
    for c in stalled:
        since = _age(now, c.releasing_since)
        if since is None or since < RELEASE_STALLED_SECS:
            continue
        found.append(
            Finding(
                FindingKind.RELEASE_STALLED,
                f"checkpoint {c.ref}",
                f"of task {c.namespace}/{c.name}: marked as being released by drainctl ledger "
                f"prune {since:.0f}s ago and never released or kept (the prune stopped "
                "half-way); a restore of it waits until drainctl ledger prune runs again",
                c.namespace,
            )
        )
    return found


def check_checkpoint_workspaces(
    checkpoints: Iterable[CheckpointView], cluster: Cluster
) -> list[Finding]:
    """Each restorable checkpoint's workspace exists: its ready snapshot, else its
    snapshot on its way or its PVC (either holds its state until the snapshot settles)."""
    found: list[Finding] = []
    pvcs = cluster.pvc_keys()
    snapshots = cluster.snapshot_keys()
    for c in checkpoints:
        pvc_there = c.pvc_name is not None and (c.namespace, c.pvc_name) in pvcs
        snap_there = c.snapshot is not None and (c.namespace, c.snapshot) in snapshots
        subject = f"checkpoint {c.ref}"
        owner = f"of task {c.namespace}/{c.name}"
        if c.snapshot_pending and c.snapshot_name is not None:
            if not pvc_there and (c.namespace, c.snapshot_name) not in snapshots:
                found.append(
                    Finding(
                        FindingKind.WORKSPACE_MISSING,
                        subject,
                        f"checkpoint {owner}: neither its VolumeSnapshot {c.snapshot_name}, "
                        f"which the ledger says is on its way, nor its workspace PVC "
                        f"{c.pvc_name} exists; the ledger still calls it restorable",
                        c.namespace,
                    )
                )
            continue
        if c.snapshot is not None and not snap_there and cluster.snapshots_served:
            if pvc_there:
                found.append(
                    Finding(
                        FindingKind.SNAPSHOT_MISSING,
                        subject,
                        f"checkpoint {owner}: the ledger says VolumeSnapshot {c.snapshot} is "
                        f"ready, and there is none; only its retained PVC {c.pvc_name} is left",
                        c.namespace,
                    )
                )
            else:
                found.append(
                    Finding(
                        FindingKind.WORKSPACE_MISSING,
                        subject,
                        f"checkpoint {owner}: neither its VolumeSnapshot {c.snapshot} nor its "
                        f"workspace PVC {c.pvc_name} exists; the ledger still calls it restorable",
                        c.namespace,
                    )
                )
        elif c.snapshot is None and c.pvc_name is not None and not pvc_there:
            found.append(
                Finding(
                    FindingKind.WORKSPACE_MISSING,
                    subject,
                    f"checkpoint {owner}: its workspace PVC {c.namespace}/{c.pvc_name} does not "
                    "exist and it has no snapshot; the ledger still calls it restorable",
                    c.namespace,
                )
            )
    return found


def check_sessions(
    checkpoint: CheckpointView, where: str, readings: Mapping[str, SessionReading]
) -> list[Finding]:
    """``readings``: agent id → its session as read in ``where`` (the snapshot's copy or
    the retained PVC)."""
    found = []
    for agent in checkpoint.agents:
        got = readings.get(agent.agent_id)
        if got is None:
            continue
        if got.error == SESSION_MISSING and agent.session_sha256 is None and agent.turns == 0:
            continue  # the ledger recorded no session for it: there is none to be missing
        if got.error is not None:
            why = got.error
        elif (got.turns, got.sha256) != (agent.turns, agent.session_sha256):
            why = (
                f"holds {got.turns} turns (sha256 {str(got.sha256)[:12]}), the ledger recorded "
                f"{agent.turns} (sha256 {str(agent.session_sha256)[:12]})"
            )
        else:
            continue
        found.append(
            Finding(
                FindingKind.SESSION_MISMATCH,
                f"checkpoint {checkpoint.ref}",
                f"agent {agent.agent_id}'s session in {where} {why}",
                checkpoint.namespace,
                lost_turns=lost_turns(agent.turns, got.turns),
            )
        )
    return _one_per_subject(found)


def _one_per_subject(found: list[Finding]) -> list[Finding]:
    """Several agents of one checkpoint mismatching are one finding, naming them all."""
    if len(found) < 2:
        return found
    first = found[0]
    return [
        Finding(
            first.kind,
            first.subject,
            "; ".join(f.message for f in found),
            first.namespace,
            first.task,
        )
    ]


# -------------------------------------------------------------------- orphans


def check_orphans(
    cluster: Cluster,
    referenced_pvcs: set[tuple[str, str]],
    referenced_snapshots: set[tuple[str, str]],
) -> list[Finding]:
    """Workspace PVCs and checkpoint snapshots nothing refers to (reported, never deleted)."""
    found: list[Finding] = []
    live = {t.uid for t in cluster.tasks}
    for pvc in cluster.pvcs:
        key = (pvc.namespace, pvc.name)
        if not pvc.workspace or pvc.terminating or key in referenced_pvcs:
            continue
        if any(uid in live for uid in pvc.owner_uids):
            continue
        found.append(
            Finding(
                FindingKind.ORPHAN_PVC,
                f"pvc {pvc.namespace}/{pvc.name}",
                "a workspace PVC no live task owns and no restorable checkpoint names: storage "
                "nothing will restore or release",
                pvc.namespace,
            )
        )
    for snap in cluster.snapshots:
        key = (snap.namespace, snap.name)
        if snap.checkpoint is None or snap.terminating or key in referenced_snapshots:
            continue
        found.append(
            Finding(
                FindingKind.ORPHAN_SNAPSHOT,
                f"volumesnapshot {snap.namespace}/{snap.name}",
                f"taken for checkpoint {snap.checkpoint}, which the ledger does not hold as "
                "restorable with this snapshot: storage nothing will restore or release",
                snap.namespace,
            )
        )
    return found
