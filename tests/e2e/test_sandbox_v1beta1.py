"""A cluster whose Sandbox API is v1beta1: pause and wake go through ``operatingMode``."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until
from worker_agent.session import load_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-e2e-b-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=12), fresh_postgres(), "--sandbox-storage", "v1beta1")
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


def test_a_task_naming_a_sandbox_version_the_cluster_does_not_store_fails_before_it_starts(
    stack: DevStack,
) -> None:
    """Tried: ``spec.sandbox.apiVersion: agents.x-k8s.io/v1alpha1`` on a cluster that stores
    v1beta1 with no conversion webhook: its pause would set ``replicas: 0``, which the
    controller never reads, and the task would say Suspended while its daemon ran on."""
    manifest = task_manifest("alpha-on-beta", agents=1)
    manifest["spec"]["sandbox"] = {"apiVersion": "agents.x-k8s.io/v1alpha1"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "alpha-on-beta", "Failed", timeout=60)
    status = stack.status("default", "alpha-on-beta")
    assert "stores Sandboxes as v1beta1 with no conversion webhook" in status["message"]
    assert "set spec.sandbox.apiVersion to agents.x-k8s.io/v1beta1" in status["message"]
    assert [c["reason"] for c in status["conditions"] if c["type"] == "SandboxCompatible"] == [
        "SandboxVersionMismatch"
    ]
    listed = stack.kubectl("get", "sandboxes.v1beta1.agents.x-k8s.io", "-o", "name").stdout
    assert "alpha-on-beta" not in listed
    stack.kubectl("delete", "ctask", "alpha-on-beta", timeout=60)


def test_v1beta1_sandbox_is_suspended_through_operating_mode(stack: DevStack) -> None:
    manifest = task_manifest("beta", agents=1, model="turns=100000,turn_ms=50")
    manifest["spec"]["sandbox"] = {"apiVersion": "agents.x-k8s.io/v1beta1"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "beta", "Running")
    pvc = wait_until(lambda: stack.status("default", "beta").get("pvcName"), 30, "the PVC")

    def mode() -> str:
        return stack.kubectl("get", "sandboxes.v1beta1.agents.x-k8s.io", sandbox_name("beta"), "-o",
                             "jsonpath={.spec.operatingMode}").stdout  # fmt: skip

    assert mode() == "Running"
    stack.kubectl("patch", "ctask", "beta", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "beta", "Suspended")
    assert mode() == "Suspended"
    wait_until(
        lambda: "sandbox_pod_stopped sandbox=default/beta-sbx" in stack.log.read_text(),
        60,
        "the stand-in controller to stop the suspended Sandbox's daemon",
    )
    [agent] = stack.agent_dirs("default", str(pvc))
    paused_at = load_session(agent).turns
    stack.kubectl("patch", "ctask", "beta", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", "beta", "Running")
    assert mode() == "Running"
    wait_until(lambda: load_session(agent).turns > paused_at, 60, "the agent to continue")
    stack.kubectl("delete", "ctask", "beta", timeout=120)
