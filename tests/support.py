"""Test helpers: a real daemon as a subprocess, short temporary dirs, condition waits."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from worker_agent.client import SupervisorClient
from worker_agent.proto import AgentRecord, AgentStatus

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T | None], timeout: float = 30.0, what: str = "condition"
) -> T:
    """Poll ``condition`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class DaemonProcess:
    """``drainctl daemon`` as a real subprocess, with a client factory."""

    def __init__(
        self,
        root: Path,
        *extra: str,
        drain_grace: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.env = env or {}
        self.store = root / "store"
        self.socket = root / "ctl.sock"
        self.log = root / "daemon.log"
        self.extra = extra
        self.drain_grace = drain_grace
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        log = self.log.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "orchestrator.cli", "daemon",
                "--store", str(self.store), "--socket", str(self.socket),
                "--drain-grace", str(self.drain_grace), *self.extra,
            ],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        log.close()
        wait_until(self._ready, 30, f"daemon socket {self.socket}")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log.read_text()}")
        if not self.socket.exists():
            return False
        try:
            with self.client() as client:
                client.status()
        except (ConnectionError, OSError):
            return False
        return True

    def client(self, timeout: float | None = 120.0) -> SupervisorClient:
        return SupervisorClient(socket_path=self.socket, timeout=timeout)

    def records(self) -> dict[str, AgentRecord]:
        with self.client() as client:
            return {r.id: r for r in client.agents()}

    def spawn_working(self, count: int, model: str, min_turns: int) -> list[str]:
        """Spawn ``count`` scripted agents and wait until each completed ``min_turns``."""
        with self.client() as client:
            ids = [client.spawn(provider="scripted", model=model).id for _ in range(count)]

        def working() -> bool:
            records = self.records()
            return all(records[i].turns >= min_turns for i in ids)

        wait_until(working, 120, f"{count} agents to complete {min_turns} turns")
        return ids

    def wait_for_status(
        self, ids: list[str], statuses: set[AgentStatus], timeout: float = 60
    ) -> dict[str, AgentRecord]:
        def reached() -> dict[str, AgentRecord] | None:
            records = self.records()
            ok = all(records[i].status in statuses for i in ids)
            return records if ok else None

        return wait_until(reached, timeout, f"agents {statuses}")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
