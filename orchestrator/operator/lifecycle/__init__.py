"""Pure lifecycle decisions for a CalibanTask: functional core, no I/O, one module per
concern (``spec``, ``keys``, ``deletion``, ``transitions``, ``sandboxes``, ``snapshots``,
``availability``, ``scaling``, ``completion``, ``conditions``, ``readiness``), every
name re-exported here.

The operator's passes (``orchestrator.operator.reconcile`` and its steps) only fetch
what they need — the object, the ledger's operation and heartbeat, the clock — call
these functions, and apply what they return. Every decision here is a function of its
arguments, so the unit tests cover the whole table of phases and events without a
cluster.

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

from orchestrator.operator.lifecycle.availability import (
    CRASH_LOOP_LIMIT,
    HEARTBEATS_MISSED_BEFORE_SILENT,
    RECOVERY_BACKOFF_SECS,
    RECOVERY_STREAK_RESET_SECS,
    AgentCounts,
    Availability,
    AvailabilityDecision,
    LaunchStep,
    RecoveryHistory,
    ResumeOutcome,
    availability,
    heartbeat_silent,
    launch_step,
    resume_outcome,
)
from orchestrator.operator.lifecycle.completion import (
    COMPLETION_RETRY_SECS,
    CompletedAnswer,
    CompletionDecision,
    CompletionStep,
    completed_request,
    completing,
    completion_step,
    every_agent_done,
)
from orchestrator.operator.lifecycle.conditions import (
    Condition,
    ConditionChange,
    as_stored,
    condition,
    merge_conditions,
    parse_time,
    status_patch,
)
from orchestrator.operator.lifecycle.deletion import (
    DeleteAction,
    DeletionObserved,
    adopts_drain,
    decide_delete,
    retries_failure,
)
from orchestrator.operator.lifecycle.keys import Purpose, operation_key
from orchestrator.operator.lifecycle.phase import CREATED_SUSPENDED, ROLLED, Phase
from orchestrator.operator.lifecycle.readiness import READY, readiness
from orchestrator.operator.lifecycle.sandboxes import (
    SandboxApi,
    default_sandbox_api_version,
    sandbox_api_version_choice,
    sandbox_readiness,
    sandbox_service_fqdn,
    sandbox_suspension_patch,
    sandbox_version_problem,
    sandbox_workspace_claim,
)
from orchestrator.operator.lifecycle.scaling import ScaleStep, scale_outcome, scale_step
from orchestrator.operator.lifecycle.snapshots import (
    ORPHANED_ASK_GRACE_SECS,
    FollowedSnapshot,
    SnapshotClass,
    SnapshotOutcome,
    SnapshotProgress,
    SnapshotState,
    SnapshotStep,
    choose_snapshot_class,
    snapshot_deadline,
    snapshot_state,
    snapshot_step,
    snapshot_timed_out,
)
from orchestrator.operator.lifecycle.spec import (
    MAX_PROMPT_BYTES,
    ON_DELETE_VALUES,
    POD_TEMPLATE_ALLOWED,
    RESERVED_ENV,
    SpecError,
    TaskSpec,
    admit_spec,
    on_existing_sandbox,
    parse_duration,
    parse_spec,
    unhonoured,
)
from orchestrator.operator.lifecycle.transitions import (
    IdleReport,
    Wanted,
    idle_report,
    idle_secs,
    should_idle_pause,
    wanted_transition,
)

__all__ = [
    "COMPLETION_RETRY_SECS",
    "CRASH_LOOP_LIMIT",
    "CREATED_SUSPENDED",
    "HEARTBEATS_MISSED_BEFORE_SILENT",
    "MAX_PROMPT_BYTES",
    "ON_DELETE_VALUES",
    "ORPHANED_ASK_GRACE_SECS",
    "POD_TEMPLATE_ALLOWED",
    "READY",
    "RECOVERY_BACKOFF_SECS",
    "RECOVERY_STREAK_RESET_SECS",
    "RESERVED_ENV",
    "ROLLED",
    "AgentCounts",
    "Availability",
    "AvailabilityDecision",
    "CompletedAnswer",
    "CompletionDecision",
    "CompletionStep",
    "Condition",
    "ConditionChange",
    "DeleteAction",
    "DeletionObserved",
    "FollowedSnapshot",
    "IdleReport",
    "LaunchStep",
    "Phase",
    "Purpose",
    "RecoveryHistory",
    "ResumeOutcome",
    "SandboxApi",
    "ScaleStep",
    "SnapshotClass",
    "SnapshotOutcome",
    "SnapshotProgress",
    "SnapshotState",
    "SnapshotStep",
    "SpecError",
    "TaskSpec",
    "Wanted",
    "admit_spec",
    "adopts_drain",
    "as_stored",
    "availability",
    "choose_snapshot_class",
    "completed_request",
    "completing",
    "completion_step",
    "condition",
    "decide_delete",
    "default_sandbox_api_version",
    "every_agent_done",
    "heartbeat_silent",
    "idle_report",
    "idle_secs",
    "launch_step",
    "merge_conditions",
    "on_existing_sandbox",
    "operation_key",
    "parse_duration",
    "parse_spec",
    "parse_time",
    "readiness",
    "resume_outcome",
    "retries_failure",
    "sandbox_api_version_choice",
    "sandbox_readiness",
    "sandbox_service_fqdn",
    "sandbox_suspension_patch",
    "sandbox_version_problem",
    "sandbox_workspace_claim",
    "scale_outcome",
    "scale_step",
    "should_idle_pause",
    "snapshot_deadline",
    "snapshot_state",
    "snapshot_step",
    "snapshot_timed_out",
    "status_patch",
    "unhonoured",
    "wanted_transition",
]
