"""The dev stack's embedded broker (fakeredis's Redis-protocol server) keeps the same
promises as a real Redis: a message whose consumer was killed comes back, and a mass
deletion loses none of its drains.

Tried with kombu's filesystem transport, the earlier embedded default: a consumer
SIGKILLed during a pause drain never got its message back (the task stayed Draining
until its deadline, then claimed its agents kept running), and a reader racing a
writer crashed on an empty message file, forcing a deletion's checkpoint.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres
from tests.support import wait_until
from worker_agent import layout
from worker_agent.children import descendants
from worker_agent.session import load_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-embedded-", dir="/tmp"))
    dev = DevStack(root, None, fresh_postgres())
    try:
        yield dev
        # Whatever the module's tests did, the ledger says only what is so.
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


def stack_processes(stack: DevStack) -> list[list[str]]:
    argvs = []
    for pid in descendants(stack.pid):
        try:
            argvs.append(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
    return argvs


def test_the_default_broker_is_the_embedded_redis_protocol_server(stack: DevStack) -> None:
    assert any("orchestrator.devcluster.broker" in " ".join(a) for a in stack_processes(stack))
    banner = stack.log_text()
    assert "broker redis://127.0.0.1:" in banner, banner
    assert "filesystem://" not in banner


def test_a_consumer_killed_during_a_pause_drain_gets_its_message_back(stack: DevStack) -> None:
    manifest = task_manifest("paused-hard", agents=2, model="turns=100000,turn_ms=3000")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "paused-hard", "Running")
    pvc = str(wait_until(lambda: stack.status("default", "paused-hard").get("pvcName"), 60, "pvc"))
    volume = stack.volume("default", pvc)

    def consumer() -> psutil.Process | None:
        for pid in descendants(stack.pid):
            try:
                process = psutil.Process(pid)
                argv = " ".join(process.cmdline())
            except psutil.Error:
                continue
            if "worker_agent.consumer" in argv and str(volume) in argv:
                return process
        return None

    wait_until(lambda: len(stack.agent_dirs("default", pvc)) == 2, 60, "two agents")
    first = wait_until(consumer, 60, "the task's consumer")
    stack.kubectl("patch", "ctask", "paused-hard", "--type", "merge", "-p",
                  '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
    stack.wait_phase("default", "paused-hard", "Draining", timeout=30)
    first.kill()  # mid-drain: the agents are finishing their 3 s turns
    stack.wait_phase("default", "paused-hard", "Suspended", timeout=120)
    status = stack.status("default", "paused-hard")
    checkpoint = stack.ledger.get_checkpoint(status["checkpointRef"])
    assert checkpoint is not None and checkpoint.verified and not checkpoint.forced
    on_disk = {d.name: load_session(d).turns for d in layout.agents_dir(volume).iterdir()}
    assert {a.agent_id: a.turns for a in checkpoint.agents} == on_disk
    stack.kubectl("delete", "ctask", "paused-hard", timeout=120)


def test_a_mass_deletion_loses_no_drain(stack: DevStack) -> None:
    names = [f"many-{i}" for i in range(8)]
    for name in names:
        assert stack.apply(task_manifest(name, agents=1)).returncode == 0
    for name in names:
        stack.wait_phase("default", name, "Running")
    uids = {name: stack.task("default", name)["metadata"]["uid"] for name in names}  # type: ignore[index]
    stack.kubectl("delete", "ctask", "--all", timeout=180)
    for name in names:
        checkpoints = [c for c in stack.ledger.list_checkpoints(namespace="default", name=name)
                       if c.task_uid == uids[name]]  # fmt: skip
        assert len(checkpoints) == 1, name
        assert not checkpoints[0].forced, (name, checkpoints[0])
        assert checkpoints[0].verified, name
