"""The floors every scenario is measured against, measured in the same run.

- ``bare_processes(n)``: N bare Python processes that hold a small conversation and, on
  SIGTERM, write it atomically and durably (temp file, fsync, rename, fsync dir: the
  worker's save) and exit 0; timed from the first SIGTERM until all are reaped.
- ``NoopChain``: a no-op two-task Celery chain with the pipeline's Celery configuration,
  one queue per task (like the daemon queue → orchestrator queue hop), served by a real
  solo-pool worker subprocess (``python -m bench.floors``); timed until ``.get()``.
- ``round_trips(call, n)``: n calls of an API request, timed together.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery, chain

from orchestrator.pipeline.app import make_app
from orchestrator.settings import Settings
from worker_agent import layout
from worker_agent.celery_worker import run_worker
from worker_agent.testing import Subprocess, child_env, short_tmp

FLOOR_TURNS = 10
"""Turns of conversation each bare process holds (about the size a worker holds)."""
NOOP_FIRST, NOOP_SECOND = "bench.noop_first", "bench.noop_second"
NOOP_QUEUES = ("bench-noop.daemon", "bench-noop.orchestrator")
REPO = Path(__file__).resolve().parents[1]

BARE_SCRIPT = r"""
import json, os, signal, sys
directory, turns, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
messages = []
for turn in range(1, turns + 1):
    for role, text in (("user", f"scripted prompt {turn}"),
                       ("assistant", f"reply {turn} (0123456789ab)")):
        messages.append({"role": role, "content": [{"type": "text", "text": text}]})
stamp = "2026-01-01T00:00:00.000000Z"
session = {"name": os.path.basename(directory), "created_at": stamp, "updated_at": stamp,
           "provider": "scripted", "model": "", "messages": messages,
           "total_usage": {"input_tokens": 0, "output_tokens": 0}, "todos": [],
           "plan_mode": False, "caliban_drain": {"version": 2,
           "agent_id": os.path.basename(directory), "turns": turns}}
def on_term(signum, frame):
    raw = json.dumps(session, separators=(",", ":")).encode()
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    signal.pause()
"""


class FloorFailure(Exception):
    """A floor process misbehaved (never ready, bad exit, no session file)."""


def bare_processes(n: int) -> float:
    """Seconds from the first SIGTERM until N bare processes saved and were reaped."""
    procs: list[subprocess.Popen[bytes]] = []
    with short_tmp("cdf-") as root:
        try:
            dirs = [root / f"a{i}" for i in range(n)]
            for directory in dirs:
                directory.mkdir(mode=0o700)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            BARE_SCRIPT,
                            str(directory),
                            str(FLOOR_TURNS),
                            layout.SESSION_FILE,
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + 60
            for proc in procs:
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
                if not ready or proc.stdout.readline() != b"ready\n":
                    raise FloorFailure(f"floor process {proc.pid} never became ready")
            started = time.perf_counter()
            for proc in procs:
                os.kill(proc.pid, signal.SIGTERM)
            for proc in procs:
                proc.wait()
            secs = time.perf_counter() - started
            for proc, directory in zip(procs, dirs, strict=True):
                if proc.returncode != 0 or not layout.session_file(directory).is_file():
                    raise FloorFailure(f"floor process {proc.pid} exited {proc.returncode}")
            return secs
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
            os.sync()  # so this run's writeback does not land in the next measurement


@functools.cache
def noop_app(broker: str) -> Celery:
    """The pipeline's Celery configuration with two trivial tasks, one per queue; one app
    per broker and process (Celery warns when a task name is registered twice)."""
    app = make_app(Settings(broker_url=broker, result_backend=broker))

    @app.task(name=NOOP_FIRST)
    def noop_first(op_id: str) -> dict[str, Any]:
        return {"op_id": op_id, "refs": []}

    @app.task(name=NOOP_SECOND)
    def noop_second(result: dict[str, Any], op_id: str) -> dict[str, Any]:
        return {"op_id": op_id, "agents": len(result["refs"])}

    return app


class NoopWorker(Subprocess):
    """The no-op chain's worker (``python -m bench.floors``), ready once Celery says so."""

    what = "the no-op chain's worker"
    ready_timeout = 60.0

    def ready(self) -> bool:
        self.check_alive(self.what)
        return "ready." in self.log_text()


class NoopChain:
    """The no-op chain floor: its worker subprocess and the client side."""

    def __init__(self, root: Path, broker: str) -> None:
        self.app = noop_app(broker)
        env = {
            "DRAIN_BROKER_URL": broker,
            "DRAIN_RESULT_BACKEND": broker,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        self.worker = NoopWorker(
            [sys.executable, "-m", "bench.floors"], root / "noop-worker.log", child_env(env)
        )
        self.runs = 0

    def start(self) -> NoopChain:
        self.worker.start()
        self.measure()  # warm-up: connections and the result backend's first subscribe
        return self

    def measure(self) -> float:
        self.runs += 1
        tag = f"noop-{self.runs}"
        first = self.app.tasks[NOOP_FIRST].s(op_id=tag).set(queue=NOOP_QUEUES[0])
        second = self.app.tasks[NOOP_SECOND].s(op_id=tag).set(queue=NOOP_QUEUES[1])
        started = time.perf_counter()
        value = chain(first, second).apply_async().get(timeout=120)
        secs = time.perf_counter() - started
        if not isinstance(value, dict) or value.get("op_id") != tag:
            raise FloorFailure(f"no-op chain answered {value!r}")
        return secs

    def stop(self) -> None:
        self.worker.stop(30)


def round_trips(call: Callable[[], object], n: int = 3) -> float:
    """Seconds for ``n`` sequential calls of ``call`` (an API request)."""
    started = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - started


def serve_noop_worker() -> None:
    """The no-op worker: both no-op queues, solo pool, like a daemon's consumer."""
    run_worker(
        noop_app(Settings().broker_url),
        queues=NOOP_QUEUES,
        hostname="bench-noop@%h",
        pool="solo",
        loglevel="INFO",
        without_gossip=True,
        without_mingle=True,
    )


if __name__ == "__main__":
    serve_noop_worker()
