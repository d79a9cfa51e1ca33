"""The orchestrator side's Prometheus metrics: the operator's and the orchestrator
worker's (each process serves its own :data:`REGISTRY`; the daemon's are in
``worker_agent.metrics``, the audit's in ``orchestrator.audit.loud``).

Outcomes are counted where an operation finishes, and nowhere else: the ledger announces
each commit that moves an operation to a terminal state (``on_operation_finished``),
which happens exactly once, under the row lock, in whichever process did it. The
worker finishes what its chains and its deadline sweeper close (recorded, failed,
expired, resumed); the operator what it closes itself (a forced delete and the drain it
supersedes). So a drain is counted once however many times its record is redelivered
or its deletion handler re-run, and ``sum`` over both jobs is every outcome.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.ledger.models import OperationKind
from orchestrator.ledger.repository import Finished, on_operation_finished
from worker_agent import metrics as daemon_metrics

SUPERSEDED_BY_FORCE: Final = "superseded by a forced checkpoint"
"""How the operator's ``_force_delete`` begins the error of the drain it abandons: such
a drain's outcome is ``forced``."""

REGISTRY = CollectorRegistry()

DRAIN_DURATION = Histogram(
    "caliban_drain_drain_duration_seconds",
    "Seconds from a drain's start to its end, by kind (delete-drain, pause, complete, drain) and "
    "outcome (recorded, failed, expired: its deadline passed, forced: superseded by a "
    "forced checkpoint).",
    ["kind", "outcome"],
    buckets=daemon_metrics.DURATION_BUCKETS,
    registry=REGISTRY,
)
RESUME_DURATION = Histogram(
    "caliban_drain_resume_duration_seconds",
    "Seconds from a resume's or restore's start to its end, by kind and outcome "
    "(resumed, failed, expired).",
    ["kind", "outcome"],
    buckets=daemon_metrics.DURATION_BUCKETS,
    registry=REGISTRY,
)
OPERATIONS = Counter(
    "caliban_drain_operations",
    "Operations finished, by kind and final state (recorded, forced, failed, resumed).",
    ["kind", "state"],
    registry=REGISTRY,
)
CHECKPOINTS = Counter(
    "caliban_drain_checkpoints_recorded",
    "Checkpoints recorded in the ledger, by reason (delete, pause, completed, manual, forced).",
    ["reason"],
    registry=REGISTRY,
)
UNPROVEN_MESSAGES = Counter(
    "caliban_drain_unproven_messages",
    "Daemon-side messages refused before they touched the ledger because they did not "
    "prove their task sent them, by kind (drain-result, resume-result, heartbeat) and "
    "reason (unsigned, bad-signature, unknown-operation, other-task).",
    ["kind", "reason"],
    registry=REGISTRY,
)
FORCED_DELETES = Counter(
    "caliban_drain_forced_deletes",
    "Deletions released with a forced checkpoint (no clean drain: drainTimeout passed, "
    "the drain failed, or no daemon was left to answer it).",
    registry=REGISTRY,
)
OPERATOR_PASSES = Counter(
    "caliban_drain_operator_passes",
    "Passes the operator ran over a CalibanTask, by what woke its steward: start (its "
    "first), event (the object changed), ledger (a heartbeat that says something new, an "
    "operation that moved), snapshot (a checkpoint snapshot it speaks of or waits for became "
    "ready or failed), clock (a deadline, a follow-up of something on its way, the "
    "resync). A fleet at rest adds nothing but its clock passes.",
    ["cause"],
    registry=REGISTRY,
)
OPERATOR_API_CALLS = Counter(
    "caliban_drain_operator_api_calls",
    "Kubernetes API calls the operator's own code made (kopf's watches and its finalizer "
    "patches not counted): what a fleet's passes cost the API server.",
    registry=REGISTRY,
)
OPERATOR_PASS_FAILURES = Counter(
    "caliban_drain_operator_pass_failures",
    "Passes over a CalibanTask that failed (the ledger or the API unreachable, a refusal); "
    "each is retried after a backoff of 1 s doubling to 5 min.",
    registry=REGISTRY,
)
SNAPSHOTS_UNSETTLED = Gauge(
    "caliban_drain_snapshots_unsettled",
    "Checkpoint snapshots asked for and neither ready nor failed (cut or not), as the "
    "operator's snapshot follower last read the ledger.",
    registry=REGISTRY,
)
SNAPSHOTS_SETTLED = Counter(
    "caliban_drain_snapshots_settled",
    "Checkpoint snapshots the operator recorded ready or failed, by outcome (ready, failed) "
    "and by who saw it (pass: a pause or deletion waiting for its cut; follower: the "
    "snapshot follower, after the cut).",
    ["outcome", "by"],
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    daemon_metrics.QUEUE_WAIT_NAME,
    daemon_metrics.QUEUE_WAIT_HELP,
    ["task"],
    buckets=daemon_metrics.QUEUE_WAIT_BUCKETS,
    registry=REGISTRY,
)


def outcome(finished: Finished) -> str:
    """The ``outcome`` label of a finished operation."""
    op = finished.operation
    if finished.expired:
        return "forced" if (op.error or "").startswith(SUPERSEDED_BY_FORCE) else "expired"
    return op.state.value


def record_finished(finished: Finished) -> None:
    """Count one finished operation (the ledger's listener)."""
    op = finished.operation
    OPERATIONS.labels(kind=op.kind.value, state=op.state.value).inc()
    if finished.checkpoint_reason is not None:
        CHECKPOINTS.labels(reason=finished.checkpoint_reason.value).inc()
    if op.kind is OperationKind.FORCE_DELETE:
        return  # nothing ran: its duration says nothing; FORCED_DELETES counts it
    if op.finished_at is None:
        return
    took = max((op.finished_at - op.created_at).total_seconds(), 0.0)
    histogram = DRAIN_DURATION if op.kind.records_checkpoint else RESUME_DURATION
    histogram.labels(kind=op.kind.value, outcome=outcome(finished)).observe(took)


def count_outcomes() -> None:
    """Count, in this process, every operation its ledger calls finish."""
    on_operation_finished(record_finished)
