"""A task whose agents all finish their work completes, with its checkpoint kept: the real
kubectl against the dev stack's embedded defaults (embedded API and broker, SQLite ledger
in a temp dir), real daemons running the reference worker with the scripted model
``then=exit`` (after its turns each worker exits 0 by itself, so its agent is ``done``).

What was tried, end to end: a task of 2 agents on ``turns=2,turn_ms=50,then=exit`` with
an ``idleTimeout`` of 1s (agents that are all done are idle to the daemon, so an idle
pause would race the completion if completion were not decided first); then the wake
annotation and ``spec.lifecycle.suspend`` on the Completed task; then its deletion; then
a new task restored from its completed checkpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.operator.crd import CHECKPOINT_LABEL, WAKE_ANNOTATION, sandbox_name
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow

FINISHING = "turns=2,turn_ms=50,then=exit"


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-completed-") as dev:
        yield dev
        # Whatever the module's tests did, the ledger and the audit say only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []


def condition_of(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c.get("type") == type_)


def reasons(stack: DevStack, name: str, reason: str) -> list[dict[str, str]]:
    return [e for e in stack.events_of(name) if e["reason"] == reason]


def test_a_task_whose_agents_all_finish_completes_keeps_its_checkpoint_and_restores(
    stack: DevStack,
) -> None:
    name = "finisher"
    manifest = task_manifest(name, agents=2, model=FINISHING, idleTimeout="1s")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Completed", timeout=120)
    pvc = stack.pvc_of(name)

    # Completed, with the checkpoint of what the agents left, and nothing else recorded.
    status = stack.status("default", name)
    ref = status["checkpointRef"]
    assert status["lastOperation"]["kind"] == "complete", status["lastOperation"]
    assert status["lastOperation"]["state"] == "recorded", status["lastOperation"]
    assert status["completions"] == 1
    assert status["agents"] == 0
    assert status.get("pausedBy") is None  # completion won: never idle-paused
    completed = condition_of(status, "Completed")
    assert (completed["status"], completed["reason"]) == ("True", "AgentsDone"), completed
    ready = condition_of(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Completed"), ready
    assert "Completed" in stack.kubectl("get", "ctask", name).stdout
    assert [str(op.kind) for op in stack.ledger.list_operations("default", name)] == ["complete"]
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None
    assert checkpoint.reason == "completed"
    assert checkpoint.verified and not checkpoint.forced
    assert checkpoint.pvc_name == pvc
    assert sorted(a.turns for a in checkpoint.agents) == [2, 2]
    assert all(a.clean for a in checkpoint.agents)
    assert stack.turns_on_disk(pvc) == {a.agent_id: 2 for a in checkpoint.agents}
    assert [e["type"] for e in reasons(stack, name, "Completed")] == ["Normal"]

    # Compute released (the Sandbox suspended, its daemon gone), the workspace kept.
    replicas = stack.kubectl("get", "sandboxes.v1alpha1.agents.x-k8s.io", sandbox_name(name),
                             "-o", "jsonpath={.spec.replicas}").stdout  # fmt: skip
    assert replicas == "0"
    wait_until(lambda: stack.daemon_pids(pvc) == [], 60, "the daemon to stop")
    stack.kubectl("get", "pvc", pvc)

    # A wake, then suspend true and back to false: each answered once, nothing resumed.
    stack.kubectl("annotate", "ctask", name, f"{WAKE_ANNOTATION}=attach-1")
    wait_until(lambda: reasons(stack, name, "NothingToResume"), 60, "the NothingToResume event")
    for suspend in ("true", "false"):
        body = f'{{"spec": {{"lifecycle": {{"suspend": {suspend}}}}}}}'
        stack.kubectl("patch", "ctask", name, "--type=merge", "-p", body)
        stack.watch_passes(name, 2)
    assert len(reasons(stack, name, "NothingToResume")) == 2  # the wake, and suspend: false
    assert len(reasons(stack, name, "AlreadyCompleted")) == 1  # suspend: true
    # A scale: answered once per change (no event at all before), nothing started.
    for agents in (3, 1):
        stack.kubectl("patch", "ctask", name, "--type=merge",
                      "-p", json.dumps({"spec": {"task": {"agents": agents}}}))  # fmt: skip
        stack.watch_passes(name, 2)
    scaled = reasons(stack, name, "NothingToScale")
    assert [e["type"] for e in scaled] == ["Normal", "Normal"], scaled
    said = sorted(e["message"] for e in scaled)  # the API lists events in no set order
    assert ["spec.task.agents is now 1" in said[0], "spec.task.agents is now 3" in said[1]] == [
        True,
        True,
    ], said
    assert all(f"spec.resumeFrom.checkpointRef: {ref}" in m for m in said), said
    status = stack.status("default", name)
    assert status["phase"] == "Completed"
    assert status["lastWake"] == "attach-1"
    assert f"spec.resumeFrom.checkpointRef: {ref}" in status["message"]
    assert [str(op.kind) for op in stack.ledger.list_operations("default", name)] == ["complete"]
    assert stack.daemon_pids(pvc) == []

    # Deleted: released at once with the completed checkpoint, never drained again.
    started = time.monotonic()
    stack.kubectl("delete", "ctask", name, "--timeout=60s")
    released_secs = time.monotonic() - started
    assert stack.task("default", name) is None
    assert released_secs < 15, released_secs
    assert [str(op.kind) for op in stack.ledger.list_operations("default", name)] == ["complete"]
    assert [c.ref for c in stack.ledger.list_checkpoints("default", name)] == [ref]
    assert not reasons(stack, name, "ForcedCheckpoint")
    kept = [e["message"] for e in reasons(stack, name, "Checkpointed")]
    assert kept == [f"checkpoint {ref}; PVC {pvc} retained"], kept
    retained = json.loads(stack.kubectl("get", "pvc", pvc, "-o", "json").stdout)
    assert not retained["metadata"].get("ownerReferences")
    assert retained["metadata"]["labels"][CHECKPOINT_LABEL] == ref

    # A new task restored from the completed checkpoint starts, as from any other: its
    # agents continue at turn 3 (this model waits for prompts after its turns).
    again = task_manifest(f"{name}-again", agents=2, model="turns=3,turn_ms=50")
    again["spec"]["resumeFrom"] = {"checkpointRef": ref}
    assert stack.apply(again).returncode == 0
    stack.wait_phase("default", f"{name}-again", "Running", timeout=120)
    status = stack.status("default", f"{name}-again")
    assert status["lastOperation"]["kind"] == "restore"
    assert status["lastOperation"]["state"] == "resumed", status["lastOperation"]
    restored_pvc = stack.pvc_of(f"{name}-again")
    stack.wait_turns(restored_pvc, 2, 3)
    wait_until(lambda: stack.status("default", f"{name}-again").get("agents") == 2, 60,
               "both restored agents live")  # fmt: skip
    assert stack.status("default", f"{name}-again")["phase"] == "Running"
    stack.kubectl("delete", "ctask", f"{name}-again", timeout=120)
