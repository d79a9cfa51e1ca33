"""Child processes kept running: started, restarted with backoff if they die, and
stopped gracefully (SIGTERM, then SIGKILL after a grace) when their parent stops.

The daemon keeps its Celery consumer this way; ``drainctl dev up`` keeps the operator
and the orchestrator worker the same way. Every such child also dies with its parent,
however the parent dies (``PR_SET_PDEATHSIG``): a SIGKILLed daemon must not leave its
consumer taking the task's messages against a dead socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

MAX_BACKOFF_SECS = 30.0
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals, expected_parent: int | None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies.

    ``expected_parent`` closes the race with a parent that died before the request took
    effect: if this process has already been re-parented, it signals itself now.
    Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)


def dying_with_this_process(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that makes a child die (by ``sig``) when this process dies."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from ``/proc`` (children before theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        children = parents.get(frontier.pop(0), [])
        found.extend(children)
        frontier.extend(children)
    return found


def is_zombie(pid: int) -> bool:
    """True for a zombie (dead, not yet reaped) or a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


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
                *self.argv,
                env=self.env,
                start_new_session=True,
                preexec_fn=dying_with_this_process(),
            )
        with self.log_path.open("ab") as out:
            return await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=dying_with_this_process(),
            )

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
