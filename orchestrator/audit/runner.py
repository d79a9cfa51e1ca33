"""One audit run, and the periodic auditor that repeats it.

A run reads the cluster once (``observe.read_cluster``), the ledger's heartbeats,
unfinished operations and drain records, and a share of the restorable checkpoints
(``Rotation``): their workspaces' existence, and, where this process can read the
workspaces (``Settings.audit_volumes_dir``), their agents' sessions. What it finds
among the cluster, tasks and operations is then read again after the operator has had
time to act on what the first read saw (``Thresholds.status_settle_secs``): only a
finding seen both times is reported, so a transition caught half-way is not one.

The one-shot ``drainctl audit`` checks every checkpoint; the periodic auditor
(``drainctl audit --every``) checks ``Rotation.share`` of them per run, so a run's cost
is bounded while every checkpoint is still checked within ``audit_full_pass_secs``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from orchestrator.audit.checks import (
    RELEASE_STALLED_SECS,
    Cluster,
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
from orchestrator.audit.findings import Finding, FindingKind
from orchestrator.audit.observe import Volumes, read_cluster, read_sessions
from orchestrator.ledger import CheckpointView, Ledger, UnsettledSnapshotView
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

OVERDUE_SCAN = 1000
"""Unfinished operations past their deadline one run looks at."""
PAGE = 500
"""Checkpoints read from the ledger at a time."""


@dataclass
class Rotation:
    """Where the periodic audit is in its pass over the restorable checkpoints: two
    cursors (checkpoint ids), one for workspace existence, one for session contents,
    each wrapping around at the end."""

    workspaces_after: int = 0
    contents_after: int = 0

    @staticmethod
    def share(total: int, batch: int, interval_secs: float, full_pass_secs: float) -> int:
        """Checkpoints one run takes: its batch, or more when a full pass in
        ``full_pass_secs`` needs it."""
        runs = max(1.0, full_pass_secs / interval_secs)
        return max(batch, math.ceil(total / runs))


@dataclass
class AuditReport:
    started_at: datetime
    duration_secs: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """What was looked at: tasks, sandboxes, pods, pvcs, snapshots, operations overdue,
    checkpoints (restorable, in the ledger), checkpoints_checked, sessions_checked; and of
    the checkpoints' snapshots, snapshots_pending (on their way, every checkpoint's) and
    snapshots_ready, snapshots_failed (of the restorable checkpoints checked)."""
    kubernetes: bool = True
    contents: bool = False
    """Whether session contents could be read at all (``audit_volumes_dir``)."""

    @property
    def clean(self) -> bool:
        return not self.findings

    def by_kind(self) -> dict[str, int]:
        counts = {kind.value: 0 for kind in FindingKind}
        for f in self.findings:
            counts[f.kind.value] += 1
        return counts

    def as_json(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            "started_at": self.started_at.isoformat(),
            "duration_secs": round(self.duration_secs, 4),
            "kubernetes": self.kubernetes,
            "contents": self.contents,
            "counts": self.counts,
            "by_kind": self.by_kind(),
            "findings": [f.as_json() for f in sorted(self.findings)],
        }


class Auditor:
    """Runs audits against one ledger and (``kubernetes``) the cluster."""

    def __init__(
        self,
        ledger: Ledger,
        settings: Settings,
        *,
        kubernetes: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ledger = ledger
        self.settings = settings
        self.kubernetes = kubernetes
        self.limits = Thresholds.of(settings)
        self.volumes = (
            Volumes(settings.audit_volumes_dir) if settings.audit_volumes_dir is not None else None
        )
        self.rotation = Rotation()
        self.sleep = sleep
        self.last_tasks: list[TaskState] = []
        """The tasks as the latest run saw them last (what ``loud`` writes conditions on)."""

    # -- one run

    def run(self, *, everything: bool = True, confirm: bool = True) -> AuditReport:
        """One audit; ``everything``: every checkpoint (else this run's share)."""
        started = datetime.now(UTC)
        clock = time.perf_counter()
        report = AuditReport(started, kubernetes=self.kubernetes, contents=self.volumes is not None)
        cluster = self.cluster()
        found = self.fast_checks(cluster, report.counts)
        checkpoints = self.ledger.count_available_checkpoints()
        report.counts["checkpoints"] = checkpoints
        slow = self.checkpoint_checks(cluster, checkpoints, everything, report.counts)
        if confirm and found:
            self.sleep(self.limits.status_settle_secs)
            again = {f.key: f for f in self.fast_checks(self.cluster(), {})}
            found = [again[f.key] for f in found if f.key in again]
        report.findings = sorted({f.key: f for f in [*found, *slow]}.values())
        report.duration_secs = time.perf_counter() - clock
        return report

    def cluster(self) -> Cluster:
        if not self.kubernetes:
            return Cluster(snapshots_served=False)
        cluster = read_cluster()
        self.last_tasks = cluster.tasks
        return cluster

    def fast_checks(self, cluster: Cluster, counts: dict[str, int]) -> list[Finding]:
        """Everything but the checkpoints' workspaces and contents: the tasks, daemons,
        operations and orphans, read in a few requests and queries."""
        now = datetime.now(UTC)
        activities = {(a.namespace, a.name): a for a in self.ledger.list_activities()}
        refs = {t.checkpoint_ref for t in cluster.tasks if t.checkpoint_ref}
        refs |= {t.resume_from for t in cluster.tasks if t.resume_from}
        known = self.ledger.existing_refs(refs)
        cutoff = now - timedelta(seconds=self.limits.overdue_slack_secs)
        overdue = self.ledger.overdue_operations(cutoff, limit=OVERDUE_SCAN)
        live = {(t.namespace, t.name): t for t in cluster.tasks}
        unsettled = self.unsettled_snapshots()
        found = [
            *check_tasks(cluster, activities, known, now, self.limits),
            *check_daemons(cluster, activities, now, self.limits),
            *check_operations(overdue, self.ledger.drain_record_problems(), now, self.limits, live),
            *check_snapshots(unsettled, now, self.limits, live),
            *check_releases(
                self.ledger.stalled_releases(now - timedelta(seconds=RELEASE_STALLED_SECS)), now
            ),
        ]
        if self.kubernetes:
            labelled_pvcs = {(p.namespace, p.name) for p in cluster.pvcs if p.workspace}
            labelled_snaps = {(s.namespace, s.name) for s in cluster.snapshots if s.checkpoint}
            used_pvcs, used_snaps = self.ledger.workspace_references(labelled_pvcs, labelled_snaps)
            found += check_orphans(cluster, used_pvcs, used_snaps)
            found += check_task_children(cluster, now, self.limits)
        counts.update(
            tasks=len(cluster.tasks),
            sandboxes=len(cluster.sandboxes),
            pods=len(cluster.pods),
            pvcs=len(cluster.pvcs),
            snapshots=len(cluster.snapshots),
            heartbeats=len(activities),
            operations_overdue=len(overdue),
            snapshots_pending=len(unsettled),
        )
        return found

    def unsettled_snapshots(self) -> list[UnsettledSnapshotView]:
        """Every checkpoint snapshot the ledger says is on its way (a partial index holds
        exactly these: a few rows, whatever the ledger's size)."""
        found: list[UnsettledSnapshotView] = []
        while page := self.ledger.unsettled_snapshots(found[-1].id if found else 0, PAGE):
            found += page
            if len(page) < PAGE:
                break
        return found

    def checkpoint_checks(
        self, cluster: Cluster, total: int, everything: bool, counts: dict[str, int]
    ) -> list[Finding]:
        """The workspace pass and (with ``audit_volumes_dir``) the contents pass, each
        over pages of restorable checkpoints from its cursor: every checkpoint for a
        one-shot; for a periodic run, its share (``Rotation.share``), the contents pass
        going on past its share (up to the checkpoint batch) until it has read
        ``audit_session_batch`` sessions."""
        s = self.settings
        share = (
            total
            if everything
            else Rotation.share(
                total, s.audit_checkpoint_batch, s.audit_interval_secs, s.audit_full_pass_secs
            )
        )
        found: list[Finding] = []
        if self.kubernetes:
            checked = 0
            ready = failed = 0
            for page in self.walk(self.rotation.workspaces_after, share):
                found += check_checkpoint_workspaces(page, cluster)
                checked += len(page)
                ready += sum(c.snapshot is not None for c in page)
                failed += sum(c.snapshot_error is not None for c in page)
                self.rotation.workspaces_after = page[-1].id
            counts["checkpoints_checked"] = checked
            counts["snapshots_ready"] = ready
            counts["snapshots_failed"] = failed
        counts["sessions_checked"] = 0
        if self.volumes is None:
            return found
        need = (
            total
            if everything
            else Rotation.share(total, 1, s.audit_interval_secs, s.audit_full_pass_secs)
        )
        sessions = taken = 0
        for page in self.walk(self.rotation.contents_after, share):
            for checkpoint, directory, where in self.readable(page, cluster):
                readings = read_sessions(directory, checkpoint)
                sessions += len(readings)
                found += check_sessions(checkpoint, where, readings)
            taken += len(page)
            self.rotation.contents_after = page[-1].id
            if taken >= need and sessions >= s.audit_session_batch:
                break
        counts["sessions_checked"] = sessions
        return found

    def walk(self, start: int, count: int) -> Iterator[list[CheckpointView]]:
        """Up to ``count`` restorable checkpoints after id ``start``, ``PAGE`` at a time,
        wrapping around to the lowest ids once (never past ``start`` again)."""
        after, wrapped, left = start, False, count
        while left > 0:
            want = min(PAGE, left)
            page = self.ledger.available_checkpoints_after(after, want)
            full = len(page) == want
            if wrapped:
                page = [c for c in page if c.id <= start]
                full = full and len(page) == want
            if page:
                left -= len(page)
                after = page[-1].id
                yield page
            if not full:
                if wrapped or start == 0:
                    return
                wrapped, after = True, 0

    def readable(
        self, batch: Sequence[CheckpointView], cluster: Cluster
    ) -> list[tuple[CheckpointView, Any, str]]:
        """The checkpoints of ``batch`` whose state some directory still holds exactly:
        a ready snapshot's copy (immutable), else the retained PVC, while it is its
        newest checkpoint, nothing has resumed from it and no live task works on it."""
        assert self.volumes is not None
        snapshots = {(sn.namespace, sn.name): sn.uid for sn in cluster.snapshots}
        live = cluster.task_by_uid()
        owned = {
            (p.namespace, p.name) for p in cluster.pvcs if any(u in live for u in p.owner_uids)
        }
        pvcs = {(c.namespace, c.pvc_name) for c in batch if c.pvc_name}
        newest = self.ledger.newest_refs_of_pvcs(pvcs)
        resumed = self.ledger.resumed_refs([c.ref for c in batch])
        out: list[tuple[CheckpointView, Any, str]] = []
        for c in batch:
            if not c.agents:
                continue
            uid = snapshots.get((c.namespace, c.snapshot)) if c.snapshot else None
            if uid is not None:
                out.append((c, self.volumes.snapshot(uid), f"VolumeSnapshot {c.snapshot}"))
            elif (
                c.pvc_name is not None
                and newest.get((c.namespace, c.pvc_name)) == c.ref
                and c.ref not in resumed
                and (c.namespace, c.pvc_name) not in owned
            ):
                out.append(
                    (c, self.volumes.pvc(c.namespace, c.pvc_name), f"retained PVC {c.pvc_name}")
                )
        return out
