"""The ``Ready`` condition, from where a pass left the task (``readiness``)."""

from __future__ import annotations

from typing import Final

from orchestrator.operator.lifecycle.availability import AgentCounts, _agents_phrase
from orchestrator.operator.lifecycle.conditions import ConditionChange
from orchestrator.operator.lifecycle.phase import CREATED_SUSPENDED, Phase

READY: Final = "Ready"
"""The condition ``kubectl wait --for=condition=Ready ctask/NAME`` waits for."""

_NOT_READY_IN: Final[dict[str | None, tuple[str, str]]] = {
    None: ("Pending", "not provisioned yet"),
    Phase.PENDING: ("Pending", "not provisioned yet"),
    Phase.PROVISIONING: ("Provisioning", "waiting for the daemon to report its agents live"),
    Phase.RESUMING: ("Resuming", "waiting for the daemon to bring its agents back"),
    Phase.DRAINING: ("Draining", "draining agents to a checkpoint"),
    Phase.SUSPENDED: ("Paused", "paused: agents drained to a checkpoint, the Sandbox suspended"),
    Phase.COMPLETED: (
        "Completed",
        "completed: every agent finished its work, checkpointed, the Sandbox suspended",
    ),
    Phase.FAILED: ("Failed", "the task failed"),
}
"""Every phase but Running: why the task is not Ready, and what that means."""


_NEVER_STARTED: Final = ("Paused", "created suspended: nothing started")
"""Why a task ``CREATED_SUSPENDED`` is not Ready: paused, though nothing was drained."""


def readiness(
    phase: str | None,
    counts: AgentCounts | None,
    why: str | None = None,
    paused_by: str | None = None,
) -> ConditionChange:
    """The ``Ready`` condition: True exactly when the task is Running and every one of
    its agents is live by the daemon's latest heartbeat.

    ``counts`` is that heartbeat as this pass read it (None: none read); ``why`` is the
    status message, added to the message of a phase that is not Running; ``paused_by``
    is ``status.pausedBy``. A Running task whose heartbeat was not read this pass (it
    has just come back from a pause that failed) is ``Unknown`` until the next pass
    reads one, never True on trust."""
    if phase != Phase.RUNNING:
        reason, meaning = _NOT_READY_IN.get(phase, ("Pending", f"phase {phase}"))
        if phase == Phase.SUSPENDED and paused_by == CREATED_SUSPENDED:
            reason, meaning = _NEVER_STARTED
        return ConditionChange(READY, False, reason, f"{meaning}: {why}" if why else meaning)
    if counts is None:
        return ConditionChange(
            READY, None, "AgentsUnknown", "Running; no heartbeat from the daemon read yet"
        )
    if not counts.total:
        return ConditionChange(READY, False, "NoAgents", "Running, but the daemon runs no agents")
    phrase = _agents_phrase(counts)
    if counts.live == counts.total:
        return ConditionChange(READY, True, "AgentsLive", f"Running; {phrase}")
    reason = "AgentsNotLive" if counts.interrupted else "AgentsFinished"
    return ConditionChange(READY, False, reason, f"Running, but not every agent is live: {phrase}")
