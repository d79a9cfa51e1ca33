"""Disruptions and recoveries: agents interrupted by a daemon restart or stopped in a
running daemon are resumed (``recoveries``, ``recoveryStreak``), a crash loop waits for
a wake to re-arm it, and a disruption's start and end are one Warning and one Normal
event each.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.operator.lifecycle import (
    AgentCounts,
    Phase,
    Purpose,
    operation_key,
    parse_time,
)
from orchestrator.operator.taskpass import (
    TaskPass,
    iso,
)

log = logging.getLogger(__name__)


def rearmed(p: TaskPass) -> bool:
    """A new wake annotation value: the user asks to try a crash-looping task again."""
    wake = p.wake_value()
    if not wake or wake == p.status.last_wake:
        return False
    p.set_status(last_wake=wake)
    return True


async def start_recovery(p: TaskPass, counts: AgentCounts, why: str, *, streak_over: bool) -> None:
    history = p.recovery_history()
    number = history.count + 1
    streak = (0 if streak_over else history.streak) + 1
    await p.start_resume(None, operation_key(p.uid, Purpose.RECOVER, number))
    cause = {
        "DaemonRestarted": "the daemon restarted",
        "AgentsStopped": "agents stopped in a running daemon",
    }.get(why, why)
    message = (
        f"resuming {counts.interrupted} interrupted agent"
        f"{'s' if counts.interrupted != 1 else ''}: {cause} (recovery {number})"
    )
    kopf.warn(p.body, reason="AgentsInterrupted", message=message)
    p.set_status(
        recoveries=number,
        recovery_streak=streak,
        last_recovery_at=iso(p.now),
        disrupted_at=p.status.disrupted_at or iso(p.now),
    )
    p.set_phase(Phase.RESUMING, message)


def disrupted(p: TaskPass, reason: str, message: str) -> None:
    """A Warning event once per disruption (not once per pass), and its start time."""
    if p.status.disrupted_at and p.status.disruption == reason:
        return
    kopf.warn(p.body, reason=reason, message=message)
    p.set_status(disruption=reason, disrupted_at=p.status.disrupted_at or iso(p.now))


def recovered(p: TaskPass, counts: AgentCounts) -> None:
    """The Normal event that ends a disruption: every agent with work left is live."""
    since = parse_time(p.status.disrupted_at)
    if since is None or counts.interrupted:
        return
    secs = (p.now - since).total_seconds()
    kopf.info(
        p.body,
        reason="Recovered",
        message=f"{counts.live} agents live again {secs:.1f}s after the disruption",
    )
    p.set_status(disrupted_at=None, disruption=None)
