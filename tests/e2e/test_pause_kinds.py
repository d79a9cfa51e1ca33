"""Both kinds of pause meet the spec as the docs say, with the real kubectl against the
dev stack's embedded defaults: an idle pause that ``spec.lifecycle.suspend: true`` then
adopts is held by the spec from there on (a wake no longer resumes it, ``suspend:
false`` does), and every agent continues at ``turns + 1`` when it resumes. A Sandbox
deleted by hand around a pause is made again; a workspace PVC deleted by hand fails the
task ``WorkspaceGone`` rather than starting fresh agents on a new, empty volume."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.operator.crd import TASK_LABEL, WAKE_ANNOTATION
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until
from worker_agent import layout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-pause-kinds-") as dev:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []


def patch_lifecycle(stack: DevStack, name: str, **fields: Any) -> None:
    body = json.dumps({"spec": {"lifecycle": fields}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)


def working(stack: DevStack, name: str) -> str:
    """A task of one agent that works until told otherwise, Running with 2 turns done;
    its workspace PVC."""
    manifest = task_manifest(name, agents=1, model="turns=100000,turn_ms=200")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, 1, at_least=2)
    return pvc


def test_suspend_true_adopts_an_idle_pause_and_only_suspend_false_resumes_it(
    stack: DevStack,
) -> None:
    name = "adopted"
    manifest = task_manifest(name, agents=2, model="turns=2,turn_ms=20", idleTimeout="2s")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Suspended", timeout=120)
    paused = stack.status("default", name)
    assert paused["pausedBy"] == "idle"
    # Nothing is live while Suspended; the checkpoint's count has its own field.
    assert (paused["agents"], paused["checkpointAgents"]) == (0, 2), paused
    pauses = paused["pauses"]

    patch_lifecycle(stack, name, suspend=True)
    wait_until(
        lambda: stack.status("default", name).get("pausedBy") == "manual", 60,
        "the spec to adopt the idle pause",
    )  # fmt: skip
    adopted = stack.status("default", name)
    assert adopted["phase"] == "Suspended"
    assert "stays paused until suspend is false" in adopted["message"], adopted["message"]
    assert adopted["checkpointRef"] == paused["checkpointRef"]  # no second drain
    assert adopted["pauses"] == pauses

    stack.kubectl("annotate", "ctask", name, f"{WAKE_ANNOTATION}=attach-1")
    held = wait_until(
        lambda: [e for e in stack.events_of(name) if e["reason"] == "WakeHeld"], 60,
        "the WakeHeld warning",
    )  # fmt: skip
    assert [e["type"] for e in held] == ["Warning"]
    wait_until(
        lambda: stack.status("default", name).get("lastWake") == "attach-1", 60,
        "the wake to be spent",
    )  # fmt: skip
    assert stack.status("default", name)["phase"] == "Suspended"

    patch_lifecycle(stack, name, suspend=False)
    # Read as the task runs again: its agents are idle at once and its idleTimeout is 2s,
    # so the next idle pause (pausedBy idle again) may follow within moments.
    resumed = wait_until(
        lambda: (s := stack.status("default", name)).get("phase") == "Running" and s, 120,
        "the task to run again",
    )  # fmt: skip
    assert resumed.get("pausedBy") is None
    transcripts = [layout.transcript_file(d)
                   for d in stack.agent_dirs("default", stack.pvc_of(name))]  # fmt: skip
    assert len(transcripts) == 2
    wait_until(
        lambda: all('"resumed_from":3' in t.read_text() for t in transcripts), 60,
        "every agent to continue at turn 3",
    )  # fmt: skip
    for transcript in transcripts:
        assert transcript.read_text().count('{"type":"TurnEnd"') == 2


def test_a_wake_makes_again_the_sandbox_deleted_while_the_task_was_paused(
    stack: DevStack,
) -> None:
    """The Sandbox deleted by hand (kubectl) while the task is Suspended: the wake makes
    it again from the spec on the kept workspace, and every agent continues at
    ``turns + 1``. (It was a 404 retried for ever, the task Suspended with
    ``suspend: false``.)"""
    name = "unsandboxed"
    pvc = working(stack, name)
    patch_lifecycle(stack, name, suspend=True)
    stack.wait_phase("default", name, "Suspended", timeout=120)
    saved = stack.turns_on_disk(pvc)
    sandbox = stack.status("default", name)["sandboxName"]
    stack.kubectl("delete", "sandbox", sandbox, "-n", "default", "--wait=true")

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Running", timeout=120)
    assert stack.kubectl("get", "sandbox", sandbox, "-n", "default", "-o", "name").stdout.strip()
    assert [e for e in stack.events_of(name) if e["reason"] == "SandboxMissing"]
    [transcript] = [layout.transcript_file(d) for d in stack.agent_dirs("default", pvc)]
    [(agent, turns)] = saved.items()
    wait_until(lambda: f'"resumed_from":{turns + 1}' in transcript.read_text(), 60,
               f"{agent} to continue at turn {turns + 1}")  # fmt: skip
    wait_until(lambda: stack.turns_on_disk(pvc)[agent] > turns, 60, "a new turn")


def test_a_pause_whose_sandbox_is_deleted_after_its_drain_ends_suspended(
    stack: DevStack,
) -> None:
    """The Sandbox deleted by hand (kubectl) after a pause's drain is recorded and
    before the Sandbox is suspended: the operator is stopped (SIGSTOP) the moment the
    ledger holds the pause's checkpoint, the Sandbox deleted, the operator continued.
    The pause ends Suspended on that checkpoint (event SandboxGone), nothing makes the
    Sandbox again while it is paused, and a wake does, every agent at ``turns + 1``.
    (The suspension of the gone Sandbox was a 404 retried for ever, the task Draining.)"""
    name = "unsandboxed-pause"
    pvc = working(stack, name)
    sandbox = stack.status("default", name)["sandboxName"]
    before = stack.ledger.latest_checkpoint("default", name)
    operator = stack.operator_pid()
    assert operator is not None

    def recorded() -> bool:
        newest = stack.ledger.latest_checkpoint("default", name)
        return newest is not None and newest != before

    patch_lifecycle(stack, name, suspend=True)
    wait_until(recorded, 120, "the pause's checkpoint in the ledger", interval=0.005)
    os.kill(operator, signal.SIGSTOP)
    try:
        stack.kubectl("delete", "sandbox", sandbox, "-n", "default", "--wait=true")
    finally:
        os.kill(operator, signal.SIGCONT)
    checkpoint = stack.ledger.latest_checkpoint("default", name)
    assert checkpoint is not None and checkpoint.verified

    stack.wait_phase("default", name, "Suspended", timeout=120)
    assert stack.status("default", name)["checkpointRef"] == checkpoint.ref
    [gone] = [e for e in stack.events_of(name) if e["reason"] == "SandboxGone"]
    assert checkpoint.ref in gone["message"]
    time.sleep(5)  # a few passes: nothing makes the Sandbox while the task is paused
    assert stack.kubectl("get", "sandbox", sandbox, "-n", "default", check=False).returncode != 0
    assert stack.status("default", name)["phase"] == "Suspended"

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Running", timeout=120)
    [(agent, turns)] = [(a.agent_id, a.turns) for a in checkpoint.agents]
    [transcript] = [layout.transcript_file(d) for d in stack.agent_dirs("default", pvc)]
    wait_until(lambda: f'"resumed_from":{turns + 1}' in transcript.read_text(), 60,
               f"{agent} to continue at turn {turns + 1}")  # fmt: skip


def test_a_wake_whose_workspace_pvc_was_deleted_fails_workspace_gone(stack: DevStack) -> None:
    """The workspace PVC deleted by hand (kubectl) while the task is Suspended: the wake
    ends Failed (WorkspaceGone) with no agent started, the Sandbox still suspended (no
    pod), rather than a fresh agent at turn 0 reported Ready. The pause's checkpoint
    keeps its snapshot, so it is still restorable, and a restore continues from it."""
    name = "unworkspaced"
    pvc = working(stack, name)
    patch_lifecycle(stack, name, suspend=True)
    stack.wait_phase("default", name, "Suspended", timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", name)
    assert checkpoint is not None and checkpoint.verified

    def snapshotted() -> bool:
        now = stack.ledger.get_checkpoint(checkpoint.ref)
        return now is not None and now.snapshot_ready_at is not None

    wait_until(snapshotted, 60,
               "the pause's snapshot to be ready")  # fmt: skip
    stack.kubectl("delete", "pvc", pvc, "-n", "default", "--wait=true")

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Failed", timeout=120)
    status = stack.status("default", name)
    assert f"workspace PVC {pvc} is gone" in status["message"], status["message"]
    assert "no fresh agents were started" in status["message"]
    assert status["agents"] == 0
    [gone] = [e for e in stack.events_of(name) if e["reason"] == "WorkspaceGone"]
    assert gone["type"] == "Warning"
    time.sleep(5)  # a few passes: nothing starts an agent on a new, empty volume
    assert stack.kubectl("get", "pods", "-n", "default", "-l", f"{TASK_LABEL}={name}",
                         "-o", "name").stdout.strip() == ""  # fmt: skip
    assert stack.status("default", name)["phase"] == "Failed"
    after = stack.ledger.get_checkpoint(checkpoint.ref)
    assert after is not None and after.available  # its snapshot holds it

    back = f"{name}-back"
    manifest = task_manifest(back, agents=1, model="turns=100000,turn_ms=200")
    manifest["spec"]["resumeFrom"] = {"checkpointRef": checkpoint.ref}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", back, "Running", timeout=120)
    [(agent, turns)] = [(a.agent_id, a.turns) for a in checkpoint.agents]
    [transcript] = [
        layout.transcript_file(d) for d in stack.agent_dirs("default", stack.pvc_of(back))
    ]
    wait_until(lambda: f'"resumed_from":{turns + 1}' in transcript.read_text(), 60,
               f"{agent} to continue at turn {turns + 1} in the restoring task")  # fmt: skip
    stack.kubectl("delete", "ctask", name, back, "-n", "default", timeout=120)


def test_a_wake_after_the_pvc_was_deleted_during_the_pause_drain_fails_workspace_gone(
    stack: DevStack,
) -> None:
    """The workspace PVC deleted (kubectl, not waiting) as the pause begins, while its
    pod still runs and drains: the pause still ends Suspended on its checkpoint, and the
    wake ends Failed (WorkspaceGone), no agent started."""
    name = "unworkspaced-drain"
    pvc = working(stack, name)
    patch_lifecycle(stack, name, suspend=True)
    stack.kubectl("delete", "pvc", pvc, "-n", "default", "--wait=false")
    stack.wait_phase("default", name, "Suspended", timeout=120)

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Failed", timeout=120)
    status = stack.status("default", name)
    assert f"workspace PVC {pvc} is gone" in status["message"], status["message"]
    assert status["agents"] == 0
    assert stack.kubectl("get", "pods", "-n", "default", "-l", f"{TASK_LABEL}={name}",
                         "-o", "name").stdout.strip() == ""  # fmt: skip
    stack.kubectl("delete", "ctask", name, "-n", "default", timeout=120)


def test_a_running_task_whose_pvc_and_sandbox_are_deleted_fails_workspace_gone(
    stack: DevStack,
) -> None:
    """The workspace PVC (kubectl, not waiting) and then the Sandbox deleted under a
    Running task: once the daemon is silent the operator would re-make the Sandbox, but
    on no workspace; the task ends Failed (WorkspaceGone), no fresh agent started."""
    name = "unworkspaced-running"
    pvc = working(stack, name)
    sandbox = stack.status("default", name)["sandboxName"]
    stack.kubectl("delete", "pvc", pvc, "-n", "default", "--wait=false")
    stack.kubectl("delete", "sandbox", sandbox, "-n", "default", "--wait=true")

    stack.wait_phase("default", name, "Failed", timeout=120)
    status = stack.status("default", name)
    assert f"workspace PVC {pvc} are gone" in status["message"], status["message"]
    assert "no fresh agents were started" in status["message"]
    assert status["agents"] == 0
    time.sleep(5)  # a few passes: nothing makes the Sandbox again on a new, empty volume
    assert stack.kubectl("get", "sandbox", sandbox, "-n", "default", check=False).returncode != 0
    assert stack.kubectl("get", "pods", "-n", "default", "-l", f"{TASK_LABEL}={name}",
                         "-o", "name").stdout.strip() == ""  # fmt: skip
    stack.kubectl("delete", "ctask", name, "-n", "default", timeout=120)
