"""Soak: drain/resume cycles against agents mid-turn, with random timing and random
SIGKILLs of the daemon-side consumer and of the orchestrator worker.

Short in CI (``DRAIN_SOAK_CYCLES``, default 12); ``DRAIN_SOAK_CYCLES=1000 make pytest
PYTEST_ARGS='-m slow -k soak'`` is the long mode. It reports cycles, turns, lost turns
(must be 0), checkpoints per drain (must be exactly 1) and failed operations with
their reasons.

The soak shortens the broker's visibility timeout (8 s) so a killed consumer's or
worker's message comes back within a cycle. That does not weaken what it shows: the
soak proves the pipeline correct for any settings ``Settings`` accepts (it refuses
those whose redelivery could arrive after a drain expires or after its operation's
deadline), and ``test_pipeline_faults.py`` proves the same kills with the defaults.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.ledger import OperationView
from tests.pipeline_support import (
    Stack,
    consumer_pid,
    fresh_sqlite,
    kill_hard,
    redis_db_url,
)
from tests.support import wait_until
from worker_agent.session import count_completed_turns, load_session

pytestmark = pytest.mark.slow

CYCLES = int(os.environ.get("DRAIN_SOAK_CYCLES", "12"))
AGENTS = 3
SEED = int(os.environ.get("DRAIN_SOAK_SEED", "20261202"))
CYCLE_BUDGET_SECS = 30
"""The test's time limit per cycle (a cycle takes about 5 s): the suite's 180 s limit
would stop the long mode after a few dozen cycles."""


def finished(stack: Stack, op_id: str) -> OperationView | None:
    op = stack.ledger.get_operation(op_id)
    return op if op is not None and op.terminal else None


@pytest.mark.timeout(max(180, CYCLES * CYCLE_BUDGET_SECS))
def test_soak_drain_resume_cycles_with_random_kills_lose_and_duplicate_nothing(
    tmp_short: Path,
) -> None:
    rng = random.Random(SEED)
    stack = Stack(tmp_short, redis_db_url(db=14), fresh_sqlite(tmp_short))
    cycles = lost = 0
    try:
        worker = stack.start_worker("worker-0")
        daemon = stack.start_daemon("soak", "task")
        ids = daemon.spawn_working(AGENTS, "turns=1000000,turn_ms=40", 1)
        best: dict[str, int] = dict.fromkeys(ids, 0)
        messages: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        kills = {"consumer": 0, "worker": 0}
        failed: list[str] = []
        for cycle in range(CYCLES):
            time.sleep(rng.uniform(0.05, 0.6))  # agents are mid-turn at a random point
            started = stack.drainctl("drain", "soak/task", "--grace", "10", "--json")
            assert started.returncode == 0, started.stderr
            op_id = json.loads(started.stdout)["id"]
            victim = rng.choice(["none", "none", "consumer", "worker"])
            time.sleep(rng.uniform(0.0, 0.2))
            if victim == "consumer" and (pid := consumer_pid(daemon)) is not None:
                kill_hard(pid)
                kills["consumer"] += 1
            elif victim == "worker" and worker.running():
                kill_hard(worker.pid)
                worker.wait(10)
                kills["worker"] += 1
                worker = stack.start_worker(f"worker-{cycle + 1}")
            op = wait_until(functools.partial(finished, stack, op_id), 120, f"drain {op_id}")
            if op.state != "recorded":
                failed.append(f"{op_id}: {op.state}: {op.error}")
                continue
            assert op.checkpoint_ref is not None
            checkpoint = stack.ledger.get_checkpoint(op.checkpoint_ref)
            assert checkpoint is not None and checkpoint.operation_id == op_id
            for agent in checkpoint.agents:
                directory = daemon.store / agent.session_dir
                session = load_session(directory)
                # Lost turns: the checkpoint must hold every turn any earlier one held,
                # and the conversation must extend the earlier one.
                earlier = messages[agent.agent_id]
                lost += max(0, best[agent.agent_id] - agent.turns)
                lost += session.messages[: len(earlier)] != earlier
                assert session.turns == agent.turns == count_completed_turns(directory)
                best[agent.agent_id] = max(best[agent.agent_id], agent.turns)
                messages[agent.agent_id] = session.messages
            resumed = stack.drainctl(
                "resume", "soak/task", "--checkpoint", op.checkpoint_ref, "--wait",
                "--timeout", "120",
            )  # fmt: skip
            assert resumed.returncode == 0, resumed.stderr + resumed.stdout
            cycles += 1
        drains = [
            o for o in stack.ledger.list_operations("soak", "task", limit=10_000)
            if o.kind == "drain"
        ]  # fmt: skip
        checkpoints = stack.ledger.list_checkpoints("soak", "task", limit=10_000)
        per_drain = {o.id: 0 for o in drains}
        for checkpoint in checkpoints:
            per_drain[checkpoint.operation_id] += 1
        recorded = [o for o in drains if o.state == "recorded"]
        report = {
            "seed": SEED,
            "cycles": cycles,
            "turns": sum(best.values()),
            "lost_turns": lost,
            "drains": len(drains),
            "checkpoints_per_recorded_drain": sorted({per_drain[o.id] for o in recorded}),
            "checkpoints_of_failed_drains": sum(
                per_drain[o.id] for o in drains if o.state != "recorded"
            ),
            "kills": kills,
            "failed_operations": failed,
        }
        print("soak report:", json.dumps(report))
        assert cycles + len(failed) == CYCLES == len(drains)
        assert lost == 0
        assert report["checkpoints_per_recorded_drain"] == [1]
        assert report["checkpoints_of_failed_drains"] == 0
        assert failed == [], failed
    finally:
        stack.close()
