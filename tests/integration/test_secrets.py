"""No secret leaves where it was given: a broker password and a database password
known to the test are looked for, after a whole drain → record → resume run, in every
log, the store on the workspace volume, every key the broker holds (messages, results,
events), the ledger's rows, Flower's HTTP API and ``drainctl``'s JSON output."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from tests.pipeline_support import PG_URL, Stack, free_port, fresh_postgres
from tests.support import wait_until

BROKER_SECRET = "broker-pw-7f3a9c1e5b"
DB_SECRET = "ledger-pw-2d8e4b6a0c"
FLOWER_CREDENTIALS = "drain:flower-pw-9b1c3e5d7f"


def start_secured_redis(port: int) -> subprocess.Popen[bytes]:
    """A private Redis that requires ``BROKER_SECRET``."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--requirepass", BROKER_SECRET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def up() -> bool:
        try:
            return bool(redis.Redis(port=port, password=BROKER_SECRET).ping())
        except redis.ConnectionError:
            return False

    wait_until(up, 15, f"redis on port {port}")
    return proc


def redis_contents(port: int) -> str:
    client = redis.Redis(port=port, password=BROKER_SECRET)
    chunks: list[str] = []
    for key in client.scan_iter(count=1000):
        raw_kind = client.type(key)
        kind = raw_kind.decode() if isinstance(raw_kind, bytes) else str(raw_kind)
        if kind == "string":
            chunks.append(repr(client.get(key)))
        elif kind == "list":
            chunks.append(repr(client.lrange(key, 0, -1)))
        elif kind == "hash":
            chunks.append(repr(client.hgetall(key)))
        elif kind == "set":
            chunks.append(repr(client.smembers(key)))
        elif kind == "zset":
            chunks.append(repr(client.zrange(key, 0, -1)))
        chunks.append(repr(key))
    client.close()
    return "\n".join(chunks)


def ledger_contents(url: str) -> str:
    engine = sa.create_engine(url)
    rows: list[str] = []
    with engine.connect() as conn:
        for table in ("operations", "checkpoints", "checkpoint_agents", "daemon_activity"):
            rows += [repr(tuple(r)) for r in conn.execute(sa.text(f"SELECT * FROM {table}"))]
    engine.dispose()
    return "\n".join(rows)


def get_json(url: str) -> Any:
    auth = "Basic " + base64.b64encode(FLOWER_CREDENTIALS.encode()).decode()
    request = urllib.request.Request(url, headers={"Authorization": auth})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def flower_tasks(base: str) -> dict[str, Any] | None:
    tasks: dict[str, Any] = get_json(f"{base}/api/tasks")
    return tasks if len(tasks) >= 4 else None


def run_and_collect(tmp_short: Path, broker: str, ledger_url: str, port: int) -> dict[str, str]:
    """A drain → record → resume run; what every place a secret could reach now holds."""
    stack = Stack(tmp_short, broker, ledger_url)
    flower_port = free_port()
    flower_log = (tmp_short / "flower.log").open("ab")
    flower = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "flower", "--port", str(flower_port)],
        stdout=flower_log, stderr=subprocess.STDOUT,
        env={**stack.full_env(), "FLOWER_BASIC_AUTH": FLOWER_CREDENTIALS},
    )  # fmt: skip
    flower_log.close()
    try:
        stack.start_worker()
        daemon = stack.start_daemon("team-a", "secretive")
        daemon.spawn_working(2, "turns=100000,turn_ms=20", 1)
        drained = stack.drainctl("drain", "team-a/secretive", "--wait", "--timeout", "90")
        assert drained.returncode == 0, drained.stderr
        resumed = stack.drainctl(
            "resume", "team-a/secretive", "--checkpoint", drained.stdout.strip(),
            "--wait", "--timeout", "90",
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        listing = stack.drainctl("ledger", "ls", "--json")
        tasks = wait_until(
            lambda: flower_tasks(f"http://127.0.0.1:{flower_port}"), 60, "Flower's task list"
        )
        outputs = [drained, resumed, listing]
        seen = {
            "drainctl output": "".join(r.stdout + r.stderr for r in outputs),
            "Flower API": json.dumps(tasks),
            "broker and results": redis_contents(port),
            "ledger rows": ledger_contents(PG_URL),
        }
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(20)
        stack.close()
    for path in tmp_short.rglob("*"):
        if path.is_file() and not path.is_symlink() and not path.is_socket():
            seen[str(path.relative_to(tmp_short))] = path.read_text(errors="replace")
    return seen


def test_no_secret_reaches_logs_payloads_ledger_flower_or_output(tmp_short: Path) -> None:
    """Tried: a broker URL and a ledger URL each carrying a password, through a drain,
    its record, a resume, Flower and ``drainctl ledger ls --json``."""
    fresh_postgres()
    ledger_url = PG_URL.replace("postgres@", f"postgres:{DB_SECRET}@", 1)
    port = free_port()
    secured = start_secured_redis(port)
    try:
        broker = f"redis://:{BROKER_SECRET}@127.0.0.1:{port}/0"
        seen = run_and_collect(tmp_short, broker, ledger_url, port)
    finally:
        secured.terminate()
        secured.wait(10)
    assert {"drainctl output", "Flower API", "broker and results", "ledger rows"} <= seen.keys()
    assert any(where.endswith("worker.log") for where in seen)
    assert any(where.endswith("daemon.log") for where in seen)
    for where, text in seen.items():
        for secret in (BROKER_SECRET, DB_SECRET, FLOWER_CREDENTIALS.split(":")[1]):
            assert secret not in text, f"{secret!r} found in {where}"
