"""The snapshot follower: every checkpoint snapshot that is asked for and neither ready
nor failed, followed until it is one or the other, whether or not the task that asked
for it still exists.

A pause or a deletion goes on once its checkpoint's snapshot is cut (``snapshots``); on
a real CSI driver ``readyToUse`` comes minutes later, long after a deleted task is gone.
So one loop for the whole operator (started with the ledger feed in
``handlers.configure``, held on the ``OperatorContext``) asks the ledger which snapshots
are unsettled (one read of a partial index: what it costs follows those rows, not the
ledger's size), lists their VolumeSnapshots (one list per namespace that has any, by
their checkpoint label), asks ``lifecycle.snapshot_step`` what to record of each and
records it in one ledger transaction. With nothing unsettled a look is that one read.
An operator restarted finds in the ledger what the last one was following.

Of each snapshot that becomes ready or failed: an event on its task (``Snapshotted``,
or a Warning ``SnapshotFailed``) if that task still exists, a log line otherwise; its
steward is woken so its ``Snapshotted`` condition follows (``snapshots.reflect_snapshot``).
A failed snapshot leaves the checkpoint its retained PVC, or nothing if that PVC is gone,
which the ledger then says. Restores waiting for a snapshot to be ready
(``restore.restore_source``) are woken once it is no longer unsettled.

What must stay true: a snapshot not cut yet is its pass's to judge (the pause or the
deletion waiting for its cut records the outcome and says so on the task); the follower
settles one only when no pass did, ``ORPHANED_ASK_GRACE_SECS`` past its cut deadline (its
task went without its finalizer). Two replicas may both follow: the ledger keeps the
first outcome and hands it back only to the process that recorded it, so each outcome is
said once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from orchestrator import metrics
from orchestrator.ledger import CheckpointView, Ledger, SnapshotMove, UnsettledSnapshotView
from orchestrator.operator import events, following, kube
from orchestrator.operator.crd import Manifest
from orchestrator.operator.failures import one_line
from orchestrator.operator.lifecycle import (
    ORPHANED_ASK_GRACE_SECS,
    FollowedSnapshot,
    SnapshotOutcome,
    snapshot_deadline,
    snapshot_state,
    snapshot_step,
)
from orchestrator.operator.taskpass import ledger_call, utc_now
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

FOLLOW_PAGE = 500
"""Unsettled snapshots read from the ledger at a time."""
LIST_CHUNK = 200
"""Checkpoint refs one list of VolumeSnapshots names in its label selector."""

Key = tuple[str, str]
"""(namespace, name) of a CalibanTask, or (namespace, checkpoint ref)."""


@dataclass
class SnapshotFollower:
    """See the module. ``look`` is one look; ``run`` repeats it every
    ``snapshot_follow_interval_secs`` for as long as the operator runs."""

    ledger: Ledger
    settings: Settings
    stewards: events.WorkQueue
    restores: dict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    """(namespace, checkpoint ref) → the restoring tasks waiting for its snapshot."""

    def wait_for_ready(self, namespace: str, ref: str, task: Key) -> None:
        """Wake ``task``'s steward once checkpoint ``ref``'s snapshot is no longer
        unsettled (ready, or failed: either way its restore can decide)."""
        self.restores[(namespace, ref)].add(task)

    async def run(self) -> None:
        interval = self.settings.snapshot_follow_interval_secs
        failing = False
        took = 0.0
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await self.look()
                if failing:
                    log.info("snapshot_follower: the ledger and the API answer again")
                failing = False
            except Exception as exc:  # the next look tries again; restores keep the resync
                if not failing:
                    log.warning(
                        "snapshot_follower: a look failed (%s); trying again", one_line(exc)
                    )
                failing = True
            took = asyncio.get_running_loop().time() - started
            await asyncio.sleep(following.pause_before_read(interval, took))

    async def look(self) -> int:
        """One look over every unsettled snapshot; how many were unsettled."""
        unsettled = await self._unsettled()
        metrics.SNAPSHOTS_UNSETTLED.set(len(unsettled))
        now = utc_now()
        followed = [u for u in unsettled if self._followed_now(u, now)]
        seen = await self._list(followed)
        now = utc_now()
        moves: list[SnapshotMove] = []
        for u in followed:
            step = snapshot_step(
                FollowedSnapshot(
                    u.snapshot_name, u.pvc_name or "-", u.created_at, u.snapshot_cut_at
                ),
                snapshot_state(seen.get((u.namespace, u.snapshot_name))),
                now,
                cut_timeout_secs=self.settings.snapshot_cut_timeout_secs,
                ready_timeout_secs=self.settings.snapshot_ready_timeout_secs,
            )
            if step.outcome is not SnapshotOutcome.WAIT:
                moves.append(SnapshotMove(u.ref, step.cut_at, step.ready_at, step.error))
        moved = await ledger_call(self.ledger.move_snapshots, moves) if moves else []
        for checkpoint in moved:
            try:
                await self._announce(checkpoint)
            except Exception:  # recorded all the same: one event lost, never the others
                log.exception("snapshot_announce_failed checkpoint=%s", checkpoint.ref)
        settled = {(c.namespace, c.ref) for c in moved if not c.snapshot_pending}
        still = {(u.namespace, u.ref) for u in unsettled} - settled
        self._wake_restores(still)
        return len(unsettled)

    async def _unsettled(self) -> list[UnsettledSnapshotView]:
        found: list[UnsettledSnapshotView] = []
        after = 0
        while True:
            page = await ledger_call(self.ledger.unsettled_snapshots, after, FOLLOW_PAGE)
            found += page
            if len(page) < FOLLOW_PAGE:
                return found
            after = page[-1].id

    def _followed_now(self, u: UnsettledSnapshotView, now: datetime) -> bool:
        """Cut ones, and those not cut that no pass settled well past their deadline."""
        if u.snapshot_cut_at is not None:
            return True
        deadline = snapshot_deadline(u.created_at, self.settings.snapshot_cut_timeout_secs)
        return now > deadline + timedelta(seconds=ORPHANED_ASK_GRACE_SECS)

    async def _list(self, followed: Iterable[UnsettledSnapshotView]) -> dict[Key, Manifest]:
        """The VolumeSnapshots of ``followed``: one list per namespace (per
        ``LIST_CHUNK`` refs), by their checkpoint label."""
        by_namespace: dict[str, list[str]] = defaultdict(list)
        for u in followed:
            by_namespace[u.namespace].append(u.ref)
        seen: dict[Key, Manifest] = {}
        for namespace in sorted(by_namespace):
            refs = sorted(by_namespace[namespace])
            for start in range(0, len(refs), LIST_CHUNK):
                listed = await kube.list_checkpoint_snapshots(
                    namespace, refs[start : start + LIST_CHUNK]
                )
                seen.update({(namespace, name): obj for name, obj in listed.items()})
        return seen

    async def _announce(self, c: CheckpointView) -> None:
        """Say what this process recorded of ``c``'s snapshot: its cut in the log; ready
        or failed on its task (an event) if it still exists, else in the log."""
        where = f"checkpoint={c.ref} snapshot={c.namespace}/{c.snapshot_name}"
        if c.snapshot_pending:
            log.info("snapshot_cut %s cut_at=%s", where, _iso(c.snapshot_cut_at))
            return
        if c.snapshot is not None:
            metrics.SNAPSHOTS_SETTLED.labels("ready", "follower").inc()
            type_, reason = "Normal", "Snapshotted"
            message = (
                f"checkpoint {c.ref}: workspace PVC {c.pvc_name} copied to VolumeSnapshot "
                f"{c.snapshot_name}, ready to restore"
            )
        else:
            metrics.SNAPSHOTS_SETTLED.labels("failed", "follower").inc()
            type_, reason = "Warning", "SnapshotFailed"
            message = await self._fell_back(c)
        task = await kube.get_task(c.namespace, c.name)
        if task is not None and task["metadata"].get("uid") == c.task_uid:
            await kube.post_event(task, type_, reason, message)
            self.stewards.add((c.namespace, c.name), "snapshot")
        log_at = log.info if type_ == "Normal" else log.warning
        log_at(
            "snapshot_%s %s task=%s/%s task_exists=%s: %s",
            "ready" if c.snapshot is not None else "failed",
            where,
            c.namespace,
            c.name,
            task is not None and task["metadata"].get("uid") == c.task_uid,
            message,
        )

    async def _fell_back(self, c: CheckpointView) -> str:
        """The message of a failed snapshot: the checkpoint is its retained PVC only; if
        that PVC is gone too, nothing is left, and the ledger says so."""
        message = (
            f"checkpoint {c.ref} has no snapshot: {c.snapshot_error}; it is kept as the "
            f"retained workspace PVC {c.pvc_name} only"
        )
        if c.pvc_name is None or (await kube.get_pvc(c.namespace, c.pvc_name)) is not None:
            return message
        gone = (
            f"its VolumeSnapshot failed ({c.snapshot_error}) and its workspace PVC "
            f"{c.namespace}/{c.pvc_name} no longer exists"
        )
        await ledger_call(self.ledger.mark_checkpoint_unavailable, c.ref, gone)
        return f"checkpoint {c.ref} can no longer be restored: {gone}"

    def _wake_restores(self, unsettled: set[Key]) -> None:
        for key in [k for k in self.restores if k not in unsettled]:
            for task in self.restores.pop(key):
                self.stewards.add(task, "snapshot")


def _iso(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")
