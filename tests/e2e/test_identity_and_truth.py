"""Identity and truth end to end: every message reaches the task it was meant for, a
restore restores or fails loudly, what the status says is what runs, and each drain
leaves one checkpoint whatever order pause, wake and delete arrive in.

``drainctl dev up`` runs the real operator, worker, daemons and agents; ``kubectl`` is
the user. Each test is one of the sequences a platform engineer tried, with what it
must leave behind written out: operations and checkpoints in the ledger, the task's
status and events, the agents' sessions on the workspace volume.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.ledger import OperationKind
from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until
from worker_agent import layout
from worker_agent.testing import DRAINCTL

pytestmark = pytest.mark.slow

SLOW_TURNS = "turns=100000,turn_ms=1500"
"""A worker finishes the turn it is in before it exits on SIGTERM: slow turns keep a
drain on its way for a second or more, long enough for a delete to land inside it."""
WAKE = "caliban.caliban-ai.dev/wake"


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-truth-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=10), fresh_postgres())
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


def uid_of(stack: DevStack, name: str, namespace: str = "default") -> str:
    task = stack.task(namespace, name)
    assert task is not None, f"{namespace}/{name} does not exist"
    return str(task["metadata"]["uid"])


def never(condition: Callable[[], bool], secs: float, what: str) -> None:
    """Fail if ``condition`` holds at any poll during ``secs``."""
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        assert not condition(), f"unexpected: {what}"
        time.sleep(0.1)


# ------------------------------------------------------------------ bound to the uid


def test_a_stale_drain_left_by_a_deleted_task_is_refused_by_the_task_recreated_under_its_name(
    stack: DevStack,
) -> None:
    """Tried: the Sandbox deleted by hand (its daemon gone), then the task deleted: its
    drain waits in the queue ``caliband.default.reborn`` and the delete is forced at
    ``drainTimeout``. A task re-created under the same name must not be drained by it."""
    old = task_manifest("reborn", model="turns=100000,turn_ms=100", drainTimeout="5s")
    assert stack.apply(old).returncode == 0
    stack.wait_phase("default", "reborn", "Running")
    old_uid = uid_of(stack, "reborn")
    sandbox = f"sandboxes.v1alpha1.agents.x-k8s.io/{sandbox_name('reborn')}"
    old_pvc = stack.pvc_of("reborn")
    stack.kubectl("delete", sandbox, "--wait=true", timeout=120)
    wait_until(lambda: not stack.daemon_pids(old_pvc), 90, "the old daemon to exit")
    stack.kubectl("delete", "ctask", "reborn", timeout=120)
    stale = stack.ledger.find_operation(f"{old_uid}:delete")
    assert stale is not None, "the deletion sent no drain"
    forced = stack.ledger.latest_checkpoint("default", "reborn")
    assert forced is not None and forced.forced and forced.task_uid == old_uid

    assert stack.apply(task_manifest("reborn", model="turns=100000,turn_ms=100")).returncode == 0
    stack.wait_phase("default", "reborn", "Running")
    new_uid = uid_of(stack, "reborn")
    pvc = stack.pvc_of("reborn")
    entry = layout.op_entry(stack.volume("default", pvc), stale.id, "drain")
    wait_until(entry.exists, 60, "the new daemon to receive the stale drain")
    answered = json.loads(entry.read_text())
    assert answered["refs"] == []
    assert answered["error"] == (
        f"refused: the message is for task uid {old_uid}, this daemon serves default/reborn "
        f"uid {new_uid} (a message of a deleted task of the same name)"
    )
    # The new agents never stopped: each goes on doing turns after the refusal.
    before = stack.turns_on_disk(pvc)
    assert len(before) == 2
    wait_until(
        lambda: all(stack.turns_on_disk(pvc)[a] > t + 2 for a, t in before.items()),
        30,
        "both new agents to go on after the stale drain",
    )
    assert stack.status("default", "reborn")["phase"] == "Running"
    # The ledger: the old task's forced checkpoint only, nothing under the new uid.
    assert [c.ref for c in stack.ledger.list_checkpoints("default", "reborn")] == [forced.ref]
    assert stack.ledger.get_operation(stale.id).terminal  # type: ignore[union-attr]
    stack.kubectl("delete", "ctask", "reborn", timeout=120)
    kept = stack.ledger.latest_checkpoint("default", "reborn")
    assert kept is not None and kept.task_uid == new_uid and not kept.forced


# ------------------------------------------------------------ status from observation


def test_a_sandbox_deleted_under_a_running_task_is_recreated_and_its_agents_resume(
    stack: DevStack,
) -> None:
    """Tried: ``kubectl delete sandbox`` under a Running task. The daemon goes with it;
    the task must stop saying Running, bring its Sandbox back, and resume every agent
    at ``turns + 1`` on the same workspace."""
    assert stack.apply(task_manifest("unsandboxed")).returncode == 0
    stack.wait_phase("default", "unsandboxed", "Running")
    pvc = stack.pvc_of("unsandboxed")
    stack.wait_turns(pvc, 2, 2)
    sandbox = f"sandboxes.v1alpha1.agents.x-k8s.io/{sandbox_name('unsandboxed')}"
    old_uid = json.loads(stack.kubectl("get", sandbox, "-o", "json").stdout)["metadata"]["uid"]

    stack.kubectl("delete", sandbox, "--wait=true", timeout=120)
    wait_until(lambda: not stack.daemon_pids(pvc), 90, "the daemon to go with its Sandbox")
    saved = stack.turns_on_disk(pvc)
    stack.wait_phase("default", "unsandboxed", "Provisioning", timeout=60)
    assert stack.status("default", "unsandboxed")["agents"] == 0

    def recreated() -> bool:
        got = stack.kubectl("get", sandbox, "-o", "json", check=False)
        return got.returncode == 0 and json.loads(got.stdout)["metadata"]["uid"] != old_uid

    wait_until(recreated, 60, "the Sandbox to be re-created")
    stack.wait_phase("default", "unsandboxed", "Running", timeout=120)
    wait_until(
        lambda: all(stack.turns_on_disk(pvc).get(a, 0) > t for a, t in saved.items()),
        60,
        "every agent to continue on the same workspace",
    )
    assert set(stack.turns_on_disk(pvc)) == set(saved)  # the same agents, none fresh
    assert stack.status("default", "unsandboxed")["agents"] == 2
    reasons = [e["reason"] for e in stack.events_of("unsandboxed") if e["type"] == "Warning"]
    assert "SandboxMissing" in reasons
    stack.kubectl("delete", "ctask", "unsandboxed", timeout=120)
    kept = stack.ledger.latest_checkpoint("default", "unsandboxed")
    assert kept is not None and not kept.forced


def test_deleting_a_task_whose_sandbox_is_gone_forces_its_checkpoint_without_the_timeout(
    stack: DevStack,
) -> None:
    """Tried: ``kubectl delete sandbox``, then at once ``kubectl delete ctask`` with the
    default ``drainTimeout`` (2m): no daemon is left to answer the drain, and nothing
    will start one, so waiting out the timeout would only hold the deletion."""
    assert stack.apply(task_manifest("orphaned", agents=1)).returncode == 0
    stack.wait_phase("default", "orphaned", "Running")
    pvc = stack.pvc_of("orphaned")
    stack.wait_turns(pvc, 1, 2)
    uid = uid_of(stack, "orphaned")
    stack.kubectl("delete", f"sandboxes.v1alpha1.agents.x-k8s.io/{sandbox_name('orphaned')}",
                  "--wait=true", timeout=120)  # fmt: skip
    wait_until(lambda: not stack.daemon_pids(pvc), 90, "the daemon to go with its Sandbox")
    stack.kubectl("delete", "ctask", "orphaned", "--wait=false")

    wait_until(lambda: stack.task("default", "orphaned") is None, 60, "the task to be gone")
    drain = stack.ledger.find_operation(f"{uid}:delete")
    assert drain is not None and drain.state == "failed"
    assert "its Sandbox is gone and no heartbeat came from its daemon" in (drain.error or "")
    (checkpoint,) = stack.ledger.list_checkpoints("default", "orphaned")
    assert checkpoint.forced and checkpoint.pvc_name == pvc
    # What the daemon's own SIGTERM drain flushed is on the PVC the checkpoint names.
    assert stack.turns_on_disk(pvc) and all(t >= 2 for t in stack.turns_on_disk(pvc).values())


# ----------------------------------------------------- a restore, or a clear failure


def deleted_with_checkpoint(stack: DevStack, name: str) -> tuple[str, str]:
    """A task run, then deleted: its checkpoint's ref and retained PVC."""
    assert stack.apply(task_manifest(name, agents=1)).returncode == 0
    stack.wait_phase("default", name, "Running")
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, 1, 1)
    stack.kubectl("delete", "ctask", name, timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", name)
    assert checkpoint is not None and checkpoint.verified
    return checkpoint.ref, pvc


def restoring(name: str, ref: str, namespace: str = "default") -> dict[str, object]:
    manifest = task_manifest(name, namespace=namespace, agents=1)
    manifest["spec"]["resumeFrom"] = {"checkpointRef": ref}
    return manifest


def assert_failed_without_starting(
    stack: DevStack, name: str, namespace: str, reason: str
) -> dict[str, object]:
    stack.wait_phase(namespace, name, "Failed", timeout=60)
    status = stack.status(namespace, name)
    resumed = [c for c in status["conditions"] if c["type"] == "Resumed"]
    assert [(c["status"], c["reason"]) for c in resumed] == [("False", reason)]
    assert "no agents were started" in status["message"]
    assert status.get("agents", 0) == 0
    warnings = [e for e in stack.events_of(name, namespace) if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == [reason]
    # Nothing was created for it: no Sandbox, no PVC, no restore operation.
    sandboxes = stack.kubectl("get", "sandboxes.v1alpha1.agents.x-k8s.io", "-n", namespace,
                              "-o", "name").stdout  # fmt: skip
    assert name not in sandboxes
    pvcs = json.loads(stack.kubectl("get", "pvc", "-n", namespace, "-o", "json").stdout)
    labels = [p["metadata"].get("labels", {}) for p in pvcs["items"]]
    assert all(lab.get("caliban.caliban-ai.dev/task") != name for lab in labels), labels
    uid = uid_of(stack, name, namespace)
    assert stack.ledger.find_operation(f"{uid}:restore") is None
    stack.kubectl("delete", "ctask", name, "-n", namespace, timeout=60)  # released at once
    return status


def test_a_restore_whose_workspace_pvc_is_gone_fails_and_the_ledger_says_so(
    stack: DevStack,
) -> None:
    """Tried: the checkpoint's VolumeSnapshot and its retained PVC deleted by hand, then
    a restore of it."""
    ref, pvc = deleted_with_checkpoint(stack, "lost-workspace")
    stack.kubectl("delete", "volumesnapshot", ref, timeout=60)
    stack.kubectl("delete", "pvc", pvc, timeout=60)
    assert stack.apply(restoring("lost-workspace-again", ref)).returncode == 0

    status = assert_failed_without_starting(
        stack, "lost-workspace-again", "default", "CheckpointWorkspaceGone"
    )
    assert f"its VolumeSnapshot {ref} no longer exists" in str(status["message"])
    assert f"PVC default/{pvc} no longer exists" in str(status["message"])
    assert stack.kubectl("get", "pvc", pvc, check=False).returncode != 0  # not re-created
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None and not checkpoint.available
    listed = subprocess.run(
        [*DRAINCTL, "ledger", "ls", "--task", "default/lost-workspace"],
        capture_output=True, text=True, check=True, timeout=60,
        env={**os.environ, "DRAIN_DATABASE_URL": stack.database_url},
    ).stdout  # fmt: skip
    (row,) = [line for line in listed.splitlines() if line.startswith(ref)]
    assert "GONE" in row.split()


def test_a_restored_task_runs_its_own_model_not_the_checkpoints(stack: DevStack) -> None:
    """Tried: a checkpoint of an agent on one model, restored by a task whose
    ``spec.task.model`` names another."""
    ref, old_pvc = deleted_with_checkpoint(stack, "first-model")
    saved = stack.turns_on_disk(old_pvc)
    manifest = restoring("second-model", ref)
    manifest["spec"]["task"]["model"] = "turns=100000,turn_ms=60"  # type: ignore[index]
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "second-model", "Running")
    pvc = stack.pvc_of("second-model")  # its own copy of the checkpoint's workspace
    wait_until(
        lambda: all(stack.turns_on_disk(pvc).get(a, 0) > t for a, t in saved.items()),
        60,
        "the restored agent to continue",
    )
    for directory in stack.agent_dirs("default", pvc):
        record = json.loads(layout.manifest_file(directory).read_text())
        assert (record["spec"]["provider"], record["spec"]["model"]) == (
            "scripted", "turns=100000,turn_ms=60"
        )  # fmt: skip
    stack.kubectl("delete", "ctask", "second-model", timeout=120)


def test_a_restore_into_another_namespace_fails_naming_the_checkpoints_namespace(
    stack: DevStack,
) -> None:
    """Tried: a checkpoint of a task in default, restored by a task in team-c."""
    ref, pvc = deleted_with_checkpoint(stack, "homebody")
    stack.kubectl("create", "namespace", "team-c", check=False)
    assert stack.apply(restoring("homebody", ref, namespace="team-c")).returncode == 0

    status = assert_failed_without_starting(
        stack, "homebody", "team-c", "CheckpointInAnotherNamespace"
    )
    assert "its workspace PVC is in namespace default" in str(status["message"])
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None and checkpoint.available  # still there, in default
    assert stack.volume("default", pvc).is_dir()


# ------------------------------------------------------------- one checkpoint per drain


def test_a_delete_during_a_pause_drain_keeps_that_drains_one_checkpoint(
    stack: DevStack,
) -> None:
    """Tried: ``suspend: true``, then ``kubectl delete`` while the pause still drains."""
    assert stack.apply(task_manifest("paused-then-deleted", model=SLOW_TURNS)).returncode == 0
    stack.wait_phase("default", "paused-then-deleted", "Running")
    pvc = stack.pvc_of("paused-then-deleted")
    uid = uid_of(stack, "paused-then-deleted")
    stack.wait_turns(pvc, 2, 1)

    stack.kubectl("patch", "ctask", "paused-then-deleted", "--type", "merge",
                  "-p", '{"spec":{"lifecycle":{"suspend":true}}}')  # fmt: skip
    stack.wait_phase("default", "paused-then-deleted", "Draining", timeout=30)
    pause = stack.ledger.find_operation(f"{uid}:pause:1")
    assert pause is not None
    assert not pause.terminal, f"the pause drain finished before the delete: {pause}"
    stack.kubectl("delete", "ctask", "paused-then-deleted", timeout=120)

    assert stack.task("default", "paused-then-deleted") is None
    checkpoints = stack.ledger.list_checkpoints("default", "paused-then-deleted")
    assert [c.operation_id for c in checkpoints] == [pause.id]
    assert stack.ledger.find_operation(f"{uid}:delete") is None  # no second drain
    assert stack.ledger.find_operation(f"{uid}:force") is None
    (checkpoint,) = checkpoints
    assert {a.agent_id: a.turns for a in checkpoint.agents} == stack.turns_on_disk(pvc)
    assert checkpoint.ref in stack.kubectl("get", "pvc", pvc, "-o", "json").stdout


def test_a_second_wake_while_resuming_does_not_resume_after_the_next_pause(
    stack: DevStack,
) -> None:
    """Tried: an idle pause, a wake, a second wake while the task resumes; then the next
    idle pause must stay Suspended (one resume per wake that found the task paused)."""
    manifest = task_manifest("woken-twice", agents=1, model="turns=2,turn_ms=20",
                             idleTimeout="2s")  # fmt: skip
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "woken-twice", "Suspended", timeout=120)
    uid = uid_of(stack, "woken-twice")
    first_ref = stack.status("default", "woken-twice")["checkpointRef"]

    stack.kubectl("annotate", "ctask", "woken-twice", f"{WAKE}=first", "--overwrite")
    stack.wait_phase("default", "woken-twice", "Resuming", timeout=30)
    stack.kubectl("annotate", "ctask", "woken-twice", f"{WAKE}=second", "--overwrite")
    # It runs again (its agents are done at once), then pauses again when idle.
    wait_until(
        lambda: (
            stack.status("default", "woken-twice").get("pauses") == 2
            and stack.status("default", "woken-twice").get("phase") == "Suspended"
        ),
        120,
        "the second idle pause",
    )
    second_ref = stack.status("default", "woken-twice")["checkpointRef"]
    assert second_ref != first_ref
    # Well past what a reconcile pass takes (0.5 s here): no resume from the second pause.
    never(lambda: stack.status("default", "woken-twice").get("phase") != "Suspended", 8,
          "the task to leave Suspended with no new wake")  # fmt: skip
    resumes = [op for op in stack.ledger.list_operations("default", "woken-twice")
               if op.kind is OperationKind.RESUME]  # fmt: skip
    assert [op.idempotency_key for op in resumes] == [f"{uid}:resume:{first_ref}"]
    stack.kubectl("delete", "ctask", "woken-twice", timeout=120)
