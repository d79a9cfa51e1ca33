"""A running task's spec edits reach its pod, with the real kubectl against the dev
stack's embedded defaults: an edit of what the pod is made of (here its env) rolls it
(drain → checkpoint → new pod made from the spec → every agent continues from its
turns), an edit of what the daemon takes without a new pod rolls nothing, and a hand
edit of the task's Sandbox is undone by the operator's server-side apply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from orchestrator.operator import crd
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until
from worker_agent import layout
from worker_agent.k8s_names import is_dns1035_label

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-spec-edits-") as dev:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []


def patch_task(stack: DevStack, name: str, spec: dict[str, Any]) -> None:
    body = json.dumps({"spec": spec})
    stack.kubectl("patch", "ctask", name, "-n", "default", "--type=merge", "-p", body)


def task_pod(stack: DevStack, name: str) -> dict[str, Any] | None:
    listed = stack.kubectl(
        "get", "pods", "-n", "default", "-l", f"{crd.TASK_LABEL}={name}", "-o", "json"
    ).stdout
    live = [p for p in json.loads(listed)["items"] if not p["metadata"].get("deletionTimestamp")]
    return live[0] if len(live) == 1 else None


def condition(stack: DevStack, name: str, kind: str) -> dict[str, Any]:
    conditions = stack.status("default", name).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def daemon_environ(stack: DevStack, pvc: str) -> list[str]:
    environs = []
    for pid in stack.daemon_pids(pvc):
        try:
            variables = psutil.Process(pid).environ()
            environs.append("\n".join(f"{k}={v}" for k, v in variables.items()))
        except psutil.Error:
            continue
    return environs


def transcripts(stack: DevStack, pvc: str) -> list[Path]:
    return [layout.transcript_file(d) for d in stack.agent_dirs("default", pvc)]


def test_an_env_edit_rolls_the_pod_and_every_agent_continues_from_its_turns(
    stack: DevStack,
) -> None:
    name = "rolled"
    assert (
        stack.apply(task_manifest(name, agents=2, model="turns=100000,turn_ms=200")).returncode == 0
    )
    stack.wait_phase("default", name, "Running", timeout=120)
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, 2, at_least=2)
    before = wait_until(lambda: task_pod(stack, name), 60, "the task's pod")
    old_template = before["metadata"]["annotations"][crd.POD_TEMPLATE_ANNOTATION]
    wait_until(
        lambda: condition(stack, name, "PodCurrent").get("status") == "True", 60,
        "PodCurrent True on the running task",
    )  # fmt: skip

    patch_task(stack, name, {"task": {"env": [{"name": "ROLL_MARK", "value": "edited"}]}})
    rolling = wait_until(
        lambda: [e for e in stack.events_of(name) if e["reason"] == "Rolling"], 60,
        "the Rolling event",
    )  # fmt: skip
    assert old_template in rolling[0]["message"], rolling
    at_drain = stack.turns_on_disk(pvc)
    done = wait_until(
        lambda: (s := stack.status("default", name)).get("phase") == "Running"
        and s.get("pausedBy") is None and condition(stack, name, "PodCurrent").get("reason")
        in ("Rolled", "Current") and s,
        180, "the task to run again on a new pod",
    )  # fmt: skip
    assert done["rolls"] == 1
    assert [e["reason"] for e in stack.events_of(name) if e["reason"] == "Rolled"] == ["Rolled"]
    after = wait_until(lambda: task_pod(stack, name), 60, "the new pod")
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    assert after["metadata"]["annotations"][crd.POD_TEMPLATE_ANNOTATION] != old_template
    wait_until(
        lambda: any("ROLL_MARK=edited" in e for e in daemon_environ(stack, pvc)), 60,
        "the new pod's daemon to run with the edited env",
    )  # fmt: skip
    # Every agent continues where the roll's checkpoint left it, at turns + 1.
    assert len(at_drain) == 2
    wait_until(
        lambda: all('"resumed_from"' in t.read_text() for t in transcripts(stack, pvc)), 60,
        "every agent to resume",
    )  # fmt: skip
    stack.wait_turns(pvc, 2, at_least=min(at_drain.values()) + 1)
    checkpoint = done["checkpointRef"]
    roll_ops = [
        op for op in stack.ledger.list_operations("default", name)
        if op.idempotency_key.endswith(":roll:1")
    ]  # fmt: skip
    assert [op.checkpoint_ref for op in roll_ops] == [checkpoint], roll_ops


def test_an_edit_the_daemon_takes_rolls_nothing_and_a_hand_edit_is_undone(
    stack: DevStack,
) -> None:
    name = "kept"
    assert stack.apply(task_manifest(name, agents=1)).returncode == 0
    stack.wait_phase("default", name, "Running", timeout=120)
    before = wait_until(lambda: task_pod(stack, name), 60, "the task's pod")
    stack.watch_passes(name, 2)  # drainGracePeriod edits: the daemon's arguments
    patch_task(stack, name, {"task": {"prompt": "another prompt"}})
    stack.watch_passes(name, 1)
    sandbox = crd.sandbox_name(name)

    def sandbox_field(jsonpath: str) -> str:
        return stack.kubectl(
            "get", "sandboxes.agents.x-k8s.io", sandbox, "-n", "default", "-o",
            f"jsonpath={jsonpath}", "--show-managed-fields",
        ).stdout  # fmt: skip

    image = "{.spec.podTemplate.spec.containers[0].image}"
    ours = sandbox_field(image)
    # A hand edit of a field the operator sets, and of one it does not.
    hand = [
        {"op": "replace", "path": "/spec/podTemplate/spec/containers/0/image",
         "value": "registry.local/hand-edited:1"},
        {"op": "add", "path": "/metadata/annotations", "value": {"team": "hand"}},
    ]  # fmt: skip
    stack.kubectl(
        "patch", "sandboxes.agents.x-k8s.io", sandbox, "-n", "default", "--type=json",
        "-p", json.dumps(hand),
    )  # fmt: skip
    stack.watch_passes(name, 1)
    wait_until(lambda: sandbox_field(image) == ours, 60, "the operator to take its image back")
    assert sandbox_field("{.metadata.annotations.team}") == "hand"  # not the operator's field
    managers = sandbox_field("{.metadata.managedFields[*].manager}").split()
    assert crd.FIELD_MANAGER in managers and "kubectl-patch" in managers, managers
    status = stack.status("default", name)
    assert status.get("rolls") is None and status["phase"] == "Running", status
    after = task_pod(stack, name)
    assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"]
    assert not [e for e in stack.events_of(name) if e["reason"] == "Rolling"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"sandbox": {"name": "another-sandbox"}}, "spec.sandbox.name"),
        ({"sandbox": {"name": None}}, "spec.sandbox.name"),
        ({"workspace": {"storage": "5Gi"}}, "spec.workspace"),
        ({"workspace": {"storageClassName": "fast"}}, "spec.workspace"),
    ],
    ids=["sandbox-name-changed", "sandbox-name-unset", "workspace-storage", "workspace-class"],
)
def test_an_edit_of_an_immutable_field_is_refused_naming_it(
    stack: DevStack, edit: dict[str, Any], field: str
) -> None:
    """Tried: a task's Sandbox binding and its workspace edited with kubectl patch."""
    name = "fixed"
    if stack.task("default", name) is None:  # created suspended: it runs nothing
        manifest = task_manifest(name, agents=1, suspend=True)
        manifest["spec"]["sandbox"] = {"name": "given-sandbox"}
        assert stack.apply(manifest).returncode == 0
    before = stack.task("default", name)
    assert before is not None
    refused = stack.kubectl(
        "patch", "ctask", name, "-n", "default", "--type=merge",
        "-p", json.dumps({"spec": edit}), check=False,
    )  # fmt: skip
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{field}: Invalid value" in lines[0], refused.stderr
    assert f"{field} is immutable" in lines[0] or "cannot be set or unset" in lines[0], lines
    after = stack.task("default", name)
    assert after is not None and after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


def test_a_task_name_no_label_can_carry_is_refused_and_a_dotted_one_gets_a_service_name(
    stack: DevStack,
) -> None:
    """Tried with kubectl apply: a 64-character name (refused in one line, nothing made)
    and a dotted one, whose ``<task>-sbx`` is no valid Service name: its Sandbox is
    named by ``crd.sandbox_name``, a DNS-1035 label."""
    long = "n" * 64
    refused = stack.apply(task_manifest(long, agents=1, suspend=True))
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "a CalibanTask's name is at most 63 characters" in lines[0], lines
    assert stack.task("default", long) is None

    dotted = "team.alpha"
    assert stack.apply(task_manifest(dotted, agents=1)).returncode == 0
    stack.wait_phase("default", dotted, "Running", timeout=120)
    sandbox = stack.status("default", dotted)["sandboxName"]
    assert sandbox == crd.sandbox_name(dotted) and is_dns1035_label(sandbox), sandbox
    assert stack.kubectl("get", "sandbox", sandbox, "-n", "default", "-o", "name").stdout.strip()
    stack.kubectl("delete", "ctask", dotted, "-n", "default", timeout=120)


def test_a_resume_from_edit_is_refused_once_the_task_has_started(stack: DevStack) -> None:
    """Tried with kubectl patch: ``spec.resumeFrom`` set on a Running task (refused in
    one line, the spec unchanged; it was ignored without a word, and prune then kept
    that checkpoint for ever), and on a task created suspended, which has started
    nothing (accepted: a task not yet started is corrected through it)."""
    running, idle = "started", "not-started"
    assert stack.apply(task_manifest(running, agents=1)).returncode == 0
    assert stack.apply(task_manifest(idle, agents=1, suspend=True)).returncode == 0
    stack.wait_phase("default", running, "Running", timeout=120)
    stack.wait_phase("default", idle, "Suspended", timeout=120)
    edit = json.dumps({"spec": {"resumeFrom": {"checkpointRef": "ckpt-0123456789abcdef0123"}}})
    before = stack.task("default", running)
    assert before is not None
    refused = stack.kubectl("patch", "ctask", running, "-n", "default", "--type=merge", "-p",
                            edit, check=False)  # fmt: skip
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "spec.resumeFrom cannot change once the task has started" in (lines[0])
    ), lines
    after = stack.task("default", running)
    assert after is not None and after["spec"] == before["spec"]

    stack.kubectl("patch", "ctask", idle, "-n", "default", "--type=merge", "-p", edit)
    corrected = stack.task("default", idle)
    assert corrected is not None
    assert corrected["spec"]["resumeFrom"] == {"checkpointRef": "ckpt-0123456789abcdef0123"}
    stack.kubectl("delete", "ctask", running, idle, "-n", "default", timeout=120)
