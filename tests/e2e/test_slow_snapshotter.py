"""A CSI driver that takes a minute to make a snapshot ready, as real ones take minutes
to upload one: ``drainctl dev up --snapshot-ready-delay 60`` cuts every VolumeSnapshot at
once (``creationTime`` set, bound to its content: its point in time fixed) and makes it
``readyToUse`` 60 s later.

A deletion and a pause go on at the cut, as fast as without the delay; the ledger shows
the snapshot pending, then ready once the operator's snapshot follower sees it (the
deleted task long gone, the operator restarted meanwhile); a restore of that checkpoint
made before it is ready waits for it (Pending, naming the snapshot) and then resumes
every agent at ``turns + 1`` from its own copy; and the audit does not call a pending
snapshot a problem.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from orchestrator.ledger import CheckpointView
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import prompt_turns, wait_until
from worker_agent import layout
from worker_agent.session import load_session
from worker_agent.testing import DRAINCTL

pytestmark = pytest.mark.slow

READY_DELAY_SECS = 60
WELL_UNDER_THE_DELAY_SECS = READY_DELAY_SECS / 2
"""What a deletion or a pause may take here: it waits for the cut, not for ready (about
1 s on a quiet machine, as without the delay; room for a loaded one)."""
SUSPEND = '{"spec": {"lifecycle": {"suspend": true}}}'


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-slowsnap-", "--snapshot-ready-delay", str(READY_DELAY_SECS)) as dev:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []


def drainctl(stack: DevStack, *args: str) -> str:
    """``drainctl`` against the stack's ledger, as a user runs it; its stdout."""
    result = subprocess.run(
        [*DRAINCTL, *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "DRAIN_DATABASE_URL": stack.database_url},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def listed_snapshot(stack: DevStack, ref: str) -> str:
    """The SNAPSHOT column of ``ref``'s row in ``drainctl ledger ls``."""
    rows = drainctl(stack, "ledger", "ls").splitlines()
    header = rows[0].split()
    row = next(r.split() for r in rows[1:] if r.split()[0] == ref)
    return row[header.index("SNAPSHOT")]


def ready_in_ledger(stack: DevStack, ref: str) -> CheckpointView | None:
    checkpoint = stack.ledger.get_checkpoint(ref)
    return checkpoint if checkpoint is not None and checkpoint.snapshot is not None else None


def failed_in_ledger(stack: DevStack, ref: str) -> CheckpointView | None:
    checkpoint = stack.ledger.get_checkpoint(ref)
    return checkpoint if checkpoint is not None and checkpoint.snapshot_error else None


def user_turns(stack: DevStack, pvc: str, agent: str) -> list[int]:
    session = load_session(layout.agents_dir(stack.volume("default", pvc)) / agent)
    return prompt_turns(session.messages)


def every_agent_goes_on(stack: DevStack, pvc: str, checkpoint: CheckpointView) -> None:
    """Every agent of ``checkpoint`` does two more turns on ``pvc``, going on at
    ``turns + 1`` from the checkpoint's own session."""
    saved = {a.agent_id: a.turns for a in checkpoint.agents}
    wait_until(
        lambda: all(stack.turns_on_disk(pvc).get(a, 0) > t + 1 for a, t in saved.items()),
        90, f"every agent of {checkpoint.ref} to go on in {pvc}",
    )  # fmt: skip
    for agent, turns in saved.items():
        assert user_turns(stack, pvc, agent)[: turns + 2] == list(range(1, turns + 3))


def condition(stack: DevStack, name: str, type_: str) -> dict[str, Any] | None:
    found = [c for c in stack.status("default", name).get("conditions") or []
             if c["type"] == type_]  # fmt: skip
    return found[0] if found else None


def running_with_turns(stack: DevStack, name: str, agents: int = 2) -> str:
    assert stack.apply(task_manifest(name, agents=agents)).returncode == 0
    stack.wait_phase("default", name, "Running")
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, agents, 2)
    return pvc


def test_a_deletion_goes_at_the_cut_and_a_restore_waits_for_ready_then_continues_every_agent(
    stack: DevStack,
) -> None:
    """Tried: a 2-agent task deleted, then a task restoring its checkpoint created at once,
    with the checkpoint's snapshot a minute from ready."""
    pvc = running_with_turns(stack, "origin")

    started = time.monotonic()
    stack.kubectl("delete", "ctask", "origin", timeout=120)
    took = time.monotonic() - started

    print(f"delete → gone with a {READY_DELAY_SECS}s ready delay: {took:.2f}s")
    assert took < WELL_UNDER_THE_DELAY_SECS, f"the deletion waited {took:.1f}s"
    assert stack.task("default", "origin") is None
    checkpoint = stack.ledger.latest_checkpoint("default", "origin")
    assert checkpoint is not None and checkpoint.verified
    ref = checkpoint.ref
    assert checkpoint.snapshot_pending and checkpoint.snapshot_cut_at is not None
    snapshot = stack.snapshot(ref)
    assert snapshot is not None and snapshot["status"]["readyToUse"] is False
    assert snapshot["status"]["boundVolumeSnapshotContentName"]
    assert listed_snapshot(stack, ref) == "pending"
    assert "not readyToUse yet" in drainctl(stack, "ledger", "show", ref)
    # The point in time is fixed at the cut: the copy already holds what was recorded.
    copy = stack.snapshot_copy(ref)
    for recorded in checkpoint.agents:
        assert load_session(copy / recorded.session_dir).turns == recorded.turns

    restoring = task_manifest("restored", agents=2)
    restoring["spec"]["resumeFrom"] = {"checkpointRef": ref}
    assert stack.apply(restoring).returncode == 0
    waiting = wait_until(
        lambda: "waiting for VolumeSnapshot" in (m := stack.status("default", "restored")
                                                 .get("message", "")) and m,
        60, "the restore to say it waits for the snapshot",
    )  # fmt: skip
    assert waiting == (
        f"waiting for VolumeSnapshot {ref} of checkpoint {ref} to become readyToUse (cut at "
        f"{checkpoint.snapshot_cut_at:%Y-%m-%dT%H:%M:%SZ}, its data still being copied) "
        "before restoring from it"
    )
    assert stack.status("default", "restored")["phase"] == "Pending"
    assert condition(stack, "restored", "Resumed") is None  # not refused: waiting
    # Nothing made for it yet: no PVC of its own, no Sandbox; the origin's PVC untouched.
    pvcs = json.loads(stack.kubectl("get", "pvc", "-o", "json").stdout)["items"]
    assert [p["metadata"]["name"] for p in pvcs] == [pvc]
    assert stack.kubectl("get", "sandbox", "restored-sbx", check=False).returncode != 0
    # Pending is not a problem to the audit until its deadline.
    report = stack.audit()
    assert report["findings"] == [] and report["counts"]["snapshots_pending"] == 1
    # An operator restarted meanwhile follows the snapshot on: the ledger says it is pending.
    killed = stack.operator_pid()
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: stack.operator_pid() not in (None, killed), 60, "the operator back")

    ready = wait_until(
        lambda: ready_in_ledger(stack, ref), READY_DELAY_SECS + 60, "the ledger to say ready"
    )
    assert ready.snapshot_cut_at is not None and ready.snapshot_ready_at is not None
    assert ready.snapshot_ready_at - ready.snapshot_cut_at >= timedelta(seconds=READY_DELAY_SECS)
    assert listed_snapshot(stack, ref) == "ready"
    # Its task is long gone: the follower says so in the operator's log.
    operator_log = (stack.state / "logs" / "operator.log").read_text()
    assert f"snapshot_ready checkpoint={ref} snapshot=default/{ref}" in operator_log
    assert "task=default/origin task_exists=False" in operator_log

    stack.wait_phase("default", "restored", "Running", timeout=90)
    restored_pvc = stack.pvc_of("restored")
    assert restored_pvc != pvc
    data_source = stack.kubectl(
        "get", "pvc", restored_pvc, "-o", "jsonpath={.spec.dataSource.name}"
    ).stdout  # fmt: skip
    assert data_source == ref
    resumed = condition(stack, "restored", "Resumed")
    assert resumed is not None and (resumed["status"], resumed["reason"]) == ("True", "Resumed")
    every_agent_goes_on(stack, restored_pvc, checkpoint)
    stack.kubectl("delete", "ctask", "restored", timeout=120)


def test_a_pause_suspends_at_the_cut_and_its_condition_follows_the_snapshot_to_ready(
    stack: DevStack,
) -> None:
    pvc = running_with_turns(stack, "pausing")

    started = time.monotonic()
    stack.kubectl("patch", "ctask", "pausing", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "pausing", "Suspended", timeout=WELL_UNDER_THE_DELAY_SECS)
    took = time.monotonic() - started

    print(f"pause → Suspended with a {READY_DELAY_SECS}s ready delay: {took:.2f}s")
    ref = stack.status("default", "pausing")["checkpointRef"]
    snapshot = stack.snapshot(ref)
    assert snapshot is not None and snapshot["status"]["readyToUse"] is False
    # Suspended: its pod goes (the stand-in controller stops it), the snapshot still uploading.
    wait_until(lambda: stack.daemon_pids(pvc) == [], 30, "the paused task's pod to go")
    assert stack.ledger.get_checkpoint(ref).snapshot_pending  # type: ignore[union-attr]
    said = condition(stack, "pausing", "Snapshotted")
    assert said is not None and (said["status"], said["reason"]) == ("Unknown", "SnapshotCut")
    assert listed_snapshot(stack, ref) == "pending"
    assert [e["reason"] for e in stack.events_of("pausing")].count("SnapshotCut") == 1

    wait_until(lambda: ready_in_ledger(stack, ref), READY_DELAY_SECS + 60, "ready in the ledger")

    # The follower says it on the task, and wakes its steward to set the condition.
    wait_until(
        lambda: (c := condition(stack, "pausing", "Snapshotted")) and c["status"] == "True", 30,
        "Snapshotted=True",
    )  # fmt: skip
    ready_events = [e for e in stack.events_of("pausing") if e["reason"] == "Snapshotted"]
    assert [e["type"] for e in ready_events] == ["Normal"]
    assert f"copied to VolumeSnapshot {ref}, ready to restore" in ready_events[0]["message"]
    stack.kubectl("delete", "ctask", "pausing", timeout=120)


def test_a_snapshot_deleted_after_its_cut_fails_loudly_and_the_task_resumes_from_its_pvc(
    stack: DevStack,
) -> None:
    """Tried: a paused task's snapshot, cut and still uploading, deleted by hand; then the
    task woken. With the project's default deadlines: a snapshot gone after its cut fails
    at once, it needs no timeout."""
    pvc = running_with_turns(stack, "doomed")
    stack.kubectl("patch", "ctask", "doomed", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "doomed", "Suspended", timeout=WELL_UNDER_THE_DELAY_SECS)
    ref = stack.status("default", "doomed")["checkpointRef"]
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None and checkpoint.snapshot_pending

    stack.kubectl("delete", "volumesnapshot", ref)

    failed = wait_until(lambda: failed_in_ledger(stack, ref), 30, "the ledger to say failed")
    assert failed.snapshot_error == (
        f"VolumeSnapshot {ref} of PVC {pvc}, cut at "
        f"{checkpoint.snapshot_cut_at:%Y-%m-%dT%H:%M:%SZ}, no longer exists: it was deleted "
        "before it was readyToUse"
    )
    assert failed.available  # its retained PVC is there: still restorable by that
    assert listed_snapshot(stack, ref) == "failed"
    warned = wait_until(
        lambda: [e for e in stack.events_of("doomed") if e["reason"] == "SnapshotFailed"], 30,
        "the SnapshotFailed warning",
    )  # fmt: skip
    assert [e["type"] for e in warned] == ["Warning"]
    assert warned[0]["message"] == (
        f"checkpoint {ref} has no snapshot: {failed.snapshot_error}; it is kept as the "
        f"retained workspace PVC {pvc} only"
    )
    wait_until(
        lambda: (c := condition(stack, "doomed", "Snapshotted")) and c["status"] == "False", 30,
        "Snapshotted=False",
    )  # fmt: skip

    stack.kubectl("patch", "ctask", "doomed", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", "doomed", "Running", timeout=90)
    every_agent_goes_on(stack, pvc, checkpoint)
    stack.kubectl("delete", "ctask", "doomed", timeout=120)
