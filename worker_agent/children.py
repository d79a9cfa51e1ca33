"""Child processes kept running: started, restarted with backoff if they die, and
stopped gracefully (SIGTERM, then SIGKILL after a grace) when their parent stops.

The daemon keeps its Celery consumer this way; ``drainctl dev up`` keeps the operator
and the orchestrator worker the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

MAX_BACKOFF_SECS = 30.0


class KeptProcess:
    def __init__(
        self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_running())

    async def _spawn(self) -> asyncio.subprocess.Process:
        if self.log_path is None:
            return await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, start_new_session=True
            )
        with self.log_path.open("ab") as out:
            return await asyncio.create_subprocess_exec(
                *self.argv, env=self.env, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    async def _keep_running(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            self.process = await self._spawn()
            log.info("child_started name=%s pid=%d", self.name, self.process.pid)
            code = await self.process.wait()
            if self._stopping.is_set():
                break
            log.warning(
                "child_exited name=%s exit=%d restart_in_secs=%.0f", self.name, code, backoff
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECS)

    def request_stop(self) -> None:
        """SIGTERM: the child's own graceful stop (Celery's warm shutdown, kopf's exit)."""
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
