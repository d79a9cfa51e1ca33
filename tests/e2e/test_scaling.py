"""A change of ``spec.task.agents`` scales a running task, with the real kubectl against
the dev stack's embedded defaults (embedded API and broker, SQLite ledger).

Scale-down drains the agents it removes into a checkpoint first (reason
``scale-down``, each agent's turns and sha256 equal to its files), then they are no
longer the task's: the AGENTS column, the heartbeat and ``Ready`` count the rest.
Scale-up brings those agents back first, each at ``turns + 1`` of its conversation,
then starts new ones. Nothing a removed agent completed is lost on the way.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.ledger import CheckpointReason, CheckpointView
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until
from worker_agent import layout, transcript
from worker_agent.children import descendants
from worker_agent.session import load_session

pytestmark = pytest.mark.slow

NAME = "scaled"


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-scaling-") as dev:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []


def set_agents(stack: DevStack, count: int) -> None:
    body = json.dumps({"spec": {"task": {"agents": count}}})
    stack.kubectl("patch", "ctask", NAME, "-n", "default", "--type=merge", "-p", body)


def scaled(stack: DevStack, reason: str, to: int) -> dict[str, Any]:
    """The task's status once its ``Scaled`` condition says ``reason`` for ``to`` agents
    and the daemon reports that many live."""

    def done() -> dict[str, Any] | None:
        status = stack.status("default", NAME)
        condition: dict[str, Any] = next(
            (c for c in status.get("conditions") or [] if c["type"] == "Scaled"), {}
        )
        settled = (
            condition.get("reason") == reason
            and f"to {to} agents" in condition.get("message", "")
            and status.get("agents") == to
            and not status.get("scaling")
        )
        return status if settled else None

    found: dict[str, Any] = wait_until(done, 120, f"{NAME} scaled ({reason}) to {to} agents")
    return found


def manifests(stack: DevStack, pvc: str) -> dict[str, dict[str, Any]]:
    return {
        d.name: json.loads(layout.manifest_file(d).read_text())
        for d in stack.agent_dirs("default", pvc)
    }


def agents_column(stack: DevStack) -> str:
    table = stack.kubectl("get", "ctask", NAME, "-n", "default").stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    return row[header.index("AGENTS")]


def test_scaling_down_drains_the_removed_agents_into_a_checkpoint_and_up_brings_them_back(
    stack: DevStack,
) -> None:
    stack.apply(task_manifest(NAME, agents=3))
    stack.wait_phase("default", NAME, "Running")
    pvc = stack.pvc_of(NAME)
    stack.wait_turns(pvc, 3, at_least=2)
    assert stack.status("default", NAME)["appliedAgents"] == 3

    # Down: 3 → 1. The two newest agents are drained into a checkpoint, then retired.
    set_agents(stack, 1)
    status = scaled(stack, "ScaledDown", 1)
    assert status["phase"] == "Running" and status["appliedAgents"] == 1
    (checkpoint,) = [
        c for c in stack.ledger.list_checkpoints("default", NAME)
        if c.reason is CheckpointReason.SCALE_DOWN
    ]  # fmt: skip
    assert checkpoint.verified and len(checkpoint.agents) == 2
    said = next(c for c in status["conditions"] if c["type"] == "Scaled")
    assert f"drained into checkpoint {checkpoint.ref}" in said["message"], said
    records = manifests(stack, pvc)
    kept = sorted(records, key=lambda i: records[i]["created_at"])[0]
    assert {a.agent_id for a in checkpoint.agents} == set(records) - {kept}
    for agent in checkpoint.agents:
        assert records[agent.agent_id]["retired"] is True
        assert records[agent.agent_id]["status"] == "drained"
        on_disk = load_session(stack.volume("default", pvc) / agent.session_dir)
        assert on_disk.turns == agent.turns >= 2, agent
    assert agents_column(stack) == "1"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    reasons = {e["reason"] for e in stack.events_of(NAME)}
    assert {"Scaling", "ScaledDown"} <= reasons, reasons
    # The agent kept goes on working; the retired ones stay as they were drained.
    turns = stack.turns_on_disk(pvc)
    wait_until(lambda: stack.turns_on_disk(pvc)[kept] > turns[kept], 60, "the kept agent")
    for agent in checkpoint.agents:
        assert stack.turns_on_disk(pvc)[agent.agent_id] == agent.turns

    # Up: 1 → 4. The two retired agents come back first, at turns + 1; one is new.
    set_agents(stack, 4)
    scaled(stack, "ScaledUp", 4)
    records = manifests(stack, pvc)
    assert len(records) == 4 and not any(r["retired"] for r in records.values())
    back = {a.agent_id: a.turns for a in checkpoint.agents}
    wait_until(
        lambda: all(stack.turns_on_disk(pvc)[i] > t for i, t in back.items()), 60,
        "the agents brought back to work again",
    )  # fmt: skip
    for agent in checkpoint.agents:
        events = [
            json.loads(line)
            for line in layout.transcript_file(
                stack.volume("default", pvc) / agent.session_dir
            ).read_text().splitlines()
        ]  # fmt: skip
        assert agent.turns + 1 in [transcript.resumed_from(e) for e in events]
    assert agents_column(stack) == "4"
    assert stack.status("default", NAME)["scales"] == 2


def test_an_agent_count_out_of_range_is_refused_by_the_api_and_changes_nothing(
    stack: DevStack,
) -> None:
    """Tried: 0 agents and 65 agents on the running task of the test above."""
    before = stack.status("default", NAME)
    for count in (0, 65):
        body = json.dumps({"spec": {"task": {"agents": count}}})
        refused = stack.kubectl(
            "patch", "ctask", NAME, "-n", "default", "--type=merge", "-p", body, check=False
        )
        assert refused.returncode != 0
        assert "spec.task.agents" in refused.stderr, refused.stderr
    after = stack.status("default", NAME)
    assert after["appliedAgents"] == before["appliedAgents"] == 4
    assert after["scales"] == before["scales"]


def test_a_scale_down_checkpoint_is_snapshotted_when_the_task_is_deleted_at_once(
    stack: DevStack,
) -> None:
    """Scale 3 → 1, and the task deleted (kubectl) the moment the ledger holds the
    scale-down's checkpoint, before any pass asked for its snapshot (the operator held
    with SIGSTOP across the delete). The deletion asks for it: the checkpoint gets a
    ready VolumeSnapshot, and a restore of it continues both removed agents at
    ``turns + 1``. (It was never snapshotted, no error, no event; its restore failed
    ``CheckpointSuperseded``.)"""
    name = "scaled-gone"
    stack.apply(task_manifest(name, agents=3, model="turns=100000,turn_ms=200"))
    stack.wait_phase("default", name, "Running")
    stack.wait_turns(stack.pvc_of(name), 3, at_least=2)
    operator = stack.operator_pid()
    assert operator is not None

    def scale_down_checkpoint() -> CheckpointView | None:
        return next((c for c in stack.ledger.list_checkpoints("default", name)
                     if c.reason is CheckpointReason.SCALE_DOWN), None)  # fmt: skip

    body = json.dumps({"spec": {"task": {"agents": 1}}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)
    checkpoint = wait_until(scale_down_checkpoint, 120, "the scale-down's checkpoint",
                            interval=0.005)  # fmt: skip
    os.kill(operator, signal.SIGSTOP)
    try:
        stack.kubectl("delete", "ctask", name, "-n", "default", "--wait=false")
    finally:
        os.kill(operator, signal.SIGCONT)
    gone = ("get", "ctask", name, "-n", "default")
    wait_until(lambda: stack.kubectl(*gone, check=False).returncode != 0, 120, "the task to go")

    def snapshotted() -> CheckpointView | None:
        now = stack.ledger.get_checkpoint(checkpoint.ref)
        return now if now is not None and now.snapshot is not None else None

    settled = wait_until(snapshotted, 120, f"a ready snapshot of {checkpoint.ref}")
    assert settled.snapshot_error is None and len(settled.agents) == 2

    back = f"{name}-back"
    manifest = task_manifest(back, agents=1, model="turns=100000,turn_ms=200")
    manifest["spec"]["resumeFrom"] = {"checkpointRef": checkpoint.ref}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", back, "Running", timeout=120)
    volume = stack.volume("default", stack.pvc_of(back))
    logs = {layout.transcript_file(volume / a.session_dir): a.turns + 1 for a in settled.agents}
    wait_until(lambda: all(f'"resumed_from":{line}' in log.read_text() for log, line in
                           logs.items()), 60, "both agents to continue at turns + 1")  # fmt: skip
    stack.kubectl("delete", "ctask", back, "-n", "default", timeout=120)


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
"""SIGTERM's bit in ``/proc/PID/status`` signal masks."""


def signal_mask(pid: int, field: str) -> int:
    """``field`` (``SigCgt``: signals the process catches; ``ShdPnd``: pending) of
    ``pid``, from ``/proc``."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1], 16)


def agent_workers(stack: DevStack, pvc: str) -> dict[int, str]:
    """The agent worker processes serving ``pvc``, each with its session directory."""
    found = {}
    for daemon in stack.daemon_pids(pvc):
        for pid in descendants(daemon):
            try:
                argv = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if "worker_agent.worker" in argv and "--manifest" in argv:
                found[pid] = os.path.dirname(argv[argv.index("--manifest") + 1])
    return found


def test_an_agent_paused_before_it_saved_anything_is_left_out_and_the_wake_is_ready(
    stack: DevStack,
) -> None:
    """Scale 1 → 2, and the new agent's worker held (SIGSTOP) before it could catch
    SIGTERM or save a session; then the task paused (kubectl), and the worker let go once
    the drain's SIGTERM is pending: it dies of it having saved nothing. The pause's
    checkpoint holds the agent that worked, verified; the audit (session contents too)
    finds nothing; the wake resumes it at ``turns + 1`` and starts the second agent
    anew: Running, Ready, 2 live. (The checkpoint held the fresh agent with 0 turns,
    unclean, no sha; the wake went ``PartlyResumed`` then ``CrashLoop``, never Ready, and
    the audit called it ``SessionMismatch``.)"""
    name = "scaled-fresh"
    stack.apply(task_manifest(name, agents=1, model="turns=100000,turn_ms=200"))
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, 1, at_least=2)
    before = agent_workers(stack, pvc)
    assert len(before) == 1, before

    body = json.dumps({"spec": {"task": {"agents": 2}}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)

    def started() -> int | None:
        new = set(agent_workers(stack, pvc)) - set(before)
        for pid in new:
            os.kill(pid, signal.SIGSTOP)
        return next(iter(new), None)

    fresh = wait_until(started, 60, "the new agent's worker", interval=0.002)
    try:
        session_dir = Path(agent_workers(stack, pvc)[fresh])
        # The premise: held before its SIGTERM handler was in place, no session saved.
        assert not signal_mask(fresh, "SigCgt") & SIGTERM_BIT, "held too late: it catches it"
        assert not layout.session_file(session_dir).exists()

        body = json.dumps({"spec": {"lifecycle": {"suspend": True}}})
        stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)
        wait_until(lambda: signal_mask(fresh, "ShdPnd") & SIGTERM_BIT, 120,
                   "the drain's SIGTERM to the held worker", interval=0.05)  # fmt: skip
    finally:
        os.kill(fresh, signal.SIGCONT)
    stack.wait_phase("default", name, "Suspended", timeout=120)
    assert not layout.session_file(session_dir).exists(), "it died having saved nothing"

    checkpoint = stack.ledger.latest_checkpoint("default", name)
    assert checkpoint is not None and checkpoint.reason is CheckpointReason.PAUSE
    [worked] = checkpoint.agents
    assert os.path.basename(session_dir) != os.path.basename(worked.session_dir)
    assert worked.clean and worked.session_sha256 and checkpoint.verified, checkpoint
    assert stack.status("default", name)["checkpointAgents"] == 1
    assert stack.audit_findings() == []

    body = json.dumps({"spec": {"lifecycle": {"suspend": False}}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)
    stack.wait_phase("default", name, "Running", timeout=120)
    wait_until(lambda: stack.status("default", name).get("agents") == 2, 120, "2 agents live")
    conditions = stack.status("default", name).get("conditions") or []
    ready = next(c for c in conditions if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    log = layout.transcript_file(stack.volume("default", pvc) / worked.session_dir)
    wait_until(lambda: f'"resumed_from":{worked.turns + 1}' in log.read_text(), 60,
               "the agent that worked to continue at turns + 1")  # fmt: skip
    stack.wait_turns(pvc, 2, at_least=1)
    stack.kubectl("delete", "ctask", name, "-n", "default", timeout=120)
