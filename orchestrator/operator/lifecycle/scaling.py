"""Following a changed ``spec.task.agents``: whether to scale now (``scale_step``) and
what the finished operation says (``scale_outcome``)."""

from __future__ import annotations

from enum import StrEnum

from orchestrator.ledger import OperationKind, OperationState
from orchestrator.ledger.models import CHECKPOINTED_STATES
from orchestrator.operator.lifecycle.availability import AgentCounts
from orchestrator.operator.lifecycle.conditions import ConditionChange


class ScaleStep(StrEnum):
    HOLD = "hold"
    """Nothing to do: the agents follow ``spec.task.agents``, or no heartbeat from after
    the last operation has been read yet."""
    ADOPT = "adopt"
    """Record ``spec.task.agents`` as followed, with no operation: a task that has not
    recorded it yet (it started before the operator scaled), or a daemon that already
    runs that many agents."""
    DOWN = "down"
    """Drain the agents beyond ``spec.task.agents`` into a checkpoint, then retire them."""
    UP = "up"
    """Resume agents an earlier scale-down retired, then spawn new ones, up to
    ``spec.task.agents``."""


def scale_step(wanted: int, applied: object, counts: AgentCounts | None) -> ScaleStep:
    """What a Running task whose agents are all available does about ``spec.task.agents``.

    ``wanted`` is ``spec.task.agents``; ``applied`` is ``status.appliedAgents``, the value
    the agents last followed (set when the task started and at each scale; None: never
    recorded); ``counts`` is the daemon's heartbeat from after the last operation ended
    (None: none read yet), whose ``total`` is the task's agents (a retired one is not).

    Only a *change* of ``spec.task.agents`` scales: a restore runs the checkpoint's
    agents whatever the spec says, until the spec changes."""
    if not isinstance(applied, int) or isinstance(applied, bool):
        return ScaleStep.ADOPT
    if wanted == applied or counts is None:
        return ScaleStep.HOLD
    if counts.total > wanted:
        return ScaleStep.DOWN
    if counts.total < wanted:
        return ScaleStep.UP
    return ScaleStep.ADOPT


def scale_outcome(
    kind: OperationKind,
    state: OperationState,
    error: str | None,
    checkpoint_ref: str | None,
    from_agents: int,
    to_agents: int,
) -> ConditionChange:
    """The ``Scaled`` condition a finished scale operation earns (its event says the same:
    Normal when True, Warning otherwise). A scale-down whose drain failed leaves every
    agent where it was; a scale-up that brought some agents back but not all says which
    did not come."""
    change = f"from {from_agents} to {to_agents} agents"
    if kind is OperationKind.SCALE_DOWN:
        if state in CHECKPOINTED_STATES and checkpoint_ref:
            return ConditionChange(
                "Scaled",
                True,
                "ScaledDown",
                f"scaled {change}: the {from_agents - to_agents} removed agent(s) drained "
                f"into checkpoint {checkpoint_ref}",
            )
        return ConditionChange(
            "Scaled",
            False,
            "ScaleDownFailed",
            f"scaling {change} failed, no agent was removed: {error or state}",
        )
    if state is OperationState.RESUMED and not error:
        return ConditionChange("Scaled", True, "ScaledUp", f"scaled {change}")
    if state is OperationState.RESUMED:
        return ConditionChange(
            "Scaled", False, "PartlyScaledUp", f"scaling {change}: not every agent came: {error}"
        )
    return ConditionChange(
        "Scaled", False, "ScaleUpFailed", f"scaling {change} failed: {error or state}"
    )
