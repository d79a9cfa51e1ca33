"""One pass over a CalibanTask: what phase it is in decides which concern's step runs.

``run`` is what a steward (``operator.steward``) calls for each pass: it parses the spec
(a ``SpecError`` fails the task, naming the field), resolves the Sandbox version and the
Workspace binding, then hands the pass to the phase's module — ``provisioning`` (Pending),
``running`` (Provisioning, Resuming, Running), ``suspended`` (Draining, Suspended),
``completion`` (Completed) — and finally keeps the ``Snapshotted`` condition in step with
what the snapshot follower recorded (``snapshots.reflect_snapshot``) and the drain guard
in step with the last operation. Every decision those modules take is a ``lifecycle``
function's answer.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.ledger.models import TERMINAL_STATES
from orchestrator.operator import completion, kube, provisioning, running, snapshots, suspended
from orchestrator.operator.lifecycle import (
    Phase,
    SpecError,
    TaskSpec,
    Wanted,
    completing,
    retries_failure,
    unhonoured,
    wanted_transition,
)
from orchestrator.operator.pacing import Requeue
from orchestrator.operator.taskpass import (
    TaskPass,
)

log = logging.getLogger(__name__)


async def run(p: TaskPass) -> None:
    await advance(p)
    p.set_ready()
    p.correct_status()


async def advance(p: TaskPass) -> None:
    try:
        spec = p.parse(p.body.spec)
    except SpecError as exc:
        p.set_condition("SpecValid", False, exc.reason, str(exc))
        if p.phase != Phase.FAILED:
            kopf.warn(p.body, reason=exc.reason, message=str(exc))
        p.fail_before_start(str(exc))
        return
    p.set_condition("SpecValid", True, "Valid", "spec accepted")
    say_what_is_not_honoured(p, spec)
    p.set_status(observed_generation=p.meta.get("generation"))
    phase = p.phase
    if retries_failure(phase, p.status.failed_generation, p.meta.get("generation")):
        # Nothing was created: the Sandbox version is chosen again with the rest.
        p.set_status(failed_generation=None, sandbox_api_version=None)
        p.set_phase(Phase.PENDING, "the spec changed since the task failed: trying again")
        phase = Phase.PENDING
    spec = await provisioning.resolve_sandbox_version(p, spec)
    if spec.workspace_ref is not None:
        bound = await provisioning.bind_workspace(p, spec, phase)
        if bound is None:
            return
        spec = bound
    if phase in (None, Phase.PENDING):
        wanted = wanted_transition(spec, phase, None, p.wake_value(), p.status.last_wake)
        if wanted is Wanted.HOLD:
            await provisioning.hold_created_suspended(p, spec)
        else:
            await provisioning.provision(p, spec)
    elif phase in (Phase.PROVISIONING, Phase.RESUMING):
        await running.await_running(p, spec)
    elif phase == Phase.RUNNING:
        await running.while_running(p, spec)
    elif phase == Phase.DRAINING:
        await finish_draining(p, spec)
    elif phase == Phase.SUSPENDED:
        await suspended.while_suspended(p, spec)
    elif phase == Phase.COMPLETED:
        completion.while_completed(p, spec)
    elif phase == Phase.FAILED:
        p.requeue = Requeue()  # a changed spec (an event) is what tries it again
    await snapshots.reflect_snapshot(p)
    await guard_operation_in_progress(p)


async def guard_operation_in_progress(p: TaskPass) -> None:
    """The drain guard exists exactly while the task's last operation is on its way."""
    last = p.status.last_operation or {}
    in_progress = bool(last.get("id")) and last.get("state") not in TERMINAL_STATES
    if not p.settings.manage_sandbox or bool(p.status.drain_guard) == in_progress:
        return
    await kube.guard_against_eviction(p.namespace, p.name, p.owner(), in_progress)
    p.set_status(drain_guard=in_progress)


async def finish_draining(p: TaskPass, spec: TaskSpec) -> None:
    """A Draining task follows its drain: a pause's (``suspended``) or a completion's
    (``completion``); without one, it runs on."""
    op = await p.last_operation()
    if op is None:
        p.set_phase(Phase.RUNNING, "no pause operation to wait for")
        return
    p.record_operation(op)
    if completing(p.phase, op.kind):
        await completion.finish_completion(p, spec, op)
    else:
        await suspended.finish_pause(p, spec, op)


def say_what_is_not_honoured(p: TaskPass, spec: TaskSpec) -> None:
    """``SpecHonoured``: every field the spec sets is acted on, or which are not (fields
    of caliban-operator's spec this operator takes and does not act on yet), with one
    Warning event each time that list changes."""
    missing = unhonoured(spec)
    if not missing:
        p.set_condition("SpecHonoured", True, "Honoured", "every field the spec sets is acted on")
        return
    them = "it" if len(missing) == 1 else "them"
    message = (
        f"{', '.join(missing)}: taken, but not acted on by this operator; the task runs "
        f"without {them}"
    )
    said = [c.get("message") for c in p.status.conditions or [] if c.get("type") == "SpecHonoured"]
    if said != [message] and p.post_events:
        kopf.warn(p.body, reason="SpecNotHonoured", message=message)
    p.set_condition("SpecHonoured", False, "NotHonoured", message)
