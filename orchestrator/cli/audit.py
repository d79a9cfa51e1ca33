"""``drainctl audit``: check every claim of the status and the ledger against reality.

One-shot by default: every restorable checkpoint, every task, operation, daemon and
orphan; the findings printed (``--json``: the report), exit 0 when clean and 1 when it
found anything. ``--every SECS`` runs it as the periodic auditor instead (events,
``Consistent`` conditions, metrics on ``--metrics-port``, the latest report in
``--report-file``) until SIGTERM. Both only read what they audit; neither repairs nor
deletes. ``docs/audit.md`` is the runbook for each finding.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.errors import OperationFailed
from orchestrator.cli.ledger import open_ledger
from orchestrator.cli.operator import kube_options, load_kube
from orchestrator.cli.output import configure_logging, emit, json_option, log_level_option


@click.command("audit")
@kube_options
@click.option(
    "--volumes",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Where workspaces can be read (the dev stack's <state>/sandboxes); default "
    "DRAIN_AUDIT_VOLUMES_DIR; without it session contents are not checked.",
)
@click.option("--no-kubernetes", is_flag=True, help="Audit the ledger alone (no cluster).")
@click.option(
    "--every",
    type=click.FloatRange(min=1.0),
    default=None,
    help="Run periodically, every SECS (the periodic auditor), until SIGTERM.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="With --every: serve Prometheus metrics on this port.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="With --every: the address the metrics listen on.",
)
@click.option(
    "--report-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="With --every: write each run's report (JSON) here.",
)
@json_option
@log_level_option
def audit_cmd(
    kubeconfig: Path | None,
    context: str | None,
    volumes: Path | None,
    no_kubernetes: bool,
    every: float | None,
    metrics_port: int | None,
    metrics_host: str,
    report_file: Path | None,
    log_level: str,
) -> None:
    """Audit the status and the ledger against the cluster and the workspaces."""
    source = click.get_current_context().get_parameter_source("log_level")
    if every is None and source is click.core.ParameterSource.DEFAULT:
        log_level = "WARNING"  # a one-shot prints its report, not the libraries' chatter
    configure_logging(log_level)
    from orchestrator.audit import Auditor
    from orchestrator.settings import get_settings

    settings = get_settings()
    if volumes is not None:
        settings = settings.model_copy(update={"audit_volumes_dir": volumes.resolve()})
    if every is not None:  # each run's share of the checkpoints follows the real period
        settings = settings.model_copy(update={"audit_interval_secs": every})
    if every is None and (metrics_port is not None or report_file is not None):
        raise click.UsageError("--metrics-port and --report-file need --every")
    if not no_kubernetes:
        load_kube(kubeconfig, context)
    auditor = Auditor(open_ledger(), settings, kubernetes=not no_kubernetes)
    if every is not None:
        from orchestrator.audit.periodic import run_periodically

        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        run_periodically(
            auditor,
            every,
            stop=stop,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            report_file=report_file,
        )
        return
    report = auditor.run(everything=True)
    emit(report.as_json(), lambda: _human(report.as_json()))
    if not report.clean:
        raise OperationFailed(
            f"the audit found {len(report.findings)} inconsistenc"
            f"{'y' if len(report.findings) == 1 else 'ies'}"
        )


def _human(report: dict[str, Any]) -> str:
    counts = report["counts"]
    looked = (
        f"{counts.get('tasks', 0)} tasks, {counts.get('checkpoints_checked', 0)} of "
        f"{counts.get('checkpoints', 0)} restorable checkpoints (snapshots: "
        f"{counts.get('snapshots_ready', 0)} ready, {counts.get('snapshots_pending', 0)} "
        f"pending, {counts.get('snapshots_failed', 0)} failed), "
        f"{counts.get('sessions_checked', 0)} sessions read"
    )
    if not report["kubernetes"]:
        looked += " (ledger only: --no-kubernetes)"
    if report["clean"]:
        return f"audit clean: {looked}"
    lines = [f"{'KIND':<20} {'SUBJECT':<48} MESSAGE"]
    for f in report["findings"]:
        lines.append(f"{f['kind']:<20} {f['subject']:<48} {f['message']}")
    return "\n".join([*lines, f"audited {looked}"])
