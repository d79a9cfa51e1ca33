"""When the operator looks at a task again (``requeue_after``): its cost follows events,
not the fleet.

A pass over a task (``reconcile.run``) ends in one of four ways, and says which
(``TaskPass.requeue``):

- **something is on its way** (an operation, provisioning, a resume, a backoff, a
  scale): the pass is repeated every ``reconcile_interval_secs`` until it settles, and
  sooner when the ledger says the operation moved;
- **Running at rest** (every agent accounted for, nothing begun): the task is looked at
  again only when its daemon's heartbeat says something new (``heartbeat_signature``), or
  when a moment the last heartbeat sets falls due: the heartbeat goes silent, the idle
  timeout is reached, a recovery streak ends (``RunningWatch``);
- **waiting for its daemon** (Provisioning, Resuming): its daemon's next heartbeat, a
  change of its last operation, or of one of its children (Sandbox, pod, PVC: watched)
  wakes it; nothing is polled;
- **quiet** (Suspended, Completed, Failed, created suspended): only a change of the
  object (its spec, an annotation) or of its last operation wakes it.

Whatever the case, the task is looked at again after ``resync_interval_secs``: the
safety net under every event. Nothing here reads a clock or the ledger; ``requeue_after``
is handed both.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from orchestrator.ledger import ActivityView
from orchestrator.operator.lifecycle import (
    HEARTBEATS_MISSED_BEFORE_SILENT,
    RECOVERY_STREAK_RESET_SECS,
)

DUE_SLACK_SECS = 0.01
"""A deadline is looked at this long after it falls (``heartbeat_silent`` and the idle
pause compare strictly, so exactly at the moment would find it not yet due)."""

Signature = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A daemon heartbeat as the pacing reads it."""

    received_at: datetime
    """The orchestrator's clock, when the heartbeat was stored."""
    idle_for_secs: float | None
    signature: Signature


def heartbeat_signature(activity: ActivityView) -> Signature:
    """What a Running task's pass reads from a heartbeat, apart from its time: a new
    heartbeat with the same signature leaves the pass's decisions as they were (only
    the deadlines ``requeue_after`` computes move)."""
    return (
        activity.task_uid,
        activity.agents_total,
        activity.agents_live,
        activity.agents_interrupted,
        activity.agents_done,
        activity.idle_for_secs is None,
        activity.all_idle_since,
    )


def heartbeat_of(activity: ActivityView) -> Heartbeat | None:
    """None for a row stored before the ledger kept receive stamps (the pass then
    looks again every interval, as it always did)."""
    if activity.received_at is None:
        return None
    return Heartbeat(activity.received_at, activity.idle_for_secs, heartbeat_signature(activity))


def newer(a: Heartbeat | None, b: Heartbeat | None) -> Heartbeat | None:
    if a is None or b is None:
        return a or b
    return b if b.received_at > a.received_at else a


@dataclass(frozen=True, slots=True)
class RunningWatch:
    """What a pass that left a Running task at rest waits for."""

    signature: Signature
    """The heartbeat it decided on: a heartbeat that says otherwise wakes the task."""
    idle_timeout_secs: float | None
    streak_resets_at: datetime | None
    """When the current recovery streak ends (``status.recoveryStreak`` goes to 0)."""
    fresh_since: datetime | None = None
    """``status.phaseSince``: the idle pause reads only a heartbeat stored after it
    (``TaskPass.fresh_activity``), so only such a heartbeat sets an idle deadline."""


@dataclass(frozen=True, slots=True)
class Requeue:
    """How a pass left its task: ``running`` set for Running at rest; ``awaiting`` for a
    task waiting for its daemon (a new heartbeat, past ``awaiting``'s, wakes it); neither
    for quiet."""

    running: RunningWatch | None = None
    awaiting: Heartbeat | None = None
    waiting: bool = False
    """Waiting for the daemon's heartbeat (``awaiting`` the newest one already seen)."""


FAILURE_BACKOFF_FIRST_SECS = 1.0
FAILURE_BACKOFF_MAX_SECS = 300.0


def failure_backoff(failures: int) -> float:
    """How long a task's steward waits after ``failures`` passes in a row failed: 1 s,
    doubling up to 5 min; 0 after a success. A failing dependency (the ledger down, the
    API refusing) then costs a fleet a few passes a minute, not one per task per
    reconcile interval."""
    if failures <= 0:
        return 0.0
    doubled: float = FAILURE_BACKOFF_FIRST_SECS * 2.0 ** min(failures - 1, 32)
    return min(doubled, FAILURE_BACKOFF_MAX_SECS)


def streak_resets_at(streak: int, last_recovery_at: datetime | None) -> datetime | None:
    if streak <= 0 or last_recovery_at is None:
        return None
    return last_recovery_at + timedelta(seconds=RECOVERY_STREAK_RESET_SECS)


def idle_due(beat: Heartbeat, idle_timeout_secs: float, bridge_secs: float) -> datetime | None:
    """When ``should_idle_pause`` turns true on ``beat`` alone: the heartbeat's idle
    measure plus the time since it arrived, which counts for at most ``bridge_secs``
    (``lifecycle.idle_secs``). None when it cannot on this heartbeat (not idle, or the
    timeout lies further than one bridge away: a later heartbeat must bring it)."""
    if beat.idle_for_secs is None:
        return None
    remaining = idle_timeout_secs - beat.idle_for_secs
    if remaining > bridge_secs:
        return None
    return beat.received_at + timedelta(seconds=max(remaining, 0.0))


def requeue_after(
    now: datetime,
    requeue: Requeue | None,
    beat: Heartbeat | None,
    *,
    follow_up_secs: float,
    resync_secs: float,
    heartbeat_interval_secs: float,
    bridge_secs: float,
) -> float:
    """Seconds until the task's next pass, unless an event comes first (0: now).

    ``requeue`` is how the last pass left the task (None: something is on its way);
    ``beat`` the newest heartbeat known for it, from the pass or from the feed since."""
    if requeue is None:
        return min(follow_up_secs, resync_secs)
    if requeue.waiting:
        # Waiting for the daemon: its first (or next) heartbeat is the news, nothing else.
        return 0.0 if beat is not None and beat != requeue.awaiting else resync_secs
    watch = requeue.running
    if watch is None:
        return resync_secs
    if beat is None or beat.signature != watch.signature:
        return 0.0
    silence = HEARTBEATS_MISSED_BEFORE_SILENT * heartbeat_interval_secs
    deadlines = [beat.received_at + timedelta(seconds=silence)]
    fresh = watch.fresh_since is None or beat.received_at >= watch.fresh_since
    if watch.idle_timeout_secs is not None and fresh:
        idle = idle_due(beat, watch.idle_timeout_secs, bridge_secs)
        if idle is not None:
            deadlines.append(idle)
    if watch.streak_resets_at is not None:
        deadlines.append(watch.streak_resets_at)
    soonest = (min(deadlines) - now).total_seconds() + DUE_SLACK_SECS
    return min(max(soonest, 0.0), resync_secs)
