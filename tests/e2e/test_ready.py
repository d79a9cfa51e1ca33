"""``kubectl wait --for=condition=Ready ctask/NAME`` with the real kubectl against the dev
stack's embedded defaults (embedded API and broker, SQLite ledger in a temp dir), and the
JSON logs of that stack's processes (``DRAIN_LOG_FORMAT=json``).

``kubectl wait`` lists the task with ``fieldSelector=metadata.name=NAME``, watches from
that list's resourceVersion with the same selector, and reads ``status.conditions``
(comparing a condition's ``observedGeneration`` with ``metadata.generation``): so these
tests also pin that the embedded API serves exactly that.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.operator.crd import sandbox_name
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.support import wait_until
from worker_agent.testing import DRAINCTL

pytestmark = pytest.mark.slow

NAME = "ready-1"


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-ready-", env={"DRAIN_LOG_FORMAT": "json"}) as dev:
        yield dev


def ready_condition(stack: DevStack, name: str) -> dict[str, Any]:
    conditions = stack.status("default", name).get("conditions") or []
    found = [c for c in conditions if c.get("type") == "Ready"]
    assert len(found) == 1, conditions
    return dict(found[0])


def kubectl_wait(
    stack: DevStack, name: str, condition: str, timeout: str
) -> subprocess.CompletedProcess[str]:
    return stack.kubectl(
        "wait", f"--for=condition={condition}", f"ctask/{name}", "-n", "default",
        f"--timeout={timeout}", check=False, timeout=200,
    )  # fmt: skip


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log, each parsed as one JSON object (a line that is not fails)."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{path}:{number} is not JSON: {line!r}") from None
        assert isinstance(entry, dict), f"{path}:{number}: {line!r}"
        assert {"ts", "level", "logger", "message"} <= set(entry), f"{path}:{number}: {line!r}"
        entries.append(entry)
    return entries


def test_kubectl_wait_for_ready_returns_once_every_agent_is_live(stack: DevStack) -> None:
    assert stack.apply(task_manifest(NAME, agents=2)).returncode == 0
    waited = kubectl_wait(stack, NAME, "Ready", "120s")
    assert waited.returncode == 0, waited.stderr
    assert f"calibantask.caliban.caliban-ai.dev/{NAME} condition met" in waited.stdout
    status = stack.status("default", NAME)
    assert status["phase"] == "Running"
    assert status["agents"] == 2
    ready = ready_condition(stack, NAME)
    assert (ready["status"], ready["reason"]) == ("True", "AgentsLive"), ready
    assert ready["message"] == "Running; 2 of 2 agents live"
    task = stack.task("default", NAME)
    assert task is not None
    assert ready["observedGeneration"] == task["metadata"]["generation"]
    table = stack.kubectl("get", "ctask", NAME, "-n", "default").stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert dict(zip(header, row, strict=False))["READY"] == "True", table


def test_after_a_pause_kubectl_wait_for_ready_false_returns(stack: DevStack) -> None:
    stack.wait_phase("default", NAME, "Running")
    paused = subprocess.run(
        [*DRAINCTL, "pause", f"default/{NAME}", "--kubeconfig", str(stack.kubeconfig)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert paused.returncode == 0, paused.stderr
    waited = kubectl_wait(stack, NAME, "Ready=false", "120s")
    assert waited.returncode == 0, waited.stderr
    stack.wait_phase("default", NAME, "Suspended")
    ready = wait_until(
        lambda: (c := ready_condition(stack, NAME))["reason"] == "Paused" and c, 60,
        "Ready False with reason Paused",
    )  # fmt: skip
    assert ready["status"] == "False"
    task = stack.task("default", NAME)
    assert task is not None
    assert ready["observedGeneration"] == task["metadata"]["generation"] == 2  # suspend: true


def test_kubectl_wait_on_a_task_that_never_gets_ready_times_out(stack: DevStack) -> None:
    """Bad input: a restore from a checkpoint the ledger does not have fails the task."""
    manifest = task_manifest("never-ready", agents=1)
    manifest["spec"]["resumeFrom"] = {"checkpointRef": "no-such-checkpoint"}
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "never-ready", "Failed")
    waited = kubectl_wait(stack, "never-ready", "Ready", "3s")
    assert waited.returncode != 0
    assert "timed out waiting for the condition" in waited.stderr, waited.stderr
    ready = ready_condition(stack, "never-ready")
    assert (ready["status"], ready["reason"]) == ("False", "Failed"), ready
    assert "unknown checkpoint ref 'no-such-checkpoint'" in ready["message"]


def test_every_process_logs_json_lines_naming_the_task_and_its_drain(stack: DevStack) -> None:
    """Runs after the pause: its drain went through the operator, the orchestrator worker
    and the pod's daemon and consumer, each of which logged it."""
    stack.wait_phase("default", NAME, "Suspended")
    status = stack.status("default", NAME)
    op_id = status["lastOperation"]["id"]
    task = stack.task("default", NAME)
    assert task is not None
    uid = task["metadata"]["uid"]
    logs = stack.state / "logs"
    pod_log = stack.state / "sandboxes" / "logs" / f"default.{sandbox_name(NAME)}.log"
    named = {"namespace": "default", "name": NAME, "task_uid": uid, "operation_id": op_id}
    for log in (logs / "operator.log", logs / "worker.log", pod_log):
        entries = json_lines(log)
        about_the_drain = [e for e in entries if e.get("operation_id") == op_id]
        assert about_the_drain, f"{log}: no line with operation_id {op_id}"
        for entry in about_the_drain:
            assert {k: entry.get(k) for k in named} == named, entry
    for log in (logs / "audit.log", logs / "broker.log"):
        json_lines(log)
