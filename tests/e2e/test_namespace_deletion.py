"""Deleting a namespace that holds tasks never wedges: the real kubectl against the dev
stack's embedded defaults (embedded API and broker, SQLite ledger in a temp dir), whose
API refuses new content in a terminating namespace as a real API server does (403,
cause ``NamespaceTerminating``).

What was tried: ``kubectl delete namespace`` of a namespace with a Running task of 2
agents working. The finalizer still drains (the daemon lives until its pod goes) and
records the checkpoint, creates nothing there (no drain guard, no snapshot), and says
the truth: the workspace goes with the namespace, so the checkpoint is marked
unavailable at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator.ledger import CheckpointView
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow

NAMESPACE_GONE_SECS = 60
"""How long a namespace with tasks may take to go (docs/operator.md)."""


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-nsdel-") as dev:
        yield dev


def operator_log(stack: DevStack) -> str:
    return (stack.state / "logs" / "operator.log").read_text(errors="replace")


def test_deleting_the_namespace_of_a_running_task_drains_it_and_goes_within_a_minute(
    stack: DevStack,
) -> None:
    stack.kubectl("create", "namespace", "team-x")
    assert stack.apply(task_manifest("worker", namespace="team-x", agents=2)).returncode == 0
    stack.wait_phase("team-x", "worker", "Running", timeout=120)
    pvc = stack.pvc_of("worker", "team-x")
    stack.wait_turns(pvc, 2, at_least=2, namespace="team-x")

    deleted = stack.kubectl(
        "delete", "namespace", "team-x", f"--timeout={NAMESPACE_GONE_SECS}s", check=False,
        timeout=NAMESPACE_GONE_SECS + 30,
    )  # fmt: skip
    assert deleted.returncode == 0, f"namespace team-x did not go: {deleted.stderr}"
    assert stack.kubectl("get", "namespace", "team-x", check=False).returncode != 0

    # One checkpoint. The pod is deleted with the namespace as the drain is sent: the
    # daemon either answers it (a clean drain of every agent) or has drained itself on
    # its SIGTERM and gone first, and the checkpoint is forced, of what the PVC held.
    checkpoints = stack.ledger.list_checkpoints("team-x", "worker")
    assert len(checkpoints) == 1, checkpoints
    checkpoint = checkpoints[0]
    if checkpoint.forced:
        assert checkpoint.reason == "forced", checkpoint
    else:
        assert checkpoint.reason == "delete" and checkpoint.verified, checkpoint
        assert len(checkpoint.agents) == 2 and all(a.turns >= 2 for a in checkpoint.agents)
    # Its workspace went with the namespace: it says so, at once, and asked no snapshot.
    assert not checkpoint.available
    assert checkpoint.unavailable is not None and "namespace team-x" in checkpoint.unavailable
    assert checkpoint.snapshot is None

    # A refusal of a terminating namespace is not a missing RBAC permission.
    log = operator_log(stack)
    assert "rbac_forbidden" not in log
    assert "namespace_terminating" in log


def with_phase(stack: DevStack, namespace: str, name: str, phase: str) -> None:
    stack.wait_phase(namespace, name, phase, timeout=120)


def test_a_namespace_with_tasks_in_every_phase_goes_within_a_minute(stack: DevStack) -> None:
    """Running, Suspended, Provisioning (its daemon never starts), Resuming (its pod cannot
    start), Draining (a pause waiting out a long turn), Completed and Failed tasks, then
    ``kubectl delete namespace``: gone within a minute, one checkpoint per drain, none
    for what never ran, every checkpoint of the namespace said gone, the audit clean."""
    ns = "team-all"
    stack.kubectl("create", "namespace", ns)

    def apply(name: str, model: str = "turns=100000,turn_ms=100", **spec: Any) -> None:
        manifest = task_manifest(name, namespace=ns, agents=1, model=model)
        manifest["spec"].update(spec)
        assert stack.apply(manifest).returncode == 0, name

    def patch(name: str, body: dict[str, Any]) -> None:
        stack.kubectl("patch", "ctask", name, "-n", ns, "--type=merge", "-p", json.dumps(body))

    apply("running")
    apply("suspended")
    apply("resuming")
    apply("completed", model="turns=2,turn_ms=50,then=exit")
    apply("draining", model="turns=100000,turn_ms=40000",
          lifecycle={"drainGracePeriod": "50s"})  # fmt: skip
    apply("failed", resumeFrom={"checkpointRef": "ckpt-nowhere"})
    workspace = {
        "apiVersion": "caliban.caliban-ai.dev/v1alpha1", "kind": "Workspace",
        "metadata": {"name": "unclonable", "namespace": ns},
        "spec": {"displayName": "u",
                 "sources": [{"name": "app", "repo": f"file://{stack.root}/none",
                              "path": "/work/app"}],
                 "providers": [{"name": "p", "kind": "ollama", "model": "m",
                                "baseUrl": "http://127.0.0.1:9/"}]},
    }  # fmt: skip
    assert stack.apply(workspace).returncode == 0
    provisioning = task_manifest("provisioning", namespace=ns, agents=1)
    provisioning["spec"]["task"] = {"agents": 1, "prompt": "go"}
    provisioning["spec"]["workspaceRef"] = {"name": "unclonable"}
    assert stack.apply(provisioning).returncode == 0

    for name in ("running", "suspended", "resuming", "draining"):
        with_phase(stack, ns, name, "Running")
    with_phase(stack, ns, "completed", "Completed")
    with_phase(stack, ns, "failed", "Failed")
    with_phase(stack, ns, "provisioning", "Provisioning")
    for name in ("suspended", "resuming"):
        patch(name, {"spec": {"lifecycle": {"suspend": True}}})
    for name in ("suspended", "resuming"):
        with_phase(stack, ns, name, "Suspended")
    # Its old pod gone first: a daemon still terminating could serve the wake's resume.
    pvc = stack.pvc_of("resuming", ns)
    wait_until(lambda: stack.daemon_pids(pvc, namespace=ns) == [], 120, "the old pod gone")
    # Its pod cannot start once woken (the namespace's broker Secret is gone): Resuming.
    stack.kubectl("delete", "secret", "caliban-drain-broker", "-n", ns)
    patch("resuming", {"spec": {"lifecycle": {"suspend": False}}})
    with_phase(stack, ns, "resuming", "Resuming")
    # A pause waiting for a 40 s turn to end: Draining.
    stack.wait_turns(stack.pvc_of("draining", ns), 1, at_least=1, namespace=ns)
    patch("draining", {"spec": {"lifecycle": {"suspend": True}}})
    with_phase(stack, ns, "draining", "Draining")

    started = time.monotonic()
    deleted = stack.kubectl(
        "delete", "namespace", ns, f"--timeout={NAMESPACE_GONE_SECS}s", check=False,
        timeout=NAMESPACE_GONE_SECS + 30,
    )  # fmt: skip
    gone_secs = time.monotonic() - started
    assert deleted.returncode == 0, f"namespace {ns} did not go: {deleted.stderr}"
    print(f"namespace with 7 tasks gone in {gone_secs:.1f}s")

    def checkpoints(name: str, reason: str) -> list[CheckpointView]:
        return [c for c in stack.ledger.list_checkpoints(ns, name) if c.reason == reason]

    # One checkpoint per drain: the deletion's for the running task, the pause's for the
    # paused ones (the deletion kept it, or took the pause on its way over), the
    # completion's; a forced one where the pod's own drain won the race. None for what
    # never ran.
    assert len(checkpoints("running", "delete") + checkpoints("running", "forced")) == 1
    assert len(checkpoints("suspended", "pause")) == 1
    assert checkpoints("suspended", "delete") == checkpoints("suspended", "forced") == []
    assert len(checkpoints("draining", "pause") + checkpoints("draining", "forced")) == 1
    assert len(checkpoints("completed", "completed")) == 1
    assert stack.ledger.list_checkpoints(ns, "provisioning") == []
    assert stack.ledger.list_checkpoints(ns, "failed") == []
    every = stack.ledger.list_checkpoints(ns, None, limit=100)
    assert every and all(not c.available for c in every), every
    assert all(f"namespace {ns}" in str(c.unavailable) for c in every)
    assert stack.audit_findings() == []
    assert "rbac_forbidden" not in operator_log(stack)
