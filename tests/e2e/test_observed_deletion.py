"""A deletion decides from what the ledger and the cluster observe, never from a status
field another writer can set: the real kubectl against the dev stack's embedded
defaults (embedded API and broker, SQLite ledger in a temp dir), the real operator.

What was tried:
- a task whose daemon never started (its Workspace's source cannot be cloned, so the
  init container fails): deleted, it goes at once with event ``NothingToDrain``, no
  drain and no forced checkpoint, instead of waiting ``drainTimeout``;
- a Running task that had paused once, its status forged (``kubectl patch
  --subresource=status``) to ``Completed`` with the old pause checkpoint, then to
  ``Suspended``, then with another task's ``checkpointRef``: each deletion still drains
  and records every completed turn (0 lost), and the forged refs are not kept;
- a second writer patching ``status.phase`` to ``Completed`` every second (as
  caliban-operator would): the task still pauses, wakes and drains on delete as told,
  and the operator puts its status right (``StatusCorrected``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from orchestrator.ledger import OperationKind
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-observed-") as dev:
        yield dev
        # Whatever the module's tests did, the ledger and the audit say only what is so.
        assert dev.ledger_contradictions() == []


def forge_status(stack: DevStack, name: str, status: dict[str, Any]) -> None:
    stack.kubectl(
        "patch", "ctask", name, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def reasons(stack: DevStack, name: str) -> list[str]:
    return [e["reason"] for e in stack.events_of(name)]


def test_a_task_whose_daemon_never_started_is_released_at_once(stack: DevStack) -> None:
    workspace = {
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1", "kind": "Workspace",
        "metadata": {"name": "unclonable", "namespace": "default"},
        "spec": {
            "displayName": "Unclonable",
            "sources": [{"name": "app", "repo": f"file://{stack.root}/no-such-repo",
                         "path": "/work/app"}],
            "providers": [{"name": "local", "kind": "ollama", "model": "m",
                           "baseUrl": "http://127.0.0.1:9/"}],
            "defaultProvider": "local",
        },
    }  # fmt: skip
    assert stack.apply(workspace).returncode == 0
    manifest = task_manifest("stuck", agents=1)
    manifest["spec"]["workspaceRef"] = {"name": "unclonable"}
    manifest["spec"]["task"] = {"agents": 1, "prompt": "go"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "stuck", "Provisioning", timeout=60)
    # The clone fails: the pod's init container, again and again; the daemon never runs.
    wait_until(
        lambda: "InitContainerFailed" in [e["reason"] for e in stack.events_of("stuck-sbx")],
        60, "the init container to fail",
    )  # fmt: skip

    started = time.monotonic()
    stack.kubectl("delete", "ctask", "stuck", "--timeout=60s")
    gone_secs = time.monotonic() - started
    assert stack.task("default", "stuck") is None
    assert gone_secs < 15, gone_secs  # drainTimeout is 2 minutes: nothing waited for it
    assert "NothingToDrain" in reasons(stack, "stuck")
    assert "ForcedCheckpoint" not in reasons(stack, "stuck")
    assert stack.ledger.list_checkpoints("default", "stuck") == []
    assert stack.ledger.list_operations("default", "stuck") == []


def pause_and_resume(stack: DevStack, name: str) -> str:
    """Pause ``name`` and wake it; the pause's checkpoint ref."""
    for suspend in (True, False):
        body = json.dumps({"spec": {"lifecycle": {"suspend": suspend}}})
        stack.kubectl("patch", "ctask", name, "--type=merge", "-p", body)
        stack.wait_phase("default", name, "Suspended" if suspend else "Running", timeout=120)
    [pause] = [op for op in stack.ledger.list_operations("default", name) if op.kind == "pause"]
    assert pause.checkpoint_ref is not None
    return pause.checkpoint_ref


@pytest.mark.parametrize(
    ("name", "forged", "ref_of"),
    [
        pytest.param("forged-1", {"phase": "Completed"}, "own-pause",
                     id="completed-with-its-old-pause-ref"),
        pytest.param("forged-2", {"phase": "Suspended", "pausedBy": "manual"}, "own-pause",
                     id="suspended-with-its-old-pause-ref"),
        pytest.param("forged-3", {"phase": "Completed"}, "foreign",
                     id="completed-with-a-foreign-ref"),
    ],
)  # fmt: skip
def test_a_forged_status_never_skips_the_drain_of_a_running_task(
    stack: DevStack, name: str, forged: dict[str, Any], ref_of: str
) -> None:
    assert (
        stack.apply(task_manifest(name, agents=2, model="turns=100000,turn_ms=200")).returncode == 0
    )
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    own_pause = pause_and_resume(stack, name)
    stack.wait_turns(pvc, 2, at_least=3)
    ref = own_pause
    if ref_of == "foreign":
        [other] = [c for c in stack.ledger.list_checkpoints(limit=100) if c.name != name][:1]
        ref = other.ref
    forge_status(stack, name, {**forged, "checkpointRef": ref})  # the operator may correct

    stack.kubectl("delete", "ctask", name, "--timeout=120s")
    assert stack.task("default", name) is None
    deleted = [op for op in stack.ledger.list_operations("default", name)
               if op.kind == "delete-drain"]  # fmt: skip
    assert len(deleted) == 1 and deleted[0].state == "recorded", deleted
    kept = stack.ledger.get_checkpoint(str(deleted[0].checkpoint_ref))
    assert kept is not None and kept.ref not in (own_pause, ref) and not kept.forced
    # Every completed turn is in the deletion's checkpoint (the workspace holds no more).
    assert {a.agent_id: a.turns for a in kept.agents} == stack.turns_on_disk(pvc)
    assert all(a.turns >= 3 for a in kept.agents)


def test_a_second_writer_of_status_phase_changes_nothing_the_operator_decides(
    stack: DevStack,
) -> None:
    """Another controller writes ``status.phase`` from its own enum every second (as
    caliban-operator does): the operator pauses, wakes and deletes the task as if it did
    not, and puts the status right."""
    import threading

    name = "two-writers"
    manifest = task_manifest(name, agents=2, model="turns=100000,turn_ms=200")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    stopping = threading.Event()

    def other_writer() -> None:
        while not stopping.wait(1.0):
            stack.kubectl(
                "patch", "ctask", name, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"phase": "Completed"}}), check=False,
            )  # fmt: skip

    writer = threading.Thread(target=other_writer, daemon=True)
    writer.start()
    try:

        def annotated_phase() -> str | None:
            task = stack.task("default", name) or {}
            annotations = task.get("metadata", {}).get("annotations") or {}
            return annotations.get("caliban.caliban-ai.dev/phase")

        def operator_says(phase: str) -> bool:
            return annotated_phase() == phase

        assert annotated_phase() == "Running"
        for suspend, phase in ((True, "Suspended"), (False, "Running")):
            body = json.dumps({"spec": {"lifecycle": {"suspend": suspend}}})
            stack.kubectl("patch", "ctask", name, "--type=merge", "-p", body)
            wait_until(partial(operator_says, phase), 120, f"the operator's phase {phase}")
        kinds = [str(op.kind) for op in stack.ledger.list_operations("default", name)]
        assert sorted(kinds) == ["pause", "resume"], kinds
        wait_until(lambda: "StatusCorrected" in reasons(stack, name), 60, "a correction")
        stack.wait_turns(pvc, 2, at_least=3)
        stack.kubectl("delete", "ctask", name, "--timeout=120s")
    finally:
        stopping.set()
        writer.join(10)
    [deleted] = [op for op in stack.ledger.list_operations("default", name)
                 if op.kind == "delete-drain"]  # fmt: skip
    assert deleted.state == "recorded", deleted
    kept = stack.ledger.get_checkpoint(str(deleted.checkpoint_ref))
    assert kept is not None and not kept.forced
    assert {a.agent_id: a.turns for a in kept.agents} == stack.turns_on_disk(pvc)


def absent(stack: DevStack, kind: str, name: str) -> bool:
    return stack.kubectl("get", kind, name, check=False).returncode != 0


def test_a_finalizer_removed_by_hand_while_draining_leaves_the_ledger_true(
    stack: DevStack,
) -> None:
    """Tried: a Running task deleted, and while its drain runs its finalizer removed by
    hand (kubectl patch), the operator held (SIGSTOP) from the drain's start until the
    task and its workspace PVC (which the task owns) are gone. The ledger must say what
    is left: the deletion's checkpoint either has a ready snapshot or is marked
    unavailable with its snapshot recorded failed, never "kept, snapshot pending" for a
    PVC that is gone (its snapshot was asked for afterwards and never became ready);
    the audit agrees."""
    name = "unfinalized"
    manifest = task_manifest(name, agents=1, model="turns=100000,turn_ms=200")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Running", timeout=120)
    stack.wait_turns(stack.pvc_of(name), 1, 2)
    pvc = stack.pvc_of(name)
    operator = stack.operator_pid()
    assert operator is not None
    stack.kubectl("delete", "ctask", name, "--wait=false")

    def draining() -> bool:
        ops = stack.ledger.list_operations("default", name, 5)
        return any(op.kind is OperationKind.DELETE_DRAIN for op in ops)

    wait_until(draining, 60, "the deletion's drain in the ledger", interval=0.005)
    # Held from the moment it sent the drain until the task and its PVC are gone, so
    # that the deletion it follows finds them gone when it goes on, as an operator busy
    # elsewhere would; the drain is answered and recorded meanwhile.
    os.kill(operator, signal.SIGSTOP)
    try:
        stack.kubectl("patch", "ctask", name, "--type=json",
                      "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')  # fmt: skip
        for kind, what in (("ctask", name), ("pvc", pvc)):
            wait_until(partial(absent, stack, kind, what), 60, f"{kind} {what} to go")
    finally:
        os.kill(operator, signal.SIGCONT)

    def settled() -> Any:
        c = stack.ledger.latest_checkpoint("default", name)
        if c is None or c.snapshot_pending:
            return None
        return c if c.snapshot is not None or (c.snapshot_error and not c.available) else None

    checkpoint = wait_until(settled, 120, "the ledger to say what is left of the checkpoint")
    print(f"finalizer removed: checkpoint {checkpoint.ref} snapshot={checkpoint.snapshot} "
          f"error={checkpoint.snapshot_error} unavailable={checkpoint.unavailable}")  # fmt: skip
    assert stack.audit_findings() == []
