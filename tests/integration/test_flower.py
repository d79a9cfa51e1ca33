"""Flower's real HTTP API shows the drain and record tasks of a real drain."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline_support import Stack, free_port, fresh_sqlite, redis_db_url
from tests.support import wait_until

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
