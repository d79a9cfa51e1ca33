"""``drainctl drain|resume|worker|flower``: the Celery pipeline without Kubernetes.

``drain`` and ``resume`` start one lifecycle operation (``orchestrator.pipeline.start``)
and, with ``--wait``, poll the ledger until it is terminal: exit 0 when it succeeded, 1
when it failed, 3 when ``--timeout`` ran out first. Before the operation's ledger row is
written the broker is probed with a bounded retry, so an unreachable broker exits 4
within seconds and leaves no operation behind; the publish that follows is bounded too
(``CLI_PUBLISH_RETRY``), so a broker that drops in between cannot hang the command.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click

from orchestrator.cli.errors import (
    Misconfigured,
    OperationFailed,
    TimedOut,
    hide_password,
    require_extra,
)
from orchestrator.cli.ledger import open_ledger
from orchestrator.cli.output import (
    LOG_LEVELS,
    TASK_REF,
    configure_logging,
    emit,
    json_option,
    log_level_option,
    wants_json,
)

if TYPE_CHECKING:
    from celery import Celery

    from orchestrator.ledger import OperationView

F = TypeVar("F", bound=Callable[..., Any])

CLI_PUBLISH_RETRY: Final = {
    "max_retries": 3,
    "interval_start": 0.2,
    "interval_step": 0.3,
    "interval_max": 1.0,
}
"""How ``drainctl drain|resume`` retry a publish (and the result backend's subscription):
about two seconds, where the long-running processes keep the app's patient policy."""

BROKER_PROBE_TIMEOUT_SECS: Final = 2.0


def _bounded_app() -> Celery:
    """The Celery app, configured for a one-shot command: bounded retries everywhere."""
    from orchestrator.pipeline.app import app

    url = app.conf.broker_url
    _check_broker_url(url)
    # Read when the producer and the backend are first created, i.e. after this.
    app.conf.task_publish_retry_policy = CLI_PUBLISH_RETRY
    app.conf.broker_connection_timeout = BROKER_PROBE_TIMEOUT_SECS
    app.conf.result_backend_transport_options = {
        **(app.conf.result_backend_transport_options or {}),
        "retry_policy": {**CLI_PUBLISH_RETRY, "timeout": BROKER_PROBE_TIMEOUT_SECS},
    }
    app.conf.redis_socket_connect_timeout = BROKER_PROBE_TIMEOUT_SECS
    with app.connection_for_write() as connection:
        # kombu.exceptions.OperationalError when unreachable → exit 4 (errors.py).
        # kombu's stubs say int; the retry loop takes seconds as floats.
        connection.ensure_connection(
            max_retries=2,
            interval_start=0.2,  # type: ignore[arg-type]
            interval_step=0.3,  # type: ignore[arg-type]
            timeout=BROKER_PROBE_TIMEOUT_SECS,  # type: ignore[arg-type]
        )
    return app


def _check_broker_url(url: str) -> None:
    """Refuse a broker URL kombu cannot use, naming it, before anything connects."""
    from urllib.parse import urlsplit

    from kombu.transport import TRANSPORT_ALIASES

    shown = hide_password(url)
    scheme = url.partition("://")[0]
    if "://" not in url or scheme not in TRANSPORT_ALIASES:
        known = ", ".join(sorted(s for s in ("redis", "rediss", "amqp", "filesystem")))
        raise Misconfigured(f"DRAIN_BROKER_URL {shown!r} is not a broker URL; use one of {known}")
    try:
        _ = urlsplit(url).port  # the port is checked when it is read
    except ValueError as exc:
        raise Misconfigured(f"DRAIN_BROKER_URL {shown!r} is malformed: {exc}") from None


def _finish(op: OperationView, wait: bool, timeout: float, *, prints: str) -> None:
    """Print the operation (waited for: its outcome) and exit as its state says.

    Under ``--json`` the operation is printed whatever its state, so a script sees the
    row of a failed or unfinished operation too; the exit code tells them apart.
    """
    from orchestrator.ledger import OperationState
    from orchestrator.pipeline.start import wait_for_operation

    if not wait:
        emit(op, f"operation {op.id} {op.state}")
        return
    op = wait_for_operation(open_ledger(), op.id, timeout)
    succeeded = op.state in (
        OperationState.RECORDED,
        OperationState.FORCED,
        OperationState.RESUMED,
    )
    if succeeded:
        emit(op, str(op.checkpoint_ref) if prints == "checkpoint" else f"{op.state} {op.id}")
        return
    if wants_json():
        emit(op, "")
    task = f"{op.namespace}/{op.name}"
    if op.state == OperationState.FAILED:
        raise OperationFailed(f"operation {op.id} of {task} failed: {op.error}")
    raise TimedOut(
        f"operation {op.id} of {task} is still {op.state} after --timeout {timeout:g}s "
        "(it goes on: wait longer with a larger --timeout, or see its checkpoint later in "
        f"drainctl ledger ls --task {task})"
    )


def _operation_options(wait_help: str) -> Callable[[F], F]:
    """The options every pipeline operation command shares."""

    def apply(command: F) -> F:
        for option in reversed(
            [
                click.option(
                    "--uid",
                    "task_uid",
                    default=None,
                    help="Task identity recorded in the ledger (default NS/NAME).",
                ),
                click.option("--wait", is_flag=True, help=wait_help),
                click.option(
                    "--timeout",
                    default=600.0,
                    show_default=True,
                    type=click.FloatRange(min=0),
                    help="Seconds --wait waits before exiting 3.",
                ),
                json_option,
            ]
        ):
            command = option(command)
        return command

    return apply


@click.command("drain")
@click.argument("task", type=TASK_REF)
@click.option(
    "--grace",
    "grace_secs",
    type=click.FloatRange(min=0),
    default=None,
    help="Drain grace in seconds (default DRAIN_DEFAULT_GRACE_SECS).",
)
@_operation_options("Wait until recorded; print the checkpoint ref.")
def drain_cmd(
    task: tuple[str, str],
    grace_secs: float | None,
    task_uid: str | None,
    wait: bool,
    timeout: float,
) -> None:
    """Drain the daemon of TASK (NS/NAME) through Celery and record a checkpoint."""
    from orchestrator.pipeline.start import start_drain
    from orchestrator.settings import get_settings

    namespace, name = task
    settings = get_settings()
    app = _bounded_app()
    op = start_drain(
        app,
        open_ledger(),
        settings,
        namespace=namespace,
        name=name,
        task_uid=task_uid,
        grace_secs=grace_secs,
    )
    _finish(op, wait, timeout, prints="checkpoint")


@click.command("resume")
@click.argument("task", type=TASK_REF)
@click.option(
    "--checkpoint", "checkpoint_ref", required=True, help="Checkpoint ref (ckpt-…) to resume."
)
@_operation_options("Wait until the daemon resumed the agents.")
def resume_cmd(
    task: tuple[str, str], checkpoint_ref: str, task_uid: str | None, wait: bool, timeout: float
) -> None:
    """Resume every agent of a checkpoint on the daemon of TASK (NS/NAME)."""
    from orchestrator.pipeline.start import start_resume
    from orchestrator.settings import get_settings

    namespace, name = task
    settings = get_settings()
    app = _bounded_app()
    op = start_resume(
        app,
        open_ledger(),
        settings,
        namespace=namespace,
        name=name,
        checkpoint_ref=checkpoint_ref,
        task_uid=task_uid,
    )
    _finish(op, wait, timeout, prints="state")


def _deprecated_loglevel(value: str | None) -> str | None:
    """``worker --loglevel`` (the old spelling) still works, with a note on stderr."""
    if value is not None:
        click.echo("note: --loglevel is deprecated; use --log-level", err=True)
    return value


@click.command("worker")
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Threads running orchestrator tasks.",
)
@log_level_option
@click.option(
    "--loglevel",
    "legacy_log_level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default=None,
    hidden=True,
    callback=lambda _ctx, _param, value: _deprecated_loglevel(value),
    help="Deprecated spelling of --log-level.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port of /metrics, /healthz, /readyz (default DRAIN_WORKER_METRICS_PORT, 9101; 0: none).",
)
def worker_cmd(
    concurrency: int, log_level: str, legacy_log_level: str | None, metrics_port: int | None
) -> None:
    """Run the orchestrator's Celery worker (queue ``orchestrator``) and the deadline
    sweeper."""
    from orchestrator.pipeline.app import app
    from orchestrator.pipeline.probes import serve_worker
    from orchestrator.pipeline.tasks import DeadlineSweeper
    from orchestrator.settings import get_settings

    level = (legacy_log_level or log_level).upper()
    _check_broker_url(app.conf.broker_url)
    ledger, settings = open_ledger(), get_settings()
    configure_logging(level)
    from worker_agent.celery_worker import run_worker
    from worker_agent.logformat import install_celery_hooks

    install_celery_hooks()  # Celery keeps to our logging; each task's records name it
    port = settings.worker_metrics_port if metrics_port is None else metrics_port
    serve_worker(app, ledger, settings.metrics_host, port)
    if settings.message_key is None:
        logging.getLogger(__name__).warning(
            "message_signing=off: DRAIN_MESSAGE_KEY is unset, so drain results, resume "
            "results and heartbeats are taken without proof of the task that sent them "
            "(one tenant only; see docs/security.md)"
        )
    DeadlineSweeper(ledger, settings.sweep_interval_secs).start()
    code = run_worker(
        app,
        queues=["orchestrator"],
        hostname="orchestrator@%h",
        pool="threads",
        loglevel=level,
        concurrency=concurrency,
        # No gossip (every daemon's worker-heartbeat event, a few a second per task, read
        # for nothing) and no mingle at start: nothing here is coordinated between workers.
        without_gossip=True,
        without_mingle=True,
    )
    sys.exit(code)


@click.command("flower")
@click.option("--port", default=5555, show_default=True, type=int, help="HTTP port.")
@click.option("--address", default="127.0.0.1", show_default=True, help="Address to bind.")
@log_level_option
def flower_cmd(port: int, address: str, log_level: str) -> None:
    """Flower on this broker: drain, record and resume tasks as they run.

    Flower's HTTP API needs credentials: set FLOWER_BASIC_AUTH=user:password (read by
    Flower itself, so it never shows in the process list), or, for a loopback-only dev
    stack, FLOWER_UNAUTHENTICATED_API=true.
    """
    require_extra("flower", "flower", "drainctl flower")
    from orchestrator.pipeline.app import app

    _check_broker_url(app.conf.broker_url)
    configure_logging(log_level)
    if not os.environ.get("FLOWER_BASIC_AUTH") and not os.environ.get("FLOWER_UNAUTHENTICATED_API"):
        logging.getLogger(__name__).warning(
            "FLOWER_BASIC_AUTH is not set; Flower's API will answer 401 "
            "(set FLOWER_BASIC_AUTH=user:password)"
        )
    # Flower runs in this process, not exec'd, so its records (and tornado's) go through
    # the handler configure_logging installed, in DRAIN_LOG_FORMAT. --logging=none keeps
    # tornado from setting the root level or adding a handler of its own; Flower's
    # SIGTERM handler still ends it with exit 0.
    try:
        code: int | None = app.start(
            ["flower", f"--port={port}", f"--address={address}", "--logging=none"]
        )
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise Misconfigured(
            f"Flower cannot listen on {address}:{port}: {exc.strerror}; "
            "choose another --port or --address"
        ) from None
    if code:
        sys.exit(code)
