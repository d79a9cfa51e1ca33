"""Keeps the daemon-side Celery consumer running as a child of ``drainctl daemon``.

One command for the pod: the supervisor serves the control socket in this process and
the consumer runs in a child (Celery's worker owns its process), restarted with
backoff if it dies. On shutdown the consumer gets SIGTERM first (Celery's warm shutdown
lets a running drain task finish against the still-open control socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from worker_agent.settings import DaemonSettings

log = logging.getLogger(__name__)

MAX_BACKOFF_SECS = 30.0


class ConsumerProcess:
    def __init__(self, settings: DaemonSettings, socket_path: str) -> None:
        assert settings.queue is not None
        self.settings = settings
        self.queue = settings.queue
        self.socket_path = socket_path
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_running())

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.settings.broker_url:
            env["DRAIN_BROKER_URL"] = self.settings.broker_url
        if self.settings.task_uid:
            env["DRAIN_TASK_UID"] = self.settings.task_uid
        return env

    async def _keep_running(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "worker_agent.consumer",
                "--queue", self.queue,
                "--socket", self.socket_path,
                "--store", str(self.settings.store.resolve()),
                env=self._env(),
                start_new_session=True,
            )  # fmt: skip
            log.info("consumer_started pid=%d queue=%s", self.process.pid, self.queue)
            code = await self.process.wait()
            if self._stopping.is_set():
                break
            log.warning("consumer_exited exit=%d restart_in_secs=%.0f", code, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECS)

    def request_stop(self) -> None:
        """Warm shutdown: no new tasks; a running one finishes."""
        self._stopping.set()
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    async def wait_stopped(self, within: float) -> None:
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.process.wait(), within)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self._task is not None:
            await self._task
