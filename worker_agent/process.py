"""Worker processes: building the command line from the template, starting, signalling
and reaping them without a thread per child.

Each worker runs in its own session and process group (so a terminal's Ctrl-C reaches
the daemon, which drains, and not the workers directly; and so a signal reaches every
process the worker started, not only the worker itself), with stdout appended to the agent's
``stdout.ndjson`` and stderr to ``stderr.log``. Exit is observed through a pidfd on
the event loop, so a hundred agents cost a hundred file descriptors, not threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path


class LaunchError(Exception):
    """The worker command could not be started; the message says why."""


def render_command(template: str, values: Mapping[str, str]) -> list[str]:
    """Split the template like a shell would, then fill each word; empty words vanish."""
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise LaunchError(f"worker command template {template!r} cannot be split: {exc}") from None
    argv: list[str] = []
    for word in words:
        try:
            filled = word.format_map(values)
        except (KeyError, ValueError, IndexError) as exc:
            raise LaunchError(
                f"worker command template word {word!r} has an unknown placeholder: {exc}"
            ) from None
        if filled:
            argv.append(filled)
    if not argv:
        raise LaunchError("worker command template renders to an empty command")
    return argv


class WorkerProcess:
    """One running worker. ``exited`` resolves to its return code (negative: a signal)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            # No pidfd (not Linux >= 5.3): one blocking waiter thread for this child.
            waiter = loop.run_in_executor(None, popen.wait)
            waiter.add_done_callback(lambda f: self._settle(f.result()))
        else:
            loop.add_reader(self._pidfd, self._reap)

    @classmethod
    def start(
        cls,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        nice: int = 0,
    ) -> WorkerProcess:
        """Start ``argv``; with ``nice``, that many levels below this process's priority
        (set from here once it runs, since ``preexec_fn`` is unsafe in a process with
        threads: its first instants run at this process's priority)."""
        out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start worker {argv[0]!r}: {exc.strerror or exc}") from None
        finally:
            os.close(out)
            os.close(err)
        if nice:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
                os.setpriority(os.PRIO_PROCESS, popen.pid, niceness)
        return cls(popen)

    def _reap(self) -> None:
        code = self._popen.poll()
        if code is None:
            return
        self._close_pidfd()
        self._settle(code)

    def _settle(self, code: int) -> None:
        if not self.exited.done():
            self.exited.set_result(code)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def signal(self, sig: signal.Signals) -> None:
        """Signal the worker's whole process group, unless the worker has been reaped.

        The group id is the worker's pid (``start_new_session``); while the worker is
        not reaped its pid cannot be reused, so the group is still the worker's.
        """
        if self.exited.done():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def kill_group(self, within: float = 2.0) -> bool:
        """SIGKILL what is left of the worker's process group after the worker exited.

        A worker's children (a tool it ran, a shell it forked) must not outlive it: one
        that kept writing the session dir after a drain replied would make the recorded
        sha256 a lie. Called right after the worker is reaped, while the group id cannot
        have been given to anyone else (the kernel does not hand out a pid that is still
        some process group's id). Waits until the group is empty; False if some member
        is still there after ``within`` seconds (a process stuck in the kernel).
        """
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return True
        deadline = asyncio.get_running_loop().time() + within
        while asyncio.get_running_loop().time() < deadline:
            try:
                os.killpg(self.pid, 0)
            except (ProcessLookupError, PermissionError):
                return True
            await asyncio.sleep(0.01)
        return False

    async def exit_within(self, secs: float) -> int | None:
        """The exit code, or None if the worker is still running after ``secs``."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.exited), secs)
        except TimeoutError:
            return None

    async def terminate(self, grace: float) -> int:
        """SIGTERM, then SIGKILL if the worker outlives ``grace``; return the exit code."""
        self.signal(signal.SIGTERM)
        code = await self.exit_within(grace)
        if code is None:
            self.signal(signal.SIGKILL)
            code = await self.exited
        return code
