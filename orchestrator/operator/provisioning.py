"""Getting a task's pod up: the Sandbox version and Workspace binding a spec runs
against, the first provisioning (workspace PVC, ServiceAccount, NetworkPolicy, broker
Secret, Sandbox) or a restore's, a task created suspended, and a Sandbox deleted under a
running task re-created on the same workspace. The Sandbox's pod template is
``children.sandbox``'s; where a restore's workspace comes from is ``restore``'s.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator import broker_tenants
from orchestrator.ledger import (
    OperationKind,
)
from orchestrator.operator import blocking, children, kube, restore
from orchestrator.operator import workspace as workspaces
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle import (
    CREATED_SUSPENDED,
    Phase,
    Purpose,
    TaskSpec,
    default_sandbox_api_version,
    operation_key,
    sandbox_api_version_choice,
    sandbox_readiness,
    sandbox_service_fqdn,
    sandbox_suspension_patch,
    sandbox_version_problem,
    sandbox_workspace_claim,
)
from orchestrator.operator.pacing import Requeue
from orchestrator.operator.restore import NotYet, Refused, RestoreSource
from orchestrator.operator.taskpass import (
    TaskPass,
    ledger_call,
)
from orchestrator.settings import Settings

log = logging.getLogger(__name__)


async def resolve_sandbox_version(p: TaskPass, spec: TaskSpec) -> TaskSpec:
    """``spec`` with the Sandbox API version it talks to its Sandbox in
    (``sandbox_api_version_choice``): what the spec names, else what is pinned in
    ``status.sandboxApiVersion``, else what the cluster serves, read once and pinned.
    Nothing is pinned from a cluster with no Sandbox CRD (the task fails for that
    before anything is created), so once it is installed a corrected task asks
    again. Every handler resolves it before it touches the Sandbox (the timer's pass
    and the drain finalizer): an unresolved spec has no version to read it at."""
    version = sandbox_api_version_choice(
        spec.sandbox_api_version,
        p.status.sandbox_api_version,
        started=bool(p.status.sandbox_name),
    )
    if version is None:
        api = await kube.sandbox_api()
        version = default_sandbox_api_version(api)
        if api is not None:
            p.set_status(sandbox_api_version=version)
    else:
        p.set_status(sandbox_api_version=version)
    return spec.with_sandbox_api_version(version)


async def bind_workspace(p: TaskPass, spec: TaskSpec, phase: str | None) -> TaskSpec | None:
    """``spec`` run against its Workspace (``spec.workspaceRef``): the binding pinned in
    ``status.resolvedWorkspace``, else the Workspace read and resolved now, then
    pinned. None when it cannot be resolved: the condition ``WorkspaceResolved`` says
    why (one Warning event per reason), and a task not started yet waits, Pending,
    with nothing created, until it can."""
    assert spec.workspace_ref is not None
    binding = workspaces.Binding.from_status(p.status.resolved_workspace)
    if binding is None or binding.workspace != spec.workspace_ref:
        found = await kube.get_workspace(p.namespace, spec.workspace_ref)
        try:
            binding = workspaces.resolve(found, spec.workspace_ref, spec.provider_ref, spec.model)
        except workspaces.WorkspaceProblem as problem:
            said = [
                c.get("reason")
                for c in p.status.conditions or []
                if c.get("type") == "WorkspaceResolved"
            ]
            if said != [problem.reason]:
                kopf.warn(p.body, reason=problem.reason, message=str(problem))
            p.set_condition("WorkspaceResolved", False, problem.reason, str(problem))
            if phase in (None, Phase.PENDING):
                p.set_status(agents=0)
                p.set_phase(Phase.PENDING, str(problem))
            else:
                p.set_status(message=str(problem))
            return None
        p.set_status(resolved_workspace=binding.to_status())
    p.set_condition(
        "WorkspaceResolved",
        True,
        "Resolved",
        (
            f"provider {binding.provider} ({binding.kind}, model {binding.model}) and "
            f"{len(binding.sources)} source(s) of Workspace {binding.workspace}"
        ),
    )
    return spec.with_binding(binding)


async def provision(p: TaskPass, spec: TaskSpec) -> None:
    pvc_name = p.pvc_name
    if p.settings.manage_sandbox:
        problem = sandbox_version_problem(spec.sandbox_version, await kube.sandbox_api())
        if problem is not None:
            p.set_condition("SandboxCompatible", False, "SandboxVersionMismatch", problem)
            kopf.warn(p.body, reason="SandboxVersionMismatch", message=problem)
            p.set_status(agents=0)
            p.fail_before_start(f"{problem}; nothing was created")
            return
    restore_from = None
    source = RestoreSource(pvc_name)
    if spec.resume_from is not None:
        restore_from = await ledger_call(p.ledger.get_checkpoint, spec.resume_from)
        if restore_from is None:
            unknown_checkpoint(p, spec.resume_from)
            return
        found = await restore.restore_source(p, restore_from, spec)
        if isinstance(found, NotYet):
            p.set_phase(Phase.PENDING, found.why)
            if found.quiet:
                p.requeue = Requeue()  # woken by the snapshot follower, or the resync
            return
        if isinstance(found, Refused):
            p.set_condition("Resumed", False, found.reason, found.message)
            kopf.warn(p.body, reason=found.reason, message=found.message)
            p.set_status(agents=0)
            p.fail_before_start(found.message)
            return
        source = found
        pvc_name = source.pvc_name
    # status.agents counts agents running, from the daemon's heartbeats: none yet.
    sandbox = p.sandbox_of(spec)
    if p.settings.manage_sandbox and spec.sandbox_name is not None:
        # An existing Sandbox: operated on (woken here), never created; its workspace
        # is the PVC it mounts.
        existing = await kube.get_sandbox(spec.sandbox_version, p.namespace, sandbox)
        if existing is None:
            existing_sandbox_missing(p, sandbox)
            p.set_phase(Phase.PENDING, f"waiting for Sandbox {sandbox} to exist")
            return
        pvc_name = sandbox_workspace_claim(existing) or pvc_name
        p.set_condition("SandboxFound", True, "Found", f"Sandbox {sandbox} exists")
        reflect_sandbox(p, existing)
    p.set_status(
        pvc_name=pvc_name,
        sandbox_name=sandbox,
        agents=0,
        idle_since=None,
        applied_agents=spec.agents,
    )
    if p.settings.manage_sandbox and spec.sandbox_name is not None:
        await ensure_task_key(p)  # what the given Sandbox's pod reads its key from
        await kube.patch_sandbox(
            spec.sandbox_version,
            p.namespace,
            sandbox,
            sandbox_suspension_patch(spec.sandbox_version, False),
        )
    elif p.settings.manage_sandbox:
        await kube.ensure_pvc(
            children.workspace_pvc(
                p.task,
                pvc_name,
                source.storage or spec.storage,
                from_snapshot=source.snapshot,
                storage_class=spec.storage_class,
            )
        )
        await create_sandbox(p, spec, pvc_name)
    if restore_from is not None:
        await p.start_resume(
            restore_from.ref,
            operation_key(p.uid, Purpose.RESTORE),
            kind=OperationKind.RESTORE,
            # The restoring task's own model and provider, not the checkpoint's.
            provider=spec.provider,
            model=spec.model or None,
        )
        p.set_status(checkpoint_ref=restore_from.ref)
        p.set_phase(Phase.RESUMING, f"restoring from checkpoint {restore_from.ref}")
        return
    p.set_phase(Phase.PROVISIONING, "waiting for the daemon to report its agents")


def unknown_checkpoint(p: TaskPass, ref: str) -> None:
    message = f"spec.resumeFrom.checkpointRef: unknown checkpoint ref {ref!r} (not in the ledger)"
    p.set_condition("SpecValid", False, "UnknownCheckpoint", message)
    kopf.warn(p.body, reason="UnknownCheckpoint", message=message)
    p.fail_before_start(message)


async def hold_created_suspended(p: TaskPass, spec: TaskSpec) -> None:
    """A task created with ``suspend: true``: nothing is created or started until the
    spec says ``false`` (``wanted_transition``). A ``resumeFrom`` naming no checkpoint
    fails now, as it would on start; its workspace is judged and claimed on start."""
    ref = spec.resume_from
    if ref is not None and await ledger_call(p.ledger.get_checkpoint, ref) is None:
        unknown_checkpoint(p, ref)
        return
    then = f"restore checkpoint {spec.resume_from}" if spec.resume_from else "start it"
    p.set_status(agents=0, paused_by=CREATED_SUSPENDED)
    p.set_phase(
        Phase.SUSPENDED,
        (
            "created suspended (spec.lifecycle.suspend is true): nothing started; set "
            f"suspend to false (drainctl wake) to {then}"
        ),
    )
    p.requeue = Requeue()


async def ensure_sandbox(p: TaskPass, spec: TaskSpec) -> None:
    """Re-create the task's Sandbox if it was deleted under it (``kubectl delete
    sandbox``): the daemon is gone with it, and nothing else brings it back. The
    daemon comes back on the same workspace, finds its agents drained or crashed, and
    the recovery resumes them. Without the workspace PVC there is nothing to come
    back to: the task fails, saying so, rather than starting fresh agents."""
    if not p.settings.manage_sandbox:
        return
    version = spec.sandbox_version
    sandbox = p.sandbox_of(spec)
    found = await kube.get_sandbox(version, p.namespace, sandbox)
    if found is not None:
        if spec.sandbox_name is not None:
            p.set_condition("SandboxFound", True, "Found", f"Sandbox {sandbox} exists")
        reflect_sandbox(p, found)
        return
    if spec.sandbox_name is not None:
        existing_sandbox_missing(p, spec.sandbox_name)
        return
    pvc = p.pvc_name
    if await workspace_gone(p, f"Sandbox {p.namespace}/{sandbox} and its workspace PVC {pvc} are"):
        return
    if (waiting := await restore.last_pod_on(p, pvc, spec)) is not None:
        p.set_status(message=waiting.why)
        return
    message = (
        f"Sandbox {p.namespace}/{sandbox} was deleted under the task: re-creating it "
        f"on workspace PVC {pvc}; its agents resume from what they saved"
    )
    kopf.warn(p.body, reason="SandboxMissing", message=message)
    await create_sandbox(p, spec, pvc)


async def workspace_gone(p: TaskPass, what: str) -> bool:
    """Whether the task's workspace PVC is gone or being deleted. If it is, the task
    fails ``WorkspaceGone`` (``what`` says what is gone, with its verb: "workspace PVC
    X is") before any agent is started, as
    a resume or a re-made pod on a new, empty volume would start fresh agents under the
    old task; the checkpoints whose only workspace it was are marked unavailable."""
    pvc = p.pvc_name
    claim = await kube.get_pvc(p.namespace, pvc)
    if claim is not None and claim.metadata.deletion_timestamp is None:
        return False
    marked = await ledger_call(
        p.ledger.mark_workspace_gone,
        p.namespace,
        pvc,
        f"workspace PVC {pvc} deleted under task {p.namespace}/{p.name}",
    )
    message = f"{what} gone: nothing to bring the agents back on; no fresh agents were started"
    if marked:
        message += f"; marked unavailable in the ledger: {', '.join(marked)}"
    kopf.warn(p.body, reason="WorkspaceGone", message=message)
    p.set_condition("AgentsAvailable", False, "WorkspaceGone", message)
    p.set_status(agents=0)
    p.set_phase(Phase.FAILED, message)
    return True


async def refresh_sandbox(p: TaskPass, spec: TaskSpec) -> None:
    """Read the task's Sandbox once (as the task starts running) and reflect it."""
    if not p.settings.manage_sandbox:
        return
    found = await kube.get_sandbox(spec.sandbox_version, p.namespace, p.sandbox_of(spec))
    if found is not None:
        reflect_sandbox(p, found)


def reflect_sandbox(p: TaskPass, sandbox: Manifest) -> None:
    """What the Sandbox's controller reports, on the task: ``SandboxReady`` (its
    ``Ready`` condition) and ``status.serviceFQDN``."""
    p.apply_condition(sandbox_readiness(sandbox))
    p.set_status(service_fqdn=sandbox_service_fqdn(sandbox))


def existing_sandbox_missing(p: TaskPass, name: str) -> None:
    """``spec.sandbox.name`` names a Sandbox that is not there: say so and wait for
    it. The operator never makes a Sandbox it was told already exists (that would be
    a second one the user's tooling knows nothing of)."""
    message = (
        f"spec.sandbox.name names Sandbox {p.namespace}/{name}, which does not "
        "exist; the operator does not create it (create it, or unset spec.sandbox.name)"
    )
    if not any(
        c.get("type") == "SandboxFound" and c.get("status") == "False"
        for c in p.status.conditions or []
    ):  # one event, not one a pass
        kopf.warn(p.body, reason="SandboxNotFound", message=message)
    p.set_condition("SandboxFound", False, "SandboxNotFound", message)


async def daemons_url(settings: Settings, namespace: str) -> str:
    """The broker URL ``namespace``'s daemons get: their tenant user's, made (or made
    equal again) now, where the operator makes tenants; else the daemons' broker URL."""
    admin = settings.broker_admin_url
    tenants = broker_tenants.tenants_for(
        None if admin is None else admin.get_secret_value(),
        settings.daemons_broker_url,
        settings.message_key_bytes,
    )
    if tenants is None:
        return settings.daemons_broker_url
    return await blocking.in_thread(tenants.ensure, namespace)


async def create_sandbox(p: TaskPass, spec: TaskSpec, pvc_name: str) -> Manifest:
    """The task's Sandbox, after the namespace's broker Secret its pod reads, its
    ServiceAccount and its default-deny NetworkPolicy: each applied (server-side, by
    field manager ``crd.FIELD_MANAGER``), so created, or made equal to the spec where
    it is there already. The Sandbox as stored."""
    broker = p.settings.daemons_broker_url
    await kube.ensure_broker_secret(
        p.namespace, p.settings.daemon_broker_secret, await daemons_url(p.settings, p.namespace)
    )
    await ensure_task_key(p)
    await kube.apply_service_account(children.service_account(p.name, p.namespace, p.owner()))
    try:
        ports = workspaces.egress_ports(spec.binding) if spec.binding else ()
        peers = children.NetworkPeers.of(p.settings)
        policy = children.network_policy(p.name, p.namespace, p.owner(), broker, ports, peers)
    except ValueError as exc:  # a broker URL whose port cannot be told
        log.warning("network_policy_skipped reason=%r", str(exc))
    else:
        await kube.apply_network_policy(policy)
    p.set_status(applied_generation=p.meta.get("generation"))
    return await apply_sandbox(p, spec, pvc_name)


async def ensure_task_key(p: TaskPass) -> None:
    """The task's key Secret, where daemons sign (``signing``)."""
    if (message_key := p.settings.message_key_bytes) is not None:
        await kube.ensure_task_key(children.task_key_secret(p.task, message_key))


async def apply_sandbox(p: TaskPass, spec: TaskSpec, pvc_name: str) -> Manifest:
    """The task's Sandbox applied as ``children.sandbox`` builds it from the spec."""
    return await kube.apply_sandbox(
        spec.sandbox_version, children.sandbox(p.task, spec, pvc_name, p.ctx.pod)
    )
