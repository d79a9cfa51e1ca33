"""Test helpers for the Celery pipeline: a real broker (Redis, or RabbitMQ with a vhost of
each test's own), real PostgreSQL or SQLite, and the orchestrator worker, daemons (with
their consumers) and ``drainctl`` as subprocesses."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from orchestrator.ledger import Ledger
from orchestrator.ledger.migrate import upgrade
from orchestrator.testing import (
    LEDGER_TABLES,
    ServerUnavailable,
    WorkerProcess,
    flushed_redis,
    fresh_ledger,
)
from orchestrator.testing.servers import PostgresServer, RedisServer, free_port
from tests.support import DaemonProcess

__all__ = [
    "BROKERS",
    "LEDGER_TABLES",
    "PipelineBroker",
    "Stack",
    "free_port",
    "fresh_postgres",
    "fresh_sqlite",
    "pipeline_broker",
    "redis_db_url",
]

PG_URL = os.environ.get("DRAIN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
"""The PostgreSQL database the tests drop and migrate (``DRAIN_TEST_PG_URL`` points them at
another, so that two checkouts can run their suites side by side)."""
REDIS_PORT = int(os.environ.get("DRAIN_TEST_REDIS_PORT", "6379"))
"""The Redis server whose databases the tests flush (``DRAIN_TEST_REDIS_PORT``)."""
PIPELINE_REDIS_DB = 3
"""The Redis database of the pipeline modules (broker, and result backend with either
broker); the e2e suites and the bench use 5 and 7 to 15."""
AMQP_URL = os.environ.get("DRAIN_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
"""The RabbitMQ server in which each amqp test gets a vhost of its own
(``DRAIN_TEST_AMQP_URL``; its user must be allowed to use the vhosts it is given)."""
AMQP_HINT = (
    "RabbitMQ is not reachable at {url}: start it with `rabbitmq-server -detached` "
    "(or scripts/ensure-services.sh)"
)
BROKERS = ("redis", "amqp")
"""The brokers the pipeline runs on; the broker-path tests run on each."""


def redis_db_url(db: int = 9, port: int = REDIS_PORT) -> str:
    """A flushed Redis database of this machine's server, or skip saying how to start it."""
    try:
        return flushed_redis(port, db)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))


@dataclass(frozen=True)
class PipelineBroker:
    """The broker of one test, and the result backend that goes with it."""

    kind: str
    url: str
    results: str


@contextlib.contextmanager
def pipeline_broker(kind: str) -> Iterator[PipelineBroker]:
    """An empty broker of ``kind`` (``redis`` or ``amqp``) for one test, or skip saying how
    to start it. RabbitMQ keeps no results, so with it the results go to Redis."""
    results = redis_db_url(PIPELINE_REDIS_DB)
    if kind == "redis":
        yield PipelineBroker(kind, results, results)
        return
    with rabbitmq_vhost() as url:
        yield PipelineBroker(kind, url, results)


def rabbitmqctl(*args: str) -> None:
    try:
        subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"rabbitmqctl {args[0]} failed ({exc}): each amqp test needs a vhost")


@contextlib.contextmanager
def rabbitmq_vhost() -> Iterator[str]:
    """``AMQP_URL`` on a new vhost, deleted afterwards with every queue declared in it, so
    that no test sees another's messages; or skip saying how to start RabbitMQ."""
    from kombu import Connection

    parts = urlsplit(AMQP_URL)
    shown = urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port or 5672}"))
    try:
        with Connection(AMQP_URL, connect_timeout=2) as probe:
            probe.ensure_connection(max_retries=1, timeout=2)
    except Exception:  # kombu's OperationalError, or the socket's own
        pytest.skip(AMQP_HINT.format(url=shown))
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed: each amqp test needs a vhost of its own")
    vhost = f"caliban-drain-test-{uuid.uuid4().hex[:12]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, parts.username or "guest", ".*", ".*", ".*")
        yield urlunsplit(parts._replace(path=f"/{vhost}"))
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True, timeout=60)


def queued_messages(broker: str, queue: str) -> int:
    """How many messages wait, ready, in ``queue`` of a RabbitMQ broker."""
    from kombu import Connection

    with Connection(broker, connect_timeout=5) as conn:
        channel: Any = conn.default_channel  # py-amqp's Channel; the stubs know its interface
        return int(channel.queue_declare(queue=queue, passive=True).message_count)


def fresh_postgres() -> str:
    """The test database with the ledger dropped and migrated again."""
    try:
        return fresh_ledger(PG_URL)
    except ServerUnavailable as exc:
        pytest.skip(str(exc))


def fresh_sqlite(directory: Path) -> str:
    url = f"sqlite:///{directory / 'ledger.db'}"
    upgrade(url)
    return url


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, subprocess.Popen[bytes], int]]:
    """A Redis server of our own on a free port, for tests that restart it."""
    try:
        server = RedisServer()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    proc = server.start()
    try:
        yield server.url(), proc, server.port
    finally:
        server.stop()


def start_redis(port: int) -> subprocess.Popen[bytes]:
    return RedisServer(port).start()


class PrivatePostgres(PostgresServer):
    """A PostgreSQL server of our own on a free port, for tests that stop and start it:
    stopping the machine's server would fail whatever the other xdist worker runs."""

    def __init__(self) -> None:
        try:
            super().__init__()
        except ServerUnavailable as exc:
            pytest.skip(str(exc))


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started :class:`PrivatePostgres` with the ledger migrated, removed afterwards."""
    server = PrivatePostgres()
    try:
        server.start()
        fresh_ledger(server.url)
        yield server
    finally:
        server.close()


class Stack:
    """The pieces of one pipeline test, sharing one environment."""

    def __init__(
        self,
        root: Path,
        broker: str,
        database: str,
        *,
        results: str | None = None,
        **overrides: str,
    ) -> None:
        self.root = root
        self.env = {
            "DRAIN_BROKER_URL": broker,
            "DRAIN_RESULT_BACKEND": results or broker,
            "DRAIN_DATABASE_URL": database,
            "DRAIN_VISIBILITY_TIMEOUT_SECS": "8",
            "DRAIN_UNACKED_RESTORE_INTERVAL_SECS": "1",
            "DRAIN_HEARTBEAT_INTERVAL_SECS": "2",
            "DRAIN_HEARTBEAT_POLL_SECS": "0.2",
            "DRAIN_SWEEP_INTERVAL_SECS": "1",
            "PYTHONUNBUFFERED": "1",
            **overrides,
        }
        self.ledger = Ledger.from_url(database)
        self.workers: list[WorkerProcess] = []
        self.daemons: list[DaemonProcess] = []

    def full_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def start_worker(self, name: str = "worker") -> WorkerProcess:
        """``drainctl worker``, waited on until it consumes."""
        worker = WorkerProcess(self.root / f"{name}.log", self.env).start()
        self.workers.append(worker)
        return worker

    def worker_log(self, name: str = "worker") -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def start_daemon(self, namespace: str, name: str, *extra: str) -> DaemonProcess:
        directory = self.root / f"{namespace}.{name}"
        directory.mkdir(exist_ok=True)
        daemon = DaemonProcess(
            directory, *extra, queue=f"caliband.{namespace}.{name}", env=self.env
        ).start()
        self.daemons.append(daemon)
        return daemon

    def drainctl(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            capture_output=True, text=True, timeout=timeout, env=self.full_env(), check=False,
        )  # fmt: skip

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop(60)
        for worker in self.workers:
            worker.stop(20)
        self.ledger.dispose()


def consumer_pid(daemon: DaemonProcess) -> int | None:
    """The pid of the daemon's Celery consumer child, if one is running."""
    import psutil

    assert daemon.proc is not None
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(daemon.proc.pid).children():
            if "worker_agent.consumer" in " ".join(child.cmdline()):
                return int(child.pid)
    return None


def kill_hard(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def eventually(seconds: float) -> float:
    return time.monotonic() + seconds
