"""caliban-operator's Sandbox conventions, with the real kubectl against the dev stack's
embedded defaults: the Sandbox the operator makes is ``<task>-sbx``, and a task whose
``spec.sandbox.name`` names an existing Sandbox is run, suspended and resumed on that one,
with no second Sandbox ever made for it; the task's ``spec.sandbox.podTemplate`` is merged
under the operator's pod template. Everything the operator creates says it manages it
(``app.kubernetes.io/managed-by``), and the pod, which it does not make, does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.operator.crd import TASK_LABEL, sandbox_name
from tests.e2e.support import DevStack, Watch, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow

SANDBOXES = "sandboxes.v1beta1.agents.x-k8s.io"  # what a task with no apiVersion gets


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-children-") as dev:
        yield dev


def sandbox_names(stack: DevStack) -> list[str]:
    listed = stack.kubectl("get", SANDBOXES, "-n", "default", "-o", "name").stdout
    return sorted(line.rsplit("/", 1)[-1] for line in listed.split())


def condition(stack: DevStack, name: str, type_: str) -> dict[str, Any] | None:
    conditions = stack.status("default", name).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def operating_mode(stack: DevStack, name: str) -> str:
    """How the Sandbox ``name`` is asked to run, at v1beta1: the version a task with no
    ``spec.sandbox.apiVersion`` talks to it in on the embedded cluster."""
    return stack.sandbox_field(name, "{.spec.operatingMode}", version="v1beta1")


def patch_suspend(stack: DevStack, name: str, suspend: bool) -> None:
    body = json.dumps({"spec": {"lifecycle": {"suspend": suspend}}})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)


def test_the_operator_names_its_sandbox_task_sbx_and_runs_an_existing_one_it_is_given(
    stack: DevStack,
) -> None:
    donor_manifest = task_manifest("donor", agents=1, model="turns=2,turn_ms=20")
    donor_manifest["spec"]["task"]["env"] = [{"name": "TEAM", "value": "blue"}]
    # The user's pod template goes under ours: its additions kept (what it may not set,
    # the pod's identity and our labels among them, is refused: test_tenant_pod.py).
    donor_manifest["spec"]["sandbox"] = {"podTemplate": {
        "metadata": {"labels": {"team": "blue"}},
        "spec": {"nodeSelector": {"pool": "agents"},
                 "containers": [{"name": "caliband",
                                 "resources": {"limits": {"memory": "2Gi"}}}]},
    }}  # fmt: skip
    assert stack.apply(donor_manifest).returncode == 0
    stack.wait_phase("default", "donor", "Running", timeout=120)
    assert stack.status("default", "donor")["sandboxName"] == "donor-sbx" == sandbox_name("donor")
    donor = json.loads(stack.kubectl("get", SANDBOXES, "donor-sbx", "-o", "json").stdout)
    assert "donor" not in sandbox_names(stack)
    # The pod runs as the task's own ServiceAccount: no token, owned by the task.
    task_uid = stack.task("default", "donor")["metadata"]["uid"]  # type: ignore[index]
    assert donor["spec"]["podTemplate"]["spec"]["serviceAccountName"] == "donor-sa"
    # Its default-deny NetworkPolicy, owned by the task: metrics in; DNS and the broker out.
    policy = json.loads(stack.kubectl("get", "netpol", "donor-netpol", "-o", "json").stdout)
    assert [o["uid"] for o in policy["metadata"]["ownerReferences"]] == [task_uid]
    assert policy["spec"]["podSelector"] == {"matchLabels": {TASK_LABEL: "donor"}}
    assert len(policy["spec"]["egress"]) == 2  # DNS, the broker: no Workspace to reach
    # What the Sandbox's controller reports is on the task.
    ready = wait_until(lambda: condition(stack, "donor", "SandboxReady"), 60,
                       "the SandboxReady condition")  # fmt: skip
    assert (ready["status"], ready["reason"]) == ("True", "DependenciesReady"), ready
    fqdn = stack.status("default", "donor")["serviceFQDN"]
    assert fqdn == "donor-sbx.default.svc.cluster.local" == donor["status"]["serviceFQDN"]
    pod = donor["spec"]["podTemplate"]
    assert pod["metadata"]["labels"]["team"] == "blue"
    assert pod["metadata"]["labels"][TASK_LABEL] == "donor"
    assert pod["spec"]["nodeSelector"] == {"pool": "agents"}
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"memory": "2Gi"}}
    env = donor["spec"]["podTemplate"]["spec"]["containers"][0]["env"]
    assert env[-1] == {"name": "TEAM", "value": "blue"}
    sa = json.loads(stack.kubectl("get", "serviceaccount", "donor-sa", "-o", "json").stdout)
    assert sa["automountServiceAccountToken"] is False
    assert [o["uid"] for o in sa["metadata"]["ownerReferences"]] == [task_uid]

    # A task told to run in a Sandbox that does not exist yet: said so, nothing made.
    manifest = task_manifest("byhand", agents=1, model="turns=100000,turn_ms=100")
    manifest["spec"]["sandbox"] = {"name": "byhand-own"}
    assert stack.apply(manifest).returncode == 0
    missing = wait_until(lambda: condition(stack, "byhand", "SandboxFound"), 60,
                         "the SandboxFound condition")  # fmt: skip
    assert (missing["status"], missing["reason"]) == ("False", "SandboxNotFound"), missing
    assert "byhand-own" in missing["message"]
    assert [e["reason"] for e in stack.events_of("byhand") if e["type"] == "Warning"] == [
        "SandboxNotFound"
    ]
    assert stack.status("default", "byhand")["phase"] == "Pending"
    assert sandbox_names(stack) == ["donor-sbx"]

    # The user's Sandbox appears (the donor's pod template, bound to byhand's queue and
    # uid, on its own PVC): the task runs in it.
    uid = stack.task("default", "byhand")["metadata"]["uid"]  # type: ignore[index]
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": "byhand-ws", "namespace": "default"},
           "spec": {"accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    assert stack.apply(pvc).returncode == 0
    template = donor["spec"]["podTemplate"]
    args = template["spec"]["containers"][0]["args"]
    args[args.index("--queue") + 1] = "caliband.default.byhand"
    args[args.index("--task-uid") + 1] = uid
    for variable in template["spec"]["containers"][0]["env"]:  # byhand's key, not the donor's
        if variable["name"] == "DRAIN_TASK_KEY":
            variable["valueFrom"]["secretKeyRef"]["name"] = f"byhand-key-{uid}"
    for volume in template["spec"]["volumes"]:
        if "persistentVolumeClaim" in volume:
            volume["persistentVolumeClaim"]["claimName"] = "byhand-ws"
    template["metadata"]["labels"][TASK_LABEL] = "byhand"
    own = {"apiVersion": donor["apiVersion"], "kind": "Sandbox",
           "metadata": {"name": "byhand-own", "namespace": "default"},
           "spec": {"operatingMode": "Running", "podTemplate": template}}  # fmt: skip
    assert stack.apply(own).returncode == 0
    stack.wait_phase("default", "byhand", "Running", timeout=120)
    status = stack.status("default", "byhand")
    assert (status["sandboxName"], status["pvcName"]) == ("byhand-own", "byhand-ws")
    found = condition(stack, "byhand", "SandboxFound")
    assert found is not None and found["status"] == "True", found

    # Suspended and resumed on that Sandbox; never a second one.
    patch_suspend(stack, "byhand", True)
    stack.wait_phase("default", "byhand", "Suspended", timeout=120)
    assert stack.task_sandbox_version("byhand") == "v1beta1"
    assert operating_mode(stack, "byhand-own") == "Suspended"
    assert sandbox_names(stack) == ["byhand-own", "donor-sbx"]
    patch_suspend(stack, "byhand", False)
    stack.wait_phase("default", "byhand", "Running", timeout=120)
    assert operating_mode(stack, "byhand-own") == "Running"
    assert sandbox_names(stack) == ["byhand-own", "donor-sbx"]

    # Deleted: drained, and the Sandbox it did not make is left where it was.
    stack.kubectl("delete", "ctask", "byhand", timeout=120)
    assert sandbox_names(stack) == ["byhand-own", "donor-sbx"]
    stack.kubectl("delete", SANDBOXES, "byhand-own", timeout=60)
    stack.kubectl("delete", "ctask", "donor", timeout=120)


def test_a_sandbox_that_never_becomes_ready_shows_on_the_task_with_its_reason(
    stack: DevStack,
) -> None:
    manifest = task_manifest("stuck", agents=1, model="turns=2,turn_ms=20")
    manifest["spec"]["sandbox"] = {"name": "stuck-own"}
    assert stack.apply(manifest).returncode == 0
    # Its pod's container reads a key of a Secret that does not exist: kubelet (and the
    # stand-in) never start it, and the Sandbox stays not Ready.
    container = {"name": "caliband", "image": "caliban-drain:dev", "command": ["drainctl"],
                 "args": ["daemon"],
                 "env": [{"name": "CALIBAN_API_KEY", "valueFrom": {"secretKeyRef": {
                     "name": "no-such-secret", "key": "api-key"}}}]}  # fmt: skip
    own = {"apiVersion": "agents.x-k8s.io/v1alpha1", "kind": "Sandbox",
           "metadata": {"name": "stuck-own", "namespace": "default"},
           "spec": {"replicas": 1, "podTemplate": {
               "metadata": {"labels": {TASK_LABEL: "stuck"}},
               "spec": {"containers": [container]}}}}  # fmt: skip
    assert stack.apply(own).returncode == 0

    def not_ready() -> dict[str, Any] | None:
        found = condition(stack, "stuck", "SandboxReady")
        return found if found is not None and found["status"] == "False" else None

    seen = wait_until(not_ready, 90, "SandboxReady=False on the task")
    assert seen["reason"] == "DependenciesNotReady", seen
    assert "no-such-secret" in seen["message"] and "stuck-own" in seen["message"], seen
    assert stack.status("default", "stuck")["phase"] == "Provisioning"
    stack.kubectl("delete", "ctask", "stuck", "--wait=false", timeout=60)
    stack.kubectl("delete", SANDBOXES, "stuck-own", timeout=60)


MANAGED_BY = "app.kubernetes.io/managed-by=caliban-drain"
LABEL_PATH = r"{.metadata.labels.app\.kubernetes\.io/managed-by}"


def managed(stack: DevStack, kind: str) -> list[str]:
    """The objects of ``kind`` in the default namespace that say caliban-drain manages
    them, as a label selector finds them."""
    listed = stack.kubectl("get", kind, "-n", "default", "-l", MANAGED_BY, "-o", "name").stdout
    return sorted(line.rsplit("/", 1)[-1] for line in listed.split())


def test_everything_the_operator_creates_says_caliban_drain_manages_it(
    stack: DevStack, tmp_path: Path
) -> None:
    """Sandbox, workspace PVC, ServiceAccount, NetworkPolicy, broker Secret, task key
    Secret, drain guard and the checkpoint's VolumeSnapshot carry
    ``app.kubernetes.io/managed-by: caliban-drain``; the pod, which the Sandbox's
    controller makes, does not."""
    name = "labelled"
    assert (
        stack.apply(task_manifest(name, agents=1, model="turns=100000,turn_ms=1500")).returncode
        == 0
    )
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    assert name + "-sbx" in managed(stack, SANDBOXES)
    assert pvc in managed(stack, "pvc")
    assert name + "-sa" in managed(stack, "serviceaccount")
    assert name + "-netpol" in managed(stack, "netpol")
    uid = stack.task("default", name)["metadata"]["uid"]  # type: ignore[index]
    secrets = set(managed(stack, "secret"))
    task_keys = {secret for secret in secrets if "-key-" in secret}
    assert secrets - task_keys == {"caliban-drain-broker"}
    assert f"{name}-key-{uid}" in task_keys
    template = json.loads(stack.kubectl("get", SANDBOXES, name + "-sbx", "-o", "json").stdout)
    assert (
        "app.kubernetes.io/managed-by" not in template["spec"]["podTemplate"]["metadata"]["labels"]
    )
    pods = json.loads(
        stack.kubectl("get", "pods", "-l", f"{TASK_LABEL}={name}", "-o", "json").stdout
    )
    assert pods["items"], "the stand-in controller's pod"
    assert all("app.kubernetes.io/managed-by" not in p["metadata"]["labels"] for p in pods["items"])

    # The drain guard lives while the pause drains: every version the watch saw of it.
    sentinel = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "watch-sentinel", "namespace": "default"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "none"}}},
    }  # fmt: skip
    assert stack.apply(sentinel).returncode == 0
    budgets = Watch(
        stack, tmp_path, "pdb", "-o", f'jsonpath={{.metadata.name}} {LABEL_PATH}{{"\\n"}}'
    )
    patch_suspend(stack, name, True)
    stack.wait_phase("default", name, "Suspended", timeout=180)
    guard = f"{name}-drain-guard"
    seen = wait_until(
        lambda: [line.split()[1:] for line in budgets.lines() if line.split()[0] == guard],
        30, "the drain guard in the watch",
    )  # fmt: skip
    budgets.close()
    assert seen and all(labels == ["caliban-drain"] for labels in seen), seen
    stack.kubectl("delete", "pdb", "watch-sentinel")
    # The pause's checkpoint copied the workspace to a VolumeSnapshot named by its ref.
    ref = stack.status("default", name)["checkpointRef"]
    wait_until(lambda: ref in managed(stack, "volumesnapshot"), 60, "the checkpoint's snapshot")
    stack.kubectl("delete", "ctask", name, timeout=120)
