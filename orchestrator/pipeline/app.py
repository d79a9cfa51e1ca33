"""The Celery app shared by the orchestrator worker and every daemon-side consumer.

Routing is by queue: orchestrator tasks run on ``orchestrator``; each daemon consumes
its own ``caliband.<namespace>.<name>``. Task *names* are the contract between the two
sides, so neither imports the other's task code: the orchestrator sends daemon tasks by
name, and a daemon's consumer sends its heartbeats the same way. Configuration follows
docs/pipeline.md: JSON only, acks late, reject on worker lost, prefetch 1, task events on,
a visibility timeout longer than the longest drain, connection retry on start-up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from celery import Celery

from orchestrator.settings import Settings, get_settings

ORCHESTRATOR_QUEUE: Final = "orchestrator"

# Task names: the wire contract between the orchestrator and the daemons.
DAEMON_DRAIN: Final = "caliban.daemon.drain"
DAEMON_RESUME: Final = "caliban.daemon.resume"
RECORD_CHECKPOINT: Final = "caliban.orchestrator.record_checkpoint"
RECORD_RESUME: Final = "caliban.orchestrator.record_resume"
ACTIVITY: Final = "caliban.orchestrator.activity"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class TaskNameError(ValueError):
    """A namespace/name pair that cannot name a Kubernetes object or a queue."""


def parse_task_ref(ref: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` → (namespace, name), validated like Kubernetes names."""
    namespace, sep, name = ref.partition("/")
    if not sep:
        raise TaskNameError(f"{ref!r} is not NAMESPACE/NAME")
    check_task_name(namespace, name)
    return namespace, name


def check_task_name(namespace: str, name: str) -> None:
    if len(namespace) > 63 or not _DNS_LABEL.match(namespace):
        raise TaskNameError(f"namespace {namespace!r} is not a DNS-1123 label")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise TaskNameError(f"name {name!r} is not a DNS-1123 subdomain")


def daemon_queue(namespace: str, name: str) -> str:
    """The queue one task's daemon consumes. Dots cannot occur in a namespace, so
    ``caliband.<ns>.<name>`` is unambiguous even when the name has dots."""
    check_task_name(namespace, name)
    return f"caliband.{namespace}.{name}"


def make_app(settings: Settings) -> Celery:
    app = Celery("caliban-drain", broker=settings.broker_url, backend=settings.backend())
    transport_options: dict[str, object] = {
        "visibility_timeout": settings.visibility_timeout_secs,
        "unacked_restore_interval": settings.unacked_restore_interval_secs,
        "unacked_restore_throttle": 1,
    }
    if settings.broker_url.startswith("filesystem://"):
        # The embedded broker: processes on one machine exchange messages as files.
        folder = Path(settings.broker_folder or "./.broker")
        for sub in ("queue", "processed", "results", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": 0.1,
        }
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        result_extended=True,
        result_expires=7 * 24 * 3600,
        broker_transport_options=transport_options,
        result_backend_transport_options=(
            {} if settings.broker_url.startswith("filesystem://") else transport_options
        ),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=ORCHESTRATOR_QUEUE,
        task_create_missing_queues=True,
        task_routes={"caliban.orchestrator.*": {"queue": ORCHESTRATOR_QUEUE}},
        task_publish_retry=True,
        task_publish_retry_policy={
            "max_retries": 30,
            "interval_start": 0.2,
            "interval_step": 0.5,
            "interval_max": 5,
        },
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
    )
    return app


app = make_app(get_settings())
