"""The operator end to end: ``kubectl`` drives CalibanTasks on the embedded API; the kopf
operator, Celery pipeline, ledger (PostgreSQL), daemons and agents are real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import prompt_turns, wait_until
from worker_agent import layout
from worker_agent.session import count_completed_turns, load_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-e2e-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=11), fresh_postgres())
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


def test_create_run_delete_then_restore_continues_every_agent(stack: DevStack) -> None:
    assert stack.apply(task_manifest("story", agents=2)).returncode == 0
    stack.wait_phase("default", "story", "Running")
    pvc = stack.pvc_of("story", "default")
    stack.wait_turns(pvc, 2, 2, "default")
    listing = stack.kubectl("get", "ctask").stdout
    assert "story" in listing
    assert "Running" in listing

    uid = stack.task("default", "story")["metadata"]["uid"]  # type: ignore[index]
    stack.kubectl("delete", "ctask", "story", timeout=120)
    assert stack.task("default", "story") is None
    checkpoint = stack.ledger.latest_checkpoint("default", "story")
    assert checkpoint is not None
    assert checkpoint.task_uid == uid
    assert checkpoint.reason == "delete"
    assert checkpoint.verified
    on_disk = stack.turns_on_disk(pvc, "default")
    assert {a.agent_id: a.turns for a in checkpoint.agents} == on_disk
    for agent in checkpoint.agents:
        directory = stack.volume("default", pvc) / agent.session_dir
        assert count_completed_turns(directory) == agent.turns
    retained = stack.kubectl("get", "pvc", pvc, "-o", "json").stdout
    assert checkpoint.ref in retained  # labelled with the checkpoint it holds
    assert '"ownerReferences": []' in retained or "ownerReferences" not in retained

    restored = task_manifest("story-again", agents=2)
    restored["spec"]["resumeFrom"] = {"checkpointRef": checkpoint.ref}
    assert stack.apply(restored).returncode == 0
    stack.wait_phase("default", "story-again", "Running")
    # Restored into a fresh PVC of its own, filled from the checkpoint's VolumeSnapshot.
    restored_pvc = stack.pvc_of("story-again", "default")
    assert restored_pvc != pvc
    assert checkpoint.ref in stack.kubectl("get", "pvc", restored_pvc, "-o",
                                           "jsonpath={.spec.dataSource.name}").stdout  # fmt: skip
    saved = {a.agent_id: a.turns for a in checkpoint.agents}
    wait_until(
        lambda: all(
            stack.turns_on_disk(restored_pvc, "default").get(i, 0) > t for i, t in saved.items()
        ),
        90,
        "restored agents to do new turns",
    )
    assert stack.turns_on_disk(pvc, "default") == on_disk  # the retained PVC is untouched
    for agent in checkpoint.agents:
        directory = stack.volume("default", restored_pvc) / agent.session_dir
        user_turns = prompt_turns(load_session(directory).messages)
        assert user_turns[: agent.turns + 1] == list(range(1, agent.turns + 2))
    stack.kubectl("delete", "ctask", "story-again", timeout=120)


def test_idle_timeout_suspends_and_the_wake_annotation_resumes(stack: DevStack) -> None:
    manifest = task_manifest("napper", agents=2, model="turns=2,turn_ms=20", idleTimeout="2s")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "napper", "Suspended", timeout=120)
    status = stack.status("default", "napper")
    assert status["pausedBy"] == "idle"
    ref = status["checkpointRef"]
    # The embedded cluster serves v1beta1, so the task's Sandbox is one.
    assert stack.task_sandbox_version("napper") == "v1beta1"
    mode = stack.sandbox_field(sandbox_name("napper"), "{.spec.operatingMode}", version="v1beta1")
    assert mode == "Suspended"
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None
    assert all(a.turns == 2 for a in checkpoint.agents)

    stack.kubectl("annotate", "ctask", "napper", "caliban.caliban-ai.dev/wake=now", "--overwrite")
    stack.wait_phase("default", "napper", "Running", timeout=120)
    transcripts = [
        layout.transcript_file(d)
        for d in stack.agent_dirs("default", stack.pvc_of("napper", "default"))
    ]
    wait_until(
        lambda: all('"resumed_from":3' in t.read_text() for t in transcripts),
        30,
        "every resumed worker to continue at turn 3",
    )
    for transcript in transcripts:
        assert transcript.read_text().count('{"type":"TurnEnd"') == 2
    stack.kubectl("delete", "ctask", "napper", timeout=120)


def test_kubectl_patch_suspend_pauses_and_resumes(stack: DevStack) -> None:
    assert stack.apply(task_manifest("manual", agents=1)).returncode == 0
    stack.wait_phase("default", "manual", "Running")
    stack.wait_turns(stack.pvc_of("manual", "default"), 1, 1, "default")
    stack.kubectl("patch", "ctask", "manual", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "manual", "Suspended")
    frozen = stack.turns_on_disk(stack.pvc_of("manual", "default"), "default")
    assert stack.status("default", "manual")["pausedBy"] == "manual"
    stack.kubectl("patch", "ctask", "manual", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", "manual", "Running")
    wait_until(
        lambda: all(
            stack.turns_on_disk(stack.pvc_of("manual", "default"), "default")[i] > t
            for i, t in frozen.items()
        ),
        60,
        "the agent to continue after the pause",
    )
    stack.kubectl("delete", "ctask", "manual", timeout=120)


def test_deleting_a_suspended_task_keeps_its_pause_checkpoint_without_a_second_drain(
    stack: DevStack,
) -> None:
    # Created running, then paused: a task created suspended never runs (and has nothing
    # to keep: tests/e2e/test_created_suspended.py).
    manifest = task_manifest("resting", agents=1, model="turns=2,turn_ms=20")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "resting", "Running", timeout=120)
    stack.kubectl("patch", "ctask", "resting", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "resting", "Suspended", timeout=120)
    ref = stack.status("default", "resting")["checkpointRef"]
    pvc = stack.pvc_of("resting", "default")
    uid = stack.task("default", "resting")["metadata"]["uid"]  # type: ignore[index]

    stack.kubectl("delete", "ctask", "resting", timeout=120)
    assert stack.task("default", "resting") is None
    assert stack.ledger.find_operation(f"{uid}:delete") is None  # no drain of a stopped daemon
    latest = stack.ledger.latest_checkpoint("default", "resting")
    assert latest is not None
    assert latest.ref == ref
    assert latest.reason == "pause"
    retained = stack.kubectl("get", "pvc", pvc, "-o", "json").stdout
    assert ref in retained


def test_on_delete_delete_releases_without_a_checkpoint(stack: DevStack) -> None:
    assert stack.apply(task_manifest("throwaway", agents=1, onDelete="delete")).returncode == 0
    stack.wait_phase("default", "throwaway", "Running")
    stack.kubectl("delete", "ctask", "throwaway", timeout=60)
    assert stack.task("default", "throwaway") is None
    assert stack.ledger.latest_checkpoint("default", "throwaway") is None


@pytest.mark.parametrize(
    ("name", "lifecycle", "task", "field", "reason"),
    [
        # caliban-operator's schema admits any string here, so ours does too and the
        # operator refuses it: condition SpecValid False and a Warning event.
        ("bad-idle", {"idleTimeout": "banana"}, {}, "idleTimeout", "InvalidLifecycleIdleTimeout"),
        ("bad-ondelete", {"onDelete": "maybe"}, {}, "onDelete", "InvalidLifecycleOnDelete"),
        ("bad-agents", {}, {"agents": -1}, "agents", None),  # the CRD schema refuses it
    ],
)
def test_malformed_specs_are_refused_naming_the_field(
    stack: DevStack,
    name: str,
    lifecycle: dict[str, str],
    task: dict[str, int],
    field: str,
    reason: str | None,
) -> None:
    """Tried: idleTimeout banana, onDelete maybe, agents -1."""
    manifest = task_manifest(name, agents=1)
    manifest["spec"]["lifecycle"] = lifecycle
    manifest["spec"]["task"].update(task)
    applied = stack.apply(manifest)
    if reason is None:
        assert applied.returncode != 0
        assert field in applied.stderr
        return
    assert applied.returncode == 0, applied.stderr
    stack.wait_phase("default", name, "Failed")
    status = stack.status("default", name)
    assert field in status["message"]
    spec_valid = [c for c in status["conditions"] if c["type"] == "SpecValid"]
    assert [(c["status"], c["reason"]) for c in spec_valid] == [("False", reason)]
    events = stack.kubectl("get", "events", "--field-selector",
                           f"involvedObject.name={name}").stdout  # fmt: skip
    assert reason in events
    stack.kubectl("delete", "ctask", name, timeout=60)


def test_unknown_resume_from_ref_fails_naming_the_field(stack: DevStack) -> None:
    manifest = task_manifest("orphan", agents=1)
    manifest["spec"]["resumeFrom"] = {"checkpointRef": "ckpt-0000000000000000beef"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "orphan", "Failed")
    message = stack.status("default", "orphan")["message"]
    assert "spec.resumeFrom.checkpointRef" in message
    assert "ckpt-0000000000000000beef" in message
    events = stack.kubectl("get", "events", "--field-selector",
                           "involvedObject.name=orphan").stdout  # fmt: skip
    assert "UnknownCheckpoint" in events
    stack.kubectl("delete", "ctask", "orphan", timeout=60)


def test_unreachable_daemon_is_force_deleted_within_drain_timeout(stack: DevStack) -> None:
    """Tried: the task's Sandbox deleted out from under it, then the task deleted."""
    assert stack.apply(task_manifest("lost", agents=1, drainTimeout="4s")).returncode == 0
    stack.wait_phase("default", "lost", "Running")
    stack.kubectl("delete", "sandboxes.agents.x-k8s.io", sandbox_name("lost"), timeout=60)
    wait_until(
        lambda: "sandbox_pod_stopped sandbox=default/lost-sbx" in stack.log.read_text(),
        60,
        "the stand-in controller to stop the task's daemon",
    )
    stack.kubectl("delete", "ctask", "lost", "--wait=false")
    wait_until(lambda: stack.task("default", "lost") is None, 30, "the task to be gone")
    checkpoint = stack.ledger.latest_checkpoint("default", "lost")
    assert checkpoint is not None
    assert checkpoint.forced
    # The abandoned drain is closed, so a daemon answering late records no second one.
    [drain] = [
        op for op in stack.ledger.list_operations(namespace="default", name="lost")
        if op.kind == "delete-drain"
    ]  # fmt: skip
    assert drain.state == "failed" and "superseded by a forced checkpoint" in (drain.error or "")
    assert len(stack.ledger.list_checkpoints(namespace="default", name="lost")) == 1
    events = stack.kubectl("get", "events", "--field-selector",
                           "involvedObject.name=lost").stdout  # fmt: skip
    assert "ForcedCheckpoint" in events


def test_operator_killed_mid_drain_completes_the_drain_once(stack: DevStack) -> None:
    manifest = task_manifest("restart", agents=2, model="turns=100000,turn_ms=2500",
                             drainGracePeriod="20s")  # fmt: skip
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "restart", "Running")
    stack.wait_turns(stack.pvc_of("restart", "default"), 2, 1, "default")
    uid = stack.task("default", "restart")["metadata"]["uid"]  # type: ignore[index]
    stack.kubectl("delete", "ctask", "restart", "--wait=false")
    stack.wait_phase("default", "restart", "Draining", timeout=30)
    pid = stack.operator_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: stack.task("default", "restart") is None, 120, "the task to be gone")
    ops = [op for op in stack.ledger.list_operations(namespace="default", name="restart")
           if op.task_uid == uid and op.kind == "delete-drain"]  # fmt: skip
    assert len(ops) == 1
    checkpoints = [c for c in stack.ledger.list_checkpoints(namespace="default", name="restart")
                   if c.task_uid == uid]  # fmt: skip
    assert len(checkpoints) == 1
    assert checkpoints[0].verified


def test_same_name_in_two_namespaces_share_nothing(stack: DevStack) -> None:
    stack.kubectl("create", "namespace", "team-b", check=False)
    for namespace in ("default", "team-b"):
        assert stack.apply(task_manifest("twin", namespace=namespace, agents=1)).returncode == 0
    for namespace in ("default", "team-b"):
        stack.wait_phase(namespace, "twin", "Running")
    stack.wait_turns(stack.pvc_of("twin", "default"), 1, 1, "default")
    stack.wait_turns(stack.pvc_of("twin", "team-b"), 1, 1, "team-b")
    assert stack.volume("default", stack.pvc_of("twin", "default")) != stack.volume(
        "team-b", stack.pvc_of("twin", "team-b")
    )
    first_uid = stack.task("default", "twin")["metadata"]["uid"]  # type: ignore[index]
    first_pvc = stack.pvc_of("twin", "default")
    stack.kubectl("delete", "ctask", "twin", "-n", "default", timeout=120)
    assert stack.status("team-b", "twin")["phase"] == "Running"
    [mine] = [c for c in stack.ledger.list_checkpoints(namespace="default", name="twin")]
    assert mine.task_uid == first_uid
    assert stack.ledger.list_checkpoints(namespace="team-b", name="twin") == []
    # Re-created with the deleted task's name: a new task, identity by uid.
    assert stack.apply(task_manifest("twin", agents=1)).returncode == 0
    stack.wait_phase("default", "twin", "Running")
    assert stack.task("default", "twin")["metadata"]["uid"] != first_uid  # type: ignore[index]
    assert stack.pvc_of("twin", "default") != first_pvc  # a new task, a new workspace
    for namespace in ("default", "team-b"):
        stack.kubectl("delete", "ctask", "twin", "-n", namespace, timeout=120)


def test_drainctl_pause_and_wake(stack: DevStack) -> None:
    assert stack.apply(task_manifest("handy", agents=1)).returncode == 0
    stack.wait_phase("default", "handy", "Running")
    env = {**stack.env, "KUBECONFIG": str(stack.kubeconfig)}

    def drainctl(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "pausing" in drainctl("pause", "default/handy")
    stack.wait_phase("default", "handy", "Suspended")
    assert "waking" in drainctl("wake", "default/handy")
    stack.wait_phase("default", "handy", "Running")
    stack.kubectl("delete", "ctask", "handy", timeout=120)
