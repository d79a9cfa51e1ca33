"""A task whose agents all finished their work: whether to complete it now, or after
the backoff of a failed completion (``completion_step``), and what a Completed task
answers to a wake or a suspend (``completed_request``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Final

from orchestrator.ledger import OperationKind, OperationState
from orchestrator.operator.lifecycle.availability import AgentCounts
from orchestrator.operator.lifecycle.phase import Phase

COMPLETION_RETRY_SECS: Final = (10.0, 30.0, 60.0, 120.0, 300.0)
"""How long after a failed completion the next attempt may begin, by how many attempts
came before it; the last value repeats for as long as every agent stays done."""


class CompletionStep(StrEnum):
    NOT_DONE = "not-done"
    """Some agent has work left or runs, was killed by a user, or nothing is known (no
    heartbeat, a silent daemon): the Running pass goes on as it would."""
    COMPLETE = "complete"
    """Every agent finished its work: begin a completion (drain → record → suspend)."""
    RETRY_LATER = "retry-later"
    """Every agent finished, but the last completion failed too recently: wait, Running.
    Nothing else is decided meanwhile: no idle pause (every agent done is "idle" to the
    daemon) and no kubectl pause, so completion is never raced by a pause."""


@dataclass(frozen=True)
class CompletionDecision:
    step: CompletionStep
    wait_secs: float = 0.0
    """For ``RETRY_LATER``: how long until the next attempt may begin."""


def every_agent_done(counts: AgentCounts | None) -> bool:
    """Whether the heartbeat says the task's work is over: it has agents and every one
    is ``done`` (its worker exited 0 by itself). An agent a user killed stopped on
    purpose but did not finish its work, and an interrupted one (drained, crashed,
    failed) has work left: either keeps the task from completing."""
    return counts is not None and counts.total > 0 and counts.done == counts.total


def completion_step(
    counts: AgentCounts | None,
    *,
    silent: bool,
    attempts: int,
    last_kind: OperationKind | None,
    last_state: OperationState | None,
    last_finished_at: datetime | None,
    now: datetime,
) -> CompletionDecision:
    """Whether a Running task completes now, given the daemon's latest heartbeat
    (``counts``; ``silent``: too old to trust), ``status.completions`` (``attempts``
    begun) and its last operation (kind, state, when it finished).

    This is decided before anything else a Running task does (a pause, a recovery): a
    task whose work is over is checkpointed as completed, never paused as idle. A
    completion that failed is tried again under a new operation key once
    ``COMPLETION_RETRY_SECS`` has passed since it failed."""
    if silent or not every_agent_done(counts):
        return CompletionDecision(CompletionStep.NOT_DONE)
    failed = last_kind is OperationKind.COMPLETE and last_state is OperationState.FAILED
    if failed and attempts > 0 and last_finished_at is not None:
        backoff = COMPLETION_RETRY_SECS[min(attempts, len(COMPLETION_RETRY_SECS)) - 1]
        wait = backoff - (now - last_finished_at).total_seconds()
        if wait > 0:
            return CompletionDecision(CompletionStep.RETRY_LATER, wait)
    return CompletionDecision(CompletionStep.COMPLETE)


def completing(phase: str | None, last_kind: OperationKind | None) -> bool:
    """Whether a Draining task is completing (its drain is a completion's), not pausing."""
    return phase == Phase.DRAINING and last_kind is OperationKind.COMPLETE


class CompletedAnswer(StrEnum):
    NOTHING = "nothing"
    NOTHING_TO_RESUME = "nothing-to-resume"
    """A new wake annotation value, or ``spec.lifecycle.suspend`` set to false: there is
    no agent with work left to resume. Said once (an event and the status message)."""
    NOTHING_TO_PAUSE = "nothing-to-pause"
    """``spec.lifecycle.suspend`` set to true: the Sandbox is suspended already. Said
    once."""


def completed_request(
    suspend: bool, last_suspend: bool | None, wake_value: str | None, last_wake: str | None
) -> CompletedAnswer:
    """What a Completed task answers to what the user asked through kubectl.

    A Completed task has nothing to pause or resume: its agents finished their work, and
    its checkpoint is kept for a new task to restore (``spec.resumeFrom``). Each request
    is answered once: a wake value once (``status.lastWake``), a change of
    ``spec.lifecycle.suspend`` once (``status.lastSuspend``: the value last answered, or
    None before the task recorded one, when there is nothing to compare). A
    ``drainctl wake``, which sets both, is one request."""
    fresh_wake = bool(wake_value) and wake_value != last_wake
    suspend_changed = last_suspend is not None and suspend != last_suspend
    if fresh_wake or (suspend_changed and not suspend):
        return CompletedAnswer.NOTHING_TO_RESUME
    if suspend_changed:
        return CompletedAnswer.NOTHING_TO_PAUSE
    return CompletedAnswer.NOTHING
