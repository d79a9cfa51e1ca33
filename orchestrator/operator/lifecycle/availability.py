"""The daemon's agents, as its heartbeats report them: whether a task waiting for its
daemon runs (``launch_step``), what a finished resume earns (``resume_outcome``), and
whether a running task's agents are available, interrupted (a recovery, with its
backoff and crash-loop limit) or silent (``availability``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Final

from orchestrator.ledger import OperationState
from orchestrator.operator.lifecycle.conditions import ConditionChange
from orchestrator.operator.lifecycle.phase import Phase
from worker_agent.contract import says_checkpoint_mismatch


@dataclass(frozen=True)
class AgentCounts:
    """What the daemon's latest heartbeat (of the current phase) says about its agents."""

    total: int
    live: int
    interrupted: int = 0
    """Stopped with work left (drained, crashed, failed): resumed after a disruption."""
    done: int = 0
    """Finished their work (the worker exited 0 by itself); counted in ``finished``."""

    @property
    def finished(self) -> int:
        """Done, or killed by a user: stopped on purpose, never brought back."""
        return self.total - self.live - self.interrupted


class LaunchStep(StrEnum):
    WAIT = "wait"
    """No heartbeat of this phase yet, or none of its agents yet: ask again next pass."""
    RUNNING = "running"
    """The daemon reports live agents: phase Running."""
    RECOVER = "recover"
    """The daemon came up on a store whose agents are all stopped with work left (its
    pod restarted): nothing runs them unless they are resumed, so begin a recovery."""


def launch_step(phase: str | None, reported: AgentCounts | None) -> LaunchStep:
    """What a task that waits for its daemon (Provisioning or Resuming) does next, given
    the daemon's latest heartbeat of this phase (None: none yet)."""
    if phase not in (Phase.PROVISIONING, Phase.RESUMING) or reported is None:
        return LaunchStep.WAIT
    if reported.interrupted and not reported.live:
        return LaunchStep.RECOVER
    if reported.total:
        # Live agents, or only agents stopped on purpose (nothing to resume): Running,
        # and the AgentsAvailable condition says how many run.
        return LaunchStep.RUNNING
    return LaunchStep.WAIT


@dataclass(frozen=True)
class ResumeOutcome:
    still_resuming: bool
    """The resume chain is still on its way: nothing else is decided this pass."""
    condition: ConditionChange | None = None
    """The ``Resumed`` condition the finished operation earns, if it is a resume."""


def resume_outcome(state: OperationState, error: str | None) -> ResumeOutcome:
    """What the task's last operation says to a task that waits for its daemon.

    That operation is the resume (a restore, a wake, a recovery) whose agents the daemon
    is bringing back, or the pause's recorded drain when there was no checkpoint to
    resume from; ``error`` on a resumed operation names the agents that did not come
    back."""
    if state is OperationState.FAILED:
        # A workspace that is not what the checkpoint recorded: nothing was resumed.
        reason = "CheckpointMismatch" if says_checkpoint_mismatch(error) else "ResumeFailed"
        return ResumeOutcome(False, ConditionChange("Resumed", False, reason, error or "failed"))
    if state is OperationState.RESUMED and error:
        return ResumeOutcome(False, ConditionChange("Resumed", False, "PartlyResumed", error))
    if state is OperationState.RESUMED:
        return ResumeOutcome(
            False, ConditionChange("Resumed", True, "Resumed", "every agent continues")
        )
    return ResumeOutcome(still_resuming=not state.terminal)


HEARTBEATS_MISSED_BEFORE_SILENT: Final = 3
"""A daemon whose last heartbeat reached the ledger more than this many heartbeat
intervals ago is reported silent: its pod is gone or restarting, its node lost, or the
orchestrator worker that records heartbeats is down. The status says so instead of
repeating the last count."""
RECOVERY_BACKOFF_SECS: Final = (0.0, 10.0, 20.0, 40.0, 80.0)
"""How long after the previous recovery the next one may begin, by how many came before
it in the current streak: the first disruption is resumed at once, an agent that keeps
failing waits longer each time (as a pod in CrashLoopBackOff)."""
CRASH_LOOP_LIMIT: Final = len(RECOVERY_BACKOFF_SECS)
"""Recoveries in one streak after which the operator stops resuming: a condition and a
Warning event say so, and a new value of the wake annotation starts a new streak."""
RECOVERY_STREAK_RESET_SECS: Final = 600.0
"""A streak ends once this long has passed since its last recovery."""


class Availability(StrEnum):
    AVAILABLE = "available"
    """Every agent with work left runs (or none has any left)."""
    DAEMON_SILENT = "daemon-silent"
    """No heartbeat for too long: nothing is known about the agents."""
    RECOVER = "recover"
    """Agents were stopped by a disruption: begin a recovery resume now."""
    BACKOFF = "backoff"
    """Agents are stopped, and the last recovery was too recent: wait."""
    CRASH_LOOP = "crash-loop"
    """Agents keep stopping; the operator no longer resumes them by itself."""


@dataclass(frozen=True)
class RecoveryHistory:
    """``status.recoveries`` (every recovery, keying its operation), ``status.recoveryStreak``
    and ``status.lastRecoveryAt``."""

    count: int = 0
    streak: int = 0
    last_at: datetime | None = None


@dataclass(frozen=True)
class AvailabilityDecision:
    step: Availability
    condition: ConditionChange
    """``AgentsAvailable``: True only when every agent with work left is live."""
    wait_secs: float = 0.0
    """For ``BACKOFF``: how long until the next recovery may begin."""
    streak_over: bool = False
    """The current streak has ended (agents ran undisturbed long enough): reset it."""


def heartbeat_silent(age_secs: float | None, heartbeat_interval_secs: float) -> bool:
    """Whether a heartbeat ``age_secs`` old (None: none at all) means the daemon is gone."""
    return age_secs is None or age_secs > HEARTBEATS_MISSED_BEFORE_SILENT * heartbeat_interval_secs


def _agents_phrase(counts: AgentCounts) -> str:
    parts = [f"{counts.live} of {counts.total} agents live"]
    if counts.interrupted:
        parts.append(f"{counts.interrupted} interrupted")
    if counts.finished:
        parts.append(f"{counts.finished} stopped on purpose or finished")
    return ", ".join(parts)


def availability(
    counts: AgentCounts | None,
    heartbeat_age_secs: float | None,
    heartbeat_interval_secs: float,
    history: RecoveryHistory,
    now: datetime,
) -> AvailabilityDecision:
    """What a Running task's latest heartbeat says, and whether to resume what stopped.

    A daemon that restarted finds its agents drained (its own SIGTERM drain on eviction)
    or crashed (it was killed); an agent's worker that exits non-zero by itself fails.
    All three are interrupted: resumed at ``turns + 1`` by a recovery, the first at once,
    the next after ``RECOVERY_BACKOFF_SECS``, and none after ``CRASH_LOOP_LIMIT`` in one
    streak. Agents done or killed by a user stay stopped.
    """
    if counts is None or heartbeat_silent(heartbeat_age_secs, heartbeat_interval_secs):
        age = "ever" if heartbeat_age_secs is None else f"for {heartbeat_age_secs:.0f}s"
        return AvailabilityDecision(
            Availability.DAEMON_SILENT,
            ConditionChange(
                "AgentsAvailable",
                False,
                "DaemonSilent",
                f"no heartbeat from the daemon {age}: its pod is gone or restarting, its "
                "node lost, or the orchestrator worker is down",
            ),
        )
    since_last = None if history.last_at is None else (now - history.last_at).total_seconds()
    streak_over = history.streak > 0 and (
        since_last is None or since_last >= RECOVERY_STREAK_RESET_SECS
    )
    streak = 0 if streak_over else history.streak
    phrase = _agents_phrase(counts)
    if not counts.interrupted:
        reason = "AgentsLive" if counts.live or not counts.total else "AgentsFinished"
        return AvailabilityDecision(
            Availability.AVAILABLE,
            ConditionChange(
                "AgentsAvailable", bool(counts.live) or not counts.total, reason, phrase
            ),
            streak_over=streak_over,
        )
    reason = "DaemonRestarted" if not counts.live else "AgentsStopped"
    if streak >= CRASH_LOOP_LIMIT:
        return AvailabilityDecision(
            Availability.CRASH_LOOP,
            ConditionChange(
                "AgentsAvailable",
                False,
                "CrashLoop",
                f"{phrase}; resumed {streak} times since they last ran for "
                f"{RECOVERY_STREAK_RESET_SECS:.0f}s, not again until the wake annotation "
                "changes",
            ),
        )
    wait = RECOVERY_BACKOFF_SECS[streak] - (since_last or 0.0) if streak else 0.0
    if wait > 0:
        return AvailabilityDecision(
            Availability.BACKOFF,
            ConditionChange(
                "AgentsAvailable",
                False,
                reason,
                f"{phrase}; resuming them in {wait:.0f}s (backoff)",
            ),
            wait_secs=wait,
            streak_over=streak_over,
        )
    return AvailabilityDecision(
        Availability.RECOVER,
        ConditionChange("AgentsAvailable", False, reason, f"{phrase}; resuming them"),
        streak_over=streak_over,
    )
