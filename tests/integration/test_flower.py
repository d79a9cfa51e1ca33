"""Flower's real HTTP API shows the drain and record tasks of a real drain; ``drainctl
flower`` logs in ``DRAIN_LOG_FORMAT`` (Flower's and tornado's records included) and
stops cleanly on SIGTERM."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_daemon_probes import EmbeddedBroker
from tests.pipeline_support import Stack, free_port, fresh_sqlite, redis_db_url
from tests.probe_support import fetch
from tests.support import wait_until
from worker_agent.testing import Subprocess

CREDENTIALS = "drain:test-only-password"
AUTH = "Basic " + base64.b64encode(CREDENTIALS.encode()).decode()


def get_json(url: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": AUTH})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def test_flower_lists_drain_and_record_tasks_with_final_states(tmp_short: Path) -> None:
    stack = Stack(tmp_short, redis_db_url(), fresh_sqlite(tmp_short))
    port = free_port()
    log = (tmp_short / "flower.log").open("ab")
    flower = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "flower", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
        env={**stack.full_env(), "FLOWER_BASIC_AUTH": CREDENTIALS},
    )  # fmt: skip
    log.close()
    base = f"http://127.0.0.1:{port}"
    try:

        def flower_up() -> bool:
            try:
                get_json(f"{base}/api/workers?refresh=false")
            except OSError:
                return False
            return True

        wait_until(flower_up, 60, "Flower to answer")
        unauthenticated = urllib.request.Request(f"{base}/api/tasks")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(unauthenticated, timeout=5)
        assert refused.value.code == 401
        stack.start_worker()
        daemon = stack.start_daemon("team-a", "flowered")
        with daemon.client() as client:
            client.spawn(provider="scripted", model="turns=100000,turn_ms=30")
        wait_until(lambda: all(r.turns >= 1 for r in daemon.records().values()), 30, "a turn")
        drained = stack.drainctl("drain", "team-a/flowered", "--wait", "--timeout", "90")
        assert drained.returncode == 0, drained.stderr
        [op] = stack.ledger.list_operations(namespace="team-a", name="flowered")

        def both_succeeded() -> dict[str, Any] | None:
            tasks: dict[str, Any] = get_json(f"{base}/api/tasks")
            mine = {t["name"]: t for t in tasks.values() if op.id in (t.get("kwargs") or "")}
            names = {"caliban.daemon.drain", "caliban.orchestrator.record_checkpoint"}
            if names <= mine.keys() and all(mine[n]["state"] == "SUCCESS" for n in names):
                return mine
            return None

        mine = wait_until(both_succeeded, 60, "Flower to show both tasks succeeded")
        drain = mine["caliban.daemon.drain"]
        assert drain["uuid"] == f"{op.id}.drain"
        assert "grace_secs" in drain["kwargs"]
        assert drain["routing_key"] == "caliband.team-a.flowered"
        assert mine["caliban.orchestrator.record_checkpoint"]["uuid"] == f"{op.id}.record"
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(20)
        stack.close()


class FlowerProcess(Subprocess):
    """``drainctl flower`` on the embedded broker at ``broker_port``, ready once its
    ``/healthcheck`` answers."""

    what = "drainctl flower"
    ready_timeout = 60.0

    def __init__(self, root: Path, broker_port: int, log_format: str | None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        broker = f"redis://127.0.0.1:{broker_port}/0"
        ambient = {k: v for k, v in os.environ.items() if not k.startswith(("DRAIN_", "FLOWER_"))}
        env = {**ambient, "DRAIN_BROKER_URL": broker, "DRAIN_RESULT_BACKEND": broker,
               "FLOWER_BASIC_AUTH": CREDENTIALS}  # fmt: skip
        if log_format is not None:
            env["DRAIN_LOG_FORMAT"] = log_format
        argv = [sys.executable, "-m", "orchestrator.cli", "flower", "--port", str(self.port)]
        super().__init__(argv, root / f"flower-{log_format or 'default'}.log", env)

    def ready(self) -> bool:
        self.check_alive(self.what)
        return fetch(f"{self.base}/healthcheck")[0] == 200


def send_malformed_request(port: int) -> bytes:
    """A request line tornado cannot parse: tornado answers 400 after logging it (its
    ``tornado.general`` logger, a record of tornado's own)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"NOT HTTP\r\n\r\n")
        return conn.recv(64)


def exercise_flower_and_stop(root: Path, log_format: str | None) -> tuple[int, str]:
    """Start Flower (``DRAIN_LOG_FORMAT=log_format``; None: unset), ask its health check
    and its API (with and without credentials), send it a malformed request, SIGTERM
    it; answer its exit code and its output."""
    embedded = EmbeddedBroker(root, free_port()).start()
    flower = FlowerProcess(root, embedded.port, log_format)
    try:
        flower.start()
        assert fetch(f"{flower.base}/healthcheck") == (200, "OK")
        assert isinstance(get_json(f"{flower.base}/api/workers?refresh=false"), dict)
        assert fetch(f"{flower.base}/api/tasks")[0] == 401
        assert send_malformed_request(flower.port).startswith(b"HTTP/1.1 400")
    finally:
        killed = flower.stop(grace=30)
        embedded.stop()
    assert killed == 0, f"Flower ignored SIGTERM:\n{flower.log_tail()}"
    assert flower.proc is not None
    return flower.proc.returncode, flower.log_text()


def test_flower_in_json_writes_only_json_objects_and_exits_0_on_sigterm(
    tmp_short: Path,
) -> None:
    code, output = exercise_flower_and_stop(tmp_short, "json")
    assert code == 0, output
    lines = output.splitlines()
    records = [json.loads(line) for line in lines]  # every line, stdout's and stderr's
    assert all(isinstance(r, dict) and {"ts", "level", "logger", "message"} <= r.keys()
               for r in records), output  # fmt: skip
    said = {(r["logger"], r["message"].split(":")[0]) for r in records}
    assert ("flower.command", "Visit me at http") in said
    assert ("tornado.general", "Malformed HTTP message from 127.0.0.1") in said
    assert ("flower.command", "15 detected, shutting down") in said  # 15: SIGTERM


def test_flower_logs_readable_text_by_default(tmp_short: Path) -> None:
    code, output = exercise_flower_and_stop(tmp_short, None)
    assert code == 0, output
    assert not [line for line in output.splitlines() if line.startswith("{")], output
    assert "level=INFO logger=flower.command event=Visit me at http://127.0.0.1:" in output
    assert "level=INFO logger=tornado.general event=Malformed HTTP message from 127.0.0.1" in output
    assert "level=INFO logger=flower.command event=15 detected, shutting down" in output
