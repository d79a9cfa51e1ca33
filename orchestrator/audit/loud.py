"""Making findings loud: a Warning event on the task, its ``Consistent`` condition, the
``caliban_drain_audit_findings{kind}`` gauge, and a log line.

Only the periodic auditor announces (the one-shot ``drainctl audit`` only reports). An
event and a log line are written when a finding first appears (and a log line when it
clears), not on every run; the condition is written only where it changes: each task
audited gets ``Consistent=True``, or ``False`` with the kind of its first finding as
the reason and every finding in the message.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import UTC, datetime
from typing import Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.audit.checks import TaskState
from orchestrator.audit.findings import Finding, FindingKind
from orchestrator.audit.runner import AuditReport
from orchestrator.operator import crd
from orchestrator.operator.lifecycle import Condition, condition, merge_conditions
from worker_agent.metrics import LOST_TURNS_HELP, LOST_TURNS_NAME

log = logging.getLogger(__name__)

CONDITION: Final = "Consistent"
SOURCE: Final = "caliban-drain-audit"
MESSAGE_MAX: Final = 1000
MERGE_PATCH: Final = "application/merge-patch+json"


class AuditMetrics:
    """The audit's Prometheus metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.findings = Gauge(
            "caliban_drain_audit_findings",
            "Findings of the latest audit run, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.runs = Counter(
            "caliban_drain_audit_runs", "Audit runs finished.", registry=self.registry
        )
        self.duration = Histogram(
            "caliban_drain_audit_duration_seconds",
            "How long one audit run took.",
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.checked = Counter(
            "caliban_drain_audit_checked",
            "Objects the audit checked, by what they are.",
            ["what"],
            registry=self.registry,
        )
        self.lost_turns = Counter(LOST_TURNS_NAME, LOST_TURNS_HELP, registry=self.registry)
        """Counted when a finding with lost turns first appears (``Announcer``)."""
        self.last_run = Gauge(
            "caliban_drain_audit_last_run_timestamp_seconds",
            "When the latest audit run finished.",
            registry=self.registry,
        )
        for kind in FindingKind:
            self.findings.labels(kind=kind.value).set(0)

    def observe(self, report: AuditReport) -> None:
        for kind, count in report.by_kind().items():
            self.findings.labels(kind=kind).set(count)
        self.runs.inc()
        self.duration.observe(report.duration_secs)
        for what in ("checkpoints_checked", "sessions_checked", "tasks"):
            self.checked.labels(what=what).inc(report.counts.get(what, 0))
        self.last_run.set(datetime.now(UTC).timestamp())


class Announcer:
    """Events, conditions and log lines for successive reports of one auditor."""

    def __init__(self) -> None:
        self.previous: set[tuple[str, str]] = set()

    def announce(self, report: AuditReport, tasks: list[TaskState]) -> list[Finding]:
        """Announce the report; answer the findings that are new since the last one."""
        current = {f.key for f in report.findings}
        new = [f for f in report.findings if f.key not in self.previous]
        by_name = {(t.namespace, t.name): t for t in tasks}
        for f in report.findings:
            if f.key in self.previous:
                continue
            log.warning(
                "audit_finding kind=%s subject=%s task=%s message=%s",
                f.kind.value,
                f.subject,
                f.task,
                f.message,
            )
            task = by_name.get((f.namespace or "", f.task or ""))
            if task is not None:
                self.event(f, task)
        for kind, subject in sorted(self.previous - current):
            log.info("audit_finding_cleared kind=%s subject=%s", kind, subject)
        self.previous = current
        if report.kubernetes:
            self.conditions(report.findings, tasks)
        return new

    @staticmethod
    def event(finding: Finding, task: TaskState) -> None:
        now = datetime.now(UTC)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{task.name[:200]}.audit-",
                         "namespace": task.namespace},
            "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                               "name": task.name, "namespace": task.namespace,
                               "uid": task.uid},
            "type": "Warning",
            "reason": finding.kind.value,
            "message": finding.message[:MESSAGE_MAX],
            "source": {"component": SOURCE},
            "reportingComponent": SOURCE,
            "firstTimestamp": now.isoformat(), "lastTimestamp": now.isoformat(),
            "count": 1,
        }  # fmt: skip
        try:
            client.CoreV1Api().create_namespaced_event(task.namespace, body)
        except ApiException as exc:
            log.warning(
                "audit_event_failed task=%s/%s status=%s", task.namespace, task.name, exc.status
            )

    def conditions(self, findings: list[Finding], tasks: list[TaskState]) -> None:
        of_task: dict[tuple[str, str], list[Finding]] = defaultdict(list)
        for f in findings:
            if f.task is not None and f.namespace is not None:
                of_task[(f.namespace, f.task)].append(f)
        now = datetime.now(UTC)
        for task in tasks:
            if task.deleting:
                continue
            mine = sorted(of_task.get((task.namespace, task.name), []))
            if mine:
                wanted = (
                    "False",
                    mine[0].kind.value,
                    "; ".join(f.line() for f in mine)[:MESSAGE_MAX],
                )
            else:
                wanted = ("True", "Audited", "the audit finds nothing inconsistent")
            if task.consistent == wanted:
                continue
            new = condition(CONDITION, wanted[0] == "True", wanted[1], wanted[2], now, None)
            self.write_condition(task, new)

    @staticmethod
    def write_condition(task: TaskState, new: Condition) -> None:
        api = client.CustomObjectsApi()
        try:
            current = api.get_namespaced_custom_object(
                crd.GROUP, crd.VERSION, task.namespace, crd.PLURAL, task.name
            )
            if current["metadata"].get("uid") != task.uid:
                return
            existing: list[Condition] = list((current.get("status") or {}).get("conditions") or [])
            api.patch_namespaced_custom_object_status(
                crd.GROUP,
                crd.VERSION,
                task.namespace,
                crd.PLURAL,
                task.name,
                {"status": {"conditions": merge_conditions(existing, new)}},
                _content_type=MERGE_PATCH,
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning(
                    "audit_condition_failed task=%s/%s status=%s",
                    task.namespace,
                    task.name,
                    exc.status,
                )
