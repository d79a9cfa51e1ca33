"""Keeps the daemon-side Celery consumer running as a child of ``drainctl daemon``.

One command for the pod: the supervisor serves the control socket in this process and
the consumer runs in a child (Celery's worker owns its process), restarted with
backoff if it dies. On shutdown the consumer gets SIGTERM first (Celery's warm shutdown
lets a running drain task finish against the still-open control socket).
"""

from __future__ import annotations

import os
import sys

from worker_agent.children import KeptProcess
from worker_agent.settings import DaemonSettings


def consumer_process(settings: DaemonSettings, socket_path: str) -> KeptProcess:
    assert settings.queue is not None
    env = dict(os.environ)
    if settings.broker_url:
        env["DRAIN_BROKER_URL"] = settings.broker_url
    if settings.task_uid:
        env["DRAIN_TASK_UID"] = settings.task_uid
    argv = [
        sys.executable, "-m", "worker_agent.consumer",
        "--queue", settings.queue,
        "--socket", socket_path,
        "--store", str(settings.store.resolve()),
    ]  # fmt: skip
    return KeptProcess(f"consumer {settings.queue}", argv, env)
