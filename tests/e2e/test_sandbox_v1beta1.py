"""The embedded cluster's default Sandbox API, agent-sandbox's CRD as released: it stores
v1beta1, serves v1alpha1 deprecated, and converts between them (the API's stand-in for
agent-sandbox's webhook). A task naming no version gets a v1beta1 Sandbox, paused and
woken through ``operatingMode``, which a v1alpha1 client reads as ``replicas``; one naming
v1alpha1 keeps it; the CRD's enum refuses an operating mode it does not know."""

from __future__ import annotations

import contextlib
import json
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
    dev = DevStack(root, redis_db_url(db=12), fresh_postgres())  # the default: v1beta1
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


@contextlib.contextmanager
def no_conversion_webhook(stack: DevStack) -> Iterator[None]:
    """The Sandbox CRD without its conversion webhook (strategy None) meanwhile, as on a
    cluster whose agent-sandbox webhook is not configured; put back afterwards."""
    crd = "customresourcedefinition/sandboxes.agents.x-k8s.io"
    kept = stack.kubectl("get", crd, "-o", "jsonpath={.spec.conversion}").stdout
    assert json.loads(kept)["strategy"] == "Webhook"
    stack.kubectl("patch", crd, "--type", "merge", "-p",
                  '{"spec": {"conversion": {"strategy": "None", "webhook": null}}}')  # fmt: skip
    try:
        yield
    finally:
        stack.kubectl("patch", crd, "--type", "merge", "-p",
                      json.dumps({"spec": {"conversion": json.loads(kept)}}))  # fmt: skip


def test_a_task_naming_a_sandbox_version_the_cluster_does_not_store_fails_before_it_starts(
    stack: DevStack,
) -> None:
    """Tried: ``spec.sandbox.apiVersion: agents.x-k8s.io/v1alpha1`` on a cluster that stores
    v1beta1 with no conversion webhook: its pause would set ``replicas: 0``, which the
    controller never reads, and the task would say Suspended while its daemon ran on."""
    manifest = task_manifest("alpha-on-beta", agents=1)
    manifest["spec"]["sandbox"] = {"apiVersion": "agents.x-k8s.io/v1alpha1"}
    with no_conversion_webhook(stack):
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


def test_a_task_naming_no_version_gets_a_v1beta1_sandbox_which_v1alpha1_reads_as_replicas(
    stack: DevStack,
) -> None:
    manifest = task_manifest("plain", agents=1, model="turns=100000,turn_ms=50")
    assert "sandbox" not in manifest["spec"]
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "plain", "Running")
    status = stack.status("default", "plain")
    assert status["sandboxApiVersion"] == "agents.x-k8s.io/v1beta1"
    sbx = sandbox_name("plain")

    def seen() -> tuple[str, str]:
        """(v1beta1's ``operatingMode``, v1alpha1's ``replicas``) of the one Sandbox."""
        return (stack.sandbox_field(sbx, "{.spec.operatingMode}", version="v1beta1"),
                stack.sandbox_field(sbx, "{.spec.replicas}", version="v1alpha1"))  # fmt: skip

    assert stack.sandbox_field(sbx, "{.apiVersion}", version="v1beta1") == (
        "agents.x-k8s.io/v1beta1"
    )
    assert seen() == ("Running", "1")
    # v1alpha1 is served deprecated: kubectl says so, as against a cluster.
    alpha = stack.kubectl("get", "sandboxes.v1alpha1.agents.x-k8s.io", sbx)
    assert alpha.stderr.strip() == (
        "Warning: agents.x-k8s.io/v1alpha1 Sandbox is deprecated; use "
        "agents.x-k8s.io/v1beta1 Sandbox instead"
    )
    # agent-sandbox's own printer columns.
    header = stack.kubectl("get", "sandboxes.v1beta1.agents.x-k8s.io", sbx).stdout.split("\n")[0]
    assert header.split() == ["NAME", "READY", "REASON", "AGE"]
    pvc = stack.pvc_of("plain")

    stack.kubectl("patch", "ctask", "plain", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "plain", "Suspended")
    assert seen() == ("Suspended", "0")
    assert stack.sandbox_field(sbx, "{.status.replicas}", version="v1alpha1") == "0"
    wait_until(
        lambda: "sandbox_pod_stopped sandbox=default/plain-sbx" in stack.log.read_text(),
        60,
        "the stand-in controller to stop the suspended Sandbox's daemon",
    )
    [agent] = stack.agent_dirs("default", pvc)
    paused_at = load_session(agent).turns

    stack.kubectl("patch", "ctask", "plain", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": false}}}')  # fmt: skip
    stack.wait_phase("default", "plain", "Running")
    assert seen() == ("Running", "1")
    wait_until(lambda: load_session(agent).turns > paused_at, 60, "the agent to continue")
    # Pinned: the task keeps the version it was created with.
    assert stack.status("default", "plain")["sandboxApiVersion"] == "agents.x-k8s.io/v1beta1"
    stack.kubectl("delete", "ctask", "plain", timeout=120)


def test_a_task_naming_v1alpha1_suspends_through_replicas_which_the_cluster_converts(
    stack: DevStack,
) -> None:
    manifest = task_manifest("alpha", agents=1, model="turns=100000,turn_ms=50")
    manifest["spec"]["sandbox"] = {"apiVersion": "agents.x-k8s.io/v1alpha1"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "alpha", "Running")
    assert stack.status("default", "alpha")["sandboxApiVersion"] == "agents.x-k8s.io/v1alpha1"
    sbx = sandbox_name("alpha")
    stack.kubectl("patch", "ctask", "alpha", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "alpha", "Suspended")
    assert stack.sandbox_field(sbx, "{.spec.replicas}", version="v1alpha1") == "0"
    # Stored as v1beta1: the controller, reading that, sees it suspended and stops it.
    assert stack.sandbox_field(sbx, "{.spec.operatingMode}", version="v1beta1") == "Suspended"
    wait_until(
        lambda: "sandbox_pod_stopped sandbox=default/alpha-sbx" in stack.log.read_text(),
        60,
        "the stand-in controller to stop the suspended Sandbox's daemon",
    )
    stack.kubectl("delete", "ctask", "alpha", timeout=120)


def test_an_operating_mode_the_crd_does_not_know_is_refused_in_one_line(
    stack: DevStack,
) -> None:
    bad = {
        "apiVersion": "agents.x-k8s.io/v1beta1", "kind": "Sandbox",
        "metadata": {"name": "paused", "namespace": "default"},
        "spec": {"operatingMode": "Paused", "podTemplate": {"spec": {"containers": [
            {"name": "c", "image": "caliban-drain:dev"}]}}},
    }  # fmt: skip
    refused = stack.apply(bad)
    assert refused.returncode != 0
    said = [line for line in refused.stderr.splitlines() if line.strip()]
    # The CRD has validation rules, which a server does not evaluate on an object its
    # schema refused: it says so as a second cause, as kube-apiserver does.
    assert said == [
        'The Sandbox "paused" is invalid: ',
        '* spec.operatingMode: Unsupported value: "Paused": supported values: "Running", '
        '"Suspended"',
        '* <nil>: Invalid value: "null": some validation rules were not checked because the '
        "object was invalid; correct the existing errors to complete validation",
    ], refused.stderr
    listed = stack.kubectl("get", "sandboxes.v1beta1.agents.x-k8s.io", "-o", "name").stdout
    assert "paused" not in listed
