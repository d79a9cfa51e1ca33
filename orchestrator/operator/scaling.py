"""``spec.task.agents`` changed on a running task: a scale-down drains the agents it
removes into a checkpoint before they go, a scale-up resumes retired agents first;
``status.scaling`` names the operation until ``follow_scaling`` sees it end.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.ledger import (
    CheckpointReason,
    OperationKind,
)
from orchestrator.ledger.models import CHECKPOINTED_STATES
from orchestrator.operator import snapshots
from orchestrator.operator.lifecycle import (
    AgentCounts,
    Purpose,
    ScaleStep,
    TaskSpec,
    operation_key,
    scale_outcome,
)
from orchestrator.operator.taskpass import (
    TaskPass,
    ledger_call,
)
from orchestrator.pipeline import start as pipeline

log = logging.getLogger(__name__)


async def start_scaling(p: TaskPass, spec: TaskSpec, step: ScaleStep, counts: AgentCounts) -> None:
    """Begin following a changed ``spec.task.agents``: a scale-down drains the agents
    it removes into a checkpoint before they go; a scale-up resumes agents an earlier
    scale-down retired, then spawns new ones. ``status.scaling`` holds the operation
    until ``follow_scaling`` sees it end."""
    number = int(p.status.scales or 0) + 1
    key = operation_key(p.uid, Purpose.SCALE, number)
    if step is ScaleStep.DOWN:
        op = await ledger_call(
            pipeline.start_drain,
            p.ctx.app,
            p.ledger,
            p.settings,
            namespace=p.namespace,
            name=p.name,
            task_uid=p.uid,
            grace_secs=spec.drain_grace_secs,
            kind=OperationKind.SCALE_DOWN,
            reason=CheckpointReason.SCALE_DOWN,
            pvc_name=p.pvc_name,
            idempotency_key=key,
            keep_agents=spec.agents,
        )
        message = (
            f"scaling from {counts.total} to {spec.agents} agents: draining "
            f"{counts.total - spec.agents} into a checkpoint before they go"
        )
    else:
        # The workspace's newest checkpoint, when a scale-down took it, holds agents
        # retired now: this scale-up resumes them first, so it names that checkpoint.
        newest = await ledger_call(p.ledger.newest_checkpoint_of_pvc, p.namespace, p.pvc_name)
        retired_in = newest.ref if newest and newest.reason is CheckpointReason.SCALE_DOWN else None
        op = await ledger_call(
            pipeline.start_scale_up,
            p.ctx.app,
            p.ledger,
            p.settings,
            namespace=p.namespace,
            name=p.name,
            task_uid=p.uid,
            agents=spec.agents,
            provider=spec.provider,
            model=spec.model or None,
            prompt=spec.prompt,
            idempotency_key=key,
            checkpoint_ref=retired_in,
        )
        message = (
            f"scaling from {counts.total} to {spec.agents} agents: resuming retired "
            "agents first, then starting new ones"
        )
    p.record_operation(op)
    p.set_status(
        scales=number,
        applied_agents=spec.agents,
        scaling={"operation": op.id, "from": counts.total, "to": spec.agents},
    )
    kopf.info(p.body, reason="Scaling", message=message)
    p.set_condition("Scaled", None, "Scaling", message)
    p.set_status(message=message)


async def follow_scaling(p: TaskPass) -> bool:
    """True while the scale operation ``status.scaling`` names is on its way (nothing
    else is decided for the task meanwhile); once it ends, its outcome as the
    ``Scaled`` condition and one event, and False."""
    scaling = p.status.scaling
    if not isinstance(scaling, dict):
        return False
    op = await ledger_call(p.ledger.get_operation, str(scaling.get("operation")))
    if op is None:
        p.set_status(scaling=None)
        return False
    p.record_operation(op)
    if not op.state.terminal:
        return True
    ref = op.checkpoint_ref if op.state in CHECKPOINTED_STATES else None
    if ref and not await snapshots.snapshot_cut(p, ref):
        return True  # the removed agents' workspace cut as they left it
    outcome = scale_outcome(
        op.kind,
        op.state,
        op.error,
        op.checkpoint_ref,
        int(scaling.get("from") or 0),
        int(scaling.get("to") or 0),
    )
    if outcome.status:
        kopf.info(p.body, reason=outcome.reason, message=outcome.message)
    else:
        kopf.warn(p.body, reason=outcome.reason, message=outcome.message)
    p.apply_condition(outcome)
    p.set_status(scaling=None, message=outcome.message)
    return False
