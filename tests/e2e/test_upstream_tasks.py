"""CalibanTasks written for caliban-operator, applied with the real kubectl to the dev
stack's embedded defaults (embedded API and broker, SQLite ledger in a temp dir).

Upstream's sample (``tests/fixtures/upstream``, its hosts rewritten to 127.0.0.1) is
admitted and stored with every field it sets; values upstream's schema admits keep their
meaning (``onDelete: Checkpoint`` drains into a checkpoint on delete, ``idleTimeout: 1d``
is a day); a value we cannot honour (``onDelete: maybe``) is admitted by the schema, as
upstream's admits it, and refused by the operator: condition SpecValid False with a
reason naming the field, and a Warning event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests import upstream
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-upstream-") as dev:
        yield dev


def spec_valid(status: dict[str, Any]) -> tuple[str, str]:
    found = [c for c in status.get("conditions") or [] if c.get("type") == "SpecValid"]
    assert len(found) == 1, status
    return found[0]["status"], found[0]["reason"]


def test_upstream_sample_is_admitted_with_every_field_it_sets(stack: DevStack) -> None:
    sample = upstream.local_samples()["calibantask.yaml"]
    namespace = sample["metadata"]["namespace"]
    stack.kubectl("create", "namespace", namespace)
    applied = stack.apply(sample)
    assert applied.returncode == 0, applied.stderr
    assert "unknown field" not in applied.stderr
    stored = stack.task(namespace, sample["metadata"]["name"])
    assert stored is not None
    for field in ("workspaceRef", "providerRef", "task"):
        kept = stored["spec"][field]
        assert kept == sample["spec"][field] or (
            isinstance(kept, dict) and kept.items() >= sample["spec"][field].items()
        ), field
    stack.kubectl("delete", "ctask", sample["metadata"]["name"], "-n", namespace, timeout=120)


def test_on_delete_checkpoint_in_upstream_case_drains_into_a_checkpoint(stack: DevStack) -> None:
    manifest = task_manifest("capital", agents=1, onDelete="Checkpoint", idleTimeout="1d")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "capital", "Running")
    status = stack.status("default", "capital")
    assert spec_valid(status) == ("True", "Valid")
    stored = stack.task("default", "capital")
    assert stored is not None
    assert stored["spec"]["lifecycle"]["onDelete"] == "Checkpoint"  # kept as written
    stack.kubectl("delete", "ctask", "capital", timeout=120)
    wait_until(lambda: stack.task("default", "capital") is None, timeout=60)
    assert stack.ledger.latest_checkpoint("default", "capital") is not None


def test_an_on_delete_we_cannot_honour_is_refused_by_the_operator(stack: DevStack) -> None:
    applied = stack.apply(task_manifest("maybe", agents=1, onDelete="maybe"))
    assert applied.returncode == 0, applied.stderr  # the schema admits it, as upstream's
    stack.wait_phase("default", "maybe", "Failed")
    status = stack.status("default", "maybe")
    assert spec_valid(status) == ("False", "InvalidLifecycleOnDelete")
    assert "spec.lifecycle.onDelete" in status["message"]
    warnings = [e for e in stack.events_of("maybe") if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["InvalidLifecycleOnDelete"]
    assert "spec.lifecycle.onDelete: 'maybe' is not checkpoint or delete" in warnings[0]["message"]
    stack.kubectl("delete", "ctask", "maybe", timeout=60)


def test_a_failed_task_starts_once_its_spec_is_corrected(stack: DevStack) -> None:
    """Tried: ``onDelete: maybe``, corrected to a ``resumeFrom`` naming no checkpoint (still
    Failed, now for that), then corrected to a real checkpoint: restored and Running."""
    assert stack.apply(task_manifest("donor", agents=1, model="turns=3,turn_ms=20")).returncode == 0
    stack.wait_phase("default", "donor", "Running")
    stack.kubectl("delete", "ctask", "donor", timeout=120)
    wait_until(lambda: stack.task("default", "donor") is None, timeout=60)
    checkpoint = stack.ledger.latest_checkpoint("default", "donor")
    assert checkpoint is not None

    assert stack.apply(task_manifest("fixme", agents=1, onDelete="maybe")).returncode == 0
    stack.wait_phase("default", "fixme", "Failed")
    assert stack.status("default", "fixme")["failedGeneration"] == 1

    def patch(spec: dict[str, Any]) -> None:
        stack.kubectl("patch", "ctask", "fixme", "--type=merge", "-p", json.dumps({"spec": spec}))

    patch({"lifecycle": {"onDelete": "checkpoint"}, "resumeFrom": {"checkpointRef": "nope-0"}})
    wait_until(
        lambda: spec_valid(stack.status("default", "fixme")) == ("False", "UnknownCheckpoint"),
        60,
        "the second failure, for the unknown checkpoint",
    )
    assert stack.status("default", "fixme")["phase"] == "Failed"
    patch({"resumeFrom": {"checkpointRef": checkpoint.ref}})
    stack.wait_phase("default", "fixme", "Running", timeout=120)
    status = stack.status("default", "fixme")
    assert status["checkpointRef"] == checkpoint.ref and "failedGeneration" not in status
    assert spec_valid(status) == ("True", "Valid")
    # The order is the phases waited for above; events within a second list in any order.
    reasons = {e["reason"] for e in stack.events_of("fixme")}
    assert {"Failed", "Pending", "Resuming", "Running"} <= reasons, reasons
    stack.kubectl("delete", "ctask", "fixme", timeout=120)
