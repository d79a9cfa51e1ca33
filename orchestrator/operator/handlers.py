"""The CalibanTask operator's kopf handlers: the imperative shell around ``lifecycle``.

This module owns the handlers kopf runs and the I/O of one pass: it reads the object,
the ledger (operations, checkpoints, daemon heartbeats) and the clock, asks
``lifecycle`` what to do, then begins operations through ``orchestrator.pipeline``,
patches Sandboxes and PVCs through ``kube``, and writes status and Events. It decides
nothing itself: every branch taken here is on a value a ``lifecycle`` function returned.

- a timer per task reconciles level-triggered: provisioning, Running once the daemon
  reports live agents, recovery of a daemon that restarted, idle pause,
  ``spec.lifecycle.suspend``, the wake annotation, a pause's drain → record → Sandbox
  suspend, and resume on re-activation; completion once every agent finished its work
  (drain → record → Sandbox suspend, phase Completed, the checkpoint kept); a task
  created suspended, which gets nothing (no PVC, Sandbox or operation) until the spec
  un-suspends it;
- the delete handler is the drain finalizer (``crd.FINALIZER``): drain, record,
  ``status.checkpointRef``, retain the PVC, release — or, past ``drainTimeout``, a
  forced checkpoint and a Warning event. Deletion never wedges.

Every operation is begun with the idempotency key ``lifecycle.operation_key`` derives
from the task's uid, so an operator restarted mid-drain finds its operation in the
ledger and waits for it instead of starting a second one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar, cast

import kopf
from kubernetes.utils import parse_quantity

from orchestrator import metrics
from orchestrator.ledger import (
    ActivityView,
    CheckpointReason,
    CheckpointView,
    Ledger,
    OperationKind,
    OperationState,
    OperationView,
)
from orchestrator.ledger.models import CHECKPOINTED_STATES, TERMINAL_STATES
from orchestrator.operator import children, crd, events, following, kube, permissions, serving  # noqa: F401 - serving: its startup handler
from orchestrator.operator import workspace as workspaces
from orchestrator.operator.batching import DrainBatcher
from orchestrator.operator.lifecycle import (
    CREATED_SUSPENDED,
    AgentCounts,
    Availability,
    AvailabilityDecision,
    CompletedAnswer,
    CompletionStep,
    ConditionChange,
    DeleteAction,
    LaunchStep,
    Phase,
    Purpose,
    RecoveryHistory,
    ScaleStep,
    SnapshotProgress,
    SpecError,
    TaskSpec,
    Wanted,
    adopts_pause_drain,
    availability,
    choose_snapshot_class,
    completed_request,
    completing,
    completion_step,
    condition,
    decide_delete,
    default_sandbox_api_version,
    heartbeat_silent,
    idle_report,
    launch_step,
    merge_conditions,
    on_existing_sandbox,
    operation_key,
    parse_spec,
    parse_time,
    readiness,
    resume_outcome,
    retries_failure,
    sandbox_api_version_choice,
    sandbox_readiness,
    sandbox_service_fqdn,
    sandbox_suspension_patch,
    sandbox_version_problem,
    sandbox_workspace_claim,
    scale_outcome,
    scale_step,
    should_idle_pause,
    snapshot_state,
    snapshot_timed_out,
    status_patch,
    wanted_transition,
)
from orchestrator.operator.pacing import (
    Beat,
    Rest,
    RunningWatch,
    beat_of,
    beat_signature,
    newer,
    next_look,
    streak_resets_at,
)
from orchestrator.pipeline import start as pipeline
from orchestrator.pipeline.app import app, daemon_queue
from orchestrator.pipeline.start import DrainStart
from orchestrator.pipeline.tasks import get_ledger
from orchestrator.settings import Settings, get_settings
from worker_agent.logformat import (
    LOG_FORMAT_ENV,
    LogSettings,
    bind_log_context,
    set_log_context,
)

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

DELETE_FOLLOW_SECS = 10.0
DELETE_POLL_SECS = 0.005
DAEMON_LOOK_SECS = 2.0
"""How often a deletion's drain looks whether a daemon is left to answer it."""
SNAPSHOT_POLL_SECS = 0.005
"""How often the deletions waiting for their checkpoints' snapshots look whether they are
ready (one list of them all), stretched by ``SNAPSHOT_POLL_PER_TASK`` for each."""
SNAPSHOT_POLL_PER_TASK = 0.0005
SNAPSHOT_LOOK_SECS = 1.0
"""How long a deletion waits on the shared snapshot poll before it asks again itself."""


@dataclass(frozen=True)
class RestoreSource:
    """Where a restoring task's workspace comes from: a fresh PVC filled from the
    checkpoint's VolumeSnapshot (``snapshot``), or the retained PVC itself, claimed for
    this task alone."""

    pvc_name: str
    snapshot: str | None = None
    storage: str | None = None
    """At least the snapshot's restore size (a PVC from a snapshot may not be smaller)."""


Refusal = tuple[str, str]
"""Why a restore cannot go ahead: (condition reason, message)."""


@dataclass(frozen=True)
class NotYet:
    """A restore that must wait (the workspace's last pod is still terminating)."""

    why: str


_DRAINS_BEGUN: DrainBatcher | None = None


def _drains() -> DrainBatcher:
    """The operator's one batcher of drains (``operator.batching``): the deletions, pauses
    and completions asked for together begin in one ledger write."""
    global _DRAINS_BEGUN
    if _DRAINS_BEGUN is None:
        _DRAINS_BEGUN = DrainBatcher(app, get_ledger, get_settings())
    return _DRAINS_BEGUN


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _arrived(activity: ActivityView) -> datetime:
    """When the orchestrator received the heartbeat (its clock); the daemon's stamp only
    for a row stored before the ledger kept receive stamps."""
    return activity.received_at or activity.reported_at


def _counts(activity: ActivityView) -> AgentCounts:
    return AgentCounts(
        total=activity.agents_total,
        live=activity.agents_live,
        interrupted=activity.agents_interrupted,
        done=activity.agents_done,
    )


_E = TypeVar("_E", OperationKind, OperationState)


def _member(enum: type[_E], value: object) -> _E | None:
    """``status.lastOperation``'s kind or state as the ledger's enum (None: unset, or a
    value this operator does not know)."""
    if not isinstance(value, str):
        return None
    try:
        return enum(value)
    except ValueError:
        return None


def _operation_status(op: OperationView) -> dict[str, Any]:
    """``status.lastOperation``: a field without a value is left out, as the API stores it
    (a merge patch drops a null), so an operation that has not moved writes nothing."""
    fields = {
        "id": op.id,
        "kind": str(op.kind),
        "state": str(op.state),
        "error": op.error,
        "startedAt": _iso(op.created_at),
        "finishedAt": _iso(op.finished_at),
    }
    return {k: v for k, v in fields.items() if v is not None}


async def _ledger_call(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """A blocking ledger (or pipeline) call in a thread, so kopf's event loop never waits
    on the database; typed through, so every call and its result are checked."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = crd.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=crd.KOPF_ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.KOPF_ANNOTATION_PREFIX, key=crd.KOPF_DIFFBASE_KEY
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 70
    # Only with --peering (standalone otherwise): see ``operator.peering``.
    settings.peering.lifetime = get_settings().peering_lifetime_secs
    kube.load_credentials()
    drain = get_settings()
    # A missing RBAC permission stops the operator here, named, instead of kopf retrying
    # a forbidden watch forever (``permissions``; drainctl operator exits with the line).
    permissions.check_startup(
        permissions.needs_of(manage_sandbox=drain.manage_sandbox, snapshots=drain.snapshots,
                             peering=drain.peering is not None),
        broker_secret=drain.daemon_broker_secret,
    )  # fmt: skip


# ----------------------------------------------------------------------- reconcile


class Reconciler:
    """One pass over one task: everything it decides is written to ``patch``."""

    def __init__(
        self,
        body: kopf.Body,
        patch: kopf.Patch,
        ledger: Ledger,
        settings: Settings,
    ) -> None:
        self.body = body
        self.patch = patch
        self.ledger = ledger
        self.settings = settings
        self.meta = body.meta
        self.status: dict[str, Any] = dict(body.status or {})
        self.namespace = str(self.meta.namespace)
        self.name = str(self.meta.name)
        self.uid = str(self.meta.uid)
        # Every record of this pass (ours, kopf's, the ledger's in its threads) names
        # the task; an operation id is bound once the pass knows it.
        set_log_context(namespace=self.namespace, name=self.name, task_uid=self.uid)
        self.now = _now()
        self.counts: AgentCounts | None = None
        """The daemon's latest heartbeat as this pass read it, for ``Ready``."""
        self.beat: Beat | None = None
        """The newest heartbeat this pass read, for its steward's deadlines."""
        self.rest: Rest | None = None
        """How the pass left the task (``pacing``): None while something is on its way."""
        self._class_ahead: tuple[str, asyncio.Task[tuple[str | None, str | None]]] | None = None
        """A workspace PVC and its snapshot class, looked up while its drain runs."""

    # -- status writing

    def set_status(self, **fields: Any) -> None:
        changed = status_patch(self.status, fields)
        self.patch.status.update(changed)
        self.status.update(changed)

    def set_phase(self, phase: Phase, message: str) -> None:
        if self.status.get("phase") != phase:
            kopf.info(self.body, reason=phase.value, message=message)
            self.set_status(phase=phase.value, phaseSince=_iso(self.now))
        self.set_status(message=message)

    def set_condition(self, type_: str, ok: bool | None, reason: str, message: str) -> None:
        new = condition(type_, ok, reason, message, self.now, self.meta.get("generation"))
        merged = merge_conditions(list(self.status.get("conditions") or []), new)
        self.set_status(conditions=merged)

    def apply_condition(self, change: ConditionChange) -> None:
        self.set_condition(change.type, change.status, change.reason, change.message)

    def record_operation(self, op: OperationView) -> None:
        self.set_status(lastOperation=_operation_status(op))
        bind_log_context(operation_id=op.id)

    def set_ready(self) -> None:
        """``Ready`` from where the pass left the task (its phase, the heartbeat read)."""
        phase = self.status.get("phase")
        why = None if phase == Phase.RUNNING else self.status.get("message")
        self.apply_condition(readiness(phase, self.counts, why, self.status.get("pausedBy")))

    # -- names

    @property
    def pvc_name(self) -> str:
        # The uid is part of the name: a task re-created under a deleted task's name is a
        # new task and must not pick up the old one's retained workspace (that is what
        # resumeFrom is for).
        return str(self.status.get("pvcName") or f"{self.name[:200]}-ws-{self.uid[:8]}")

    def owner(self) -> dict[str, Any]:
        return {
            "apiVersion": crd.API_VERSION,
            "kind": crd.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    # -- the pass

    def parse(self, spec: Any) -> TaskSpec:
        """The task's spec as the operator runs it (``lifecycle.parse_spec``, then
        ``lifecycle.on_existing_sandbox``); a ``SpecError`` names what is wrong."""
        parsed = parse_spec(dict(spec or {}))
        return on_existing_sandbox(parsed, self.name, self.settings.existing_sandboxes)

    async def run(self) -> None:
        await self.advance()
        self.set_ready()

    async def advance(self) -> None:
        try:
            spec = self.parse(self.body.spec)
        except SpecError as exc:
            self.set_condition("SpecValid", False, exc.reason, str(exc))
            if self.status.get("phase") != Phase.FAILED:
                kopf.warn(self.body, reason=exc.reason, message=str(exc))
            self.fail_before_start(str(exc))
            return
        self.set_condition("SpecValid", True, "Valid", "spec accepted")
        self.set_status(observedGeneration=self.meta.get("generation"))
        phase = self.status.get("phase")
        if retries_failure(phase, self.status.get("failedGeneration"), self.meta.get("generation")):
            # Nothing was created: the Sandbox version is chosen again with the rest.
            self.set_status(failedGeneration=None, sandboxApiVersion=None)
            self.set_phase(Phase.PENDING, "the spec changed since the task failed: trying again")
            phase = Phase.PENDING
        spec = await self.resolve_sandbox_version(spec)
        if spec.workspace_ref is not None:
            bound = await self.bind_workspace(spec, phase)
            if bound is None:
                return
            spec = bound
        if phase in (None, Phase.PENDING):
            wanted = wanted_transition(spec, phase, None, self.wake_value(),
                                       self.status.get("lastWake"))  # fmt: skip
            if wanted is Wanted.HOLD:
                await self.hold_created_suspended(spec)
            else:
                await self.provision(spec)
        elif phase in (Phase.PROVISIONING, Phase.RESUMING):
            await self.await_running(spec)
        elif phase == Phase.RUNNING:
            await self.while_running(spec)
        elif phase == Phase.DRAINING:
            await self.finish_pause(spec)
        elif phase == Phase.SUSPENDED:
            await self.while_suspended(spec)
        elif phase == Phase.COMPLETED:
            self.while_completed(spec)
        elif phase == Phase.FAILED:
            self.rest = Rest()  # a changed spec (an event) is what tries it again
        await self.guard_operation_in_progress()

    async def resolve_sandbox_version(self, spec: TaskSpec) -> TaskSpec:
        """``spec`` with the Sandbox API version it talks to its Sandbox in
        (``sandbox_api_version_choice``): what the spec names, else what is pinned in
        ``status.sandboxApiVersion``, else what the cluster serves, read once and pinned.
        Nothing is pinned from a cluster with no Sandbox CRD (the task fails for that
        before anything is created), so once it is installed a corrected task asks
        again. Every handler resolves it before it touches the Sandbox (the timer's pass
        and the drain finalizer): an unresolved spec has no version to read it at."""
        version = sandbox_api_version_choice(
            spec.sandbox_api_version, self.status.get("sandboxApiVersion"),
            started=bool(self.status.get("sandboxName")),
        )  # fmt: skip
        if version is None:
            api = await kube.sandbox_api()
            version = default_sandbox_api_version(api)
            if api is not None:
                self.set_status(sandboxApiVersion=version)
        else:
            self.set_status(sandboxApiVersion=version)
        return spec.with_sandbox_api_version(version)

    async def bind_workspace(self, spec: TaskSpec, phase: str | None) -> TaskSpec | None:
        """``spec`` run against its Workspace (``spec.workspaceRef``): the binding pinned in
        ``status.resolvedWorkspace``, else the Workspace read and resolved now, then
        pinned. None when it cannot be resolved: the condition ``WorkspaceResolved`` says
        why (one Warning event per reason), and a task not started yet waits, Pending,
        with nothing created, until it can."""
        assert spec.workspace_ref is not None
        binding = workspaces.Binding.from_status(self.status.get("resolvedWorkspace"))
        if binding is None or binding.workspace != spec.workspace_ref:
            found = await kube.get_workspace(self.namespace, spec.workspace_ref)
            try:
                binding = workspaces.resolve(found, spec.workspace_ref, spec.provider_ref,
                                             spec.model)  # fmt: skip
            except workspaces.WorkspaceProblem as problem:
                said = [c.get("reason") for c in self.status.get("conditions") or []
                        if c.get("type") == "WorkspaceResolved"]  # fmt: skip
                if said != [problem.reason]:
                    kopf.warn(self.body, reason=problem.reason, message=str(problem))
                self.set_condition("WorkspaceResolved", False, problem.reason, str(problem))
                if phase in (None, Phase.PENDING):
                    self.set_status(agents=0)
                    self.set_phase(Phase.PENDING, str(problem))
                else:
                    self.set_status(message=str(problem))
                return None
            self.set_status(resolvedWorkspace=binding.to_status())
        self.set_condition("WorkspaceResolved", True, "Resolved", (
            f"provider {binding.provider} ({binding.kind}, model {binding.model}) and "
            f"{len(binding.sources)} source(s) of Workspace {binding.workspace}"
        ))  # fmt: skip
        return spec.with_binding(binding)

    async def guard_operation_in_progress(self) -> None:
        """The drain guard exists exactly while the task's last operation is on its way."""
        last = self.status.get("lastOperation") or {}
        in_progress = bool(last.get("id")) and last.get("state") not in TERMINAL_STATES
        if not self.settings.manage_sandbox or bool(self.status.get("drainGuard")) == in_progress:
            return
        await kube.guard_against_eviction(self.namespace, self.name, self.owner(), in_progress)
        self.set_status(drainGuard=in_progress)

    async def provision(self, spec: TaskSpec) -> None:
        pvc_name = self.pvc_name
        if self.settings.manage_sandbox:
            problem = sandbox_version_problem(spec.sandbox_version, await kube.sandbox_api())
            if problem is not None:
                self.set_condition("SandboxCompatible", False, "SandboxVersionMismatch", problem)
                kopf.warn(self.body, reason="SandboxVersionMismatch", message=problem)
                self.set_status(agents=0)
                self.fail_before_start(f"{problem}; nothing was created")
                return
        restore_from = None
        source = RestoreSource(pvc_name)
        if spec.resume_from is not None:
            restore_from = await _ledger_call(self.ledger.get_checkpoint, spec.resume_from)
            if restore_from is None:
                self.unknown_checkpoint(spec.resume_from)
                return
            found = await self.restore_source(restore_from, spec)
            if isinstance(found, NotYet):
                self.set_phase(Phase.PENDING, found.why)
                return
            if not isinstance(found, RestoreSource):
                reason, message = found
                self.set_condition("Resumed", False, reason, message)
                kopf.warn(self.body, reason=reason, message=message)
                self.set_status(agents=0)
                self.fail_before_start(message)
                return
            source = found
            pvc_name = source.pvc_name
        # status.agents counts agents running, from the daemon's heartbeats: none yet.
        sandbox = self.sandbox_of(spec)
        if self.settings.manage_sandbox and spec.sandbox_name is not None:
            # An existing Sandbox: operated on (woken here), never created; its workspace
            # is the PVC it mounts.
            existing = await kube.get_sandbox(spec.sandbox_version, self.namespace, sandbox)
            if existing is None:
                self.existing_sandbox_missing(sandbox)
                self.set_phase(Phase.PENDING, f"waiting for Sandbox {sandbox} to exist")
                return
            pvc_name = sandbox_workspace_claim(existing) or pvc_name
            self.set_condition("SandboxFound", True, "Found", f"Sandbox {sandbox} exists")
            self.reflect_sandbox(existing)
        self.set_status(pvcName=pvc_name, sandboxName=sandbox, agents=0, idleSince=None,
                        appliedAgents=spec.agents)  # fmt: skip
        if self.settings.manage_sandbox and spec.sandbox_name is not None:
            await kube.patch_sandbox(
                spec.sandbox_version, self.namespace, sandbox,
                sandbox_suspension_patch(spec.sandbox_version, False),
            )  # fmt: skip
        elif self.settings.manage_sandbox:
            await kube.ensure_pvc(
                self.namespace, pvc_name, source.storage or spec.storage, self.owner(),
                self.name, from_snapshot=source.snapshot, storage_class=spec.storage_class,
            )  # fmt: skip
            await self.create_sandbox(spec, pvc_name)
        if restore_from is not None:
            op = await _ledger_call(
                pipeline.start_resume, app, self.ledger, self.settings,
                namespace=self.namespace, name=self.name, checkpoint_ref=restore_from.ref,
                task_uid=self.uid, kind=OperationKind.RESTORE,
                idempotency_key=operation_key(self.uid, Purpose.RESTORE),
                # The restoring task's own model and provider, not the checkpoint's.
                provider=spec.provider, model=spec.model or None,
            )  # fmt: skip
            self.record_operation(op)
            self.set_status(checkpointRef=restore_from.ref)
            self.set_phase(Phase.RESUMING, f"restoring from checkpoint {restore_from.ref}")
            return
        self.set_phase(Phase.PROVISIONING, "waiting for the daemon to report its agents")

    def unknown_checkpoint(self, ref: str) -> None:
        message = (
            f"spec.resumeFrom.checkpointRef: unknown checkpoint ref {ref!r} (not in the ledger)"
        )
        self.set_condition("SpecValid", False, "UnknownCheckpoint", message)
        kopf.warn(self.body, reason="UnknownCheckpoint", message=message)
        self.fail_before_start(message)

    def fail_before_start(self, message: str) -> None:
        """``Failed`` with nothing created for the task (a spec it cannot run, a checkpoint
        it cannot restore): the generation is kept in ``status.failedGeneration``, so a
        changed spec tries again (``retries_failure``)."""
        self.set_status(failedGeneration=self.meta.get("generation"))
        self.set_phase(Phase.FAILED, message)
        self.rest = Rest()

    async def hold_created_suspended(self, spec: TaskSpec) -> None:
        """A task created with ``suspend: true``: nothing is created or started until the
        spec says ``false`` (``wanted_transition``). A ``resumeFrom`` naming no checkpoint
        fails now, as it would on start; its workspace is judged and claimed on start."""
        ref = spec.resume_from
        if ref is not None and await _ledger_call(self.ledger.get_checkpoint, ref) is None:
            self.unknown_checkpoint(ref)
            return
        then = f"restore checkpoint {spec.resume_from}" if spec.resume_from else "start it"
        self.set_status(agents=0, pausedBy=CREATED_SUSPENDED)
        self.set_phase(Phase.SUSPENDED, (
            "created suspended (spec.lifecycle.suspend is true): nothing started; set "
            f"suspend to false (drainctl wake) to {then}"
        ))  # fmt: skip
        self.rest = Rest()

    async def restore_source(
        self, checkpoint: CheckpointView, spec: TaskSpec
    ) -> RestoreSource | Refusal | NotYet:
        """Where this task's workspace comes from when it restores ``checkpoint``, or why
        it cannot. Decided before anything is created: a restore whose workspace is
        missing, moved on, or another task's must fail, never start agents on the wrong
        state or beside another task's daemon.

        With the checkpoint's VolumeSnapshot ready, the task gets a fresh PVC filled from
        it: any number of tasks can restore one checkpoint, each into its own copy, and
        an older checkpoint restores exactly its own state. Without one (no CSI snapshots,
        or the snapshot failed), the retained PVC is all there is: it holds only its
        newest checkpoint and serves one task at a time, claimed here atomically.

        The workspace is a namespaced object, reachable only by a task in its own
        namespace. The rest is checked where this operator manages the workspace
        (``DRAIN_MANAGE_SANDBOX``); elsewhere the Sandbox controller owns it."""
        ref = checkpoint.ref
        owner = f"{checkpoint.namespace}/{checkpoint.name}"
        if checkpoint.namespace != self.namespace:
            return "CheckpointInAnotherNamespace", (
                f"checkpoint {ref} is of task {owner}: its workspace PVC is in namespace "
                f"{checkpoint.namespace}, which a task in {self.namespace} cannot mount; "
                f"create the restoring task in {checkpoint.namespace}; no agents were started"
            )
        if checkpoint.unavailable is not None:
            return "CheckpointWorkspaceGone", (
                f"checkpoint {ref} cannot be restored: {checkpoint.unavailable}; no agents "
                "were started"
            )
        if not self.settings.manage_sandbox:
            return RestoreSource(checkpoint.pvc_name or self.pvc_name)
        snapshot_gone = None
        if checkpoint.snapshot is not None:
            state = snapshot_state(await kube.get_snapshot(self.namespace, checkpoint.snapshot))
            if state.progress is SnapshotProgress.READY:
                return RestoreSource(
                    self.pvc_name, checkpoint.snapshot, _larger(spec.storage, state.restore_size)
                )
            snapshot_gone = f"its VolumeSnapshot {checkpoint.snapshot} no longer exists"
        return await self.claim_retained(checkpoint, snapshot_gone, spec)

    async def claim_retained(
        self, checkpoint: CheckpointView, snapshot_gone: str | None, spec: TaskSpec
    ) -> RestoreSource | Refusal | NotYet:
        """The checkpoint's retained PVC, claimed for this task, or why it cannot be."""
        ref, pvc = checkpoint.ref, checkpoint.pvc_name
        no_snapshot = snapshot_gone or "it has no VolumeSnapshot"
        for _ in range(3):  # a claim lost to a concurrent write is judged again
            found = None if pvc is None else await kube.get_pvc(self.namespace, pvc)
            if found is None or found.metadata.deletion_timestamp is not None:
                gone = (
                    f"its workspace PVC {self.namespace}/{pvc} no longer exists (deleted with "
                    "its namespace, or by hand)"
                    if pvc is not None
                    else "it names no workspace PVC"
                )
                if snapshot_gone is not None:
                    gone = f"{snapshot_gone} and {gone}"
                await _ledger_call(self.ledger.mark_checkpoint_unavailable, ref, gone)
                return "CheckpointWorkspaceGone", (
                    f"checkpoint {ref} cannot be restored: {gone}; no agents were started"
                )
            assert pvc is not None
            newest = await _ledger_call(self.ledger.newest_checkpoint_of_pvc, self.namespace, pvc)
            if newest is not None and newest.ref != ref:
                return "CheckpointSuperseded", (
                    f"checkpoint {ref} cannot be restored: {no_snapshot}, and its workspace "
                    f"PVC {pvc} has moved on to the newer checkpoint {newest.ref} of task "
                    f"{newest.namespace}/{newest.name}; a workspace without snapshots holds "
                    f"only its newest checkpoint: restore {newest.ref}; no agents were started"
                )
            holder = await self.holder_of(found)
            if holder is not None:
                return "WorkspaceInUse", (
                    f"checkpoint {ref} cannot be restored: {no_snapshot}, and its workspace "
                    f"PVC {pvc} is held by task {holder}; without a snapshot a workspace "
                    "serves one task at a time (never two daemons on one workspace): delete "
                    "that task, then restore the checkpoint its drain records; no agents "
                    "were started"
                )
            if (waiting := await self.last_pod_on(pvc, spec)) is not None:
                return waiting
            if any(o.uid == self.uid for o in found.metadata.owner_references or []):
                return RestoreSource(pvc)
            claimed = await kube.claim_pvc(
                self.namespace, pvc, str(found.metadata.resource_version), self.owner(),
                self.name,
            )  # fmt: skip
            if claimed:
                return RestoreSource(pvc)
        return "WorkspaceInUse", (
            f"checkpoint {ref} cannot be restored: its workspace PVC {pvc} kept changing "
            "while this task claimed it; no agents were started"
        )

    async def last_pod_on(self, pvc: str, spec: TaskSpec) -> NotYet | None:
        """Wait while a pod not of this task's Sandbox still mounts ``pvc``: the pod of
        a deleted task, Terminating while its daemon drains (an RWO volume can be
        mounted by two pods of one node). Starting another daemon on the workspace
        before it is gone would put two daemons on one store."""
        pods = await kube.pods_mounting(self.namespace, pvc)
        if not pods:
            return None
        ours = await kube.get_sandbox(spec.sandbox_version, self.namespace, self.sandbox_of(spec))
        owned = ours is not None and any(
            o.get("uid") == self.uid for o in ours["metadata"].get("ownerReferences") or []
        )
        mine = str(ours["metadata"]["uid"]) if ours is not None and owned else None
        others = sorted(
            name for name, controller in pods if controller is None or controller != mine
        )
        if not others:
            return None
        return NotYet(
            f"waiting for pod {', '.join(others)} to release workspace PVC {self.namespace}/"
            f"{pvc} before its agents start here (never two daemons on one workspace)"
        )

    async def holder_of(self, pvc: Any) -> str | None:
        """The live task other than this one that owns ``pvc`` (``ns/name``, and its phase
        when it is not running), or None. An owner reference to a task that is gone, or
        was re-created under its name, holds nothing."""
        for ref in pvc.metadata.owner_references or []:
            if ref.kind != crd.KIND or ref.uid == self.uid:
                continue
            task = await kube.get_task(self.namespace, ref.name)
            if task is None or task["metadata"].get("uid") != ref.uid:
                continue
            phase = (task.get("status") or {}).get("phase")
            state = ", being deleted" if task["metadata"].get("deletionTimestamp") else ""
            return f"{self.namespace}/{ref.name} ({phase or 'Pending'}{state})"
        return None

    async def snapshot_settled(self, ref: str) -> bool:
        """Whether checkpoint ``ref``'s workspace snapshot is settled: ready, failed, or
        not to be taken (no CSI snapshots). Until then the drained pod must stay (a
        pause does not suspend it, a deletion does not release it), so the snapshot
        copies the workspace exactly as the drain left it. Asks for the snapshot on the
        first call; the ledger records each step, so any pass, of any operator replica,
        carries on from where the last one was."""
        if not (self.settings.manage_sandbox and self.settings.snapshots):
            return True
        checkpoint = await _ledger_call(self.ledger.get_checkpoint, ref)
        if checkpoint is None or checkpoint.pvc_name is None:
            return True
        if checkpoint.snapshot_ready_at is not None or checkpoint.snapshot_error is not None:
            return True
        pvc, name = checkpoint.pvc_name, checkpoint.snapshot_name
        if name is None:
            class_name, problem = await self._snapshot_class_of(pvc)
            if problem is not None:
                await self.snapshot_failed(ref, None, problem)
                return True
            if class_name is None:
                return True  # the cluster offers no snapshots: the retained PVC it is
            name = ref  # one snapshot per checkpoint, named by it
            labels = {crd.CHECKPOINT_LABEL: ref, crd.TASK_LABEL: self.name,
                      crd.TASK_UID_LABEL: self.uid}  # fmt: skip
            await kube.create_snapshot(self.namespace, name, pvc, class_name, labels)
            await _ledger_call(self.ledger.record_snapshot, ref, name)
        state = snapshot_state(await kube.get_snapshot(self.namespace, name))
        self.now = _now()
        if state.progress is SnapshotProgress.READY:
            await _ledger_call(self.ledger.record_snapshot, ref, name, ready_at=self.now)
            message = f"checkpoint {ref}: workspace PVC {pvc} copied to VolumeSnapshot {name}"
            kopf.info(self.body, reason="Snapshotted", message=message)
            self.set_condition("Snapshotted", True, "SnapshotReady", message)
            return True
        timeout = self.settings.snapshot_ready_timeout_secs
        if not snapshot_timed_out(checkpoint.created_at, self.now, timeout):
            return False
        why = f"VolumeSnapshot {name} of PVC {pvc} was not ready within {timeout:g}s"
        if state.progress is SnapshotProgress.MISSING:
            why += " and no longer exists"
        elif state.error:
            why += f" (the snapshotter says: {state.error})"
        await self.snapshot_failed(ref, name, why)
        return True

    def look_up_snapshot_class_ahead(self) -> None:
        """While the workspace's drain runs, look up its snapshot class (four API reads),
        so the checkpoint's snapshot is asked for the moment the checkpoint is recorded.
        A lookup that fails is made again then, where its error is reported."""
        if self._class_ahead is not None or not self.status.get("pvcName"):
            return
        if not (self.settings.manage_sandbox and self.settings.snapshots):
            return
        lookup = asyncio.create_task(self.snapshot_class(self.pvc_name), name="snapshot class")
        lookup.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._class_ahead = (self.pvc_name, lookup)

    async def _snapshot_class_of(self, pvc_name: str) -> tuple[str | None, str | None]:
        ahead = self._class_ahead
        if ahead is not None and ahead[0] == pvc_name:
            with contextlib.suppress(Exception):
                return await ahead[1]
        return await self.snapshot_class(pvc_name)

    async def snapshot_class(self, pvc_name: str) -> tuple[str | None, str | None]:
        """The VolumeSnapshotClass for the workspace (None: the cluster offers none that
        fits), or a problem to report: a configured class that does not exist."""
        if not await kube.snapshots_served():
            return None, None
        classes = await kube.snapshot_classes()
        configured = self.settings.snapshot_class
        if configured is not None:
            if any(c.name == configured for c in classes):
                return configured, None
            return None, (
                f"DRAIN_SNAPSHOT_CLASS names VolumeSnapshotClass {configured}, which does not "
                f"exist (there are: {', '.join(c.name for c in classes) or 'none'})"
            )
        driver = await kube.storage_driver(await kube.get_pvc(self.namespace, pvc_name))
        return choose_snapshot_class(classes, driver), None

    async def snapshot_failed(self, ref: str, name: str | None, why: str) -> None:
        """The checkpoint goes without a snapshot, loudly: it is kept as the retained PVC
        only, restorable while it is that workspace's newest, by one task at a time."""
        await _ledger_call(self.ledger.record_snapshot, ref, name, error=why)
        message = (
            f"checkpoint {ref} has no snapshot: {why}; it is kept as the retained workspace "
            "PVC only"
        )
        kopf.warn(self.body, reason="SnapshotFailed", message=message)
        self.set_condition("Snapshotted", False, "SnapshotFailed", message)

    async def no_daemon_to_answer(self, spec: TaskSpec) -> str | None:
        """Why no daemon can answer this task's drain, or None: its Sandbox is gone (so
        nothing will start one) and its daemon silent. A deletion then takes its forced
        checkpoint at once rather than at drainTimeout; the daemon's own SIGTERM drain
        has flushed what the PVC holds."""
        if not self.settings.manage_sandbox:
            return None
        name = self.sandbox_of(spec)
        if await kube.get_sandbox(spec.sandbox_version, self.namespace, name):
            return None
        self.now = _now()  # a deletion's pass follows its drain for a while
        age = self.heartbeat_age(await self.latest_activity())
        if not heartbeat_silent(age, self.settings.heartbeat_interval_secs):
            return None
        silent = "ever" if age is None else f"for {age:.0f}s"
        return f"its Sandbox is gone and no heartbeat came from its daemon {silent}"

    async def ensure_sandbox(self, spec: TaskSpec) -> None:
        """Re-create the task's Sandbox if it was deleted under it (``kubectl delete
        sandbox``): the daemon is gone with it, and nothing else brings it back. The
        daemon comes back on the same workspace, finds its agents drained or crashed, and
        the recovery resumes them. Without the workspace PVC there is nothing to come
        back to: the task fails, saying so, rather than starting fresh agents."""
        if not self.settings.manage_sandbox:
            return
        version = spec.sandbox_version
        sandbox = self.sandbox_of(spec)
        found = await kube.get_sandbox(version, self.namespace, sandbox)
        if found is not None:
            if spec.sandbox_name is not None:
                self.set_condition("SandboxFound", True, "Found", f"Sandbox {sandbox} exists")
            self.reflect_sandbox(found)
            return
        if spec.sandbox_name is not None:
            self.existing_sandbox_missing(spec.sandbox_name)
            return
        pvc = self.pvc_name
        claim = await kube.get_pvc(self.namespace, pvc)
        if claim is None or claim.metadata.deletion_timestamp is not None:
            message = (
                f"Sandbox {self.namespace}/{sandbox} and its workspace PVC {pvc} are gone: "
                "nothing to bring the agents back on; no fresh agents were started"
            )
            kopf.warn(self.body, reason="WorkspaceGone", message=message)
            self.set_condition("AgentsAvailable", False, "WorkspaceGone", message)
            self.set_status(agents=0)
            self.set_phase(Phase.FAILED, message)
            return
        if (waiting := await self.last_pod_on(pvc, spec)) is not None:
            self.set_status(message=waiting.why)
            return
        message = (
            f"Sandbox {self.namespace}/{sandbox} was deleted under the task: re-creating it "
            f"on workspace PVC {pvc}; its agents resume from what they saved"
        )
        kopf.warn(self.body, reason="SandboxMissing", message=message)
        await self.create_sandbox(spec, pvc)

    async def refresh_sandbox(self, spec: TaskSpec) -> None:
        """Read the task's Sandbox once (as the task starts running) and reflect it."""
        if not self.settings.manage_sandbox:
            return
        found = await kube.get_sandbox(spec.sandbox_version, self.namespace, self.sandbox_of(spec))
        if found is not None:
            self.reflect_sandbox(found)

    def reflect_sandbox(self, sandbox: dict[str, Any]) -> None:
        """What the Sandbox's controller reports, on the task: ``SandboxReady`` (its
        ``Ready`` condition) and ``status.serviceFQDN``."""
        self.apply_condition(sandbox_readiness(sandbox))
        self.set_status(serviceFQDN=sandbox_service_fqdn(sandbox))

    def sandbox_of(self, spec: TaskSpec) -> str:
        """The name of the Sandbox this task drains, suspends and resumes."""
        return crd.sandbox_name(self.name, spec.sandbox_name)

    def existing_sandbox_missing(self, name: str) -> None:
        """``spec.sandbox.name`` names a Sandbox that is not there: say so and wait for
        it. The operator never makes a Sandbox it was told already exists (that would be
        a second one the user's tooling knows nothing of)."""
        message = (
            f"spec.sandbox.name names Sandbox {self.namespace}/{name}, which does not "
            "exist; the operator does not create it (create it, or unset spec.sandbox.name)"
        )
        if not any(
            c.get("type") == "SandboxFound" and c.get("status") == "False"
            for c in self.status.get("conditions") or []
        ):  # one event, not one a pass
            kopf.warn(self.body, reason="SandboxNotFound", message=message)
        self.set_condition("SandboxFound", False, "SandboxNotFound", message)

    async def create_sandbox(self, spec: TaskSpec, pvc_name: str) -> None:
        """The task's Sandbox, after the namespace's broker Secret its pod reads, its
        ServiceAccount and its default-deny NetworkPolicy."""
        broker = self.settings.daemon_broker_url or self.settings.broker_url
        await kube.ensure_broker_secret(self.namespace, self.settings.daemon_broker_secret,
                                        broker)  # fmt: skip
        await kube.ensure_service_account(
            children.service_account(self.name, self.namespace, self.owner())
        )
        try:
            ports = workspaces.egress_ports(spec.binding) if spec.binding else ()
            policy = children.network_policy(self.name, self.namespace, self.owner(), broker,
                                             ports)  # fmt: skip
        except ValueError as exc:  # a broker URL whose port cannot be told
            log.warning("network_policy_skipped reason=%r", str(exc))
        else:
            await kube.ensure_network_policy(policy)
        await kube.create_sandbox(spec.sandbox_version, self.namespace,
                                  self.sandbox_body(spec, pvc_name))  # fmt: skip

    def sandbox_body(self, spec: TaskSpec, pvc_name: str) -> dict[str, Any]:
        args = [
            "daemon", "--store", crd.WORKSPACE_MOUNT,
            "--socket", f"{crd.RUN_MOUNT}/{crd.DAEMON_SOCKET_FILE}",
            "--queue", daemon_queue(self.namespace, self.name), "--task-uid", self.uid,
            "--drain-grace", str(spec.drain_grace_secs),
            "--initial-agents", str(spec.agents), "--initial-provider", spec.provider,
        ]  # fmt: skip
        if spec.model:
            args += ["--initial-model", spec.model]
        if spec.prompt:
            args += ["--initial-prompt", spec.prompt]
        args += ["--metrics-port", str(crd.DAEMON_METRICS_PORT)]
        # The URL may hold a password: the pod reads it from the namespace's Secret
        # (``ensure_broker_secret``), so it is never in the Sandbox spec.
        broker = {"secretKeyRef": {"name": self.settings.daemon_broker_secret,
                                   "key": crd.BROKER_SECRET_KEY}}  # fmt: skip
        pod_spec: dict[str, Any] = {
            "serviceAccountName": children.service_account_name(self.name),
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": int(spec.drain_grace_secs) + 30,
            "containers": [
                {
                    "name": "caliband",
                    "image": spec.image or self.settings.daemon_image,
                    "command": ["drainctl"],
                    "args": args,
                    "env": [
                        {"name": crd.BROKER_URL_ENV, "valueFrom": broker},
                        # The operator's own log format, so one DRAIN_LOG_FORMAT sets all.
                        {"name": LOG_FORMAT_ENV, "value": LogSettings().log_format},
                        *({"name": n, "value": v} for n, v in spec.env),
                    ],
                    "ports": [{"name": "metrics", "containerPort": crd.DAEMON_METRICS_PORT}],
                    "livenessProbe": dict(crd.DAEMON_LIVENESS_PROBE),
                    "readinessProbe": dict(crd.DAEMON_READINESS_PROBE),
                    "volumeMounts": [
                        {"name": "workspace", "mountPath": crd.WORKSPACE_MOUNT},
                        {"name": crd.RUN_VOLUME, "mountPath": crd.RUN_MOUNT},
                    ],
                }
            ],
            "volumes": [
                {"name": "workspace", "persistentVolumeClaim": {"claimName": pvc_name}},
                {"name": crd.RUN_VOLUME, "emptyDir": {}},
            ],
        }
        if spec.binding is not None:
            # The Workspace's provider (its key through secretKeyRef), its sources'
            # mounts, and the init container that clones them once.
            parts = workspaces.pod_parts(spec.binding, pod_spec["containers"][0]["image"])
            pod_spec["containers"][0]["env"] += parts["env"]
            pod_spec["containers"][0]["volumeMounts"] += parts["volumeMounts"]
            pod_spec["initContainers"] = parts["initContainers"]
        suspended = sandbox_suspension_patch(spec.sandbox_version, False)["spec"]
        pod_labels = {crd.TASK_LABEL: self.name, crd.COMPONENT_LABEL: crd.DAEMON_COMPONENT}
        return {
            "apiVersion": spec.sandbox_version,
            "kind": crd.SANDBOX_KIND,
            "metadata": {
                "name": crd.sandbox_name(self.name),
                "namespace": self.namespace,
                "ownerReferences": [self.owner()],
                "labels": {crd.TASK_LABEL: self.name},
            },
            "spec": {
                **suspended,
                # The task label is how the drain guard (a PodDisruptionBudget) finds the
                # pod; the component label is what the daemon NetworkPolicy selects.
                # The user's spec.sandbox.podTemplate goes under ours: what it adds is
                # kept, what it sets that we set is ours.
                "podTemplate": children.merge_under(
                    {"metadata": {"labels": pod_labels}, "spec": pod_spec}, spec.pod_template
                ),
            },
        }

    async def fresh_activity(self) -> ActivityView | None:
        """The daemon's latest heartbeat, if it is from this task and this phase.

        "This phase" is judged by when the orchestrator received it, never by the
        daemon's own clock, which may be any distance from this one (a row stored before
        the ledger kept receive stamps has only the daemon's)."""
        activity = await self.latest_activity()
        if activity is None:
            return None
        since = parse_time(self.status.get("phaseSince"))
        if since is not None and _arrived(activity) < since:
            return None
        return activity

    async def latest_activity(self) -> ActivityView | None:
        """The daemon's latest heartbeat, if it is from this task."""
        activity = await _ledger_call(self.ledger.get_activity, self.namespace, self.name)
        if activity is None or (activity.task_uid not in (None, self.uid)):
            return None
        self.beat = newer(self.beat, beat_of(activity))
        return activity

    def recovery_history(self) -> RecoveryHistory:
        return RecoveryHistory(
            count=int(self.status.get("recoveries") or 0),
            streak=int(self.status.get("recoveryStreak") or 0),
            last_at=parse_time(self.status.get("lastRecoveryAt")),
        )

    def heartbeat_age(self, activity: ActivityView | None) -> float | None:
        if activity is None:
            return None
        return max(0.0, (self.now - _arrived(activity)).total_seconds())

    async def since_last_operation(self, activity: ActivityView) -> bool:
        """Whether the heartbeat reached the ledger after the last operation finished, so
        it shows what that operation left (a recovery's agents live), not what it found."""
        op = await self.last_operation()
        if op is None or op.finished_at is None:
            return op is None
        return _arrived(activity) > op.finished_at

    async def await_running(self, spec: TaskSpec) -> None:
        op = await self.last_operation()
        if op is not None:
            self.record_operation(op)
            outcome = resume_outcome(op.state, op.error)
            if outcome.condition is not None:
                self.apply_condition(outcome.condition)
                if outcome.condition.reason == "CheckpointMismatch":
                    # Not recovered either: a recovery would resume what the checkpoint
                    # does not hold, the very thing the check refused.
                    if self.status.get("phase") != Phase.FAILED:
                        kopf.warn(self.body, reason="CheckpointMismatch", message=str(op.error))
                    self.set_status(agents=0)
                    self.set_phase(Phase.FAILED, str(op.error))
                    return
            if outcome.still_resuming:
                return
        activity = await self.fresh_activity()
        if self.status.get("phase") == Phase.PROVISIONING and heartbeat_silent(
            self.heartbeat_age(await self.latest_activity()), self.settings.heartbeat_interval_secs
        ):
            await self.ensure_sandbox(spec)
            if self.status.get("phase") == Phase.FAILED:
                return
        if activity is not None and not await self.since_last_operation(activity):
            return  # a heartbeat from before the resume finished: wait for the next one
        reported = None
        if activity is not None:
            reported = self.counts = _counts(activity)
        step = launch_step(self.status.get("phase"), reported)
        # Without a heartbeat launch_step answers WAIT: both branches below have one.
        if step is LaunchStep.RUNNING:
            assert activity is not None and reported is not None
            self.set_status(agents=activity.agents_live)
            self.apply_condition(
                availability(
                    reported,
                    0.0,
                    self.settings.heartbeat_interval_secs,
                    self.recovery_history(),
                    self.now,
                ).condition
            )
            self.recovered(reported)
            self.consume_wake()
            await self.refresh_sandbox(spec)
            self.set_phase(Phase.RUNNING, f"{activity.agents_live} agents live")
        elif step is LaunchStep.RECOVER:
            assert activity is not None and reported is not None
            await self.act_on(self.availability(reported, activity), spec, reported)

    def availability(self, counts: AgentCounts, activity: ActivityView) -> AvailabilityDecision:
        return availability(
            counts, self.heartbeat_age(activity), self.settings.heartbeat_interval_secs,
            self.recovery_history(), self.now,
        )  # fmt: skip

    async def while_running(self, spec: TaskSpec) -> None:
        if await self.follow_scaling():
            return  # a pause, a completion or a further scale waits for the agents to settle
        activity = await self.latest_activity()
        counts = self.counts = None if activity is None else _counts(activity)
        if await self.complete_when_done(spec, counts, activity):
            return
        wanted = wanted_transition(
            spec, Phase.RUNNING, None, self.wake_value(), self.status.get("lastWake")
        )
        if wanted is Wanted.PAUSE:
            await self.start_pause(spec, "manual")
            return
        decision = availability(
            counts, self.heartbeat_age(activity), self.settings.heartbeat_interval_secs,
            self.recovery_history(), self.now,
        )  # fmt: skip
        if activity is not None:
            self.set_status(agents=activity.agents_live)
        if decision.step is Availability.AVAILABLE:
            assert counts is not None and activity is not None
            self.apply_condition(decision.condition)
            if decision.streak_over:
                self.set_status(recoveryStreak=0)
            self.recovered(counts)
            self.consume_wake()
            self.set_phase(Phase.RUNNING, decision.condition.message)
            fresh = await self.fresh_activity()
            # idleSince is the daemon's wall clock, shown as it is; the decision never
            # reads it.
            idle_since = fresh.all_idle_since if fresh is not None else None
            self.set_status(idleSince=_iso(idle_since))
            since = counts if await self.since_last_operation(activity) else None
            step = scale_step(spec.agents, self.status.get("appliedAgents"), since)
            if step is ScaleStep.ADOPT:
                self.set_status(appliedAgents=spec.agents)
            elif step is not ScaleStep.HOLD:
                await self.start_scaling(spec, step, counts)
                return
            elif spec.agents != self.status.get("appliedAgents"):
                return  # a scale waits for a heartbeat from after the last operation
            bridge = self.settings.heartbeat_gap_secs
            if should_idle_pause(spec, Phase.RUNNING, idle_report(fresh), self.now, bridge):
                await self.start_pause(spec, "idle")
                return
            history = self.recovery_history()
            self.rest = Rest(RunningWatch(
                beat_signature(activity), spec.idle_timeout_secs,
                streak_resets_at(0 if decision.streak_over else history.streak,
                                 history.last_at),
                fresh_since=parse_time(self.status.get("phaseSince")),
            ))  # fmt: skip
            return
        # Stopped or unknown agents are never idle: nothing to pause.
        self.set_status(idleSince=None)
        if decision.step is Availability.DAEMON_SILENT:
            self.apply_condition(decision.condition)
            self.set_status(agents=0)  # none is known to run
            self.disrupted("DaemonSilent", decision.condition.message)
            await self.ensure_sandbox(spec)
            self.set_phase(Phase.PROVISIONING, f"waiting for the daemon: "
                                               f"{decision.condition.message}")  # fmt: skip
            return
        assert counts is not None and activity is not None
        if not await self.since_last_operation(activity):
            return  # what a recovery found, not what it left: wait for the next heartbeat
        await self.act_on(decision, spec, counts)

    async def act_on(
        self, decision: AvailabilityDecision, spec: TaskSpec, counts: AgentCounts
    ) -> None:
        """Begin a recovery of interrupted agents, or say why not yet."""
        if decision.step is Availability.CRASH_LOOP and self.rearmed():
            decision = AvailabilityDecision(Availability.RECOVER, decision.condition)
            self.set_status(recoveryStreak=0)
        self.apply_condition(decision.condition)
        if decision.step is Availability.RECOVER:
            await self.start_recovery(counts, decision.condition.reason,
                                      streak_over=decision.streak_over)  # fmt: skip
            return
        if decision.step is Availability.CRASH_LOOP:
            self.disrupted("CrashLoop", decision.condition.message)
        self.set_phase(Phase.RUNNING, decision.condition.message)

    async def start_scaling(self, spec: TaskSpec, step: ScaleStep, counts: AgentCounts) -> None:
        """Begin following a changed ``spec.task.agents``: a scale-down drains the agents
        it removes into a checkpoint before they go; a scale-up resumes agents an earlier
        scale-down retired, then spawns new ones. ``status.scaling`` holds the operation
        until ``follow_scaling`` sees it end."""
        number = int(self.status.get("scales") or 0) + 1
        key = operation_key(self.uid, Purpose.SCALE, number)
        if step is ScaleStep.DOWN:
            op = await _ledger_call(
                pipeline.start_drain, app, self.ledger, self.settings,
                namespace=self.namespace, name=self.name, task_uid=self.uid,
                grace_secs=spec.drain_grace_secs, kind=OperationKind.SCALE_DOWN,
                reason=CheckpointReason.SCALE_DOWN, pvc_name=self.pvc_name,
                idempotency_key=key, keep_agents=spec.agents,
            )  # fmt: skip
            message = (
                f"scaling from {counts.total} to {spec.agents} agents: draining "
                f"{counts.total - spec.agents} into a checkpoint before they go"
            )
        else:
            # The workspace's newest checkpoint, when a scale-down took it, holds agents
            # retired now: this scale-up resumes them first, so it names that checkpoint.
            newest = await _ledger_call(
                self.ledger.newest_checkpoint_of_pvc, self.namespace, self.pvc_name
            )
            retired_in = (
                newest.ref if newest and newest.reason is CheckpointReason.SCALE_DOWN else None
            )
            op = await _ledger_call(
                pipeline.start_scale_up, app, self.ledger, self.settings,
                namespace=self.namespace, name=self.name, task_uid=self.uid,
                agents=spec.agents, provider=spec.provider, model=spec.model or None,
                prompt=spec.prompt, idempotency_key=key, checkpoint_ref=retired_in,
            )  # fmt: skip
            message = (
                f"scaling from {counts.total} to {spec.agents} agents: resuming retired "
                "agents first, then starting new ones"
            )
        self.record_operation(op)
        self.set_status(
            scales=number, appliedAgents=spec.agents,
            scaling={"operation": op.id, "from": counts.total, "to": spec.agents},
        )  # fmt: skip
        kopf.info(self.body, reason="Scaling", message=message)
        self.set_condition("Scaled", None, "Scaling", message)
        self.set_status(message=message)

    async def follow_scaling(self) -> bool:
        """True while the scale operation ``status.scaling`` names is on its way (nothing
        else is decided for the task meanwhile); once it ends, its outcome as the
        ``Scaled`` condition and one event, and False."""
        scaling = self.status.get("scaling")
        if not isinstance(scaling, dict):
            return False
        op = await _ledger_call(self.ledger.get_operation, str(scaling.get("operation")))
        if op is None:
            self.set_status(scaling=None)
            return False
        self.record_operation(op)
        if not op.state.terminal:
            return True
        ref = op.checkpoint_ref if op.state in CHECKPOINTED_STATES else None
        if ref and not await self.snapshot_settled(ref):
            return True  # the removed agents' workspace copied as they left it
        outcome = scale_outcome(
            op.kind, op.state, op.error, op.checkpoint_ref, int(scaling.get("from") or 0),
            int(scaling.get("to") or 0),
        )  # fmt: skip
        if outcome.status:
            kopf.info(self.body, reason=outcome.reason, message=outcome.message)
        else:
            kopf.warn(self.body, reason=outcome.reason, message=outcome.message)
        self.apply_condition(outcome)
        self.set_status(scaling=None, message=outcome.message)
        return False

    def rearmed(self) -> bool:
        """A new wake annotation value: the user asks to try a crash-looping task again."""
        wake = self.wake_value()
        if not wake or wake == self.status.get("lastWake"):
            return False
        self.set_status(lastWake=wake)
        return True

    async def start_recovery(self, counts: AgentCounts, why: str, *, streak_over: bool) -> None:
        history = self.recovery_history()
        number = history.count + 1
        streak = (0 if streak_over else history.streak) + 1
        op = await _ledger_call(
            pipeline.start_resume, app, self.ledger, self.settings,
            namespace=self.namespace, name=self.name, checkpoint_ref=None, task_uid=self.uid,
            idempotency_key=operation_key(self.uid, Purpose.RECOVER, number),
        )  # fmt: skip
        self.record_operation(op)
        cause = {
            "DaemonRestarted": "the daemon restarted",
            "AgentsStopped": "agents stopped in a running daemon",
        }.get(why, why)
        message = (
            f"resuming {counts.interrupted} interrupted agent"
            f"{'s' if counts.interrupted != 1 else ''}: {cause} (recovery {number})"
        )
        kopf.warn(self.body, reason="AgentsInterrupted", message=message)
        self.set_status(
            recoveries=number, recoveryStreak=streak, lastRecoveryAt=_iso(self.now),
            disruptedAt=self.status.get("disruptedAt") or _iso(self.now),
        )  # fmt: skip
        self.set_phase(Phase.RESUMING, message)

    def disrupted(self, reason: str, message: str) -> None:
        """A Warning event once per disruption (not once per pass), and its start time."""
        if self.status.get("disruptedAt") and self.status.get("disruption") == reason:
            return
        kopf.warn(self.body, reason=reason, message=message)
        self.set_status(disruption=reason, disruptedAt=self.status.get("disruptedAt")
                        or _iso(self.now))  # fmt: skip

    def recovered(self, counts: AgentCounts) -> None:
        """The Normal event that ends a disruption: every agent with work left is live."""
        since = parse_time(self.status.get("disruptedAt"))
        if since is None or counts.interrupted:
            return
        secs = (self.now - since).total_seconds()
        kopf.info(
            self.body,
            reason="Recovered",
            message=f"{counts.live} agents live again {secs:.1f}s after the disruption",
        )
        self.set_status(disruptedAt=None, disruption=None)  # fmt: skip

    def consume_wake(self) -> None:
        """A wake that arrives while the task runs, or while it comes back, asks for
        nothing more than it has: it is spent here, so it cannot resume the task the
        moment it next pauses. (A crash-looping task is not Available: a wake then still
        re-arms its recoveries.)"""
        wake = self.wake_value()
        if wake:
            self.set_status(lastWake=wake)

    def wake_value(self) -> str | None:
        value = self.meta.annotations.get(crd.WAKE_ANNOTATION)
        return None if value is None else str(value)

    async def start_pause(self, spec: TaskSpec, paused_by: str) -> None:
        count = int(self.status.get("pauses") or 0) + 1
        await self.begin_drain(spec, OperationKind.PAUSE, CheckpointReason.PAUSE,
                               operation_key(self.uid, Purpose.PAUSE, count))  # fmt: skip
        self.set_status(pauses=count, pausedBy=paused_by)
        why = "every agent idle" if paused_by == "idle" else "spec.lifecycle.suspend is true"
        self.set_phase(Phase.DRAINING, f"pausing: {why}; draining agents")

    async def begin_drain(
        self, spec: TaskSpec, kind: OperationKind, reason: CheckpointReason, key: str
    ) -> None:
        """Begin the drain → record chain of a pause or a completion under ``key``; the
        phase is the caller's to set."""
        op = await _drains().begin(DrainStart(
            self.namespace, self.name, task_uid=self.uid, grace_secs=spec.drain_grace_secs,
            kind=kind, reason=reason, pvc_name=self.pvc_name, idempotency_key=key,
        ))  # fmt: skip
        self.record_operation(op)

    async def suspend_checkpointed(self, spec: TaskSpec, ref: str, doing: str) -> bool:
        """Once checkpoint ``ref``'s snapshot has settled, suspend the Sandbox (compute
        released, the workspace PVC kept) and write ``ref`` to the task; False while the
        snapshot is still being taken (phase Draining, ``doing`` says what for)."""
        if not await self.snapshot_settled(ref):
            self.set_phase(Phase.DRAINING, f"{doing}: agents drained; snapshotting the "
                                           f"workspace for {ref}")  # fmt: skip
            return False
        if self.settings.manage_sandbox:
            await kube.patch_sandbox(
                spec.sandbox_version, self.namespace, self.sandbox_of(spec),
                sandbox_suspension_patch(spec.sandbox_version, True),
            )  # fmt: skip
        self.set_status(checkpointRef=ref, idleSince=None)
        self.set_condition("Checkpointed", True, "Recorded", f"checkpoint {ref}")
        return True

    async def last_operation(self) -> OperationView | None:
        last = self.status.get("lastOperation") or {}
        op_id = last.get("id")
        if not op_id:
            return None
        return await _ledger_call(self.ledger.get_operation, op_id)

    async def finish_pause(self, spec: TaskSpec) -> None:
        op = await self.last_operation()
        if op is None:
            self.set_phase(Phase.RUNNING, "no pause operation to wait for")
            return
        self.record_operation(op)
        if completing(self.status.get("phase"), op.kind):
            await self.finish_completion(spec, op)
            return
        if op.state is OperationState.RECORDED and op.checkpoint_ref:
            if not await self.suspend_checkpointed(spec, op.checkpoint_ref, "pausing"):
                return
            self.set_phase(Phase.SUSPENDED, f"suspended with checkpoint {op.checkpoint_ref}")
        elif op.state is OperationState.FAILED:
            message = f"pause abandoned, agents keep running: {op.error}"
            kopf.warn(self.body, reason="PauseFailed", message=message)
            self.set_condition("Checkpointed", False, "PauseFailed", message)
            self.set_status(pausedBy=None)
            self.set_phase(Phase.RUNNING, message)

    # -- completion: every agent finished its work

    async def complete_when_done(
        self, spec: TaskSpec, counts: AgentCounts | None, activity: ActivityView | None
    ) -> bool:
        """Begin a completion when every agent is done (``completion_step``), or wait out
        the backoff after a failed one; True when that is all this pass does."""
        last = self.status.get("lastOperation") or {}
        decision = completion_step(
            counts,
            silent=heartbeat_silent(self.heartbeat_age(activity),
                                    self.settings.heartbeat_interval_secs),
            attempts=int(self.status.get("completions") or 0),
            last_kind=_member(OperationKind, last.get("kind")),
            last_state=_member(OperationState, last.get("state")),
            last_finished_at=parse_time(last.get("finishedAt")),
            now=self.now,
        )  # fmt: skip
        if decision.step is CompletionStep.NOT_DONE:
            return False
        assert counts is not None
        self.set_status(agents=counts.live, idleSince=None)
        if decision.step is CompletionStep.RETRY_LATER:
            self.set_status(message=(
                f"every agent finished its work; completion failed ({last.get('error')}), "
                f"trying again in {decision.wait_secs:.0f}s"
            ))  # fmt: skip
            return True
        await self.start_completion(spec, counts)
        return True

    async def start_completion(self, spec: TaskSpec, counts: AgentCounts) -> None:
        """Drain (agents that are all stopped: the daemon answers verified refs of each)
        and record the completed checkpoint, as a pause does; ``finish_completion`` then
        suspends the Sandbox."""
        attempt = int(self.status.get("completions") or 0) + 1
        await self.begin_drain(spec, OperationKind.COMPLETE, CheckpointReason.COMPLETED,
                               operation_key(self.uid, Purpose.COMPLETE, attempt))  # fmt: skip
        self.set_status(completions=attempt)
        self.set_phase(Phase.DRAINING, (
            f"completing: all {counts.total} agents finished their work; recording their "
            "checkpoint"
        ))  # fmt: skip

    async def finish_completion(self, spec: TaskSpec, op: OperationView) -> None:
        """The completion's drain recorded: suspend the Sandbox (compute released, the
        workspace PVC kept), and the task is Completed with that checkpoint. Failed: back
        to Running, saying why; ``completion_step`` tries again after a backoff."""
        if op.state is OperationState.RECORDED and op.checkpoint_ref:
            ref = op.checkpoint_ref
            if not await self.suspend_checkpointed(spec, ref, "completing"):
                return
            # What kubectl asked until now is spent: only later requests are answered.
            self.set_status(agents=0, lastSuspend=spec.suspend)
            if wake := self.wake_value():
                self.set_status(lastWake=wake)
            self.set_condition("Completed", True, "AgentsDone", (
                f"every agent finished its work; checkpoint {ref} is kept (restore it with "
                "spec.resumeFrom.checkpointRef)"
            ))  # fmt: skip
            self.set_phase(Phase.COMPLETED, (
                f"checkpoint {ref}; workspace PVC {self.pvc_name} kept"
            ))  # fmt: skip
        elif op.state is OperationState.FAILED:
            message = f"completion abandoned, the task stays Running: {op.error}"
            kopf.warn(self.body, reason="CompletionFailed", message=message)
            self.set_condition("Completed", False, "CompletionFailed", message)
            self.set_phase(Phase.RUNNING, message)

    def while_completed(self, spec: TaskSpec) -> None:
        """A wake or a change of ``spec.lifecycle.suspend`` is answered once: there is
        nothing to resume or pause (``completed_request``)."""
        self.rest = Rest()
        wake = self.wake_value()
        answer = completed_request(spec.suspend, self.status.get("lastSuspend"), wake,
                                   self.status.get("lastWake"))  # fmt: skip
        self.set_status(lastSuspend=spec.suspend)
        if wake:
            self.set_status(lastWake=wake)
        if answer is CompletedAnswer.NOTHING:
            return
        ref = self.status.get("checkpointRef")
        reason = "NothingToResume"
        message = (
            f"nothing to resume: the task completed (every agent finished its work) with "
            f"checkpoint {ref}; to continue from it, create a task with "
            f"spec.resumeFrom.checkpointRef: {ref}"
        )
        if answer is CompletedAnswer.NOTHING_TO_PAUSE:
            reason = "AlreadyCompleted"
            message = (
                f"nothing to pause: the task completed with checkpoint {ref} and its "
                "Sandbox is suspended already"
            )
        kopf.info(self.body, reason=reason, message=message)
        self.set_status(message=message)

    def wake_held(self, wake: str | None) -> None:
        """A wake on a task whose spec says ``suspend: true``: the spec wins, so the wake
        is spent saying what would resume it; an idle pause is the spec's from here on."""
        message = (
            f"wake {wake!r} not applied: spec.lifecycle.suspend is true and holds the task "
            "paused; set it to false (drainctl wake sets both) to resume"
        )
        kopf.warn(self.body, reason="WakeHeld", message=message)
        if self.status.get("pausedBy") == "idle":
            self.set_status(pausedBy="manual")
        self.set_status(lastWake=wake)
        self.set_status(message=message)

    async def while_suspended(self, spec: TaskSpec) -> None:
        wake = self.wake_value()
        wanted = wanted_transition(
            spec, Phase.SUSPENDED, self.status.get("pausedBy"), wake, self.status.get("lastWake")
        )
        if wanted is Wanted.START:
            self.set_status(pausedBy=None, lastWake=wake)
            await self.provision(spec)
            return
        if wanted is not Wanted.RESUME:
            self.rest = Rest()
        if wanted is Wanted.WAKE_HELD:
            self.wake_held(wake)
            return
        if wanted is Wanted.ADOPT:
            self.set_status(pausedBy="manual")
            self.set_status(message="paused, and spec.lifecycle.suspend is true: it stays "
                                    "paused until suspend is false (drainctl wake)")  # fmt: skip
            return
        if wanted is not Wanted.RESUME:
            return
        ref = self.status.get("checkpointRef")
        if self.settings.manage_sandbox:
            await kube.patch_sandbox(
                spec.sandbox_version, self.namespace, self.sandbox_of(spec),
                sandbox_suspension_patch(spec.sandbox_version, False),
            )  # fmt: skip
        if ref:
            op = await _ledger_call(
                pipeline.start_resume, app, self.ledger, self.settings,
                namespace=self.namespace, name=self.name, checkpoint_ref=ref,
                task_uid=self.uid, idempotency_key=operation_key(self.uid, Purpose.RESUME, ref),
            )  # fmt: skip
            self.record_operation(op)
        self.set_status(pausedBy=None, lastWake=wake)
        self.set_phase(Phase.RESUMING, f"resuming from checkpoint {ref}")


# ---------------------------------------------------------------- the steward
# One steward per task (a kopf daemon) runs its passes one after another, so no two
# passes over a task ever race; between passes it sleeps until an event wakes it or a
# deadline falls due (``operator.events``, ``operator.pacing``). A task at rest costs
# nothing but its sleeping coroutine.

STEWARDS = events.Stewards()
STEWARD_EXIT_POLL_SECS = 0.1
"""How often kopf looks whether a deleted task's steward has finished its pass (it
exits at once when asleep): the finalizer is not released before it has."""
_feed_task: asyncio.Task[None] | None = None


def _noticed(body: kopf.Body) -> tuple[object, ...]:
    """What of the object itself a pass reads apart from its own status (the spec by its
    generation, the wake annotation, the labels its children carry): a watch event that
    changes none of it (the status a pass wrote, kopf's own annotations) wakes nobody.
    A deletion is the finalizer's (kopf stops the steward)."""
    return (
        body.meta.get("generation"),
        body.meta.annotations.get(crd.WAKE_ANNOTATION),
        tuple(sorted(body.meta.labels.items())),
    )


def _freshest(live: kopf.Body, written: dict[str, Any] | None) -> dict[str, Any]:
    """The newer of the watched object and what the steward's last patch answered: the
    watch may not have delivered that patch yet, and a pass must read its own status."""
    current = dict(live)
    if written is None:
        return current
    try:
        mine = int(written["metadata"]["resourceVersion"])
        seen = int(current["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return current
    return written if mine > seen else current


@kopf.on.startup()
async def start_feed(**_: Any) -> None:
    global _feed_task
    _feed_task = asyncio.create_task(
        events.feed(get_ledger(), STEWARDS, get_settings().event_feed_interval_secs),
        name="ledger event feed",
    )


@kopf.on.cleanup()
async def stop_feed(**_: Any) -> None:
    if _feed_task is not None:
        _feed_task.cancel()


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
def noticed(body: kopf.Body, **_: Any) -> None:
    box = STEWARDS.boxes.get((str(body.meta.namespace), str(body.meta.name)))
    if box is not None and box.noticed != _noticed(body):
        STEWARDS.look((str(body.meta.namespace), str(body.meta.name)), "event")


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_polling=STEWARD_EXIT_POLL_SECS)
async def steward(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
    key = (str(body.meta.namespace), str(body.meta.name))
    box = STEWARDS.open(key)
    settings = get_settings()
    written: dict[str, Any] | None = None
    # The fleet's resyncs spread evenly from the start, not all at once a resync after
    # the operator started.
    resync = settings.resync_interval_secs * random.random()
    cause = "start"
    try:
        while not stopped and not body.meta.get("deletionTimestamp"):
            metrics.OPERATOR_PASSES.labels(cause).inc()
            box.look = None
            current = kopf.Body(cast(kopf.RawBody, _freshest(body, written)))
            box.noticed = _noticed(current)
            (rest, read), wrote = await _one_pass(current, settings, cause)
            box.beat = newer(box.beat, read)
            known, written = box.beat, wrote or written
            resync_at = time.monotonic() + resync
            cause = "clock"
            while not stopped:
                box.wake.clear()
                if box.look:
                    cause = box.look
                    break
                secs = next_look(
                    _now(), rest, box.beat, follow_up_secs=settings.reconcile_interval_secs,
                    resync_secs=max(resync_at - time.monotonic(), 0.0),
                    heartbeat_interval_secs=settings.heartbeat_interval_secs,
                    bridge_secs=settings.heartbeat_gap_secs,
                )  # fmt: skip
                if secs <= 0 and wrote is None and box.beat is known:
                    # Due again at once, yet the pass changed nothing and no heartbeat came
                    # since: never a busy loop; look again as a task on its way would.
                    secs = settings.reconcile_interval_secs
                if secs <= 0:
                    cause = "clock" if box.beat is known else "ledger"  # a heartbeat's news
                    break
                if not await _nap(box.wake, stopped, secs):
                    break  # fell due asleep
            resync = settings.resync_interval_secs
    finally:
        STEWARDS.close(key)


async def _one_pass(
    body: kopf.Body, settings: Settings, cause: str
) -> tuple[tuple[Rest | None, Beat | None], dict[str, Any] | None]:
    """A pass over the task and its status written: how it left the task, the heartbeat
    it read, and the object as its status patch left it (None: nothing to write). A
    pass that fails is logged and tried again after ``reconcile_interval_secs``, as
    something on its way."""
    patch = kopf.Patch()
    r = Reconciler(body, patch, get_ledger(), settings)
    try:
        with permissions.forbidden_reported(_warn_forbidden(body)):
            await r.run()
        status = dict(patch.get("status") or {})
        if not status:
            return (r.rest, r.beat), None
        written = await kube.patch_task_status(r.namespace, r.name, status)
        # One line for a pass that changed the task (none at rest), named by the task and
        # its operation like every line the pass logged.
        log.info("task_pass cause=%s phase=%s changed=%s", cause, r.status.get("phase"),
                 ",".join(sorted(status)))  # fmt: skip
        return (r.rest, r.beat), written
    except Exception:
        log.exception("pass over %s/%s failed; trying again", r.namespace, r.name)
        return (None, r.beat), None


async def _nap(wake: asyncio.Event, stopped: kopf.DaemonStopped, secs: float) -> bool:
    """Sleep ``secs``, or until ``wake`` is set or kopf stops the steward; False when
    the whole ``secs`` went by."""
    waits = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        done, _ = await asyncio.wait(waits, timeout=secs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    return bool(done)


def _warn_forbidden(body: kopf.Body) -> Callable[[str], None]:
    return lambda line: kopf.warn(body, reason="Forbidden", message=line)


# ------------------------------------------------------------------ drain finalizer


@kopf.on.delete(crd.GROUP, crd.VERSION, crd.PLURAL, backoff=1.0)
async def drain_on_delete(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    with permissions.forbidden_reported(_warn_forbidden(body)):
        await _drain_on_delete(body, patch)


async def _drain_on_delete(body: kopf.Body, patch: kopf.Patch) -> None:
    r = Reconciler(body, patch, get_ledger(), get_settings())
    try:
        spec: TaskSpec | None = r.parse(body.spec)
    except SpecError:
        spec = None
    if spec is not None:  # its Sandbox is looked at while the drain runs
        spec = await r.resolve_sandbox_version(spec)
    key = operation_key(r.uid, Purpose.DELETE)
    op = await _ledger_call(r.ledger.find_operation, key)
    if op is None:
        pause = await r.last_operation()
        if pause is not None and adopts_pause_drain(r.status.get("phase"), pause.kind, pause.state):
            op = pause  # deleted mid-pause: one drain, one checkpoint
    # The handler follows the drain itself for a while (most drains take well under a
    # second) and only then hands back to kopf's retry, so deletion is not paced by it.
    follow_until = time.monotonic() + DELETE_FOLLOW_SECS
    next_look = time.monotonic()
    while True:
        checkpoint_ref = r.status.get("checkpointRef")
        action = decide_delete(
            spec, phase=r.status.get("phase"), checkpoint_ref=checkpoint_ref,
            op_state=op.state if op else None, drain_started=op.created_at if op else None,
            now=_now(), paused_by=r.status.get("pausedBy"),
        )  # fmt: skip
        if action is DeleteAction.RELEASE:
            why = "onDelete: delete" if spec and spec.on_delete == "delete" else "nothing ran"
            kopf.info(body, reason="Released", message=f"{why}; not checkpointed")
            await _workspace_goes_with(r, why)
            return
        if action in (DeleteAction.KEEP_PAUSE_CHECKPOINT, DeleteAction.KEEP_COMPLETED_CHECKPOINT):
            await _release_with_checkpoint(r, str(checkpoint_ref))
            return
        if action is DeleteAction.START_DRAIN:
            assert spec is not None
            op = await _drains().begin(DrainStart(
                r.namespace, r.name, task_uid=r.uid, grace_secs=spec.drain_grace_secs,
                kind=OperationKind.DELETE_DRAIN, reason=CheckpointReason.DELETE,
                pvc_name=r.pvc_name, idempotency_key=key,
            ))  # fmt: skip
            r.record_operation(op)
            if r.settings.manage_sandbox:  # gone with the task (it owns the guard)
                await kube.guard_against_eviction(r.namespace, r.name, r.owner(), True)
            r.set_phase(Phase.DRAINING, "deleting: draining agents before the pod goes")
            r.set_ready()
            # Written now rather than when the handler returns, so kubectl shows
            # Draining while the handler follows the drain.
            await kube.patch_task_status(r.namespace, r.name, dict(r.patch.status))
            continue
        assert op is not None
        r.record_operation(op)
        r.look_up_snapshot_class_ahead()
        if action is DeleteAction.RECORDED and op.checkpoint_ref:
            await _release_with_checkpoint(r, op.checkpoint_ref)
            return
        if action is DeleteAction.FORCE:
            await _force_delete(r, op)
            return
        if spec is not None and time.monotonic() >= next_look:
            next_look = time.monotonic() + DAEMON_LOOK_SECS
            if (cause := await r.no_daemon_to_answer(spec)) is not None:
                await _force_delete(r, op, cause)
                return
        left = follow_until - time.monotonic()
        if left < 0:
            raise kopf.TemporaryError(f"drain {op.id} is {op.state}", delay=0.5)
        # Woken when the drain's state moves (one ledger read per poll for every deletion
        # followed at once), or at the next look for a daemon, whichever is first.
        within = min(left, max(next_look - time.monotonic(), 0.0) + DELETE_POLL_SECS)
        state = await _DRAINS.until(op.id, _moved_from(op.state), within)
        if state is not None and state is not op.state:
            op = await _ledger_call(r.ledger.get_operation, op.id) or op


async def _read_drains(op_ids: Collection[str]) -> Mapping[str, OperationState]:
    return await _ledger_call(get_ledger().operation_states, op_ids)


async def _read_snapshots(keys: Collection[tuple[str, str]]) -> Mapping[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    for namespace in sorted({namespace for namespace, _ in keys}):
        refs = [ref for where, ref in keys if where == namespace]
        listed = await kube.list_checkpoint_snapshots(namespace, refs)
        found.update({(namespace, name): obj for name, obj in listed.items()})
    return found


def _moved_from(state: OperationState) -> Callable[[OperationState | None], bool]:
    return lambda seen: seen is not None and seen is not state


def _snapshot_ready(snapshot: Any) -> bool:
    return snapshot_state(snapshot).progress is SnapshotProgress.READY


_DRAINS: following.Poller[str, OperationState] = following.Poller(
    "drains", DELETE_POLL_SECS, _read_drains
)
"""Every deletion's drain state, followed in the ledger with one read per poll (the
operation itself read once it has moved)."""
_SNAPSHOTS: following.Poller[tuple[str, str], Any] = following.Poller(
    "snapshots", SNAPSHOT_POLL_SECS, _read_snapshots, SNAPSHOT_POLL_PER_TASK
)
"""Every deletion's checkpoint snapshot, followed with one list per namespace per poll
(of the awaited checkpoints' snapshots only, by label)."""


async def _workspace_goes_with(r: Reconciler, why: str) -> None:
    """A task released without a checkpoint takes its workspace PVC with it (it owns it):
    the earlier checkpoints that PVC was the only copy of (pauses without a snapshot, or
    the checkpoint it was restored from) say so in the ledger, so nothing claims them
    restorable any more."""
    if not r.settings.manage_sandbox or not r.status.get("pvcName"):
        return
    pvc = await kube.get_pvc(r.namespace, r.pvc_name)
    if pvc is None or not any(o.uid == r.uid for o in pvc.metadata.owner_references or []):
        return
    gone = await _ledger_call(
        r.ledger.mark_workspace_gone, r.namespace, r.pvc_name,
        f"its workspace PVC {r.pvc_name} was deleted with task {r.namespace}/{r.name} ({why})",
    )  # fmt: skip
    if gone:
        kopf.info(r.body, reason="CheckpointsReleased", message=(
            f"workspace PVC {r.pvc_name} goes with the task: checkpoint {', '.join(gone)} "
            "can no longer be restored"
        ))  # fmt: skip


async def _release_with_checkpoint(r: Reconciler, ref: str) -> None:
    r.set_status(checkpointRef=ref)
    # Written now, not with the finalizer's removal: a task that goes at once would
    # otherwise never show the checkpoint it was released with.
    await kube.patch_task_status(r.namespace, r.name, dict(r.patch.status))
    follow_until = time.monotonic() + DELETE_FOLLOW_SECS
    while not await r.snapshot_settled(ref):
        left = follow_until - time.monotonic()
        if left < 0:
            raise kopf.TemporaryError(f"waiting for the snapshot of checkpoint {ref}", delay=0.5)
        # Its snapshot is named by the checkpoint (``snapshot_settled``); asked again at
        # once when the shared poll sees it ready, else after a bounded wait.
        await _SNAPSHOTS.until((r.namespace, ref), _snapshot_ready, min(left, SNAPSHOT_LOOK_SECS))
    retained = await kube.retain_pvc(r.namespace, r.pvc_name, ref)
    where = f"PVC {r.pvc_name} retained" if retained else "no PVC to retain"
    kopf.info(r.body, reason="Checkpointed", message=f"checkpoint {ref}; {where}")


async def _force_delete(r: Reconciler, op: OperationView, cause: str | None = None) -> None:
    """Past drainTimeout, a failed drain, or no daemon left to answer it (``cause``):
    record what the PVC holds, warn, release.

    The abandoned drain is closed first, as superseded: if its daemon answers after all,
    its record finds the operation finished and records nothing, so the deleted task
    keeps exactly one checkpoint, the forced one.
    """
    if not op.terminal:
        op = await _ledger_call(
            r.ledger.expire_operation, op.id,
            f"{metrics.SUPERSEDED_BY_FORCE}: {cause}" if cause else
            f"{metrics.SUPERSEDED_BY_FORCE}: the drain did not finish within drainTimeout "
            f"({op.state} after the timeout)",
        )  # fmt: skip
    forced = await _ledger_call(
        r.ledger.begin_operation, OperationKind.FORCE_DELETE, task_uid=r.uid,
        namespace=r.namespace, name=r.name,
        idempotency_key=operation_key(r.uid, Purpose.FORCE),
    )  # fmt: skip
    checkpoint = await _ledger_call(
        r.ledger.record_checkpoint, forced.id, [], reason=CheckpointReason.FORCED,
        pvc_name=r.pvc_name, forced=True,
    )  # fmt: skip
    if forced.state is not OperationState.FORCED:
        metrics.FORCED_DELETES.inc()  # recorded by this call, not by a re-run's
    why = op.error or f"drain {op.id} did not finish within drainTimeout"
    kopf.warn(
        r.body,
        reason="ForcedCheckpoint",
        message=f"deleting without a clean drain ({why}); forced checkpoint {checkpoint.ref} "
        f"of PVC {r.pvc_name}",
    )
    await _release_with_checkpoint(r, checkpoint.ref)


def _larger(storage: str, restore_size: str | None) -> str:
    """``storage``, or the snapshot's restore size when that is larger."""
    if restore_size is None:
        return storage
    try:
        return restore_size if parse_quantity(restore_size) > parse_quantity(storage) else storage
    except ValueError:
        return storage


def run_operator(
    *,
    namespaces: list[str] | None,
    manage_sandbox: bool,
    peering: str | None = None,
    liveness: str | None = None,
    existing_sandboxes: bool = False,
) -> None:
    """``drainctl operator``: kopf in the foreground; standalone (one replica) unless
    ``peering`` (or ``DRAIN_PEERING``) names the peering object its replicas share
    (``operator.peering``). ``liveness``: the URL kopf serves its health probe on."""
    import os

    from orchestrator.operator.peering import own_priority

    if manage_sandbox:
        os.environ["DRAIN_MANAGE_SANDBOX"] = "true"
    if existing_sandboxes:
        os.environ["DRAIN_EXISTING_SANDBOXES"] = "true"
    if peering is not None:
        os.environ["DRAIN_PEERING"] = peering
    get_settings.cache_clear()
    settings = get_settings()
    priority = None if settings.peering is None else own_priority(settings.peering_priority)
    if priority is not None:
        log.info("operator_peering name=%s priority=%d lifetime_secs=%d", settings.peering,
                 priority, settings.peering_lifetime_secs)  # fmt: skip
    kopf.run(
        standalone=settings.peering is None,
        peering_name=settings.peering,
        priority=priority,
        clusterwide=not namespaces,
        namespaces=namespaces or [],
        liveness_endpoint=liveness,
    )
