"""Who may create a CalibanTask gets agents in a sandbox, not a pod of their choosing: the
real kubectl against the dev stack's embedded defaults (embedded API and broker, SQLite
ledger in a temp dir), the real operator.

What was tried, as a hostile task author: ``hostNetwork``, a ``hostPath`` of ``/`` and a
privileged extra container in ``spec.sandbox.podTemplate`` (kubectl's strict field
validation refuses each, naming it; with ``--validate=false`` the API prunes them and
the Sandbox carries none); a label in the operator's own domain and an image not on
``DRAIN_ALLOWED_IMAGES`` (the task fails, ``SpecValid=False`` naming the field, and no
Sandbox is created). A plain task's pod runs restricted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.operator import crd
from tests.e2e.support import DevStack, embedded_stack, task_manifest

pytestmark = pytest.mark.slow

HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("host-network", {"spec": {"hostNetwork": True}}, "hostNetwork"),
    ("host-path", {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
     "volumes"),
    ("privileged-container", {"spec": {"containers": [{
        "name": "caliband", "securityContext": {"privileged": True}}]}}, "securityContext"),
]  # fmt: skip


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-tenant-") as dev:
        yield dev


def hostile_task(name: str, template: dict[str, Any]) -> dict[str, Any]:
    manifest = task_manifest(name, agents=1)
    manifest["spec"]["sandbox"] = {"podTemplate": template}
    return manifest


def sandbox_json(stack: DevStack, name: str) -> str | None:
    got = stack.kubectl("get", "sandbox", crd.sandbox_name(name), "-o", "json", check=False)
    return got.stdout if got.returncode == 0 else None


@pytest.mark.parametrize(("template", "field"), [(t, f) for _, t, f in HOSTILE],
                         ids=[i for i, _, _ in HOSTILE])  # fmt: skip
def test_kubectl_refuses_a_hostile_pod_template_naming_the_field(
    stack: DevStack, template: dict[str, Any], field: str
) -> None:
    refused = stack.apply(hostile_task("hostile", template))
    assert refused.returncode != 0
    assert "unknown field" in refused.stderr and field in refused.stderr, refused.stderr
    assert stack.task("default", "hostile") is None


def test_what_the_schema_prunes_never_reaches_the_sandbox(stack: DevStack) -> None:
    template: dict[str, Any] = {"spec": {"nodeSelector": {"pool": "agents"}}}
    for _, hostile, _ in HOSTILE:
        for key, value in hostile["spec"].items():
            template["spec"].setdefault(key, value)
    manifest = hostile_task("pruned", template)
    applied = stack.kubectl(
        "apply", "--validate=false", "-f", "-", stdin=json.dumps(manifest), check=False
    )
    assert applied.returncode == 0, applied.stderr
    stack.wait_phase("default", "pruned", "Running", timeout=120)
    sandbox = json.loads(str(sandbox_json(stack, "pruned")))
    pod = sandbox["spec"]["podTemplate"]["spec"]
    assert pod["nodeSelector"] == {"pool": "agents"}  # what the allow-list takes
    assert "hostNetwork" not in pod
    assert all("hostPath" not in v for v in pod["volumes"])
    [daemon] = pod["containers"]
    assert daemon["securityContext"] == crd.CONTAINER_SECURITY_CONTEXT
    assert pod["securityContext"] == crd.POD_SECURITY_CONTEXT


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("own-label", {"sandbox": {"podTemplate": {"metadata": {"labels": {
            crd.TASK_LABEL: "another-task"}}}}}, "InvalidSandboxPodTemplateMetadataLabels"),
        ("any-image", {"task": {"agents": 1, "provider": "scripted", "image": "evil:latest"}},
         "InvalidTaskImage"),
    ],
)  # fmt: skip
def test_what_only_the_operator_can_tell_fails_the_task_before_anything_is_created(
    stack: DevStack, name: str, change: dict[str, Any], reason: str
) -> None:
    manifest = task_manifest(name, agents=1)
    manifest["spec"].update(change)
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", name, "Failed", timeout=60)
    valid = next(c for c in stack.status("default", name)["conditions"]
                 if c["type"] == "SpecValid")  # fmt: skip
    assert (valid["status"], valid["reason"]) == ("False", reason), valid
    assert any(e["reason"] == reason and e["type"] == "Warning" for e in stack.events_of(name))
    assert sandbox_json(stack, name) is None


def test_upstream_fields_are_honoured_or_said_not_to_be(stack: DevStack) -> None:
    """caliban-operator's fields, as a user of it writes them: the runtime class reaches
    the pod; a field this operator does not act on is named in a condition and an event;
    what upstream's schema refuses is refused by the API, naming the field."""
    manifest = task_manifest("sandboxed", agents=1)
    manifest["spec"]["isolation"] = {"runtimeClass": "gvisor"}
    manifest["spec"]["task"]["agentType"] = "planner"
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "sandboxed", "Running", timeout=120)
    sandbox = json.loads(str(sandbox_json(stack, "sandboxed")))
    assert sandbox["spec"]["podTemplate"]["spec"]["runtimeClassName"] == "gvisor"
    honoured = next(c for c in stack.status("default", "sandboxed")["conditions"]
                    if c["type"] == "SpecHonoured")  # fmt: skip
    assert (honoured["status"], honoured["reason"]) == ("False", "NotHonoured"), honoured
    assert "spec.task.agentType" in honoured["message"]
    warned = [e for e in stack.events_of("sandboxed") if e["reason"] == "SpecNotHonoured"]
    assert len(warned) == 1 and "spec.task.agentType" in warned[0]["message"]

    empty = task_manifest("no-prompt", agents=1)
    empty["spec"]["task"]["prompt"] = ""
    refused = stack.apply(empty)
    assert refused.returncode != 0 and "spec.task.prompt" in refused.stderr, refused.stderr
    missing = task_manifest("no-task", agents=1)
    del missing["spec"]["task"]
    refused = stack.apply(missing)
    assert refused.returncode != 0 and "spec.task" in refused.stderr, refused.stderr
