"""Pure lifecycle decisions for a CalibanTask: functional core, no I/O.

The operator's handlers (``orchestrator.operator.handlers``) only fetch what they need — the
object, the ledger's operation and heartbeat, the clock — call these functions, and
apply what they return. Every decision here is a function of its arguments, so the unit
tests cover the whole table of phases and events without a cluster.

Spec parsing lives here too: a malformed spec becomes a ``SpecError`` naming the field,
which the operator turns into phase ``Failed`` with a condition, and keeps serving others.

The decisions: what the drain finalizer does next (``decide_delete``), how long a task
has been idle and whether to idle-pause (``idle_secs``, ``should_idle_pause``), what the
user asked for through kubectl (``wanted_transition``: pause, resume, and a task
created suspended that starts nothing until resumed), what a task waiting for its
daemon does (``launch_step``: Running, or resume a daemon that came back with stopped
agents), which condition a finished resume earns (``resume_outcome``), whether a Running task
whose agents all finished their work completes (``completion_step``) and what a
Completed task answers to kubectl (``completed_request``), and the idempotency key of
each operation (``operation_key``). Names on the wire come from
``crd``; ledger states and kinds are the ledger's enums.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from orchestrator.ledger import ActivityView, OperationKind, OperationState
from orchestrator.ledger.models import CHECKPOINTED_STATES
from orchestrator.operator.crd import (
    BROKER_URL_ENV,
    SANDBOX_API_VERSIONS,
    SANDBOX_CRD,
    SANDBOX_V1ALPHA1,
    SANDBOX_V1BETA1,
    sandbox_name,
)
from orchestrator.operator.workspace import DAEMON_PROVIDER, Binding
from worker_agent.contract import says_checkpoint_mismatch
from worker_agent.logformat import LOG_FORMAT_ENV

RESERVED_ENV: Final = frozenset({BROKER_URL_ENV, LOG_FORMAT_ENV})
"""The daemon container's own variables: a ``spec.task.env`` entry may not set them."""

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h|d))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_LABEL_VALUE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UNIT_SECS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
ON_DELETE_VALUES: Final = ("checkpoint", "delete")
"""``spec.lifecycle.onDelete``, compared case-insensitively: caliban-operator's schema
takes any string, and its users write ``Checkpoint``/``Delete`` too."""

MAX_PROMPT_BYTES: Final = 128 * 1024 - len("CALIBAN_INITIAL_PROMPT=") - 1
"""The longest ``spec.task.prompt`` (UTF-8 bytes) the daemon can pass on: it reaches the
daemon as one argument (``--initial-prompt``) and each agent as the environment entry
``CALIBAN_INITIAL_PROMPT=<prompt>``, and Linux refuses to exec a process with any single
argument or entry over 128 KiB (``MAX_ARG_STRLEN``, counting its NUL). A longer prompt
would leave every agent failing to launch, so ``parse_spec`` refuses it instead."""


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    DRAINING = "Draining"
    SUSPENDED = "Suspended"
    RESUMING = "Resuming"
    COMPLETED = "Completed"
    FAILED = "Failed"


class SpecError(ValueError):
    """A CalibanTask spec field that cannot be honoured; ``field`` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field

    @property
    def reason(self) -> str:
        """The condition and event reason naming the field: ``lifecycle.onDelete`` →
        ``InvalidLifecycleOnDelete``."""
        words = re.split(r"[^A-Za-z0-9]+", self.field)
        return "Invalid" + "".join(w[:1].upper() + w[1:] for w in words if w)


def parse_duration(value: object, field: str) -> float:
    """``"90s"``, ``"2m"``, ``"1h30m"``, ``"500ms"``, ``"1d"`` → seconds."""
    if not isinstance(value, str) or not _DURATION.match(value):
        raise SpecError(field, f"{value!r} is not a duration like 30s, 2m, 1h30m or 1d")
    return sum(float(n) * _UNIT_SECS[unit] for n, unit in _DURATION_PART.findall(value))


@dataclass(frozen=True)
class TaskSpec:
    agents: int
    provider: str
    model: str
    prompt: str | None
    idle_timeout_secs: float | None
    on_delete: str
    drain_grace_secs: float
    drain_timeout_secs: float
    suspend: bool
    resume_from: str | None
    sandbox_api_version: str | None
    """``spec.sandbox.apiVersion``; None where unset, until the operator resolves it
    (:func:`sandbox_api_version_choice`, :meth:`with_sandbox_api_version`): read
    :attr:`sandbox_version` once resolved."""
    storage: str
    sandbox_name: str | None = None
    """``spec.sandbox.name``: an existing Sandbox to operate on (never created)."""
    image: str | None = None
    """``spec.task.image``: the daemon container's image, over the operator's default."""
    env: tuple[tuple[str, str], ...] = ()
    """``spec.task.env`` (name, value), appended to the daemon container's env."""
    storage_class: str | None = None
    """``spec.workspace.storageClassName`` for the workspace PVC."""
    pod_template: dict[str, Any] = field(default_factory=dict, hash=False)
    """``spec.sandbox.podTemplate`` (``metadata`` and ``spec``), merged under the pod
    template the operator generates (``children.merge_under``)."""
    workspace_ref: str | None = None
    """``spec.workspaceRef.name``: the Workspace whose sources and provider the task uses."""
    provider_ref: str | None = None
    """``spec.providerRef``: which of the Workspace's providers (else its default)."""
    binding: Binding | None = field(default=None, hash=False)
    """The resolved Workspace (``with_binding``); its provider and model are the task's."""

    @property
    def sandbox_version(self) -> str:
        """The Sandbox API version the task talks to its Sandbox in; only a resolved spec
        has one (an unresolved one never silently means either version)."""
        if self.sandbox_api_version is None:
            raise ValueError("spec.sandbox.apiVersion is not resolved yet")
        return self.sandbox_api_version

    def with_sandbox_api_version(self, api_version: str) -> TaskSpec:
        """This spec with its Sandbox API version resolved to ``api_version``."""
        return replace(self, sandbox_api_version=api_version)

    def with_binding(self, binding: Binding) -> TaskSpec:
        """This spec run against ``binding``: the daemon's OpenAI-compatible provider with
        the Workspace provider's model."""
        return replace(self, binding=binding, provider=DAEMON_PROVIDER, model=binding.model)


def on_existing_sandbox(spec: TaskSpec, task: str, existing_sandboxes: bool) -> TaskSpec:
    """``spec`` as the operator runs it: where Sandboxes are provisioned elsewhere
    (``DRAIN_EXISTING_SANDBOXES``), a task that names no Sandbox runs in the one
    caliban-operator makes for it, ``<task>-sbx``, exactly as if ``spec.sandbox.name``
    named it: waited for, drained, suspended and resumed, never created."""
    if not existing_sandboxes or spec.sandbox_name is not None:
        return spec
    return replace(spec, sandbox_name=sandbox_name(task))


def _value_or(section: dict[str, Any], key: str, default: Any) -> Any:
    """``section[key]``, or ``default`` where it is absent or null: caliban-operator's
    schema makes its fields nullable, and a null means unset (the API server prunes it
    under our schema, which declares those fields non-nullable)."""
    value = section.get(key)
    return default if value is None else value


def parse_spec(spec: dict[str, Any]) -> TaskSpec:
    """Validate and default a spec the way the CRD schema does, for objects that reach the
    operator without it (an older CRD, a server without structural defaults), and refuse
    what caliban-operator's schema admits but this operator cannot honour (an unknown
    ``onDelete``, an unreadable ``idleTimeout``, a prompt over ``MAX_PROMPT_BYTES``)."""
    task = spec.get("task") or {}
    lifecycle = spec.get("lifecycle") or {}
    resume_from = spec.get("resumeFrom") or {}
    sandbox = spec.get("sandbox") or {}
    workspace = spec.get("workspace") or {}
    for name, section in (
        ("task", task), ("lifecycle", lifecycle), ("resumeFrom", resume_from),
        ("sandbox", sandbox), ("workspace", workspace),
    ):  # fmt: skip
        if not isinstance(section, dict):
            raise SpecError(name, f"must be an object, not {type(section).__name__}")
    agents = _value_or(task, "agents", 1)
    if not isinstance(agents, int) or isinstance(agents, bool) or not 1 <= agents <= 64:
        raise SpecError("task.agents", f"{agents!r} is not a whole number from 1 to 64")
    provider = _value_or(task, "provider", "scripted")
    if not isinstance(provider, str) or not provider:
        raise SpecError("task.provider", f"{provider!r} is not a provider name")
    model = _value_or(task, "model", "")
    if not isinstance(model, str):
        raise SpecError("task.model", f"{model!r} is not a string")
    prompt = task.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise SpecError("task.prompt", f"{prompt!r} is not a string")
    if prompt is not None and len(prompt.encode()) > MAX_PROMPT_BYTES:
        raise SpecError("task.prompt", (
            f"{len(prompt.encode())} bytes is longer than the {MAX_PROMPT_BYTES} bytes the "
            "daemon can pass to an agent (a process argument is capped at 128 KiB); "
            "shorten it, or put the long text in the workspace and point the prompt at it"
        ))  # fmt: skip
    idle = lifecycle.get("idleTimeout")
    idle_timeout = None if idle is None else parse_duration(idle, "lifecycle.idleTimeout")
    on_delete = _value_or(lifecycle, "onDelete", "checkpoint")
    if not isinstance(on_delete, str) or on_delete.lower() not in ON_DELETE_VALUES:
        raise SpecError("lifecycle.onDelete", f"{on_delete!r} is not checkpoint or delete")
    on_delete = on_delete.lower()
    grace = parse_duration(
        _value_or(lifecycle, "drainGracePeriod", "30s"), "lifecycle.drainGracePeriod"
    )
    timeout = parse_duration(_value_or(lifecycle, "drainTimeout", "2m"), "lifecycle.drainTimeout")
    suspend = _value_or(lifecycle, "suspend", False)
    if not isinstance(suspend, bool):
        raise SpecError("lifecycle.suspend", f"{suspend!r} is not true or false")
    ref = resume_from.get("checkpointRef")
    if ref is not None and (not isinstance(ref, str) or not _LABEL_VALUE.match(ref)):
        raise SpecError("resumeFrom.checkpointRef", f"{ref!r} is not a checkpoint ref")
    api_version = sandbox.get("apiVersion")
    if api_version is not None and api_version not in SANDBOX_API_VERSIONS:
        raise SpecError("sandbox.apiVersion", f"{api_version!r} is not a Sandbox API version")
    existing = sandbox.get("name")
    if existing is not None and (
        not isinstance(existing, str) or len(existing) > 63 or not _LABEL_VALUE.match(existing)
    ):
        raise SpecError("sandbox.name", f"{existing!r} is not a Sandbox name (a DNS label)")
    image = task.get("image") or None
    if image is not None and not isinstance(image, str):
        raise SpecError("task.image", f"{image!r} is not an image reference")
    env = _parse_env(task.get("env"))
    storage_class = workspace.get("storageClassName") or None
    if storage_class is not None and not isinstance(storage_class, str):
        raise SpecError("workspace.storageClassName", f"{storage_class!r} is not a name")
    storage = _value_or(workspace, "storage", "1Gi")
    pod_template = _parse_pod_template(sandbox.get("podTemplate"))
    workspace_ref = spec.get("workspaceRef")
    if workspace_ref is not None:
        ws_name = workspace_ref.get("name") if isinstance(workspace_ref, dict) else None
        if not isinstance(ws_name, str) or len(ws_name) > 253 or not _SUBDOMAIN.match(ws_name):
            raise SpecError("workspaceRef.name", (
                f"{ws_name!r} is not a Workspace name (a lowercase DNS subdomain), so no "
                "Workspace can have it"
            ))  # fmt: skip
        workspace_ref = ws_name
    provider_ref = spec.get("providerRef") or None  # "" is unset, as upstream reads it
    if provider_ref is not None and (not isinstance(provider_ref, str) or not provider_ref):
        raise SpecError("providerRef", f"{provider_ref!r} is not a provider name")
    if provider_ref is not None and workspace_ref is None:
        raise SpecError("providerRef", "names a Workspace provider, but there is no workspaceRef")
    return TaskSpec(
        agents=agents,
        provider=provider,
        model=model,
        prompt=prompt,
        idle_timeout_secs=idle_timeout,
        on_delete=on_delete,
        drain_grace_secs=grace,
        drain_timeout_secs=timeout,
        suspend=suspend,
        resume_from=ref,
        sandbox_api_version=api_version,
        storage=str(storage),
        sandbox_name=existing,
        image=image,
        env=env,
        storage_class=storage_class,
        pod_template=pod_template,
        workspace_ref=workspace_ref,
        provider_ref=provider_ref,
    )


def _parse_pod_template(template: Any) -> dict[str, Any]:
    """``spec.sandbox.podTemplate``: an object of ``metadata`` and ``spec`` objects, whose
    named lists (containers, volumes, env…) are lists of objects, each with a name."""
    if template is None:
        return {}
    field_name = "sandbox.podTemplate"
    if not isinstance(template, dict):
        raise SpecError(field_name, f"must be an object, not {type(template).__name__}")
    unknown = sorted(set(template) - {"metadata", "spec"})
    if unknown:
        raise SpecError(field_name, f"has {', '.join(unknown)}; it takes metadata and spec")
    for key in ("metadata", "spec"):
        if not isinstance(template.get(key, {}), dict):
            raise SpecError(f"{field_name}.{key}", "must be an object")
    pod = template.get("spec") or {}
    for key in ("containers", "initContainers", "volumes"):
        items = pod.get(key, [])
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and i["name"] for i in items
        ):
            raise SpecError(f"{field_name}.spec.{key}", "must be a list of objects with a name")
    return template


def _parse_env(env: Any) -> tuple[tuple[str, str], ...]:
    """``spec.task.env`` as (name, value) pairs; one naming a variable the daemon's own
    container sets (``RESERVED_ENV``) is refused, as it would silently lose."""
    if env is None:
        return ()
    if not isinstance(env, list):
        raise SpecError("task.env", f"must be a list, not {type(env).__name__}")
    pairs = []
    for item in env:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name:
            raise SpecError("task.env", f"{item!r} has no variable name")
        if name in RESERVED_ENV:
            raise SpecError("task.env", f"{name} is set by the operator and cannot be overridden")
        value = item.get("value") or ""
        if not isinstance(value, str):
            raise SpecError("task.env", f"{name}: value {value!r} is not a string")
        pairs.append((name, value))
    return tuple(pairs)


# ------------------------------------------------------------------ idempotency keys


class Purpose(StrEnum):
    """Why the operator begins a ledger operation for a task.

    With the task's uid it makes the operation's idempotency key (``operation_key``), so
    an operator restarted mid-operation finds the operation it began instead of
    beginning a second one. The values are stored in the ledger's keys: renaming one
    makes a restarted operator repeat an operation already under way.
    """

    DELETE = "delete"
    """The drain finalizer's drain: once per task."""
    FORCE = "force"
    """The forced checkpoint past ``drainTimeout``: once per task."""
    RESTORE = "restore"
    """The first start from ``spec.resumeFrom``: once per task."""
    PAUSE = "pause"
    """A pause's drain: one per pause, numbered by ``status.pauses``."""
    RESUME = "resume"
    """A resume from a pause's checkpoint: one per checkpoint ref."""
    RECOVER = "recover"
    """Resuming agents a disruption stopped: one per recovery, numbered by
    ``status.recoveries``."""
    SCALE = "scale"
    """Following a changed ``spec.task.agents``: one per change, numbered by
    ``status.scales``."""
    COMPLETE = "complete"
    """Recording the checkpoint of a task whose agents all finished their work: one per
    attempt, numbered by ``status.completions`` (a failed attempt is tried again under
    the next number)."""


_REPEATING = frozenset(
    {Purpose.PAUSE, Purpose.RESUME, Purpose.RECOVER, Purpose.SCALE, Purpose.COMPLETE}
)


def operation_key(uid: str, purpose: Purpose, which: int | str | None = None) -> str:
    """The idempotency key of the operation begun for ``purpose``: ``<uid>:<purpose>``, and
    ``:<which>`` for a purpose that repeats (which pause, which checkpoint, which
    recovery). The uid comes first, so a task re-created under a deleted task's name
    never finds the old task's operations."""
    if (which is None) == (purpose in _REPEATING):
        needs = "needs" if purpose in _REPEATING else "takes no"
        raise ValueError(f"an operation key for {purpose.value!r} {needs} a discriminator")
    return f"{uid}:{purpose.value}" if which is None else f"{uid}:{purpose.value}:{which}"


# ------------------------------------------------------------------------ decisions


class DeleteAction(StrEnum):
    RELEASE = "release"
    """Let the finalizer go now."""
    KEEP_PAUSE_CHECKPOINT = "keep-pause-checkpoint"
    """A suspended task was drained and checkpointed when it paused, and its daemon is
    stopped: keep that checkpoint (``status.checkpointRef``), retain the PVC, release."""
    KEEP_COMPLETED_CHECKPOINT = "keep-completed-checkpoint"
    """A Completed task's agents finished their work and it was checkpointed then, its
    daemon stopped: that checkpoint is the task's; keep it, retain the PVC, release —
    as after a pause, never a second drain of agents that are done."""
    START_DRAIN = "start-drain"
    WAIT = "wait"
    RECORDED = "recorded"
    """The checkpoint is in the ledger: write checkpointRef, retain the PVC, release."""
    FORCE = "force"
    """Drain failed or timed out: record a forced checkpoint, warn, release."""


CREATED_SUSPENDED: Final = "created-suspended"
"""``status.pausedBy`` of a task created with ``spec.lifecycle.suspend: true``: it never
started, so it has no checkpoint to resume from (beside ``idle`` and ``manual``)."""


def retries_failure(phase: str | None, failed_generation: object, generation: object) -> bool:
    """Whether a ``Failed`` task starts again, from ``Pending``: only one that failed with
    nothing created (``status.failedGeneration`` set: an invalid spec, an unknown or
    unrestorable checkpoint, a Sandbox version the cluster cannot take), and only once
    its spec has changed since (a newer ``metadata.generation``), e.g. a corrected
    ``resumeFrom``. A task that failed after its agents ran (``WorkspaceGone``,
    ``CheckpointMismatch``) has no ``failedGeneration`` and stays ``Failed``: starting it
    again would start fresh agents where work was lost, or resume what the checkpoint
    does not hold."""
    if phase != Phase.FAILED:
        return False
    if not isinstance(failed_generation, int) or not isinstance(generation, int):
        return False
    return generation > failed_generation


NEVER_RAN = frozenset({None, Phase.PENDING, Phase.FAILED})
"""Phases in which no agent ever ran for the task: a Failed task failed before it
provisioned (a bad spec, an unknown checkpoint), or its restore refused the workspace
before any agent resumed (``CheckpointMismatch``), so there is nothing to drain."""


def decide_delete(
    spec: TaskSpec | None,
    *,
    phase: str | None,
    checkpoint_ref: str | None,
    op_state: OperationState | None,
    drain_started: datetime | None,
    now: datetime,
    paused_by: str | None = None,
) -> DeleteAction:
    """What the drain finalizer does next for a task being deleted.

    ``spec`` is None for a task whose spec never parsed (nothing of it ran, nothing to
    keep); ``checkpoint_ref`` is ``status.checkpointRef``; ``op_state`` is the ledger
    state of this deletion's drain, None if not begun, and ``drain_started`` its start;
    ``paused_by`` is ``status.pausedBy``: a task ``CREATED_SUSPENDED`` never ran either.
    """
    if spec is None or spec.on_delete == "delete":
        return DeleteAction.RELEASE
    if op_state is None:
        if phase in NEVER_RAN or (phase == Phase.SUSPENDED and paused_by == CREATED_SUSPENDED):
            return DeleteAction.RELEASE
        if phase == Phase.SUSPENDED and checkpoint_ref:
            return DeleteAction.KEEP_PAUSE_CHECKPOINT
        if phase == Phase.COMPLETED and checkpoint_ref:
            return DeleteAction.KEEP_COMPLETED_CHECKPOINT
        return DeleteAction.START_DRAIN
    if op_state in CHECKPOINTED_STATES:
        return DeleteAction.RECORDED
    if op_state is OperationState.FAILED:
        return DeleteAction.FORCE
    if drain_started is not None and (now - drain_started).total_seconds() >= (
        spec.drain_timeout_secs
    ):
        return DeleteAction.FORCE
    if op_state is OperationState.PENDING:
        # Begun in the ledger but never sent: the operator that began it died between the
        # ledger and the broker (a replica killed, a failover). Starting it again with the
        # same key sends that operation's messages; the daemon answers a second copy from
        # its journal and the record is per operation, so one checkpoint either way.
        return DeleteAction.START_DRAIN
    return DeleteAction.WAIT


_DRAINING_OR_CHECKPOINTED = (
    frozenset({OperationState.PENDING, OperationState.DRAINING, OperationState.DRAINED})
    | CHECKPOINTED_STATES
)


_ADOPTABLE_DRAINS = frozenset({OperationKind.PAUSE, OperationKind.COMPLETE})


def adopts_pause_drain(
    phase: str | None, last_kind: OperationKind | None, last_state: OperationState | None
) -> bool:
    """Whether a deletion takes over the pause (or completion) drain on its way instead
    of starting its own.

    A task deleted while it pauses or completes (phase Draining, its last operation a
    pause or a completion) is already being drained to a checkpoint: a second drain
    would record a second checkpoint of the same agents. The deletion waits for that
    drain and keeps its checkpoint (``decide_delete`` with that operation's state), or
    forces one past ``drainTimeout``. One that failed drained nothing: the deletion
    drains anew."""
    return (
        phase == Phase.DRAINING
        and last_kind in _ADOPTABLE_DRAINS
        and last_state in _DRAINING_OR_CHECKPOINTED
    )


@dataclass(frozen=True)
class IdleReport:
    """What the daemon's latest heartbeat says about idleness, as the ledger keeps it."""

    idle_for_secs: float
    """How long every agent had been idle when the daemon sent the heartbeat, measured
    on the daemon host's monotonic clock."""
    received_at: datetime
    """When the orchestrator stored the heartbeat, on the orchestrator's wall clock."""


def idle_report(activity: ActivityView | None) -> IdleReport | None:
    """The idle part of a stored heartbeat: None when it is not idle, comes from a daemon
    too old to measure idleness (no ``idle_for_secs``), or was stored before the ledger
    kept a receive stamp. Its daemon-clock fields (``reported_at``, ``all_idle_since``)
    are not read."""
    if activity is None or activity.idle_for_secs is None or activity.received_at is None:
        return None
    return IdleReport(idle_for_secs=activity.idle_for_secs, received_at=activity.received_at)


def idle_secs(report: IdleReport, now: datetime, bridge_secs: float) -> float:
    """How long the task has been idle: the daemon's monotonic measure, plus the time
    since the heartbeat arrived, clamped to ``[0, bridge_secs]``.

    ``bridge_secs`` is the longest gap a healthy daemon leaves between heartbeats
    (``BrokerSettings.heartbeat_gap_secs``: the interval plus one poll), so within it the
    estimate grows with this clock as the daemon's would. The daemon's wall clock is
    never read, so skew between its host and this one does not matter at all. The only
    wall-clock difference is ``now - received_at`` (this host against the orchestrator
    worker's), and the clamp keeps a step of any size, either way, or any skew between
    those two, to at most ``bridge_secs`` of error: a forward jump cannot make a task
    idle for longer than it reported plus one gap, and a backward jump cannot take away
    what it reported. A daemon that stops reporting stops the estimate one gap after
    its last heartbeat: a pause is then late, never early.
    """
    since_received = (now - report.received_at).total_seconds()
    return report.idle_for_secs + min(max(since_received, 0.0), bridge_secs)


def should_idle_pause(
    spec: TaskSpec,
    phase: str | None,
    report: IdleReport | None,
    now: datetime,
    bridge_secs: float,
) -> bool:
    """Pause a Running task with an ``idleTimeout`` once ``idle_secs`` reaches it.

    ``report`` is None when the latest heartbeat says the task is not idle, or comes
    from a daemon too old to measure it (no ``idle_for_secs``): no idle decision at all,
    rather than one taken from wall clocks (``all_idle_since`` is for display only)."""
    if spec.idle_timeout_secs is None or phase != Phase.RUNNING or report is None:
        return False
    return idle_secs(report, now, bridge_secs) >= spec.idle_timeout_secs


class Wanted(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    HOLD = "hold"
    """A task not provisioned yet whose spec says ``suspend: true``: create nothing, phase
    Suspended (``CREATED_SUSPENDED``), until the spec says ``false``."""
    START = "start"
    """A task created suspended is un-suspended: provision it as a new task would be (its
    initial agents, or the restore of ``spec.resumeFrom``)."""
    ADOPT = "adopt"
    """An idle-paused task whose spec now says ``suspend: true``: the spec holds it from
    here on (``pausedBy: manual``), so ``suspend: false`` is what resumes it."""
    WAKE_HELD = "wake-held"
    """A new wake annotation value on a task the spec holds (``suspend: true``): the
    spec wins, and the wake is spent with a Warning event saying what to set."""
    NOTHING = "nothing"


def wanted_transition(
    spec: TaskSpec,
    phase: str | None,
    paused_by: str | None,
    wake_value: str | None,
    last_wake: str | None,
) -> Wanted:
    """What the user asked for through kubectl, given where the task is.

    ``spec.lifecycle.suspend: true`` pauses a running task (like a Job's
    ``spec.suspend``); ``false`` resumes one that was paused that way. The wake
    annotation resumes an idle-paused task once per new value (what an attach does).
    A task paused by ``suspend: true`` stays paused until the spec says otherwise.

    A task created with ``suspend: true`` starts nothing until resumed, as a Job created
    suspended never starts a pod (``HOLD``, then ``START``). Not even its workspace PVC
    or its Sandbox (suspended) is created: a queued task should hold no storage, and a
    restore claims its checkpoint's retained PVC for itself alone, which a task that
    runs nothing must not keep from others; deleting it then has nothing to release.
    ``suspend: false`` (``drainctl wake`` sets it) starts it.

    Both kinds of pause end the same ways. While the spec says ``suspend: true`` it
    holds the task, whoever paused it: a wake annotation is refused out loud
    (``WAKE_HELD``), never silently dropped, and an idle-paused task is adopted by the
    spec (``ADOPT``), so the ``suspend: false`` that follows resumes it. With
    ``suspend: false``, a task paused by the spec resumes, and an idle-paused one
    resumes on a new wake value.
    """
    fresh_wake = bool(wake_value) and wake_value != last_wake
    if phase in (None, Phase.PENDING):
        return Wanted.HOLD if spec.suspend else Wanted.NOTHING
    if spec.suspend:
        if phase == Phase.RUNNING:
            return Wanted.PAUSE
        if phase != Phase.SUSPENDED:
            return Wanted.NOTHING
        if fresh_wake:
            return Wanted.WAKE_HELD
        return Wanted.ADOPT if paused_by == "idle" else Wanted.NOTHING
    if phase != Phase.SUSPENDED:
        return Wanted.NOTHING
    if paused_by == CREATED_SUSPENDED:
        return Wanted.START
    if paused_by == "manual":
        return Wanted.RESUME
    if fresh_wake:
        return Wanted.RESUME
    return Wanted.NOTHING


@dataclass(frozen=True)
class SandboxApi:
    """What the cluster's Sandbox CRD serves: version names, the storage version, and
    whether a conversion webhook translates between them."""

    served: tuple[str, ...]
    storage: str | None
    converts: bool


def default_sandbox_api_version(api: SandboxApi | None) -> str:
    """The Sandbox API version of a task whose spec names none, from what the cluster
    serves: v1beta1 where it can drive the cluster's Sandboxes, else v1alpha1 where that
    can; where neither can, v1beta1 if served, else v1alpha1 (and
    :func:`sandbox_version_problem` then says why before anything is created)."""
    if api is None:
        return SANDBOX_V1ALPHA1
    for candidate in (SANDBOX_V1BETA1, SANDBOX_V1ALPHA1):
        if sandbox_version_problem(candidate, api) is None:
            return candidate
    return SANDBOX_V1BETA1 if "v1beta1" in api.served else SANDBOX_V1ALPHA1


def sandbox_api_version_choice(
    requested: str | None, pinned: object, *, started: bool
) -> str | None:
    """The Sandbox API version a task talks to its Sandbox in, or None: ask the cluster
    (:func:`default_sandbox_api_version`) and pin the answer in ``status.sandboxApiVersion``.

    ``requested`` (``spec.sandbox.apiVersion``) always wins; else the version pinned when
    the task was first seen, so a task keeps talking to its Sandbox in the version it was
    created with whatever the cluster serves later; else, for a task ``started`` (its
    Sandbox named in its status) with nothing pinned, made before versions were pinned
    when an unset version meant v1alpha1, v1alpha1."""
    if requested is not None:
        return requested
    if isinstance(pinned, str) and pinned in SANDBOX_API_VERSIONS:
        return pinned
    if started:
        return SANDBOX_V1ALPHA1
    return None


def sandbox_version_problem(api_version: str, api: SandboxApi | None) -> str | None:
    """Why the task's ``spec.sandbox.apiVersion`` cannot drive this cluster's Sandboxes,
    or None. Suspension is a different field per version (``replicas`` on v1alpha1,
    ``operatingMode`` on v1beta1): written at a version other than the stored one with
    no webhook to convert it, it would never reach the controller, and the task would
    say Suspended while its daemon kept running."""
    if api is None:
        return f"the cluster has no Sandbox API (CRD {SANDBOX_CRD})"
    version = api_version.partition("/")[2]
    if version not in api.served:
        return (
            f"spec.sandbox.apiVersion {api_version} is not served by this cluster (served: "
            f"{', '.join(api.served) or 'none'})"
        )
    if api.storage is not None and api.storage != version and not api.converts:
        return (
            f"spec.sandbox.apiVersion {api_version}: this cluster stores Sandboxes as "
            f"{api.storage} with no conversion webhook, so a suspension written at {version} "
            f"would not reach its controller; set spec.sandbox.apiVersion to "
            f"{api_version.partition('/')[0]}/{api.storage}"
        )
    return None


def parse_time(value: object) -> datetime | None:
    """A timestamp as the status and metadata write it (``2026-12-03T12:00:00Z``), or
    None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def sandbox_workspace_claim(sandbox: dict[str, Any]) -> str | None:
    """The PVC an existing Sandbox (``spec.sandbox.name``) mounts, which is then the
    task's workspace (its snapshots and checkpoints copy it): the only
    ``persistentVolumeClaim`` volume of its pod template, or None where it has none or
    several (then nothing says which one the agents write)."""
    pod = ((sandbox.get("spec") or {}).get("podTemplate") or {}).get("spec") or {}
    claims = [
        str(v["persistentVolumeClaim"]["claimName"])
        for v in pod.get("volumes") or []
        if isinstance(v, dict) and (v.get("persistentVolumeClaim") or {}).get("claimName")
    ]
    return claims[0] if len(claims) == 1 else None


def sandbox_readiness(sandbox: dict[str, Any]) -> ConditionChange:
    """``SandboxReady`` from the Sandbox's own ``Ready`` condition (its controller's
    reason and message, with the Sandbox named), Unknown while its controller has written
    none: a Sandbox that never becomes Ready is seen on the task, not only on the Sandbox."""
    name = (sandbox.get("metadata") or {}).get("name", "?")
    conditions = (sandbox.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if isinstance(c, dict) and c.get("type") == "Ready"), None)
    if ready is None:
        return ConditionChange(
            "SandboxReady", None, "NoSandboxStatus",
            f"Sandbox {name} has no Ready condition yet (its controller has not reported)",
        )  # fmt: skip
    status = {"True": True, "False": False}.get(str(ready.get("status")))
    reason = str(ready.get("reason") or "SandboxReported")
    said = str(ready.get("message") or "").strip()
    state = {True: "is Ready", False: "is not Ready", None: "reports Ready Unknown"}[status]
    return ConditionChange(
        "SandboxReady", status, reason, f"Sandbox {name} {state}" + (f": {said}" if said else "")
    )


def sandbox_service_fqdn(sandbox: dict[str, Any]) -> str | None:
    """The Sandbox's ``status.serviceFQDN``, where its controller has written one."""
    fqdn = (sandbox.get("status") or {}).get("serviceFQDN")
    return fqdn if isinstance(fqdn, str) and fqdn else None


def sandbox_suspension_patch(api_version: str, suspended: bool) -> dict[str, Any]:
    """The Sandbox spec change that stops (or restarts) its pod, per API version."""
    if api_version == SANDBOX_V1BETA1:
        return {"spec": {"operatingMode": "Suspended" if suspended else "Running"}}
    return {"spec": {"replicas": 0 if suspended else 1}}


# ------------------------------------------------------ waiting for the daemon's agents


# ----------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class SnapshotClass:
    """A VolumeSnapshotClass as far as choosing one goes."""

    name: str
    driver: str
    default: bool


def choose_snapshot_class(classes: Sequence[SnapshotClass], driver: str | None) -> str | None:
    """The VolumeSnapshotClass for a workspace whose StorageClass provisions with CSI
    ``driver`` (None: unknown, e.g. no StorageClass API or no default class), or None
    when none fits: the cluster cannot snapshot that workspace.

    A class of another driver cannot snapshot the volume. Among the fitting ones the
    default-annotated class wins, then the only one; several and no default is
    ambiguous, so none is chosen (``DRAIN_SNAPSHOT_CLASS`` names one)."""
    fitting = [c for c in classes if driver is None or c.driver == driver]
    defaults = [c for c in fitting if c.default]
    if len(defaults) == 1:
        return defaults[0].name
    if len(fitting) == 1:
        return fitting[0].name
    return None


class SnapshotProgress(StrEnum):
    READY = "ready"
    PENDING = "pending"
    MISSING = "missing"


@dataclass(frozen=True)
class SnapshotState:
    progress: SnapshotProgress
    error: str | None = None
    """The snapshotter's ``status.error.message`` while it is not ready."""
    restore_size: str | None = None


def snapshot_state(snapshot: dict[str, Any] | None) -> SnapshotState:
    """What a VolumeSnapshot object (None: it does not exist) says about its copy."""
    if snapshot is None or snapshot.get("metadata", {}).get("deletionTimestamp"):
        return SnapshotState(SnapshotProgress.MISSING)
    status = snapshot.get("status") or {}
    error = (status.get("error") or {}).get("message")
    size = status.get("restoreSize")
    ready = status.get("readyToUse") is True
    return SnapshotState(
        SnapshotProgress.READY if ready else SnapshotProgress.PENDING,
        None if ready else (str(error) if error else None),
        None if size is None else str(size),
    )


def snapshot_timed_out(created_at: datetime, now: datetime, timeout_secs: float) -> bool:
    """Whether a checkpoint recorded at ``created_at`` waited too long for its snapshot."""
    return (now - created_at).total_seconds() > timeout_secs


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
class ConditionChange:
    """A condition to set: ``type`` to ``status`` for ``reason``, explained by ``message``;
    ``status`` None is ``Unknown``."""

    type: str
    status: bool | None
    reason: str
    message: str


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


# -------------------------------------------------------------------------- scaling


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
                "Scaled", True, "ScaledDown",
                f"scaled {change}: the {from_agents - to_agents} removed agent(s) drained "
                f"into checkpoint {checkpoint_ref}",
            )  # fmt: skip
        return ConditionChange(
            "Scaled", False, "ScaleDownFailed",
            f"scaling {change} failed, no agent was removed: {error or state}",
        )  # fmt: skip
    if state is OperationState.RESUMED and not error:
        return ConditionChange("Scaled", True, "ScaledUp", f"scaled {change}")
    if state is OperationState.RESUMED:
        return ConditionChange(
            "Scaled", False, "PartlyScaledUp", f"scaling {change}: not every agent came: {error}"
        )
    return ConditionChange(
        "Scaled", False, "ScaleUpFailed", f"scaling {change} failed: {error or state}"
    )


# ---------------------------------------------------------------------- disruptions

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
                "AgentsAvailable", False, "DaemonSilent",
                f"no heartbeat from the daemon {age}: its pod is gone or restarting, its "
                "node lost, or the orchestrator worker is down",
            ),
        )  # fmt: skip
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
            ConditionChange("AgentsAvailable", bool(counts.live) or not counts.total, reason,
                            phrase),
            streak_over=streak_over,
        )  # fmt: skip
    reason = "DaemonRestarted" if not counts.live else "AgentsStopped"
    if streak >= CRASH_LOOP_LIMIT:
        return AvailabilityDecision(
            Availability.CRASH_LOOP,
            ConditionChange(
                "AgentsAvailable", False, "CrashLoop",
                f"{phrase}; resumed {streak} times since they last ran for "
                f"{RECOVERY_STREAK_RESET_SECS:.0f}s, not again until the wake annotation "
                "changes",
            ),
        )  # fmt: skip
    wait = RECOVERY_BACKOFF_SECS[streak] - (since_last or 0.0) if streak else 0.0
    if wait > 0:
        return AvailabilityDecision(
            Availability.BACKOFF,
            ConditionChange("AgentsAvailable", False, reason,
                            f"{phrase}; resuming them in {wait:.0f}s (backoff)"),
            wait_secs=wait,
            streak_over=streak_over,
        )  # fmt: skip
    return AvailabilityDecision(
        Availability.RECOVER,
        ConditionChange("AgentsAvailable", False, reason, f"{phrase}; resuming them"),
        streak_over=streak_over,
    )


# ------------------------------------------------------------------------ completion

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


# ----------------------------------------------------------------------------- Ready

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


# ---------------------------------------------------------------------------- status


def condition(
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> dict[str, Any]:
    """A ``metav1.Condition``; ``status`` None is ``Unknown``."""
    return {
        "type": type_,
        "status": "Unknown" if status is None else "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "observedGeneration": generation,
    }


def merge_conditions(existing: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Replace the condition of the same type; keep lastTransitionTime if status held."""
    out = []
    replaced = False
    for cond in existing:
        if cond.get("type") == new["type"]:
            replaced = True
            if cond.get("status") == new["status"]:
                new = {**new, "lastTransitionTime": cond.get("lastTransitionTime")}
            out.append(new)
        else:
            out.append(cond)
    if not replaced:
        out.append(new)
    return out


def status_patch(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """Only the status fields that differ (no-op churn avoidance)."""
    return {k: v for k, v in desired.items() if current.get(k) != v}
