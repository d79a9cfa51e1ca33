"""The testing kit, daemon half: ``drainctl daemon`` as a real subprocess, as kopf ships
``kopf.testing``. Tests, the benchmarks and ``drainctl demo`` start daemons through it.

What it guarantees:

- every child is started in a session of its own (``start_new_session``), so a signal
  sent to the test runner's terminal never reaches it half-way, and the whole process
  group can be killed at once;
- ``stop`` sends SIGTERM, waits ``grace`` seconds, then SIGKILLs the process group, and
  SIGKILLs every descendant it ever saw (a daemon's agents and consumer run in sessions
  of their own, so the group alone does not hold them);
- every process still running when the interpreter exits is killed the same way
  (``atexit``), so a test run that is interrupted leaves no daemon, agent or Celery
  worker behind to eat a later run's queues.

Standard library and this package only: it imports nothing from ``orchestrator`` (the
orchestrator's half, for its worker and the dev stack, is ``orchestrator.testing``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from signal import Signals
from typing import Self, TypeVar

from worker_agent.children import descendants, is_zombie
from worker_agent.client import SupervisorClient
from worker_agent.proto import AgentRecord, AgentStatus

T = TypeVar("T")

DRAINCTL = (sys.executable, "-m", "orchestrator.cli")
"""How the kit runs ``drainctl``: this interpreter, so a checkout on ``PYTHONPATH`` wins."""


class WaitTimeout(AssertionError):
    """A condition the kit waited for did not come true in time; the message says which."""


class ProcessExited(AssertionError):
    """A process of the kit exited before it was ready; the message carries its log tail."""


def wait_until(
    condition: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "condition",
    interval: float = 0.02,
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def short_tmp(prefix: str = "cd-") -> Iterator[Path]:
    """A temp dir with a short path: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def child_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without ``DRAIN_DAEMON_*`` (the caller's options are the only
    daemon options), unbuffered output, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAIN_DAEMON_")}
    return {**env, "PYTHONUNBUFFERED": "1", **(overrides or {})}


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of its stat): with the pid, it names the process,
    so a pid recycled by an unrelated process is never signalled."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Subprocess:
    """One child process of the kit: started in its own session, its output in ``log``,
    stopped with SIGTERM then SIGKILL (its group and every descendant seen).

    ``start`` launches it and waits until ``ready`` (a subclass's probe; this base is
    ready once launched) answers true; ``what`` names it in errors."""

    what = "the process"
    ready_timeout = 30.0

    def __init__(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> None:
        self.argv = list(argv)
        self.log = log
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, str] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def launch(self) -> None:
        """Start the process without waiting for it to be ready."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        _LIVE.append(self)

    def start(self, timeout: float | None = None) -> Self:
        """Launch, then wait (``ready_timeout`` by default) until ``ready``."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        wait_until(self.ready, timeout or self.ready_timeout, f"{self.what} to be ready", 0.05)

    def ready(self) -> bool:
        self.check_alive(self.what)
        return True

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self, what: str) -> None:
        """Raise ``ProcessExited`` (with the log tail) if the process has exited."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is not None:
            raise ProcessExited(f"{what} exited {self.proc.returncode}:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:]) or "(empty log)"

    def note_descendants(self) -> None:
        """Remember the process's current descendants, to be killed if they outlive it."""
        if self.running():
            for pid in descendants(self.pid):
                stamp = _start_time(pid)
                if stamp is not None:
                    self._seen.setdefault(pid, stamp)

    def signal(self, sig: Signals) -> None:
        assert self.proc is not None, "not started"
        self.proc.send_signal(sig)

    def wait(self, timeout: float | None = 60) -> int:
        assert self.proc is not None, "not started"
        return self.proc.wait(timeout)

    def send_stop(self) -> None:
        """SIGTERM, without waiting (so that many processes stop in parallel)."""
        self.note_descendants()
        if self.running():
            self.signal(signal.SIGTERM)

    def reap(self, grace: float) -> int:
        """Wait up to ``grace`` for the process, then SIGKILL its group and every
        descendant seen that is still alive; answer how many processes were killed."""
        killed = 0
        if self.proc is not None:
            try:
                self.proc.wait(max(0.0, grace))
            except subprocess.TimeoutExpired:
                killed += 1
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: pgid == pid
            self.proc.wait()
        for pid, stamp in self._seen.items():
            if _start_time(pid) == stamp and not is_zombie(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        self._seen.clear()
        with contextlib.suppress(ValueError):
            _LIVE.remove(self)
        return killed

    def stop(self, grace: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``grace``; answer how many had to be killed."""
        self.send_stop()
        return self.reap(grace)


_LIVE: list[Subprocess] = []


@atexit.register
def _kill_leftovers() -> None:
    for child in list(_LIVE):
        child.note_descendants()
        child.reap(0)


def stop_all(children: Sequence[Subprocess], grace: float = 60.0) -> int:
    """SIGTERM all at once (they stop in parallel), then reap each within one shared
    ``grace``; answer how many processes had to be killed."""
    for child in children:
        child.send_stop()
    deadline = time.monotonic() + grace
    return sum(child.reap(deadline - time.monotonic()) for child in children)


_DRAINED = re.compile(r"event=drained .*? secs=([0-9.]+)")


class DaemonProcess(Subprocess):
    """``drainctl daemon`` in ``root`` (store ``root/store``, socket ``root/ctl.sock``),
    ready when its socket answers ``status``; with ``queue`` it runs its Celery consumer.
    """

    def __init__(
        self,
        root: Path,
        *extra: str,
        drain_grace: float = 10.0,
        queue: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = root
        self.store = root / "store"
        self.socket = root / "ctl.sock"
        self.extra = extra
        self.drain_grace = drain_grace
        self.queue = queue
        self.env_overrides = dict(env or {})
        self.what = f"the daemon in {root}"
        super().__init__([], root / "daemon.log", {})

    def launch(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        queue = ("--queue", self.queue) if self.queue else ()
        self.argv = [
            *DRAINCTL, "daemon", "--store", str(self.store), "--socket", str(self.socket),
            "--drain-grace", str(self.drain_grace), *queue, *self.extra,
        ]  # fmt: skip
        self.env = child_env(self.env_overrides)
        super().launch()

    def ready(self) -> bool:
        """The control socket answers ``status`` (raises if the daemon exited)."""
        self.check_alive(self.what)
        if not self.socket.exists():
            return False
        try:
            with self.client(timeout=10) as client:
                client.status()
        except OSError:
            return False
        return True

    def client(self, timeout: float | None = 120.0) -> SupervisorClient:
        return SupervisorClient(socket_path=self.socket, timeout=timeout)

    def records(self) -> dict[str, AgentRecord]:
        with self.client() as client:
            return {r.id: r for r in client.agents()}

    def spawn(self, count: int, model: str) -> list[str]:
        """Spawn ``count`` scripted agents; answer their ids."""
        with self.client() as client:
            ids = [client.spawn(provider="scripted", model=model).id for _ in range(count)]
        self.note_descendants()
        return ids

    def spawn_working(self, count: int, model: str, min_turns: int) -> list[str]:
        """Spawn ``count`` scripted agents and wait until each completed ``min_turns``."""
        ids = self.spawn(count, model)

        def working() -> bool:
            records = self.records()
            return all(records[i].turns >= min_turns for i in ids)

        wait_until(working, 120, f"{count} agents to complete {min_turns} turns")
        self.note_descendants()
        return ids

    def wait_for_status(
        self, ids: list[str], statuses: set[AgentStatus], timeout: float = 60
    ) -> dict[str, AgentRecord]:
        def reached() -> dict[str, AgentRecord] | None:
            records = self.records()
            ok = all(records[i].status in statuses for i in ids)
            return records if ok else None

        return wait_until(reached, timeout, f"agents {statuses}")

    def drained_secs(self) -> float | None:
        """The daemon's own duration of its latest drain (its ``event=drained`` log line)."""
        found = _DRAINED.findall(self.log_text())
        return float(found[-1]) if found else None
