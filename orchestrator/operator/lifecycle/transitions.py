"""What the user asked for through kubectl (``wanted_transition``: pause, resume,
start a task created suspended, a wake the spec holds), and the idle pause
(``idle_secs``, ``should_idle_pause``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from orchestrator.ledger import ActivityView
from orchestrator.operator.lifecycle.phase import CREATED_SUSPENDED, ROLLED, Phase
from orchestrator.operator.lifecycle.spec import TaskSpec


@dataclass(frozen=True)
class IdleReport:
    """What the daemon's latest heartbeat says about idleness, as the ledger keeps it."""

    idle_for_secs: float
    """How long every agent had been idle when the daemon sent the heartbeat, measured
    on the daemon host's monotonic clock."""
    received_at: datetime
    """When the orchestrator stored the heartbeat, on the orchestrator's wall clock."""


def idle_report(activity: ActivityView | None) -> IdleReport | None:
    """The idle part of a stored heartbeat: None when it is not idle, comes from a daemon
    too old to measure idleness (no ``idle_for_secs``), or was stored before the ledger
    kept a receive stamp. Its daemon-clock fields (``reported_at``, ``all_idle_since``)
    are not read."""
    if activity is None or activity.idle_for_secs is None or activity.received_at is None:
        return None
    return IdleReport(idle_for_secs=activity.idle_for_secs, received_at=activity.received_at)


def idle_secs(report: IdleReport, now: datetime, bridge_secs: float) -> float:
    """How long the task has been idle: the daemon's monotonic measure, plus the time
    since the heartbeat arrived, clamped to ``[0, bridge_secs]``.

    ``bridge_secs`` is the longest gap a healthy daemon leaves between heartbeats
    (``BrokerSettings.heartbeat_gap_secs``: the interval plus one poll), so within it the
    estimate grows with this clock as the daemon's would. The daemon's wall clock is
    never read, so skew between its host and this one does not matter at all. The only
    wall-clock difference is ``now - received_at`` (this host against the orchestrator
    worker's), and the clamp keeps a step of any size, either way, or any skew between
    those two, to at most ``bridge_secs`` of error: a forward jump cannot make a task
    idle for longer than it reported plus one gap, and a backward jump cannot take away
    what it reported. A daemon that stops reporting stops the estimate one gap after
    its last heartbeat: a pause is then late, never early.
    """
    since_received = (now - report.received_at).total_seconds()
    return report.idle_for_secs + min(max(since_received, 0.0), bridge_secs)


def should_idle_pause(
    spec: TaskSpec,
    phase: str | None,
    report: IdleReport | None,
    now: datetime,
    bridge_secs: float,
) -> bool:
    """Pause a Running task with an ``idleTimeout`` once ``idle_secs`` reaches it.

    ``report`` is None when the latest heartbeat says the task is not idle, or comes
    from a daemon too old to measure it (no ``idle_for_secs``): no idle decision at all,
    rather than one taken from wall clocks (``all_idle_since`` is for display only)."""
    if spec.idle_timeout_secs is None or phase != Phase.RUNNING or report is None:
        return False
    return idle_secs(report, now, bridge_secs) >= spec.idle_timeout_secs


class Wanted(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    HOLD = "hold"
    """A task not provisioned yet whose spec says ``suspend: true``: create nothing, phase
    Suspended (``CREATED_SUSPENDED``), until the spec says ``false``."""
    START = "start"
    """A task created suspended is un-suspended: provision it as a new task would be (its
    initial agents, or the restore of ``spec.resumeFrom``)."""
    ADOPT = "adopt"
    """An idle-paused (or rolling) task whose spec now says ``suspend: true``: the spec
    holds it from here on (``pausedBy: manual``), so ``suspend: false`` resumes it."""
    WAKE_HELD = "wake-held"
    """A new wake annotation value on a task the spec holds (``suspend: true``): the
    spec wins, and the wake is spent with a Warning event saying what to set."""
    NOTHING = "nothing"


def wanted_transition(
    spec: TaskSpec,
    phase: str | None,
    paused_by: str | None,
    wake_value: str | None,
    last_wake: str | None,
) -> Wanted:
    """What the user asked for through kubectl, given where the task is.

    ``spec.lifecycle.suspend: true`` pauses a running task (like a Job's
    ``spec.suspend``); ``false`` resumes one that was paused that way. The wake
    annotation resumes an idle-paused task once per new value (what an attach does).
    A task paused by ``suspend: true`` stays paused until the spec says otherwise.

    A task created with ``suspend: true`` starts nothing until resumed, as a Job created
    suspended never starts a pod (``HOLD``, then ``START``). Not even its workspace PVC
    or its Sandbox (suspended) is created: a queued task should hold no storage, and a
    restore claims its checkpoint's retained PVC for itself alone, which a task that
    runs nothing must not keep from others; deleting it then has nothing to release.
    ``suspend: false`` (``drainctl wake`` sets it) starts it.

    Both kinds of pause end the same ways. While the spec says ``suspend: true`` it
    holds the task, whoever paused it: a wake annotation is refused out loud
    (``WAKE_HELD``), never silently dropped, and an idle-paused task is adopted by the
    spec (``ADOPT``), so the ``suspend: false`` that follows resumes it. With
    ``suspend: false``, a task paused by the spec resumes, and an idle-paused one
    resumes on a new wake value. A pause that rolls the pod (``ROLLED``) resumes at
    once, unless the spec says ``suspend: true`` by then: it is adopted, as an idle
    pause is.
    """
    fresh_wake = bool(wake_value) and wake_value != last_wake
    if phase in (None, Phase.PENDING):
        return Wanted.HOLD if spec.suspend else Wanted.NOTHING
    if spec.suspend:
        if phase == Phase.RUNNING:
            return Wanted.PAUSE
        if phase != Phase.SUSPENDED:
            return Wanted.NOTHING
        if fresh_wake:
            return Wanted.WAKE_HELD
        return Wanted.ADOPT if paused_by in ("idle", ROLLED) else Wanted.NOTHING
    if phase != Phase.SUSPENDED:
        return Wanted.NOTHING
    if paused_by == CREATED_SUSPENDED:
        return Wanted.START
    if paused_by in ("manual", ROLLED):
        return Wanted.RESUME
    if fresh_wake:
        return Wanted.RESUME
    return Wanted.NOTHING
