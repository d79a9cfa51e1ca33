"""A running task's children follow its spec, and its pod is rolled when the spec changes
what the pod is made of.

Every pass over a running task at rest applies its Sandbox (server-side, field manager
``crd.FIELD_MANAGER``), and its ServiceAccount and NetworkPolicy when the spec's
generation moved since they were last applied: an edit, or a hand edit of a child, is
undone by the next pass. A Sandbox's controller never changes a pod it has made, so an
edit of the image, env, ``podTemplate``, resources or runtime class reaches the pod only
through a roll: the pod's ``crd.POD_TEMPLATE_ANNOTATION`` (the hash of the template it
was made from) is compared with the spec's, and a pod made from another template is
drained into a checkpoint (a pause whose ``pausedBy`` is ``roll``), its Sandbox suspended
until the old pod is gone, then resumed on a new pod made from the spec; every agent
continues from the checkpoint.
"""

from __future__ import annotations

import kopf

from orchestrator.ledger import CheckpointReason, OperationKind
from orchestrator.operator import children, crd, kube, provisioning
from orchestrator.operator.lifecycle import ROLLED, Phase, Purpose, TaskSpec, operation_key
from orchestrator.operator.taskpass import TaskPass


async def follow_spec(p: TaskPass, spec: TaskSpec) -> bool:
    """Keep the task's children equal to its spec; True when its pod is stale and a roll
    has begun (the pass then waits for its drain)."""
    if not p.settings.manage_sandbox or spec.sandbox_name is not None:
        return False  # a Sandbox the task was given is the user's to change
    live = await kube.get_sandbox(spec.sandbox_version, p.namespace, p.sandbox_of(spec))
    if live is None:
        return False  # gone under the task: its daemon's silence brings it back (running)
    wanted = children.sandbox(p.task, spec, p.pvc_name, p.ctx.pod)
    if p.meta.get("generation") != p.status.applied_generation:
        live = await provisioning.create_sandbox(p, spec, p.pvc_name)
    elif not holds(live, wanted):
        live = await kube.apply_sandbox(spec.sandbox_version, wanted)
    provisioning.reflect_sandbox(p, live)
    template = wanted["spec"]["podTemplate"]["metadata"]["annotations"]
    made_from = template[crd.POD_TEMPLATE_ANNOTATION]
    stale = [
        pod
        for pod in await kube.task_pods(p.namespace, p.name)
        if not pod.terminating and pod.template not in (None, made_from)
    ]
    if not stale:
        p.set_condition(
            "PodCurrent", True, "Current", f"the pod is made from the spec ({made_from})"
        )
        return False
    await start_roll(p, spec, stale[0], made_from)
    return True


def holds(live: object, wanted: object) -> bool:
    """Whether ``live`` has every field ``wanted`` sets, with its value: what a server-side
    apply of ``wanted`` would leave unchanged (fields others set, and the API's defaults,
    are not ``wanted``'s to undo)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(
            key in live and holds(live[key], value) for key, value in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(live, list)
            and len(live) == len(wanted)
            and all(holds(have, want) for have, want in zip(live, wanted, strict=True))
        )
    return live == wanted


async def start_roll(p: TaskPass, spec: TaskSpec, pod: kube.TaskPod, wanted: str | None) -> None:
    """Drain the agents of ``pod`` (made from template ``pod.template``) into a
    checkpoint, as a pause does; the pause ends in a new pod (``suspended``)."""
    count = int(p.status.rolls or 0) + 1
    await p.begin_drain(
        spec,
        OperationKind.PAUSE,
        CheckpointReason.PAUSE,
        operation_key(p.uid, Purpose.ROLL, count),
    )
    message = (
        f"the spec changed what pod {pod.name} is made of (template {pod.template} → "
        f"{wanted}): draining its agents into a checkpoint, then a new pod resumes them"
    )
    kopf.info(p.body, reason="Rolling", message=message)
    p.set_condition("PodCurrent", False, "Rolling", message)
    p.set_status(rolls=count, paused_by=ROLLED)
    p.set_phase(Phase.DRAINING, f"rolling the pod: {message}")


async def old_pod_going(p: TaskPass, doing: str = "rolling the pod") -> str | None:
    """While a paused task's old pod is still there (Terminating while its daemon
    exits), what ``doing`` waits for; None once it is gone and the new pod may be made."""
    pods = await kube.task_pods(p.namespace, p.name)
    if not pods:
        return None
    names = ", ".join(sorted(pod.name for pod in pods))
    return (
        f"{doing}: waiting for pod {names} to go before a new one is made (its daemon "
        "would take the resume)"
    )


def rolled(p: TaskPass, ref: str | None) -> None:
    """Say that a rolled task resumes on a new pod."""
    message = f"a new pod is made from the spec; its agents resume from checkpoint {ref}"
    kopf.info(p.body, reason="Rolled", message=message)
    p.set_condition("PodCurrent", True, "Rolled", message)
