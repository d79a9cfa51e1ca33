"""A cluster whose agent-sandbox predates v1beta1 (``drainctl dev up --sandbox-storage
v1alpha1``: v1alpha1 only, served and stored): a task naming no Sandbox version gets a
v1alpha1 Sandbox, paused and woken through ``spec.replicas``; one naming v1beta1 fails
before anything is created, saying what the cluster serves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, embedded_stack, task_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-alpha-", "--sandbox-storage", "v1alpha1") as dev:
        yield dev


def test_a_task_naming_no_version_gets_a_v1alpha1_sandbox_suspended_through_replicas(
    stack: DevStack,
) -> None:
    manifest = task_manifest("old", agents=1, model="turns=100000,turn_ms=50")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "old", "Running")
    assert stack.status("default", "old")["sandboxApiVersion"] == "agents.x-k8s.io/v1alpha1"
    sbx = sandbox_name("old")
    assert stack.sandbox_field(sbx, "{.spec.replicas}", version="v1alpha1") == "1"
    unserved = stack.kubectl("get", "sandboxes.v1beta1.agents.x-k8s.io", check=False)
    assert unserved.returncode != 0

    stack.kubectl("patch", "ctask", "old", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "old", "Suspended")
    assert stack.sandbox_field(sbx, "{.spec.replicas}", version="v1alpha1") == "0"
    stack.kubectl("patch", "ctask", "old", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", "old", "Running")
    assert stack.sandbox_field(sbx, "{.spec.replicas}", version="v1alpha1") == "1"
    stack.kubectl("delete", "ctask", "old", timeout=120)


def test_a_task_naming_v1beta1_where_it_is_not_served_fails_before_it_starts(
    stack: DevStack,
) -> None:
    manifest = task_manifest("beta-on-alpha", agents=1)
    manifest["spec"]["sandbox"] = {"apiVersion": "agents.x-k8s.io/v1beta1"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "beta-on-alpha", "Failed", timeout=60)
    status = stack.status("default", "beta-on-alpha")
    assert (
        "spec.sandbox.apiVersion agents.x-k8s.io/v1beta1 is not served by this cluster "
        "(served: v1alpha1)" in status["message"]
    )
    listed = stack.kubectl("get", "sandboxes.v1alpha1.agents.x-k8s.io", "-o", "name").stdout
    assert "beta-on-alpha" not in listed
    stack.kubectl("delete", "ctask", "beta-on-alpha", timeout=60)
