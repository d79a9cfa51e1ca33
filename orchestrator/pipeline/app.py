"""The orchestrator's Celery app, configured from the shared contract.

Routing is by queue: orchestrator tasks run on ``orchestrator``; each daemon consumes
its own ``caliband.<namespace>.<name>``. Task *names* are the contract between the two
sides, so neither imports the other's task code: the orchestrator sends daemon tasks by
name, and a daemon's consumer sends its heartbeats the same way. The names, the queue
helpers and the Celery configuration (docs/pipeline.md) live in ``worker_agent.contract``;
this module re-exports them for the orchestrator's modules and builds ``app`` from
``Settings`` (which extends the contract's ``BrokerSettings``) when it is first
configured, not when this module is imported: what runs it (the worker, ``drainctl``)
has set its settings by then.
"""

from __future__ import annotations

from celery import Celery

from orchestrator.settings import Settings, get_settings
from worker_agent.contract import (
    ACTIVITY,
    DAEMON_DRAIN,
    DAEMON_RESUME,
    ORCHESTRATOR_QUEUE,
    RECORD_CHECKPOINT,
    RECORD_RESUME,
    TaskNameError,
    celery_config,
    check_task_name,
    daemon_queue,
    make_celery,
    parse_task_ref,
    stamp_messages,
)

__all__ = [
    "ACTIVITY",
    "DAEMON_DRAIN",
    "DAEMON_RESUME",
    "ORCHESTRATOR_QUEUE",
    "RECORD_CHECKPOINT",
    "RECORD_RESUME",
    "TaskNameError",
    "app",
    "check_task_name",
    "daemon_queue",
    "make_app",
    "parse_task_ref",
]


def make_app(settings: Settings) -> Celery:
    """The orchestrator's Celery app: the contract's configuration from ``settings``."""
    return make_celery(settings)


def _configure(sender: Celery, **_: object) -> None:
    sender.config_from_object(celery_config(get_settings()))
    stamp_messages()


app = Celery("caliban-drain")
"""The orchestrator's app, configured from ``get_settings()`` the first time its
configuration is read (Celery's ``on_configure``)."""
app.on_configure.connect(_configure, weak=False)
