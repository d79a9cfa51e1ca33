"""Sandboxes provisioned elsewhere (``drainctl operator --existing-sandboxes``), as on a
cluster where caliban-operator makes each task's Sandbox ``<task>-sbx``: the operator
waits for that Sandbox, runs the task in it, drains, suspends and resumes it, and never
creates a Sandbox, a PVC or any other child. With the real kubectl against the dev
stack, a Redis broker of this machine and a SQLite ledger; the Sandbox is made here by
hand, as the other controller would make it."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.operator.crd import TASK_LABEL, sandbox_name
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import redis_db_url
from tests.support import wait_until

pytestmark = pytest.mark.slow

SANDBOXES = "sandboxes.v1alpha1.agents.x-k8s.io"
NAME = "elsewhere"


@pytest.fixture(scope="module")
def broker() -> str:
    return redis_db_url(db=6)


@pytest.fixture(scope="module")
def stack(broker: str) -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-existing-", dir="/tmp"))
    dev = DevStack(root, broker, f"sqlite:///{root / 'ledger.db'}",
                   env={"DRAIN_EXISTING_SANDBOXES": "true"})  # fmt: skip
    try:
        yield dev
        assert dev.ledger_contradictions() == []
    finally:
        dev.close()


def names(stack: DevStack, kind: str) -> list[str]:
    listed = stack.kubectl("get", kind, "-n", "default", "-o", "name").stdout
    return sorted(line.rsplit("/", 1)[-1] for line in listed.split())


def replicas(stack: DevStack, name: str) -> str:
    return stack.kubectl("get", SANDBOXES, name, "-o", "jsonpath={.spec.replicas}").stdout


def patch_suspend(stack: DevStack, suspend: bool) -> None:
    body = json.dumps({"spec": {"lifecycle": {"suspend": suspend}}})
    stack.kubectl("patch", "ctask", NAME, "-n", "default", "--type=merge", "-p", body)


def sandbox_made_elsewhere(uid: str, broker: str) -> list[dict[str, Any]]:
    """The PVC and the Sandbox another controller would make for task ``NAME``: its pod
    runs the daemon on the task's queue, bound to its uid, on that PVC."""
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": f"{NAME}-ws", "namespace": "default"},
           "spec": {"accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    daemon = {
        "name": "caliband", "image": "caliban-drain:dev", "command": ["drainctl"],
        "args": ["daemon", "--store", "/workspace", "--socket", "/run/caliband/ctl.sock",
                 "--queue", f"caliband.default.{NAME}", "--task-uid", uid,
                 "--initial-agents", "2", "--initial-provider", "scripted",
                 "--initial-model", "turns=100000,turn_ms=100"],
        # The task's key, which the operator writes for a task it runs (the dev stack
        # signs daemon messages): what the other controller's pod must read too.
        "env": [{"name": "DRAIN_BROKER_URL", "value": broker},
                {"name": "DRAIN_TASK_KEY", "valueFrom": {"secretKeyRef": {
                    "name": f"{NAME}-key-{uid}", "key": "key"}}}],
        "volumeMounts": [{"name": "workspace", "mountPath": "/workspace"},
                         {"name": "run", "mountPath": "/run/caliband"}],
    }  # fmt: skip
    sandbox = {
        "apiVersion": "agents.x-k8s.io/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": sandbox_name(NAME), "namespace": "default"},
        "spec": {"replicas": 1, "podTemplate": {
            "metadata": {"labels": {TASK_LABEL: NAME}},
            "spec": {"containers": [daemon], "volumes": [
                {"name": "workspace", "persistentVolumeClaim": {"claimName": f"{NAME}-ws"}},
                {"name": "run", "emptyDir": {}},
            ]},
        }},
    }  # fmt: skip
    return [pvc, sandbox]


def test_a_task_runs_in_the_sandbox_made_elsewhere_and_never_gets_one_made(
    stack: DevStack, broker: str
) -> None:
    assert stack.apply(task_manifest(NAME, agents=2)).returncode == 0

    def not_found() -> dict[str, Any] | None:
        conditions = stack.status("default", NAME).get("conditions") or []
        found = next((c for c in conditions if c["type"] == "SandboxFound"), None)
        return found if found and found["status"] == "False" else None

    missing = wait_until(not_found, 60, "SandboxFound=False on the task")
    assert missing["reason"] == "SandboxNotFound" and f"{NAME}-sbx" in missing["message"]
    assert stack.status("default", NAME)["phase"] == "Pending"
    assert names(stack, SANDBOXES) == [] and names(stack, "pvc") == []

    uid = stack.task("default", NAME)["metadata"]["uid"]  # type: ignore[index]
    for manifest in sandbox_made_elsewhere(uid, broker):
        assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", NAME, "Running", timeout=120)
    status = stack.status("default", NAME)
    assert (status["sandboxName"], status["pvcName"]) == (f"{NAME}-sbx", f"{NAME}-ws")
    stack.wait_turns(f"{NAME}-ws", 2, at_least=1)

    patch_suspend(stack, True)
    stack.wait_phase("default", NAME, "Suspended", timeout=120)
    assert replicas(stack, f"{NAME}-sbx") == "0"
    frozen = stack.turns_on_disk(f"{NAME}-ws")
    checkpoint = stack.ledger.get_checkpoint(stack.status("default", NAME)["checkpointRef"])
    assert checkpoint is not None and {a.agent_id: a.turns for a in checkpoint.agents} == frozen
    patch_suspend(stack, False)
    stack.wait_phase("default", NAME, "Running", timeout=120)
    assert replicas(stack, f"{NAME}-sbx") == "1"
    wait_until(
        lambda: all(stack.turns_on_disk(f"{NAME}-ws")[i] > t for i, t in frozen.items()), 60,
        "every agent to continue after the pause",
    )  # fmt: skip

    stack.kubectl("delete", "ctask", NAME, timeout=120)
    deleted = stack.ledger.latest_checkpoint("default", NAME)
    assert deleted is not None and deleted.reason == "delete" and deleted.verified
    # Nothing of the task's was made by the operator, so nothing goes with it.
    assert names(stack, SANDBOXES) == [f"{NAME}-sbx"]
    assert names(stack, "pvc") == [f"{NAME}-ws"]
    assert names(stack, "serviceaccounts").count(f"{NAME}-sa") == 0
    stack.kubectl("delete", SANDBOXES, f"{NAME}-sbx", timeout=60)
