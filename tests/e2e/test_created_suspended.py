"""A task created with ``spec.lifecycle.suspend: true`` starts nothing until resumed, as
a Kubernetes Job created suspended never starts a pod: with the real kubectl against the
dev stack's embedded defaults (embedded API and broker, SQLite ledger in a temp dir).

"Nothing" is checked over several reconcile passes, counted by ``observedGeneration``
(``DevStack.watch_passes``): each spec edit bumps ``metadata.generation``, and the
operator writes the generation it saw only from a pass over the object, so waiting for it
proves a pass ran since.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.operator.crd import WAKE_ANNOTATION, sandbox_name
from orchestrator.operator.lifecycle import CREATED_SUSPENDED
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow

PASSES = 4
"""Reconcile passes a suspended task is watched for before it is resumed."""


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-suspended-") as dev:
        yield dev


def suspended(name: str, agents: int = 2, ref: str | None = None) -> dict[str, Any]:
    manifest = task_manifest(name, agents=agents, suspend=True)
    if ref is not None:
        manifest["spec"]["resumeFrom"] = {"checkpointRef": ref}
    return manifest


def patch_lifecycle(stack: DevStack, name: str, **fields: Any) -> None:
    body = json.dumps({"spec": {"lifecycle": fields}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)


def ready_of(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c.get("type") == "Ready")


def assert_nothing_started(stack: DevStack, name: str, says: str = "created suspended") -> None:
    status = stack.status("default", name)
    assert status["phase"] == "Suspended", status
    assert status["pausedBy"] == CREATED_SUSPENDED
    assert status["agents"] == 0
    assert says in status["message"], status["message"]
    assert "pvcName" not in status and "lastOperation" not in status, status
    ready = ready_of(status)
    assert (ready["status"], ready["reason"]) == ("False", "Paused"), ready
    assert ready["message"].startswith("created suspended: nothing started"), ready
    got = stack.kubectl("get", "sandbox", sandbox_name(name), "-n", "default", check=False)
    assert got.returncode != 0 and "NotFound" in got.stderr, (got.stdout, got.stderr)
    pvcs = json.loads(stack.kubectl("get", "pvc", "-n", "default", "-o", "json").stdout)
    owned = [
        p["metadata"]["name"]
        for p in pvcs["items"]
        if name in {o.get("name") for o in p["metadata"].get("ownerReferences") or []}
    ]
    assert owned == []
    assert stack.ledger.list_operations("default", name) == []
    assert stack.ledger.get_activity("default", name) is None  # no daemon ever reported


def test_a_task_created_suspended_starts_nothing_until_suspend_is_false(stack: DevStack) -> None:
    name = "held-1"
    assert stack.apply(suspended(name)).returncode == 0
    stack.wait_phase("default", name, "Suspended")
    stack.watch_passes(name, PASSES)
    assert_nothing_started(stack, name)

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Running")
    status = wait_until(
        lambda: (s := stack.status("default", name)).get("agents") == 2 and s, 90, "2 agents"
    )  # fmt: skip
    assert status.get("pausedBy") is None
    assert ready_of(status)["status"] == "True"
    # A fresh start: its initial agents, no resume of a checkpoint it never had.
    assert stack.ledger.list_operations("default", name) == []
    assert "checkpointRef" not in status
    stack.kubectl("get", "sandbox", sandbox_name(name), "-n", "default")
    activity = stack.ledger.get_activity("default", name)
    assert activity is not None and activity.agents_live == 2


def test_deleting_a_task_created_suspended_releases_it_with_no_checkpoint(
    stack: DevStack,
) -> None:
    name = "held-2"
    assert stack.apply(suspended(name)).returncode == 0
    stack.wait_phase("default", name, "Suspended")
    stack.kubectl("delete", "ctask", name, "-n", "default", "--timeout=60s")
    assert stack.task("default", name) is None
    assert stack.ledger.list_checkpoints("default", name) == []
    assert stack.ledger.list_operations("default", name) == []
    released = [e for e in stack.events_of(name) if e["reason"] == "NothingToDrain"]
    assert [e["message"] for e in released] == [
        "its daemon never ran (no heartbeat, no daemon container started on its workspace): "
        "nothing to drain; not checkpointed"
    ]
    assert not [e for e in stack.events_of(name) if e["reason"] == "ForcedCheckpoint"]


def test_a_restore_created_suspended_restores_only_once_resumed(stack: DevStack) -> None:
    source, name = "held-src", "held-3"
    assert stack.apply(task_manifest(source, agents=1)).returncode == 0
    stack.wait_phase("default", source, "Running")
    stack.wait_turns(stack.pvc_of(source), 1, 2)
    stack.kubectl("delete", "ctask", source, "-n", "default", timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", source)
    assert checkpoint is not None and checkpoint.verified
    retained = json.loads(
        stack.kubectl("get", "pvc", str(checkpoint.pvc_name), "-o", "json").stdout
    )  # fmt: skip
    owners_before = retained["metadata"].get("ownerReferences") or []

    assert stack.apply(suspended(name, agents=1, ref=checkpoint.ref)).returncode == 0
    stack.wait_phase("default", name, "Suspended")
    stack.watch_passes(name, PASSES)
    assert_nothing_started(stack, name)
    assert f"restore checkpoint {checkpoint.ref}" in stack.status("default", name)["message"]
    # The retained workspace is not claimed by a task that runs nothing.
    now = json.loads(stack.kubectl("get", "pvc", str(checkpoint.pvc_name), "-o", "json").stdout)
    assert (now["metadata"].get("ownerReferences") or []) == owners_before

    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Running")
    status = stack.status("default", name)
    assert status["checkpointRef"] == checkpoint.ref
    assert status["lastOperation"]["kind"] == "restore"
    assert status["lastOperation"]["state"] == "resumed", status["lastOperation"]
    restores = [op.kind for op in stack.ledger.list_operations("default", name)]
    assert [str(k) for k in restores] == ["restore"]


def test_a_task_created_suspended_from_an_unknown_checkpoint_fails_at_once(
    stack: DevStack,
) -> None:
    """Bad input is reported when the task is created, not when it is resumed."""
    name = "held-bad"
    assert stack.apply(suspended(name, ref="no-such-checkpoint")).returncode == 0
    stack.wait_phase("default", name, "Failed")
    status = stack.status("default", name)
    assert "unknown checkpoint ref 'no-such-checkpoint'" in status["message"]
    assert stack.ledger.list_operations("default", name) == []


def test_a_wake_on_a_task_held_by_suspend_is_refused_out_loud_and_spent(
    stack: DevStack,
) -> None:
    """Tried: the wake annotation (what an attach sets) on a task created suspended."""
    name = "held-wake"
    assert stack.apply(suspended(name, agents=1)).returncode == 0
    stack.wait_phase("default", name, "Suspended")
    stack.kubectl("annotate", "ctask", name, f"{WAKE_ANNOTATION}=attach-1")
    held = wait_until(
        lambda: [e for e in stack.events_of(name) if e["reason"] == "WakeHeld"], 60,
        "the WakeHeld warning",
    )  # fmt: skip
    assert [e["type"] for e in held] == ["Warning"]
    assert "wake 'attach-1' not applied: spec.lifecycle.suspend is true" in held[0]["message"]
    status = stack.status("default", name)
    assert status["lastWake"] == "attach-1"  # spent: it will not resume a later pause
    stack.watch_passes(name, 2)
    assert_nothing_started(stack, name, says="not applied: spec.lifecycle.suspend is true")
    assert len([e for e in stack.events_of(name) if e["reason"] == "WakeHeld"]) == 1
    patch_lifecycle(stack, name, suspend=False)
    stack.wait_phase("default", name, "Running")
