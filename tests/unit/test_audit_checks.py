"""The self-audit's judgements, with hand-built values: every check of
``orchestrator.audit.checks`` finds its inconsistency, and passes over the healthy and
transient states a working system goes through; ``Rotation.share``, the report's JSON,
and ``observe.read_sessions`` on real session files.

The waits are the project's defaults (``Thresholds.of(Settings())``), never shortened:
heartbeats silent after 45 s, status settled 10 s after a heartbeat, phase side effects
25 s after a phase change, 600 s for a first heartbeat, 60 s of slack on deadlines, a
snapshot on its way until 400 s (not cut) or 3640 s (cut) after its checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrator.audit import AuditReport, Finding, FindingKind
from orchestrator.audit.checks import (
    DAEMON_PHASES,
    RELEASE_STALLED_SECS,
    Cluster,
    PodState,
    PvcState,
    SandboxState,
    SessionReading,
    SnapshotState,
    TaskState,
    Thresholds,
    check_checkpoint_workspaces,
    check_daemons,
    check_operations,
    check_orphans,
    check_releases,
    check_sessions,
    check_snapshots,
    check_task_children,
    check_tasks,
)
from orchestrator.audit.observe import Volumes, read_sessions
from orchestrator.audit.runner import Auditor, Rotation
from orchestrator.ledger import (
    ActivityView,
    CheckpointAgentView,
    CheckpointReason,
    CheckpointView,
    DrainRecordProblem,
    Ledger,
    OperationKind,
    OperationState,
    OperationView,
    UnsettledSnapshotView,
    upgrade,
)
from orchestrator.operator import crd
from orchestrator.operator.lifecycle import Phase
from orchestrator.settings import Settings
from worker_agent import layout
from worker_agent.session import Session, save_session

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LIMITS = Thresholds.of(Settings())
NS = "default"
UID = "uid-task-a"
SHA_A = "a" * 64
SHA_B = "b" * 64


def ago(secs: float) -> datetime:
    return NOW - timedelta(seconds=secs)


# ------------------------------------------------------------------ value builders


def task(name: str = "task-a", **overrides: Any) -> TaskState:
    """A Running task of an hour, 2 agents in its status, on PVC ``<name>-workspace``."""
    fields: dict[str, Any] = {
        "namespace": NS, "name": name, "uid": f"uid-{name}", "phase": Phase.RUNNING.value,
        "phase_since": ago(3600), "created_at": ago(7200), "agents": 2,
        "checkpoint_ref": None, "pvc_name": f"{name}-workspace", "deleting": False,
    }  # fmt: skip
    fields.update(overrides)
    return TaskState(**fields)


def heartbeat(
    name: str = "task-a", *, age: float, task_uid: str | None = UID, **overrides: Any
) -> ActivityView:
    """A heartbeat of ``name``'s daemon that reached the ledger ``age`` seconds ago."""
    fields: dict[str, Any] = {
        "namespace": NS, "name": name, "task_uid": task_uid, "all_idle_since": None,
        "agents_total": 2, "agents_live": 2, "agents_idle": 0, "reported_at": ago(age),
        "seq": 1, "idle_for_secs": None, "received_at": ago(age), "agents_interrupted": 0,
    }  # fmt: skip
    fields.update(overrides)
    return ActivityView(**fields)


def by_task(*activities: ActivityView) -> dict[tuple[str, str], ActivityView]:
    return {(a.namespace, a.name): a for a in activities}


def sandbox(name: str = "task-a", **overrides: Any) -> SandboxState:
    """The Sandbox the operator makes for ``name``: running, owned, bound to its queue."""
    fields: dict[str, Any] = {
        "namespace": NS, "name": crd.sandbox_name(name), "uid": f"sbx-{name}",
        "suspended": False,
        "owner_uid": f"uid-{name}", "queue": f"caliband.{NS}.{name}",
        "task_uid": f"uid-{name}",
    }  # fmt: skip
    fields.update(overrides)
    return SandboxState(**fields)


def pod(name: str, pvc: str = "task-a-workspace", **overrides: Any) -> PodState:
    fields: dict[str, Any] = {
        "namespace": NS, "name": name, "pvcs": (pvc,), "controller_uid": "sbx-task-a",
        "terminating": False,
    }  # fmt: skip
    fields.update(overrides)
    return PodState(**fields)


def pvc(name: str = "task-a-workspace", **overrides: Any) -> PvcState:
    fields: dict[str, Any] = {
        "namespace": NS, "name": name, "owner_uids": (), "workspace": True, "terminating": False,
    }  # fmt: skip
    fields.update(overrides)
    return PvcState(**fields)


def snapshot(name: str = "snap-1", **overrides: Any) -> SnapshotState:
    fields: dict[str, Any] = {
        "namespace": NS, "name": name, "uid": f"uid-{name}", "checkpoint": "ckpt-1",
        "terminating": False,
    }  # fmt: skip
    fields.update(overrides)
    return SnapshotState(**fields)


def agent(agent_id: str = "a1", *, turns: int = 3, sha: str | None = SHA_A) -> CheckpointAgentView:
    return CheckpointAgentView(
        agent_id=agent_id, session_dir=f"agents/{agent_id}", turns=turns, session_sha256=sha,
        clean=True, exit=0, error=None,
    )  # fmt: skip


def checkpoint(ref: str = "ckpt-1", **overrides: Any) -> CheckpointView:
    """A restorable delete checkpoint of task-a on its PVC, without a snapshot."""
    fields: dict[str, Any] = {
        "id": 1, "ref": ref, "operation_id": "op-1", "task_uid": UID, "namespace": NS,
        "name": "task-a", "reason": CheckpointReason.DELETE, "pvc_name": "task-a-workspace",
        "forced": False, "verified": True, "created_at": ago(600), "agents": (agent(),),
    }  # fmt: skip
    fields.update(overrides)
    return CheckpointView(**fields)


def with_snapshot(name: str = "snap-1", **overrides: Any) -> CheckpointView:
    """A checkpoint whose VolumeSnapshot ``name`` the ledger says is ready."""
    return checkpoint(snapshot_name=name, snapshot_ready_at=ago(500), **overrides)


def operation(**overrides: Any) -> OperationView:
    """A delete-drain of task-a still draining, its deadline ``deadline_at``."""
    fields: dict[str, Any] = {
        "id": "op-1", "kind": OperationKind.DELETE_DRAIN, "task_uid": UID, "namespace": NS,
        "name": "task-a", "state": OperationState.DRAINING, "idempotency_key": "k-1",
        "checkpoint_ref": None, "grace_secs": 30.0, "celery_task_ids": {}, "detail": None,
        "error": None, "created_at": ago(3600), "updated_at": ago(3600),
        "deadline_at": ago(3000), "finished_at": None,
    }  # fmt: skip
    fields.update(overrides)
    return OperationView(**fields)


def kinds(found: list[Finding]) -> list[FindingKind]:
    return [f.kind for f in found]


def tasks_found(
    *tasks: TaskState,
    activities: tuple[ActivityView, ...] = (),
    sandboxes: tuple[SandboxState, ...] = (),
    pods: tuple[PodState, ...] = (),
    known: set[str] | dict[str, str | None] | None = None,
) -> list[Finding]:
    """``known``: the refs the ledger holds (a set: all restorable)."""
    cluster = Cluster(tasks=list(tasks), sandboxes=list(sandboxes), pods=list(pods))
    refs = known if isinstance(known, dict) else dict.fromkeys(known or (), None)
    return check_tasks(cluster, by_task(*activities), refs, NOW, LIMITS)


# ---------------------------------------------------------------------- thresholds


def test_thresholds_of_the_default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tried: the waits derived from the default settings (no ``DRAIN_*`` variable set):
    3 x 15 s heartbeats; 2 x 2 s reconciles + 1 s poll + 5; the 16 s heartbeat gap + 4 + 5;
    the 600 s first-heartbeat allowance; 2 x 15 s sweeps + 30; a snapshot's 300 s cut
    timeout + the 60 s left to its pass + 2 x 5 s follower looks + 30, and its 3600 s
    ready timeout + 2 x 5 s + 30."""
    for variable in [v for v in os.environ if v.startswith("DRAIN_")]:
        monkeypatch.delenv(variable)
    assert Thresholds.of(Settings()) == Thresholds(
        heartbeat_silent_secs=45.0, status_settle_secs=10.0, phase_settle_secs=25.0,
        first_heartbeat_secs=600.0, overdue_slack_secs=60.0, snapshot_cut_secs=400.0,
        snapshot_ready_secs=3640.0,
    )  # fmt: skip


def test_first_heartbeat_wait_is_never_shorter_than_silence() -> None:
    """Tried: an ``audit_first_heartbeat_secs`` below the silence threshold; the wait for
    a first heartbeat is then the silence threshold."""
    limits = Thresholds.of(Settings(audit_first_heartbeat_secs=1.0))
    assert limits.first_heartbeat_secs == limits.heartbeat_silent_secs == 45.0


# ------------------------------------------------------------------- tasks: refs


def test_checkpoint_ref_the_ledger_does_not_hold_is_found() -> None:
    """Tried: ``status.checkpointRef`` naming a ref that is not among the ledger's."""
    found = tasks_found(
        task(checkpoint_ref="ckpt-gone"), activities=(heartbeat(age=5),), known={"ckpt-other"}
    )
    assert found == [
        Finding(
            FindingKind.UNKNOWN_CHECKPOINT, "calibantask default/task-a",
            "status.checkpointRef ckpt-gone is not in the ledger: the task cannot be resumed "
            "or restored from it",
            NS, "task-a",
        )
    ]  # fmt: skip


@pytest.mark.parametrize("ref", [None, "", "ckpt-known"])
def test_known_or_absent_checkpoint_ref_is_fine(ref: str | None) -> None:
    """Tried: a ref the ledger holds, no ref, and an empty one."""
    assert tasks_found(task(checkpoint_ref=ref), activities=(heartbeat(age=5),),
                       known={"ckpt-known"}) == []  # fmt: skip


def test_deleting_task_is_skipped_but_for_its_checkpoint_ref() -> None:
    """Tried: a deleting Running task with every other inconsistency (no heartbeat for an
    hour, a status far from it); only the unknown ref is found, the drain finalizer owns
    the rest."""
    silent = task(deleting=True, agents=7, checkpoint_ref="ckpt-gone")
    found = tasks_found(silent, activities=(heartbeat(age=3600),))
    assert kinds(found) == [FindingKind.UNKNOWN_CHECKPOINT]
    assert tasks_found(replace(silent, checkpoint_ref=None), activities=(heartbeat(age=3600),),
                       ) == []  # fmt: skip
    suspended = task(deleting=True, phase=Phase.SUSPENDED.value)
    assert tasks_found(suspended, sandboxes=(sandbox(),), pods=(pod("task-a-0"),)) == []


# ------------------------------------------------------------ tasks: RestoreStuck

RELEASED: dict[str, str | None] = {"ckpt-from": "released by drainctl ledger prune"}


def restoring(**overrides: Any) -> TaskState:
    """A task restoring checkpoint ckpt-from, Pending for 120 s (past 25 s to settle)."""
    fields: dict[str, Any] = {
        "phase": Phase.PENDING.value, "phase_since": ago(120), "agents": 0,
        "pvc_name": None, "resume_from": "ckpt-from",
    }  # fmt: skip
    fields.update(overrides)
    return task(**fields)


def test_a_restore_of_a_released_checkpoint_left_waiting_is_found() -> None:
    """Tried: a task Pending 120 s on a restore whose checkpoint a prune released (the
    operator fails such a restore at its next pass: it is not acting on the task)."""
    assert tasks_found(restoring(), known=RELEASED) == [
        Finding(
            FindingKind.RESTORE_STUCK, "calibantask default/task-a",
            "phase Pending for 120s, restoring checkpoint ckpt-from (spec.resumeFrom), which "
            "is unavailable (released by drainctl ledger prune): the restore can only fail, "
            "and the task was not failed; is the operator running?",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_a_restore_of_a_checkpoint_the_ledger_lacks_is_found_even_before_a_phase() -> None:
    """Tried: a task created 120 s ago that has no phase yet (no pass has run), naming a
    ref the ledger does not hold."""
    stuck = restoring(phase=None, phase_since=None, created_at=ago(120))
    [found] = tasks_found(stuck, known={"ckpt-other"})
    assert found.kind is FindingKind.RESTORE_STUCK
    assert found.message.startswith(
        "phase none for 120s, restoring checkpoint ckpt-from (spec.resumeFrom), which is "
        "not in the ledger:"
    )


def test_a_restore_whose_checkpoint_was_released_under_it_is_found() -> None:
    """Tried: the race the prune/restore exclusion closes: Resuming from the restore's
    checkpoint (``checkpointRef`` is the ``resumeFrom``), which was released meanwhile;
    its heartbeat is fresh, so only the restore is wrong."""
    stuck = restoring(phase=Phase.RESUMING.value, checkpoint_ref="ckpt-from",
                      pvc_name="task-a-restored")  # fmt: skip
    found = tasks_found(stuck, activities=(heartbeat(age=5),), known=RELEASED)
    assert kinds(found) == [FindingKind.RESTORE_STUCK]


@pytest.mark.parametrize(
    "state",
    [
        pytest.param({"phase_since": ago(20)}, id="pending-20s-not-settled"),
        pytest.param({"phase": Phase.RUNNING.value, "agents": 2}, id="running-restored"),
        pytest.param({"phase": Phase.FAILED.value}, id="failed-said-so"),
        pytest.param(
            {"phase": Phase.SUSPENDED.value, "checkpoint_ref": "ckpt-own"},
            id="suspended-on-its-own-checkpoint",
        ),
        pytest.param(
            {"phase": Phase.RESUMING.value, "checkpoint_ref": "ckpt-own"},
            id="waking-from-its-own-checkpoint",
        ),
        pytest.param({"deleting": True}, id="deleting"),
        pytest.param({"resume_from": None}, id="no-restore"),
    ],
)
def test_no_restore_stuck_where_the_restore_is_over_settling_or_not_asked(
    state: dict[str, Any],
) -> None:
    """Tried: the released checkpoint named by tasks that are not restoring it (restored
    and Running, Failed, paused and woken on their own checkpoint, being deleted), one
    Pending only 20 s, and a task with no ``resumeFrom``."""
    found = tasks_found(restoring(**state), activities=(heartbeat(age=5),),
                        known={**RELEASED, "ckpt-own": None})  # fmt: skip
    assert FindingKind.RESTORE_STUCK not in kinds(found)


def test_a_restore_of_a_restorable_checkpoint_waiting_is_not_stuck() -> None:
    """Tried: Pending 120 s on a restorable checkpoint (a snapshot still being cut, or a
    prune's mark: ``ReleaseStalled`` says when that lasts)."""
    assert tasks_found(restoring(), known={"ckpt-from": None}) == []


# -------------------------------------------------------------- tasks: DaemonSilent


@pytest.mark.parametrize("phase", sorted(DAEMON_PHASES))
def test_daemon_silent_when_its_heartbeat_is_old(phase: str) -> None:
    """Tried: each phase that needs a daemon, its last heartbeat 120 s old (past 45 s of
    silence plus 25 s to settle) and the phase an hour old."""
    found = tasks_found(task(phase=phase), activities=(heartbeat(age=120),))
    assert found == [
        Finding(
            FindingKind.DAEMON_SILENT, "calibantask default/task-a",
            f"phase {phase}, but its daemon's last heartbeat reached the ledger 120s ago "
            "(silent after 45s)",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_daemon_silent_boundary() -> None:
    """Tried: a heartbeat exactly at silence + settle (not yet), and one second past it."""
    edge = LIMITS.heartbeat_silent_secs + LIMITS.phase_settle_secs
    assert tasks_found(task(), activities=(heartbeat(age=edge),)) == []
    assert kinds(tasks_found(task(), activities=(heartbeat(age=edge + 1),))) == [
        FindingKind.DAEMON_SILENT
    ]


def test_heartbeat_silent_but_within_settle_is_not_reported_yet() -> None:
    """Tried: a heartbeat 50 s old, past the operator's 45 s of silence but within the
    25 s the operator has to act on it."""
    assert tasks_found(task(), activities=(heartbeat(age=50),)) == []


def test_new_task_without_heartbeat_waits_for_its_first() -> None:
    """Tried: a Provisioning task created 590 s ago with no heartbeat (image pulls); and
    the same at 601 s, which is silent."""
    young = task(phase=Phase.PROVISIONING.value, created_at=ago(590), phase_since=ago(590))
    assert tasks_found(young) == []
    old = replace(young, created_at=ago(601), phase_since=ago(601))
    found = tasks_found(old)
    assert kinds(found) == [FindingKind.DAEMON_SILENT]
    assert found[0].message == (
        "phase Provisioning, and no heartbeat from its daemon in the 601s since the phase began"
    )


def test_no_heartbeat_falls_back_to_phase_since_then_to_nothing() -> None:
    """Tried: no heartbeat and no creation time (the phase's age is used), and neither
    (nothing can be judged)."""
    assert kinds(tasks_found(task(created_at=None, phase_since=ago(700)))) == [
        FindingKind.DAEMON_SILENT
    ]
    assert tasks_found(task(created_at=None, phase_since=ago(100))) == []
    assert tasks_found(task(created_at=None, phase_since=None)) == []


@pytest.mark.parametrize(
    "phase",
    [Phase.PENDING, Phase.DRAINING, Phase.SUSPENDED, Phase.COMPLETED, Phase.FAILED, None],
)
def test_no_daemon_expected_outside_daemon_phases(phase: Phase | None) -> None:
    """Tried: a task in each phase without a daemon, its last heartbeat an hour old, and
    one with none at all."""
    value = None if phase is None else phase.value
    assert tasks_found(task(phase=value), activities=(heartbeat(age=3600, agents_live=0),)) == []
    assert tasks_found(task(phase=value, agents=0)) == []


def test_heartbeat_of_another_task_uid_counts_as_none() -> None:
    """Tried: a fresh heartbeat on the task's queue from a daemon bound to another uid;
    the task itself has had no heartbeat for its hour, so its daemon is silent."""
    found = tasks_found(task(), activities=(heartbeat(age=5, task_uid="uid-other"),))
    assert kinds(found) == [FindingKind.DAEMON_SILENT]
    assert "no heartbeat from its daemon in the 3600s since the phase began" in found[0].message


def test_heartbeat_without_uid_or_receive_stamp_counts() -> None:
    """Tried: a heartbeat with no task uid (an older daemon) and no receive stamp (a row
    from before migration 0002): its ``reported_at`` is when it arrived."""
    fresh = heartbeat(age=5, task_uid=None, received_at=None)
    assert tasks_found(task(), activities=(fresh,)) == []
    stale = heartbeat(age=5, task_uid=None, received_at=None, reported_at=ago(300))
    found = tasks_found(task(), activities=(stale,))
    assert kinds(found) == [FindingKind.DAEMON_SILENT]
    assert "300s ago" in found[0].message


def test_resuming_long_after_its_last_heartbeat_is_silent_once_it_waited() -> None:
    """Tried: a task Resuming for 700 s (past the 600 s a first heartbeat may take), its
    daemon's last heartbeat from before the pause an hour ago."""
    waking = task(phase=Phase.RESUMING.value, phase_since=ago(700), agents=0)
    found = tasks_found(waking, activities=(heartbeat(age=3600, agents_live=0),))
    assert kinds(found) == [FindingKind.DAEMON_SILENT]


def test_resuming_task_whose_new_pod_has_not_heartbeated_yet_is_not_silent() -> None:
    """Tried: a task paused an hour ago and woken 5 s ago (phase Resuming): its Sandbox's
    new pod is starting (image pull), and the ledger's heartbeat is the old pod's last,
    received an hour ago, before the pause. The operator waits for a heartbeat of this
    phase; the audit should wait as for a first heartbeat, not call the daemon silent."""
    waking = task(phase=Phase.RESUMING.value, phase_since=ago(5), agents=0)
    before_pause = heartbeat(age=3600, agents_live=0, agents_interrupted=0)
    assert tasks_found(waking, activities=(before_pause,), sandboxes=(sandbox(),)) == []


# --------------------------------------------------------- tasks: StatusDisagrees


def test_running_status_disagreeing_with_settled_heartbeat_is_found() -> None:
    """Tried: a Running task whose status says 2 agents live, its daemon's 20 s old
    heartbeat (settled, not silent) 1 live of 3 with 1 interrupted."""
    beat = heartbeat(age=20, agents_total=3, agents_live=1, agents_interrupted=1)
    found = tasks_found(task(agents=2), activities=(beat,))
    assert found == [
        Finding(
            FindingKind.STATUS_DISAGREES, "calibantask default/task-a",
            "status says 2 agents live; its daemon's heartbeat of 20s ago says 1 live of 3 "
            "(1 interrupted)",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_status_compared_with_a_fresh_heartbeat_at_check_level() -> None:
    """Tried: a 5 s old heartbeat with another agent count than the status. ``check_tasks``
    compares it (the run's confirming re-read, ``status_settle_secs`` later, is what
    spares a status that has not caught up yet: ``test_run_confirms_*`` below)."""
    found = tasks_found(task(agents=2), activities=(heartbeat(age=5, agents_live=1),))
    assert [(f.kind, f.message) for f in found] == [
        (FindingKind.STATUS_DISAGREES,
         "status says 2 agents live; its daemon's heartbeat of 5s ago says 1 live of 2 "
         "(0 interrupted)")
    ]  # fmt: skip


def test_status_not_compared_in_a_young_running_phase() -> None:
    """Tried: a task Running for 8 s, its 20 s old heartbeat (from Resuming) disagreeing."""
    young = task(agents=2, phase_since=ago(8))
    assert tasks_found(young, activities=(heartbeat(age=20, agents_live=1),)) == []


def test_status_not_compared_with_a_silent_heartbeat() -> None:
    """Tried: a heartbeat just past silence (46 s): the status no longer repeats a count
    (nothing is reported until it is DaemonSilent); and one exactly at silence (45 s),
    still compared."""
    silent = LIMITS.heartbeat_silent_secs
    assert tasks_found(task(agents=2), activities=(heartbeat(age=silent + 1, agents_live=1),)
                       ) == []  # fmt: skip
    assert kinds(tasks_found(task(agents=2), activities=(heartbeat(age=silent, agents_live=1),))
                 ) == [FindingKind.STATUS_DISAGREES]  # fmt: skip


@pytest.mark.parametrize("phase", [Phase.PROVISIONING, Phase.RESUMING, Phase.SUSPENDED])
def test_status_compared_only_when_running(phase: Phase) -> None:
    """Tried: a status disagreeing with a settled heartbeat in a phase other than Running."""
    beat = heartbeat(age=20, agents_live=0)
    found = tasks_found(task(phase=phase.value, agents=2), activities=(beat,))
    assert FindingKind.STATUS_DISAGREES not in kinds(found)


def test_status_agreeing_with_its_heartbeat_is_fine() -> None:
    """Tried: a settled heartbeat saying 2 live, the status saying 2."""
    assert tasks_found(task(agents=2), activities=(heartbeat(age=20, agents_live=2),)) == []


# ----------------------------------------------------- tasks: SuspendedNotStopped


def suspended(**overrides: Any) -> TaskState:
    """Task-a Suspended for 300 s, no agents in its status."""
    return task(**{"phase": Phase.SUSPENDED.value, "phase_since": ago(300), "agents": 0,
                   **overrides})  # fmt: skip


def test_suspended_task_with_running_sandbox_is_found() -> None:
    """Tried: Suspended for 300 s, its Sandbox not suspended, no pod, no heartbeat since."""
    found = tasks_found(suspended(), sandboxes=(sandbox(suspended=False),),
                        activities=(heartbeat(age=300, agents_live=0),))  # fmt: skip
    assert found == [
        Finding(
            FindingKind.SUSPENDED_NOT_STOPPED, "calibantask default/task-a",
            "phase Suspended for 300s, but its Sandbox default/task-a-sbx is not suspended",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_suspended_task_with_pods_still_running_is_found() -> None:
    """Tried: Suspended, its Sandbox suspended, but two pods it controls not terminating."""
    found = tasks_found(
        suspended(), sandboxes=(sandbox(suspended=True),),
        pods=(pod("task-a-1"), pod("task-a-0")),
    )  # fmt: skip
    assert kinds(found) == [FindingKind.SUSPENDED_NOT_STOPPED]
    assert found[0].message == "phase Suspended for 300s, but pod task-a-0, task-a-1 still runs"


def test_suspended_task_whose_daemon_still_reports_live_agents_is_found() -> None:
    """Tried: Suspended for 300 s, and a heartbeat 10 s ago (275 s after the suspension)
    saying 2 agents live."""
    found = tasks_found(suspended(), sandboxes=(sandbox(suspended=True),),
                        activities=(heartbeat(age=10, agents_live=2),))  # fmt: skip
    assert kinds(found) == [FindingKind.SUSPENDED_NOT_STOPPED]
    assert found[0].message == (
        "phase Suspended for 300s, but its daemon reported 2 live agents 10s ago"
    )


def test_a_completed_task_still_running_is_found_as_a_suspended_one_is() -> None:
    """Tried: Completed for 300 s (its compute released, as a pause releases it), its
    Sandbox not suspended and a pod it controls still running."""
    found = tasks_found(
        suspended(phase=Phase.COMPLETED.value), sandboxes=(sandbox(suspended=False),),
        pods=(pod("task-a-0"),),
    )  # fmt: skip
    assert kinds(found) == [FindingKind.SUSPENDED_NOT_STOPPED]
    assert found[0].message == (
        "phase Completed for 300s, but its Sandbox default/task-a-sbx is not suspended; pod "
        "task-a-0 still runs"
    )


def test_a_completed_task_stopped_is_fine() -> None:
    """Tried: Completed for 300 s, its Sandbox suspended, no pod, no heartbeat since."""
    found = tasks_found(suspended(phase=Phase.COMPLETED.value),
                        sandboxes=(sandbox(suspended=True),),
                        activities=(heartbeat(age=300, agents_live=0),))  # fmt: skip
    assert found == []


def test_suspended_not_stopped_names_every_problem_in_one_finding() -> None:
    """Tried: all three at once: one finding, the problems joined."""
    found = tasks_found(suspended(), sandboxes=(sandbox(suspended=False),),
                        pods=(pod("task-a-0"),), activities=(heartbeat(age=10),))  # fmt: skip
    assert len(found) == 1
    assert found[0].message == (
        "phase Suspended for 300s, but its Sandbox default/task-a-sbx is not suspended; pod "
        "task-a-0 still runs; its daemon reported 2 live agents 10s ago"
    )


def test_suspended_within_settle_is_not_judged() -> None:
    """Tried: Suspended for 20 s (within 25 s) with its Sandbox unsuspended, its pod
    running and live agents reported: the operator is still suspending it."""
    young = suspended(phase_since=ago(20))
    assert tasks_found(young, sandboxes=(sandbox(suspended=False),), pods=(pod("task-a-0"),),
                       activities=(heartbeat(age=1),)) == []  # fmt: skip
    edge = suspended(phase_since=ago(LIMITS.phase_settle_secs))
    assert tasks_found(edge, sandboxes=(sandbox(suspended=False),)) == []


def test_suspended_and_stopped_is_fine() -> None:
    """Tried: the healthy suspended task: Sandbox suspended, its pod terminating, another
    Sandbox's pod running, the drain's last heartbeat (live agents, 10 s after the
    suspension) and a later one saying none live."""
    terminating = pod("task-a-0", terminating=True)
    foreign = pod("task-b-0", pvc="task-b-workspace", controller_uid="sbx-task-b")
    assert tasks_found(suspended(), sandboxes=(sandbox(suspended=True),),
                       pods=(terminating, foreign),
                       activities=(heartbeat(age=290, agents_live=2),)) == []  # fmt: skip
    assert tasks_found(suspended(), sandboxes=(sandbox(suspended=True),),
                       activities=(heartbeat(age=10, agents_live=0),)) == []  # fmt: skip


def test_suspended_task_without_sandbox_is_fine() -> None:
    """Tried: a Suspended task whose Sandbox is gone altogether."""
    assert tasks_found(suspended()) == []


def test_live_agents_reported_long_ago_are_not_running_now() -> None:
    """Tried: Suspended for 600 s, a heartbeat 100 s ago (silent now) saying 2 live: the
    daemon is not reporting live agents any more."""
    assert tasks_found(suspended(phase_since=ago(600)), sandboxes=(sandbox(suspended=True),),
                       activities=(heartbeat(age=100),)) == []  # fmt: skip


def test_pods_of_a_sandbox_owned_by_another_task_do_not_count() -> None:
    """Tried: a Suspended task-a; the running pod belongs to a Sandbox task-b owns."""
    other = sandbox("task-b", uid="sbx-task-b", owner_uid="uid-task-b")
    found = tasks_found(suspended(), task("task-b"), sandboxes=(sandbox(suspended=True), other),
                        pods=(pod("task-b-0", controller_uid="sbx-task-b"),),
                        activities=(heartbeat("task-b", age=5, task_uid="uid-task-b"),),
                        )  # fmt: skip
    assert found == []


# ----------------------------------------------------------------- daemons: duplicate


def test_two_pods_on_one_workspace_are_a_duplicate_daemon() -> None:
    """Tried: two running pods mounting task-a's PVC (owned by task-a)."""
    cluster = Cluster(tasks=[task()], pvcs=[pvc(owner_uids=(UID,))],
                      pods=[pod("task-a-1"), pod("task-a-0")])  # fmt: skip
    assert check_daemons(cluster, {}, NOW, LIMITS) == [
        Finding(
            FindingKind.DUPLICATE_DAEMON, "pvc default/task-a-workspace",
            "2 pods mount workspace PVC task-a-workspace: task-a-0, task-a-1; two daemons on "
            "one store overwrite each other's sessions",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_a_terminating_pod_beside_a_running_one_is_still_a_duplicate() -> None:
    """Tried: the old pod terminating (its daemon may still write) and its replacement
    running on the same PVC."""
    cluster = Cluster(tasks=[task()], pvcs=[pvc(owner_uids=(UID,))],
                      pods=[pod("old", terminating=True), pod("new")])  # fmt: skip
    found = check_daemons(cluster, {}, NOW, LIMITS)
    assert kinds(found) == [FindingKind.DUPLICATE_DAEMON]
    assert "2 pods mount workspace PVC task-a-workspace: new, old (terminating)" in found[0].message


def test_duplicate_daemon_on_a_pvc_no_live_task_owns_names_no_task() -> None:
    """Tried: three pods on a workspace PVC whose owner is not a live task, and two on a
    PVC not listed (so not known as a workspace: not the audit's business)."""
    cluster = Cluster(pvcs=[pvc(owner_uids=("uid-gone",))],
                      pods=[pod("p1"), pod("p2"), pod("p3"), pod("q1", pvc="unlisted"),
                            pod("q2", pvc="unlisted")])  # fmt: skip
    found = check_daemons(cluster, {}, NOW, LIMITS)
    assert [(f.subject, f.task) for f in found] == [
        ("pvc default/task-a-workspace", None),
    ]  # fmt: skip
    assert found[0].message.startswith("3 pods mount workspace PVC task-a-workspace: p1, p2, p3")


def test_one_pod_per_workspace_is_fine() -> None:
    """Tried: one pod per PVC, including a PVC of the same name in another namespace."""
    cluster = Cluster(tasks=[task()], pvcs=[pvc(owner_uids=(UID,))],
                      pods=[pod("task-a-0"), pod("twin", namespace="other")])  # fmt: skip
    assert check_daemons(cluster, {}, NOW, LIMITS) == []


def test_two_pods_sharing_a_pvc_that_is_no_workspace_are_not_daemons() -> None:
    """Tried: an unrelated two-replica app sharing a ReadWriteMany PVC that the operator
    never labelled as a workspace (``PvcState.workspace`` False): no daemon is involved,
    yet it is reported as a DuplicateDaemon on a "workspace PVC"."""
    cluster = Cluster(pvcs=[pvc("shared-cache", workspace=False)],
                      pods=[pod("web-0", pvc="shared-cache", controller_uid="rs-web"),
                            pod("web-1", pvc="shared-cache", controller_uid="rs-web")])  # fmt: skip
    assert check_daemons(cluster, {}, NOW, LIMITS) == []


# --------------------------------------------------------------- daemons: queue


def test_sandbox_started_with_another_tasks_queue_is_found() -> None:
    """Tried: task-a's Sandbox whose daemon consumes task-b's queue."""
    cluster = Cluster(tasks=[task()], sandboxes=[sandbox(queue="caliband.default.task-b")])
    assert check_daemons(cluster, {}, NOW, LIMITS) == [
        Finding(
            FindingKind.QUEUE_MISMATCH, "sandbox default/task-a-sbx",
            "the daemon of task default/task-a is started with --queue caliband.default.task-b "
            "(its task's queue is caliband.default.task-a)",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_sandbox_started_with_another_uid_and_queue_is_one_finding() -> None:
    """Tried: a wrong ``--task-uid`` alone, then with a wrong ``--queue`` too."""
    cluster = Cluster(tasks=[task()], sandboxes=[sandbox(task_uid="uid-old")])
    found = check_daemons(cluster, {}, NOW, LIMITS)
    assert [f.message for f in found] == [
        "the daemon of task default/task-a is started with --task-uid uid-old (its task's uid "
        "is uid-task-a)"
    ]
    cluster.sandboxes = [sandbox(task_uid="uid-old", queue="caliband.x.y")]
    found = check_daemons(cluster, {}, NOW, LIMITS)
    assert len(found) == 1
    assert found[0].message == (
        "the daemon of task default/task-a is started with --queue caliband.x.y (its task's "
        "queue is caliband.default.task-a) and --task-uid uid-old (its task's uid is uid-task-a)"
    )


@pytest.mark.parametrize(
    "sbx",
    [
        sandbox(),
        sandbox(queue=None, task_uid=None),
        sandbox(owner_uid=None, queue="caliband.x.y"),
        sandbox(owner_uid="uid-gone", task_uid="uid-other"),
    ],
    ids=["its-own", "no-args", "unowned", "owner-gone"],
)
def test_sandbox_bound_to_its_own_task_or_to_none_is_fine(sbx: SandboxState) -> None:
    """Tried: the right arguments, no arguments to compare, and Sandboxes no live task owns."""
    assert check_daemons(Cluster(tasks=[task()], sandboxes=[sbx]), {}, NOW, LIMITS) == []


def test_task_whose_name_cannot_be_a_queue_is_skipped() -> None:
    """Tried: a task named so that it has no daemon queue (upper case)."""
    bad = task("Task_A", uid="uid-bad")
    cluster = Cluster(tasks=[bad], sandboxes=[sandbox("Task_A", owner_uid="uid-bad",
                                                      queue="anything")])  # fmt: skip
    assert check_daemons(cluster, {}, NOW, LIMITS) == []


def test_heartbeat_with_another_uid_on_a_tasks_queue_is_found() -> None:
    """Tried: a 5 s old heartbeat on task-a's queue from a daemon bound to uid-old."""
    cluster = Cluster(tasks=[task()])
    found = check_daemons(cluster, by_task(heartbeat(age=5, task_uid="uid-old")), NOW, LIMITS)
    assert found == [
        Finding(
            FindingKind.QUEUE_MISMATCH, "queue default/task-a",
            "a daemon bound to task uid uid-old heartbeats on task default/task-a's queue 5s "
            "ago; the task's uid is uid-task-a",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_old_foreign_heartbeat_is_not_a_queue_mismatch() -> None:
    """Tried: a foreign-uid heartbeat older than the silence threshold (a previous task of
    that name, long gone), one exactly at it (still reported), and the same fresh one on
    a deleting task, on no task, and without a uid."""
    silent = LIMITS.heartbeat_silent_secs
    cluster = Cluster(tasks=[task()])
    assert check_daemons(cluster, by_task(heartbeat(age=silent + 1, task_uid="uid-old")),
                         NOW, LIMITS) == []  # fmt: skip
    assert kinds(check_daemons(cluster, by_task(heartbeat(age=silent, task_uid="uid-old")),
                               NOW, LIMITS)) == [FindingKind.QUEUE_MISMATCH]  # fmt: skip
    fresh = by_task(heartbeat(age=5, task_uid="uid-old"))
    assert check_daemons(Cluster(tasks=[task(deleting=True)]), fresh, NOW, LIMITS) == []
    assert check_daemons(Cluster(), fresh, NOW, LIMITS) == []
    assert check_daemons(cluster, by_task(heartbeat(age=5, task_uid=None)), NOW, LIMITS) == []
    assert check_daemons(cluster, by_task(heartbeat(age=5)), NOW, LIMITS) == []


# ----------------------------------------------------------------------- operations


def test_operation_overdue_past_its_slack_is_found() -> None:
    """Tried: a delete-drain still draining 600 s past its deadline, its task live."""
    op = operation(deadline_at=ago(600))
    found = check_operations([op], [], NOW, LIMITS, {(NS, "task-a"): task()})
    assert found == [
        Finding(
            FindingKind.OPERATION_OVERDUE, "operation op-1",
            "delete-drain of default/task-a is still draining 600s past its deadline; the "
            "deadline sweeper (drainctl worker) closes such operations within 60s",
            NS, "task-a",
        )
    ]  # fmt: skip


def test_operation_overdue_by_less_than_the_slack_is_not_reported() -> None:
    """Tried: 30 s past the deadline, exactly 60 s past it (the sweeper still has time),
    and no deadline at all; then 61 s past, found."""
    live = {(NS, "task-a"): task()}
    for secs in (30.0, LIMITS.overdue_slack_secs):
        assert check_operations([operation(deadline_at=ago(secs))], [], NOW, LIMITS, live) == []
    assert check_operations([operation(deadline_at=None)], [], NOW, LIMITS, live) == []
    late = operation(deadline_at=ago(LIMITS.overdue_slack_secs + 1))
    assert kinds(check_operations([late], [], NOW, LIMITS, live)) == [FindingKind.OPERATION_OVERDUE]


def test_overdue_operation_of_a_recreated_or_gone_task_names_no_task() -> None:
    """Tried: the operation's task gone, and replaced by a task of the same name with
    another uid: the finding is raised on no task."""
    op = operation(deadline_at=ago(600))
    assert check_operations([op], [], NOW, LIMITS, {})[0].task is None
    recreated = {(NS, "task-a"): task(uid="uid-new")}
    found = check_operations([op], [], NOW, LIMITS, recreated)
    assert [(f.kind, f.namespace, f.task) for f in found] == [
        (FindingKind.OPERATION_OVERDUE, NS, None)
    ]


def test_drain_record_problems_become_findings() -> None:
    """Tried: the ledger's two kinds of problem line; each is one DrainRecord finding,
    its subject what the line is about."""
    problems = [
        DrainRecordProblem(
            "operation op-9",
            "operation op-9 (delete-drain of default/task-a) is recorded but the ledger holds "
            "no checkpoint for it",
        ),
        DrainRecordProblem(
            "task default/task-b",
            "task default/task-b (uid uid-b) has 2 deletion checkpoints, one deletion records "
            "one: ckpt-1, ckpt-2",
        ),
    ]
    found = check_operations([], problems, NOW, LIMITS, {})
    assert found == [
        Finding(FindingKind.DRAIN_RECORD, "ledger: operation op-9", problems[0].message),
        Finding(FindingKind.DRAIN_RECORD, "ledger: task default/task-b", problems[1].message),
    ]


# ------------------------------------------------------------ checkpoint workspaces


def test_ready_snapshot_present_is_fine_even_without_its_pvc() -> None:
    """Tried: a checkpoint whose ready snapshot exists, its retained PVC deleted."""
    assert check_checkpoint_workspaces([with_snapshot()], Cluster(snapshots=[snapshot()])) == []


def test_ready_snapshot_gone_with_its_pvc_left_is_snapshot_missing() -> None:
    """Tried: the ledger's ready snapshot absent, the retained PVC present."""
    found = check_checkpoint_workspaces([with_snapshot()], Cluster(pvcs=[pvc()]))
    assert found == [
        Finding(
            FindingKind.SNAPSHOT_MISSING, "checkpoint ckpt-1",
            "checkpoint of task default/task-a: the ledger says VolumeSnapshot snap-1 is ready, "
            "and there is none; only its retained PVC task-a-workspace is left",
            NS,
        )
    ]  # fmt: skip


def test_ready_snapshot_and_pvc_both_gone_is_workspace_missing() -> None:
    """Tried: neither the snapshot nor the PVC exists; a terminating snapshot and PVC
    count as gone."""
    gone = Cluster(snapshots=[snapshot(terminating=True)], pvcs=[pvc(terminating=True)])
    found = check_checkpoint_workspaces([with_snapshot()], gone)
    assert found == [
        Finding(
            FindingKind.WORKSPACE_MISSING, "checkpoint ckpt-1",
            "checkpoint of task default/task-a: neither its VolumeSnapshot snap-1 nor its "
            "workspace PVC task-a-workspace exists; the ledger still calls it restorable",
            NS,
        )
    ]  # fmt: skip


def test_snapshots_not_served_are_not_judged() -> None:
    """Tried: a cluster that serves no VolumeSnapshot API: a snapshot-bearing checkpoint
    is not reported, with or without its PVC."""
    unserved = Cluster(pvcs=[pvc()], snapshots_served=False)
    assert check_checkpoint_workspaces([with_snapshot()], unserved) == []
    assert check_checkpoint_workspaces([with_snapshot()], Cluster(snapshots_served=False)) == []


def test_snapshot_of_another_namespace_does_not_count() -> None:
    """Tried: a snapshot of the right name in another namespace, and the PVC likewise."""
    elsewhere = Cluster(snapshots=[snapshot(namespace="other")], pvcs=[pvc(namespace="other")])
    assert kinds(check_checkpoint_workspaces([with_snapshot()], elsewhere)) == [
        FindingKind.WORKSPACE_MISSING
    ]


def test_snapshotless_checkpoint_whose_pvc_exists_is_fine() -> None:
    """Tried: no snapshot, the PVC there; a snapshot asked for but not ready (the PVC is
    all a restore uses); and a checkpoint naming no PVC at all."""
    cluster = Cluster(pvcs=[pvc()])
    pending = checkpoint(snapshot_name="snap-1", snapshot_ready_at=None)
    failed = checkpoint(snapshot_name="snap-1", snapshot_error="never ready")
    assert check_checkpoint_workspaces([checkpoint(), pending, failed], cluster) == []
    assert check_checkpoint_workspaces([checkpoint(pvc_name=None)], Cluster()) == []


def test_a_snapshot_on_its_way_holds_the_checkpoint_whatever_became_of_its_pvc() -> None:
    """Tried: a snapshot cut and not ready, its retained PVC since deleted (the
    external-snapshotter removes a snapshot's source PVC only once the snapshot is
    ready): the VolumeSnapshot is the workspace."""
    pending = checkpoint(snapshot_name="snap-1", snapshot_cut_at=ago(30))
    assert check_checkpoint_workspaces([pending], Cluster(snapshots=[snapshot()])) == []


def test_a_snapshot_on_its_way_gone_with_its_pvc_is_workspace_missing() -> None:
    pending = checkpoint(snapshot_name="snap-1", snapshot_cut_at=ago(30))
    gone = Cluster(snapshots=[snapshot(terminating=True)])
    assert check_checkpoint_workspaces([pending], gone) == [
        Finding(
            FindingKind.WORKSPACE_MISSING, "checkpoint ckpt-1",
            "checkpoint of task default/task-a: neither its VolumeSnapshot snap-1, which the "
            "ledger says is on its way, nor its workspace PVC task-a-workspace exists; the "
            "ledger still calls it restorable",
            NS,
        )
    ]  # fmt: skip


def unsettled(cut_secs_ago: float | None, checkpoint_secs_ago: float) -> UnsettledSnapshotView:
    """Checkpoint ckpt-1 of task-a, taken ``checkpoint_secs_ago``, its snapshot snap-1 cut
    ``cut_secs_ago`` (None: not cut) and neither ready nor failed."""
    return UnsettledSnapshotView(
        id=1, ref="ckpt-1", task_uid=UID, namespace=NS, name="task-a",
        pvc_name="task-a-workspace", created_at=ago(checkpoint_secs_ago), snapshot_name="snap-1",
        snapshot_cut_at=None if cut_secs_ago is None else ago(cut_secs_ago),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("pending", "late"),
    [
        pytest.param(unsettled(None, 10), False, id="just-asked"),
        pytest.param(unsettled(None, 400), False, id="not-cut-at-its-deadline"),
        pytest.param(unsettled(None, 401), True, id="not-cut-past-its-deadline"),
        pytest.param(unsettled(3000, 3005), False, id="cut-uploading-for-50-minutes"),
        pytest.param(unsettled(3635, 3640), False, id="cut-at-its-ready-deadline"),
        pytest.param(unsettled(3636, 3641), True, id="cut-past-its-ready-deadline"),
    ],
)  # fmt: skip
def test_a_pending_snapshot_is_no_finding_until_its_deadline(
    pending: UnsettledSnapshotView, late: bool
) -> None:
    """The defaults: 300 s to the cut (+ 60 s left to its pass + 40 s for the follower
    to see it), 3600 s to ready (+ 40 s), both from the checkpoint."""
    found = check_snapshots([pending], NOW, LIMITS, {})
    assert kinds(found) == ([FindingKind.SNAPSHOT_OVERDUE] if late else [])


def test_a_snapshot_that_never_came_is_a_finding_on_its_task() -> None:
    """Tried: snapshots the ledger still calls on their way long past their deadlines, one
    of a live task (the finding is raised on it), one cut, of a task since deleted."""
    live = {(NS, "task-a"): task()}
    never_cut = check_snapshots([unsettled(None, 1000)], NOW, LIMITS, live)
    assert never_cut == [
        Finding(
            FindingKind.SNAPSHOT_OVERDUE, "checkpoint ckpt-1",
            "of task default/task-a: the ledger still says its VolumeSnapshot snap-1 is on its "
            "way (not cut) 400s after the checkpoint, 600s past the moment the operator "
            "records such a snapshot failed; is the operator running (with --manage-sandbox)?",
            NS, "task-a",
        )
    ]  # fmt: skip
    never_ready = check_snapshots([unsettled(7190, 7200)], NOW, LIMITS, {})
    assert never_ready == [
        Finding(
            FindingKind.SNAPSHOT_OVERDUE, "checkpoint ckpt-1",
            "of task default/task-a: the ledger still says its VolumeSnapshot snap-1 is on its "
            "way (cut at 2026-12-02T10:00:10Z and not readyToUse) 3640s after the checkpoint, "
            "3560s past the moment the operator records such a snapshot failed; is the "
            "operator running (with --manage-sandbox)?",
            NS,
        )
    ]  # fmt: skip


def test_snapshotless_checkpoint_whose_pvc_is_gone_is_workspace_missing() -> None:
    """Tried: no snapshot, and the PVC deleted (then terminating)."""
    expected = [
        Finding(
            FindingKind.WORKSPACE_MISSING, "checkpoint ckpt-1",
            "checkpoint of task default/task-a: its workspace PVC default/task-a-workspace does "
            "not exist and it has no snapshot; the ledger still calls it restorable",
            NS,
        )
    ]  # fmt: skip
    assert check_checkpoint_workspaces([checkpoint()], Cluster()) == expected
    assert check_checkpoint_workspaces([checkpoint()], Cluster(pvcs=[pvc(terminating=True)])
                                       ) == expected  # fmt: skip


def test_each_checkpoint_is_judged_on_its_own() -> None:
    """Tried: three checkpoints, one fine, two missing their workspaces differently."""
    fine = checkpoint("ckpt-ok", pvc_name="ok-pvc")
    no_pvc = checkpoint("ckpt-nopvc", pvc_name="gone-pvc")
    no_snap = with_snapshot("snap-gone", ref="ckpt-nosnap", pvc_name="ok-pvc")
    found = check_checkpoint_workspaces([fine, no_pvc, no_snap], Cluster(pvcs=[pvc("ok-pvc")]))
    assert [(f.kind, f.subject) for f in found] == [
        (FindingKind.WORKSPACE_MISSING, "checkpoint ckpt-nopvc"),
        (FindingKind.SNAPSHOT_MISSING, "checkpoint ckpt-nosnap"),
    ]


# ------------------------------------------------------------------------- sessions


def test_sessions_as_recorded_are_fine() -> None:
    """Tried: every agent's session reads the ledger's turns and sha256; an agent whose
    session was not read is not judged."""
    ckpt = checkpoint(agents=(agent("a1"), agent("a2", turns=5, sha=SHA_B)))
    readings = {"a1": SessionReading(3, SHA_A), "a2": SessionReading(5, SHA_B)}
    assert check_sessions(ckpt, "VolumeSnapshot snap-1", readings) == []
    assert check_sessions(ckpt, "VolumeSnapshot snap-1", {}) == []


def test_session_edited_is_a_mismatch() -> None:
    """Tried: the same turns but another sha256; and fewer turns (rolled back)."""
    ckpt = checkpoint()
    found = check_sessions(ckpt, "retained PVC task-a-workspace", {"a1": SessionReading(3, SHA_B)})
    assert found == [
        Finding(
            FindingKind.SESSION_MISMATCH, "checkpoint ckpt-1",
            "agent a1's session in retained PVC task-a-workspace holds 3 turns (sha256 "
            "bbbbbbbbbbbb), the ledger recorded 3 (sha256 aaaaaaaaaaaa)",
            NS,
        )
    ]  # fmt: skip
    rolled_back = check_sessions(ckpt, "here", {"a1": SessionReading(2, SHA_A)})
    assert kinds(rolled_back) == [FindingKind.SESSION_MISMATCH]
    assert "holds 2 turns" in rolled_back[0].message


def test_session_recorded_without_sha_compares_as_none() -> None:
    """Tried: an agent the ledger recorded with no sha256 (it never saved a session), and
    a session found there after all."""
    ckpt = checkpoint(agents=(agent(turns=0, sha=None),))
    found = check_sessions(ckpt, "here", {"a1": SessionReading(0, SHA_A)})
    assert [f.message for f in found] == [
        "agent a1's session in here holds 0 turns (sha256 aaaaaaaaaaaa), the ledger recorded 0 "
        "(sha256 None)"
    ]
    assert check_sessions(ckpt, "here", {"a1": SessionReading(0, None)}) == []


def test_no_session_where_the_ledger_recorded_none_is_no_mismatch() -> None:
    """Tried: an agent recorded with 0 turns and no sha256 (drained before it saved
    anything, as checkpoints taken before such agents were left out hold them) whose
    session file is missing: nothing was recorded, nothing is lost. The same missing file
    for an agent recorded with turns is a mismatch."""
    never = checkpoint(agents=(agent("a1", turns=0, sha=None), agent("a2")))
    readings = {"a1": SessionReading.missing(), "a2": SessionReading(3, SHA_A)}
    assert check_sessions(never, "VolumeSnapshot snap-1", readings) == []
    lost = check_sessions(never, "here", {"a2": SessionReading.missing()})
    assert [f.message for f in lost] == ["agent a2's session in here is missing"]


def test_unreadable_session_is_a_mismatch_saying_why() -> None:
    """Tried: a reading that failed; its error is the reason."""
    failed = {"a1": SessionReading(None, None, "is unreadable (not JSON)")}
    found = check_sessions(checkpoint(), "VolumeSnapshot snap-1", failed)
    assert [(f.kind, f.message) for f in found] == [
        (FindingKind.SESSION_MISMATCH,
         "agent a1's session in VolumeSnapshot snap-1 is unreadable (not JSON)")
    ]  # fmt: skip


def test_several_agents_mismatching_are_one_finding() -> None:
    """Tried: three agents, two wrong (one edited, one missing): one finding naming both."""
    ckpt = checkpoint(agents=(agent("a1"), agent("a2"), agent("a3")))
    readings = {
        "a1": SessionReading(4, SHA_B), "a2": SessionReading(3, SHA_A),
        "a3": SessionReading(None, None, "is missing"),
    }  # fmt: skip
    found = check_sessions(ckpt, "here", readings)
    assert found == [
        Finding(
            FindingKind.SESSION_MISMATCH, "checkpoint ckpt-1",
            "agent a1's session in here holds 4 turns (sha256 bbbbbbbbbbbb), the ledger "
            "recorded 3 (sha256 aaaaaaaaaaaa); agent a3's session in here is missing",
            NS,
        )
    ]  # fmt: skip


# -------------------------------------------------------------------------- orphans


def test_workspace_pvc_nothing_refers_to_is_an_orphan() -> None:
    """Tried: a workspace PVC owned by a task that is gone, and one owned by nothing."""
    cluster = Cluster(tasks=[task()], pvcs=[pvc("old", owner_uids=("uid-gone",)), pvc("bare")])
    assert check_orphans(cluster, set(), set()) == [
        Finding(
            FindingKind.ORPHAN_PVC, "pvc default/old",
            "a workspace PVC no live task owns and no restorable checkpoint names: storage "
            "nothing will restore or release",
            NS,
        ),
        Finding(
            FindingKind.ORPHAN_PVC, "pvc default/bare",
            "a workspace PVC no live task owns and no restorable checkpoint names: storage "
            "nothing will restore or release",
            NS,
        ),
    ]  # fmt: skip


def test_pvcs_that_are_owned_referenced_or_not_workspaces_are_no_orphans() -> None:
    """Tried: a PVC owned by a live task (among other owners), one a restorable
    checkpoint names, one terminating, and one that is no workspace."""
    cluster = Cluster(
        tasks=[task()],
        pvcs=[pvc("owned", owner_uids=("uid-gone", UID)), pvc("kept"),
              pvc("going", terminating=True), pvc("data", workspace=False)],
    )  # fmt: skip
    assert check_orphans(cluster, {(NS, "kept")}, set()) == []


def test_pvc_referenced_in_another_namespace_is_still_an_orphan() -> None:
    """Tried: the ledger names a PVC of the same name in another namespace."""
    cluster = Cluster(pvcs=[pvc("kept")])
    assert kinds(check_orphans(cluster, {("other", "kept")}, set())) == [FindingKind.ORPHAN_PVC]


def test_checkpoint_snapshot_nothing_refers_to_is_an_orphan() -> None:
    """Tried: a snapshot labelled for checkpoint ckpt-1, which no restorable checkpoint
    names."""
    cluster = Cluster(snapshots=[snapshot()])
    assert check_orphans(cluster, set(), set()) == [
        Finding(
            FindingKind.ORPHAN_SNAPSHOT, "volumesnapshot default/snap-1",
            "taken for checkpoint ckpt-1, which the ledger does not hold as restorable with "
            "this snapshot: storage nothing will restore or release",
            NS,
        )
    ]  # fmt: skip


def test_snapshots_referenced_unlabelled_or_terminating_are_no_orphans() -> None:
    """Tried: a referenced snapshot, one not taken for a checkpoint (no label), and one
    terminating."""
    cluster = Cluster(snapshots=[snapshot("kept"), snapshot("user", checkpoint=None),
                                 snapshot("going", terminating=True)])  # fmt: skip
    assert check_orphans(cluster, set(), {(NS, "kept")}) == []


# ------------------------------------------------------------------------- rotation


@pytest.mark.parametrize(
    ("total", "batch", "interval", "full_pass", "share"),
    [
        (100_000, 2000, 60, 3600, 2000),
        (1_000_000, 2000, 60, 3600, math.ceil(1_000_000 / 60)),
        (1_000_000, 2000, 60, 3600, 16_667),
        (120_001, 2000, 60, 3600, 2001),
        (0, 2000, 60, 3600, 2000),
        (10, 1, 60, 3600, 1),
        (500, 1, 60, 3600, 9),
        (5000, 100, 600, 60, 5000),
        (5000, 100, 60, 60, 5000),
    ],
)
def test_rotation_share(total: int, batch: int, interval: float, full_pass: float,
                        share: int) -> None:  # fmt: skip
    """Tried: the batch as a floor, the share a full pass within ``full_pass`` needs, and a
    full pass no longer than one interval (everything each run)."""
    assert Rotation.share(total, batch, interval, full_pass) == share


def test_rotation_share_covers_every_checkpoint_within_the_full_pass() -> None:
    """Tried: for many totals, runs every 60 s over 3600 s take at least the total."""
    for total in (1, 59, 60, 61, 119_999, 120_000, 120_001, 7_777_777):
        assert 60 * Rotation.share(total, 2000, 60, 3600) >= total


# ------------------------------------------------------------ runner: confirmation


class ScriptedAuditor(Auditor):
    """An ``Auditor`` on a real (SQLite) ledger that reads the given clusters in turn
    instead of the Kubernetes API, and records its sleeps instead of sleeping."""

    def __init__(self, ledger: Ledger, *clusters: Cluster) -> None:
        self.slept: list[float] = []
        super().__init__(ledger, Settings(), kubernetes=True, sleep=self.slept.append)
        self.reads = list(clusters)

    def cluster(self) -> Cluster:
        return self.reads.pop(0)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    ledger = Ledger.from_url(url)
    yield ledger
    ledger.dispose()


def live_cluster(agents: int) -> Cluster:
    """Task-a Running for an hour (by the real clock), ``agents`` in its status, its
    Sandbox and PVC as the operator makes them."""
    now = datetime.now(UTC)
    running = task(agents=agents, phase_since=now - timedelta(hours=1),
                   created_at=now - timedelta(hours=2))  # fmt: skip
    return Cluster(tasks=[running], sandboxes=[sandbox()], pvcs=[pvc(owner_uids=(UID,))],
                   pods=[pod("task-a-0")])  # fmt: skip


def one_live_of_two(ledger: Ledger) -> None:
    now = datetime.now(UTC)
    ledger.record_activity(NS, "task-a", task_uid=UID, all_idle_since=None, agents_total=2,
                           agents_live=1, agents_idle=0, seq=1, reported_at=now,
                           idle_for_secs=None, received_at=now)  # fmt: skip


def test_run_confirms_a_status_that_caught_up_is_no_finding(ledger: Ledger) -> None:
    """Tried: a run whose first read sees status 2 agents against a fresh heartbeat of 1
    live, and whose confirming read ``status_settle_secs`` later sees the status caught up
    (1): nothing is reported."""
    auditor = ScriptedAuditor(ledger, live_cluster(2), live_cluster(1))
    one_live_of_two(ledger)
    report = auditor.run()
    assert report.findings == []
    assert auditor.slept == [LIMITS.status_settle_secs]
    assert report.counts["heartbeats"] == 1
    assert report.counts["tasks"] == 1


def test_run_confirms_a_disagreement_seen_twice(ledger: Ledger) -> None:
    """Tried: the same disagreement on both reads: one StatusDisagrees finding."""
    auditor = ScriptedAuditor(ledger, live_cluster(2), live_cluster(2))
    one_live_of_two(ledger)
    report = auditor.run()
    assert [(f.kind, f.subject) for f in report.findings] == [
        (FindingKind.STATUS_DISAGREES, "calibantask default/task-a")
    ]
    assert report.as_json()["by_kind"]["StatusDisagrees"] == 1


def test_run_without_findings_does_not_wait_to_confirm(ledger: Ledger) -> None:
    """Tried: a healthy read (status 1, heartbeat 1 live): clean, no second read."""
    auditor = ScriptedAuditor(ledger, live_cluster(1))
    one_live_of_two(ledger)
    report = auditor.run()
    assert report.clean
    assert auditor.slept == []
    assert auditor.reads == []


# ----------------------------------------------------------------------- releases


def test_a_prune_mark_older_than_the_bound_is_a_finding_a_fresh_one_is_not() -> None:
    """Tried: a checkpoint marked as being released 601 s ago (a prune that stopped) and
    one marked 5 s ago (a prune at work)."""
    old = checkpoint("ckpt-old", releasing_since=ago(RELEASE_STALLED_SECS + 1))
    fresh = checkpoint("ckpt-fresh", releasing_since=ago(5))
    found = check_releases([old, fresh], NOW)
    assert [(f.kind, f.subject) for f in found] == [
        (FindingKind.RELEASE_STALLED, "checkpoint ckpt-old")
    ]
    assert "a restore of it waits until drainctl ledger prune runs again" in found[0].message


# ------------------------------------------------------------------ task children


def children_found(*tasks: TaskState, pvcs: tuple[PvcState, ...] = (),
                   sandboxes: tuple[SandboxState, ...] = ()) -> list[Finding]:  # fmt: skip
    cluster = Cluster(tasks=list(tasks), pvcs=list(pvcs), sandboxes=list(sandboxes))
    return check_task_children(cluster, NOW, LIMITS)


def test_a_running_task_whose_pvc_or_sandbox_is_gone_is_a_finding() -> None:
    """Tried: a Running task whose workspace PVC was deleted, one whose PVC is being
    deleted (a pod keeps it until it goes), and one whose Sandbox was deleted; each is
    named once, with what is gone."""
    named = crd.sandbox_name
    gone = task("gone", sandbox_name=named("gone"))
    going = task("going", sandbox_name=named("going"))
    bare = task("bare", sandbox_name=named("bare"))
    found = children_found(
        gone, going, bare,
        pvcs=(pvc("going-workspace", terminating=True), pvc("bare-workspace")),
        sandboxes=(sandbox("gone"), sandbox("going")),
    )  # fmt: skip
    assert kinds(found) == [FindingKind.TASK_CHILD_GONE] * 3
    messages = {f.task: f.message for f in found}
    assert "its workspace PVC gone-workspace does not exist" in messages["gone"]
    assert "its workspace PVC going-workspace is being deleted" in messages["going"]
    assert f"its Sandbox {named('bare')} does not exist" in messages["bare"]
    assert all(m.startswith("phase Running for 3600s, but ") for m in messages.values())


def test_a_suspended_task_whose_pvc_is_gone_is_a_finding_its_gone_sandbox_is_not() -> None:
    """A wake of it could only fail: its workspace is gone. Its Sandbox may be gone (a
    wake makes it again). Tried both."""
    without_pvc = task("paused", phase=Phase.SUSPENDED.value, sandbox_name="x")
    without_sandbox = task("held", phase=Phase.SUSPENDED.value, sandbox_name="y")
    found = children_found(without_pvc, without_sandbox, pvcs=(pvc("held-workspace"),))
    assert [(f.kind, f.task) for f in found] == [(FindingKind.TASK_CHILD_GONE, "paused")]


def test_no_child_finding_while_a_phase_settles_or_for_what_does_not_run() -> None:
    """Tried: a task that just went Running (its PVC and Sandbox on their way), a
    Failed, a Pending and a deleting task without either, and a cluster that serves no
    Sandbox API: no finding."""
    fresh = task("fresh", phase_since=ago(2), sandbox_name="s")
    failed = task("failed", phase=Phase.FAILED.value, sandbox_name="s")
    pending = task("pending", phase=Phase.PENDING.value, sandbox_name="s")
    deleting = task("deleting", deleting=True, sandbox_name="s")
    assert children_found(fresh, failed, pending, deleting) == []
    unserved = Cluster(tasks=[task("t", sandbox_name="s")], pvcs=[pvc("t-workspace")],
                       sandboxes_served=False)  # fmt: skip
    assert check_task_children(unserved, NOW, LIMITS) == []


# --------------------------------------------------------------------------- report


def test_report_json_and_counts_by_kind() -> None:
    """Tried: a report with findings of two kinds given out of order: the JSON has them
    sorted, ``by_kind`` every kind (zero for the rest), and the report is not clean."""
    started = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    orphan = Finding(FindingKind.ORPHAN_PVC, "pvc default/x", "m2", NS)
    silent_b = Finding(FindingKind.DAEMON_SILENT, "calibantask default/b", "m1", NS, "b")
    silent_a = Finding(FindingKind.DAEMON_SILENT, "calibantask default/a", "m0", NS, "a")
    report = AuditReport(started, duration_secs=1.234567, findings=[orphan, silent_b, silent_a],
                         counts={"tasks": 2}, kubernetes=True, contents=False)  # fmt: skip
    assert not report.clean
    by_kind = report.by_kind()
    assert set(by_kind) == {k.value for k in FindingKind}
    assert {k: v for k, v in by_kind.items() if v} == {"DaemonSilent": 2, "OrphanPVC": 1}
    document = report.as_json()
    assert document == {
        "clean": False,
        "started_at": "2026-12-02T12:00:00+00:00",
        "duration_secs": 1.2346,
        "kubernetes": True,
        "contents": False,
        "counts": {"tasks": 2},
        "by_kind": by_kind,
        "findings": [
            {"kind": "DaemonSilent", "subject": "calibantask default/a", "message": "m0",
             "namespace": NS, "task": "a"},
            {"kind": "DaemonSilent", "subject": "calibantask default/b", "message": "m1",
             "namespace": NS, "task": "b"},
            {"kind": "OrphanPVC", "subject": "pvc default/x", "message": "m2",
             "namespace": NS, "task": None},
        ],
    }  # fmt: skip
    assert json.loads(json.dumps(document)) == document


def test_clean_report() -> None:
    """Tried: a report without findings."""
    report = AuditReport(datetime(2026, 1, 1, tzinfo=UTC))
    assert report.clean
    assert set(report.by_kind().values()) == {0}
    assert report.as_json()["findings"] == []
    assert report.as_json()["clean"] is True


def test_finding_line_key_and_json() -> None:
    """Tried: a finding's one-line form, its key and its JSON (the kind as its value)."""
    f = Finding(FindingKind.QUEUE_MISMATCH, "queue default/t", "a message", NS, "t")
    assert f.line() == "QueueMismatch queue default/t: a message"
    assert f.key == ("QueueMismatch", "queue default/t")
    assert f.as_json() == {"kind": "QueueMismatch", "subject": "queue default/t",
                           "message": "a message", "namespace": NS, "task": "t"}  # fmt: skip


# -------------------------------------------------------------- observe: sessions


def write_agent_session(store: Path, agent_id: str, turns: int) -> str:
    """``agents/<agent_id>/session.json`` as the worker writes it; its sha256."""
    directory = layout.agent_dir(store, agent_id)
    directory.mkdir(parents=True)
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(turns)]
    return save_session(directory, Session(agent_id, turns, messages, {"model": "m"}, ""))


def test_session_read_from_a_workspace_matches_its_checkpoint(tmp_path: Path) -> None:
    """Tried: two agents' sessions written as the worker writes them, and the checkpoint
    the daemon would record of them: each reads the same turns and sha256."""
    store = Volumes(tmp_path).pvc(NS, "task-a-workspace")
    sha1 = write_agent_session(store, "a1", 3)
    sha2 = write_agent_session(store, "a2", 5)
    ckpt = checkpoint(agents=(agent("a1", turns=3, sha=sha1), agent("a2", turns=5, sha=sha2)))
    readings = read_sessions(store, ckpt)
    assert readings == {"a1": SessionReading(3, sha1), "a2": SessionReading(5, sha2)}
    assert check_sessions(ckpt, "retained PVC task-a-workspace", readings) == []


def test_session_edited_after_the_checkpoint_reads_another_sha(tmp_path: Path) -> None:
    """Tried: the session rewritten after the checkpoint with the same number of turns
    (one message changed): it reads another sha256, and is a SessionMismatch."""
    sha = write_agent_session(tmp_path, "a1", 3)
    ckpt = checkpoint(agents=(agent("a1", turns=3, sha=sha),))
    path = layout.session_file(layout.agent_dir(tmp_path, "a1"))
    document = json.loads(path.read_bytes())
    document["messages"][0]["content"][0]["text"] = "edited"
    path.write_text(json.dumps(document))
    reading = read_sessions(tmp_path, ckpt)["a1"]
    assert reading.turns == 3
    assert reading.sha256 not in (None, sha)
    found = check_sessions(ckpt, "here", {"a1": reading})
    assert kinds(found) == [FindingKind.SESSION_MISMATCH]
    assert f"sha256 {sha[:12]}" in found[0].message


def test_session_that_is_not_json_reads_unreadable(tmp_path: Path) -> None:
    """Tried: a truncated session.json."""
    write_agent_session(tmp_path, "a1", 3)
    path = layout.session_file(layout.agent_dir(tmp_path, "a1"))
    path.write_bytes(path.read_bytes()[:10])
    reading = read_sessions(tmp_path, checkpoint())["a1"]
    assert (reading.turns, reading.sha256) == (None, None)
    assert reading.error is not None
    assert reading.error.startswith("is unreadable (")
    assert "not valid JSON" in reading.error


def test_missing_session_dir_reads_as_an_error(tmp_path: Path) -> None:
    """Tried: a workspace holding agent a1's session but not a2's: a2 reads as an error
    (whatever its wording), and the checkpoint is a SessionMismatch naming a2 alone."""
    sha = write_agent_session(tmp_path, "a1", 3)
    ckpt = checkpoint(agents=(agent("a1", turns=3, sha=sha), agent("a2")))
    readings = read_sessions(tmp_path, ckpt)
    assert readings["a1"] == SessionReading(3, sha)
    assert (readings["a2"].turns, readings["a2"].sha256) == (None, None)
    assert readings["a2"].error is not None
    found = check_sessions(ckpt, "here", readings)
    assert kinds(found) == [FindingKind.SESSION_MISMATCH]
    assert "agent a2's session in here" in found[0].message
    assert "a1" not in found[0].message.replace("agents/a1", "")


def test_missing_session_dir_reads_is_missing(tmp_path: Path) -> None:
    """Tried: a checkpoint agent whose session dir is not in the workspace at all: the
    reading's error is "is missing" (``observe.read_sessions``' own wording)."""
    (tmp_path / "agents").mkdir()
    readings = read_sessions(tmp_path, checkpoint())
    assert readings == {"a1": SessionReading(None, None, "is missing")}


def test_workspace_directory_that_is_not_there_reads_nothing(tmp_path: Path) -> None:
    """Tried: a workspace root that does not exist (whether it should is the API's to say)."""
    assert read_sessions(tmp_path / "nope", checkpoint()) == {}


def test_volumes_layout(tmp_path: Path) -> None:
    """Tried: where the stand-in controller keeps a PVC and a snapshot's copy."""
    volumes = Volumes(tmp_path)
    assert volumes.pvc("ns", "p") == tmp_path / "volumes" / "ns" / "p"
    assert volumes.snapshot("u-1") == tmp_path / "snapshots" / "u-1"
