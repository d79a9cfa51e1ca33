"""Shared fixtures, and the isolation that lets ``pytest -n`` (pytest-xdist) run the suite
on several workers at once.

The suite's tests use this machine's Redis databases (fixed numbers per module), the
PostgreSQL database ``test`` (dropped and migrated by ``fresh_postgres``) and a per-user
demo lock in the temp dir. The first worker (and a plain run) keep those; every other
worker gets a Redis server of its own on a free port, a PostgreSQL database of its own
(``test_<worker>``) and a temp dir of its own, through the ``DRAIN_TEST_*`` variables
``tests.pipeline_support`` reads, so no two workers ever share one of them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.devcluster.broker import free_port
from tests.support import DaemonProcess, short_tmp

_private_redis: subprocess.Popen[bytes] | None = None


def _wait_listening(port: int) -> None:
    """Until the worker's Redis accepts connections (a test finding it not yet up would
    skip as if Redis were missing)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _own_postgres_database(worker: str) -> str | None:
    """``test_<worker>`` created on this machine's PostgreSQL if missing; None when it is
    not reachable (the tests that need it then skip, saying so)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.pool import NullPool

    name = f"test_{worker}"
    engine = create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        isolation_level="AUTOCOMMIT", poolclass=NullPool, connect_args={"connect_timeout": 3},
    )  # fmt: skip
    try:
        with engine.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).first()
            if exists is None:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError:
        return None
    finally:
        engine.dispose()
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


METRICS_OFF = ("DRAIN_METRICS_PORT", "DRAIN_WORKER_METRICS_PORT", "DRAIN_DAEMON_METRICS_PORT")
"""Off unless a test asks (the dev stack picks free loopback ports for its own): the
defaults, 9100-9102 on every address, are a pod's, and would collide between tests."""


def pytest_configure(config: pytest.Config) -> None:
    global _private_redis
    for name in METRICS_OFF:
        os.environ.setdefault(name, "0")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # DRAIN_TEST_ISOLATE=<name> gives every worker, gw0 too, its own servers and temp dir,
    # so two suites (two checkouts) can run side by side on one machine.
    if isolate := os.environ.get("DRAIN_TEST_ISOLATE"):
        worker = f"{isolate}_{worker or 'main'}"
    if worker in (None, "gw0"):
        return
    assert worker is not None
    own_tmp = Path(tempfile.gettempdir()) / f"caliban-drain-{worker}"
    own_tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(own_tmp)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    if shutil.which("redis-server") is not None:
        port = free_port()
        _private_redis = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_listening(port)
        os.environ["DRAIN_TEST_REDIS_PORT"] = str(port)
    if (url := _own_postgres_database(worker)) is not None:
        os.environ["DRAIN_TEST_PG_URL"] = url


def pytest_unconfigure(config: pytest.Config) -> None:
    if _private_redis is not None:
        _private_redis.terminate()
        _private_redis.wait(10)


@pytest.fixture
def tmp_short() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


@pytest.fixture
def daemon(tmp_short: Path) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_short).start()
    try:
        yield proc
    finally:
        proc.stop()
