"""The periodic auditor: ``drainctl audit --every SECS``.

Each run audits its share of the checkpoints (``runner.Rotation``) and everything else,
announces what it found (``loud``), updates the metrics served on ``--metrics-port`` and
writes the report to ``--report-file`` (atomically, for a probe or a script to read). A
run that cannot reach the API or the database is logged and retried at the next period:
the auditor never stops on an outage, and reports it as such.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from prometheus_client import start_http_server

from orchestrator.audit.loud import Announcer, AuditMetrics
from orchestrator.audit.runner import Auditor, AuditReport

log = logging.getLogger(__name__)


def write_report(path: Path, report: AuditReport) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(report.as_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


def run_periodically(
    auditor: Auditor,
    every_secs: float,
    *,
    stop: threading.Event,
    metrics: AuditMetrics | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    report_file: Path | None = None,
) -> None:
    """Audit every ``every_secs`` until ``stop`` is set; the first run at once."""
    metrics = metrics or AuditMetrics()
    if metrics_port is not None:
        start_http_server(metrics_port, addr=metrics_host, registry=metrics.registry)
        log.info("audit_metrics_serving host=%s port=%d", metrics_host, metrics_port)
    announcer = Announcer()
    while not stop.is_set():
        try:
            report = auditor.run(everything=False)
            new = announcer.announce(report, auditor.last_tasks)
        except Exception as exc:  # an outage: say so, and try again next period
            log.warning("audit_failed error=%s: %s", type(exc).__name__, exc)
        else:
            metrics.observe(report)
            metrics.lost_turns.inc(sum(f.lost_turns for f in new))
            log.info(
                "audit_done findings=%d duration=%.3fs checkpoints_checked=%d sessions_checked=%d",
                len(report.findings),
                report.duration_secs,
                report.counts.get("checkpoints_checked", 0),
                report.counts.get("sessions_checked", 0),
            )
            if report_file is not None:
                write_report(report_file, report)
        stop.wait(every_secs)
