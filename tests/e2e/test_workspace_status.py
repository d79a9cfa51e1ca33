"""A Workspace's status end to end, with the real kubectl against ``drainctl dev up``
(embedded API, the real kopf operator, the embedded broker, a SQLite ledger) recording
every API request it serves (``--record-requests``).

Where the operator provisions (``--manage-sandbox``, as ``dev up`` runs it, with
``DRAIN_WORKSPACE_STATUS`` at its default ``auto``) it writes each Workspace's status as
caliban-operator's Workspace controller does: a usable one is ``Ready`` for its
generation (``kubectl wait --for=condition=Ready`` returns), one with a provider kind it
cannot drive or a bad source is ``Failed`` with the message and the reason, an edit is
observed in ``observedGeneration``, and a watch event that changes nothing of the
verdict writes nothing. Where caliban-operator provisions (``--existing-sandboxes``),
the operator reads Workspaces and writes none of their status.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devcluster import authz
from orchestrator.devcluster.up import OPERATOR_USER
from tests.e2e.support import DevStack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow

RECORD = "requests.jsonl"


def started(prefix: str, env: dict[str, str] | None = None) -> DevStack:
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return DevStack(
        root, None, f"sqlite:///{root / 'ledger.db'}", "--record-requests", str(root / RECORD),
        env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    dev = started("cd-wsstatus-")
    try:
        yield dev
    finally:
        dev.close()


def workspace(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "displayName": "Team A",
        "sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "/work/app"}],
        "providers": [{"name": "workers", "kind": "ollama", "model": "qwen2.5-coder"}],
    }
    base.update(spec)
    return {"apiVersion": "caliban.caliban-ai.dev/v1alpha1", "kind": "Workspace",
            "metadata": {"name": name, "namespace": "default"}, "spec": base}  # fmt: skip


def get(stack: DevStack, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(stack.kubectl("get", "cws", name, "-o", "json").stdout)
    return found


def ready_condition(found: dict[str, Any]) -> dict[str, Any]:
    conditions = (found.get("status") or {}).get("conditions") or []
    return next(c for c in conditions if c["type"] == "Ready")


def observed(stack: DevStack, name: str, phase: str) -> dict[str, Any]:
    """The Workspace once its status says ``phase`` for its current generation."""

    def settled() -> dict[str, Any] | None:
        found = get(stack, name)
        status = found.get("status") or {}
        if status.get("phase") != phase:
            return None
        return (
            found if status.get("observedGeneration") == found["metadata"]["generation"] else None
        )

    return wait_until(settled, 60, f"Workspace {name}: phase {phase} for its generation")


def status_writes(stack: DevStack, name: str) -> list[authz.RecordedRequest]:
    """The operator's writes of Workspace ``name``'s status, as the API recorded them."""
    return [
        r for r in authz.read_record(stack.root / RECORD)
        if (r.user, r.resource, r.subresource, r.verb, r.name)
        == (OPERATOR_USER.name, "workspaces", "status", "patch", name)
    ]  # fmt: skip


def patch_spec(stack: DevStack, name: str, spec: dict[str, Any]) -> None:
    stack.kubectl("patch", "cws", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def test_a_usable_workspace_is_ready_for_its_generation_and_an_edit_is_observed(
    stack: DevStack,
) -> None:
    assert stack.apply(workspace("usable")).returncode == 0
    stack.kubectl("wait", "--for=condition=Ready", "cws/usable", "--timeout=60s")
    found = observed(stack, "usable", "Ready")
    status = found["status"]
    assert (status["phase"], status["observedGeneration"]) == ("Ready", 1)
    assert "message" not in status
    ready = ready_condition(found)
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "Valid", 1)
    assert ready["message"] == "Workspace usable: its 1 provider(s) and 1 source(s) can be used"
    since = ready["lastTransitionTime"]
    assert len(status_writes(stack, "usable")) == 1
    listed = stack.kubectl("get", "cws", "usable").stdout
    assert listed.split("\n")[0].split()[:2] == ["NAME", "PHASE"] and " Ready " in listed

    # An annotation changes nothing the status says: no write. Then an edit of the spec,
    # whose event comes after the annotation's: observed, the rest unchanged.
    stack.kubectl("annotate", "cws", "usable", "team=a")
    patch_spec(stack, "usable", {"displayName": "Team A (renamed)"})
    found = observed(stack, "usable", "Ready")
    assert found["status"]["observedGeneration"] == 2
    ready = ready_condition(found)
    assert (ready["observedGeneration"], ready["lastTransitionTime"]) == (2, since)
    assert len(status_writes(stack, "usable")) == 2  # created, edited: never for the rest


def test_a_provider_kind_it_cannot_drive_fails_the_workspace_until_corrected(
    stack: DevStack,
) -> None:
    planner = {"name": "planner", "kind": "anthropic", "model": "claude",
               "credentialsRef": {"secretName": "anthropic-key", "key": "api-key"}}  # fmt: skip
    assert stack.apply(workspace("planner", providers=[planner])).returncode == 0
    found = observed(stack, "planner", "Failed")
    message = found["status"]["message"]
    assert message == (
        "provider planner of Workspace planner is of kind anthropic, which caliban-drain "
        "cannot drive yet (it drives ollama, openai, openai-compatible); a task bound to it "
        "is refused"
    )
    ready = ready_condition(found)
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False", "UnsupportedProviderKind", message,
    )  # fmt: skip
    warnings = [e for e in stack.events_of("planner") if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["UnsupportedProviderKind"], warnings
    failed_since = ready["lastTransitionTime"]

    # Corrected: Ready for the new generation, the message gone, a new transition.
    patch_spec(stack, "planner", {"providers": [
        {"name": "planner", "kind": "ollama", "model": "qwen2.5-coder"}]})  # fmt: skip
    found = observed(stack, "planner", "Ready")
    assert found["status"]["observedGeneration"] == 2
    assert "message" not in found["status"]
    ready = ready_condition(found)
    assert (ready["status"], ready["reason"]) == ("True", "Valid")
    assert ready["lastTransitionTime"] >= failed_since
    assert [e["reason"] for e in stack.events_of("planner") if e["type"] == "Normal"] == ["Ready"]


@pytest.mark.parametrize(
    ("name", "spec", "reason", "says"),
    [
        ("relative-source-path",
         {"sources": [{"name": "app", "repo": "file:///srv/app.git", "path": "work/app"}]},
         "InvalidWorkspace", "source app: path 'work/app' is not an absolute path"),
        ("source-over-the-run-dir",
         {"sources": [{"name": "app", "repo": "file:///srv/app.git",
                       "path": "/run/caliband/app"}]},
         "InvalidWorkspace", "overlaps /run/caliband"),
        ("dangling-default", {"defaultProvider": "nobody"}, "ProviderNotFound",
         "defaultProvider names provider 'nobody'"),
    ],
)  # fmt: skip
def test_a_bad_source_or_default_fails_the_workspace_with_its_reason(
    stack: DevStack, name: str, spec: dict[str, Any], reason: str, says: str
) -> None:
    assert stack.apply(workspace(name, **spec)).returncode == 0
    found = observed(stack, name, "Failed")
    assert says in found["status"]["message"]
    ready = ready_condition(found)
    assert (ready["status"], ready["reason"]) == ("False", reason)
    assert ready["message"] == found["status"]["message"]


def test_where_caliban_operator_provisions_no_workspace_status_is_written() -> None:
    """``--existing-sandboxes`` (caliban-operator makes the Sandboxes, and its Workspace
    controller writes their status): the operator reads the Workspace for a task bound
    to it, and leaves its status to the other controller, even one it would fail."""
    dev = started("cd-wsstatus-off-", env={"DRAIN_EXISTING_SANDBOXES": "true"})
    try:
        planner = {"name": "planner", "kind": "anthropic", "model": "claude"}
        body = workspace("shared", providers=[
            {"name": "workers", "kind": "ollama", "model": "qwen2.5-coder"}, planner])  # fmt: skip
        assert dev.apply(body).returncode == 0
        # What caliban-operator's controller would write.
        theirs = {"phase": "Ready", "observedGeneration": 1}
        dev.kubectl("patch", "cws", "shared", "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": theirs}))  # fmt: skip
        task = task_manifest("bound", agents=1)
        task["spec"].update({"workspaceRef": {"name": "shared"}, "providerRef": "workers"})
        task["spec"]["task"]["prompt"] = "go"  # required with a workspaceRef
        assert dev.apply(task).returncode == 0

        def resolved() -> dict[str, Any] | None:
            conditions = dev.status("default", "bound").get("conditions") or []
            found = next((c for c in conditions if c["type"] == "WorkspaceResolved"), None)
            return found if found is not None and found["status"] == "True" else None

        wait_until(resolved, 60, "the task bound to the Workspace")
        patch_spec(dev, "shared", {"displayName": "Team A (renamed)"})
        wait_until(lambda: get(dev, "shared")["metadata"]["generation"] == 2, 30, "the edit")
        dev.watch_passes("bound", 1)  # the operator is acting after the edit
        assert get(dev, "shared")["status"] == theirs
        assert status_writes(dev, "shared") == []
        operator = (OPERATOR_USER.name, "workspaces", "shared")
        reads = [r for r in authz.read_record(dev.root / RECORD)
                 if (r.user, r.resource, r.name) == operator]  # fmt: skip
        assert reads, "the operator read the Workspace"
        dev.kubectl("delete", "ctask", "bound", "--wait=false")
    finally:
        dev.close()
