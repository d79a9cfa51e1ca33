"""``drainctl dev up`` SIGKILLed and started again on the same state dir: nothing of the
first stack runs on, and the second one has the first one's cluster (the embedded API's
objects, restored from ``<state-dir>/api-state.json``) over the same workspace volume.
Real processes throughout: the stack, kubectl, Redis, PostgreSQL, daemons and agents."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devcluster import broker
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until
from worker_agent import layout
from worker_agent.children import descendants, is_zombie
from worker_agent.session import count_completed_turns, load_session

pytestmark = pytest.mark.slow

GONE_WITHIN_SECS = 10.0
# Agents that ignore SIGTERM, under a daemon with a grace longer than that bound: before
# the pods ran under a reaper, a SIGKILLed stack sent its daemons SIGTERM only, and each
# drained (its agents running on) for the whole grace, while a restarted stack could
# already be starting a new daemon on the same volume.
STUBBORN_MODEL = "turns=100000,turn_ms=100,sigterm=ignore"
DRAIN_GRACE = "30s"


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cd-restart-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def processes_of(root: Path) -> set[int]:
    """Every live process whose command line or working directory is under ``root``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        pid = int(entry.name)
        if (str(root) in command_of(pid) or cwd.startswith(str(root))) and not is_zombie(pid):
            found.add(pid)
    return found


def sessions(stack: DevStack, pvc: str) -> dict[str, tuple[int, bytes]]:
    """Each agent's saved turns and its ``session.json`` as bytes."""
    return {
        d.name: (load_session(d).turns, layout.session_file(d).read_bytes())
        for d in stack.agent_dirs("default", pvc)
        if layout.session_file(d).exists()
    }


def kubectl_json(stack: DevStack, *args: str) -> dict[str, Any]:
    import json

    loaded: dict[str, Any] = json.loads(stack.kubectl("get", *args, "-o", "json").stdout)
    return loaded


def test_a_sigkilled_dev_up_leaves_nothing_running_and_its_restart_has_the_same_cluster(
    root: Path,
) -> None:
    broker, database = redis_db_url(db=15), fresh_postgres()
    first = DevStack(root, broker, database)
    second: DevStack | None = None
    try:
        manifest = task_manifest(
            "survivor", agents=2, model=STUBBORN_MODEL, drainGracePeriod=DRAIN_GRACE
        )
        assert first.apply(manifest).returncode == 0
        first.wait_phase("default", "survivor", "Running")
        pvc = str(wait_until(lambda: first.status("default", "survivor").get("pvcName"), 60, "pvc"))

        def two_agents_taking_turns() -> bool:
            saved = sessions(first, pvc)
            return len(saved) == 2 and all(turns >= 3 for turns, _ in saved.values())

        wait_until(two_agents_taking_turns, 90, "2 agents with 3+ saved turns")
        task = kubectl_json(first, "ctask", "survivor")
        sandbox = kubectl_json(first, "sandboxes.agents.x-k8s.io", "survivor-sbx")
        claim = kubectl_json(first, "pvc", pvc)
        # The stack's processes: its descendants, and anything else pointing into its dir.
        tree = {pid: command_of(pid) for pid in {*descendants(first.pid), *processes_of(root)}}
        commands = " ".join(tree.values())
        for part in ("cli operator", "cli worker", "cli daemon", "consumer", "reaper"):
            assert part in commands, f"{part!r} not among the stack's processes: {tree}"
        assert commands.count("worker_agent.worker ") == 2
        del tree[first.pid]

        before_kill = {agent: turns for agent, (turns, _) in sessions(first, pvc).items()}
        killed_at = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(
            lambda: not [pid for pid in tree if not is_zombie(pid)],
            GONE_WITHIN_SECS,
            f"all {len(tree)} processes of the stack to be gone "
            f"(left: { {p: tree[p] for p in tree if not is_zombie(p)} })",
            interval=0.05,
        )
        gone_secs = time.monotonic() - killed_at
        assert processes_of(root) == set()
        after_kill = sessions(first, pvc)
        for directory in first.agent_dirs("default", pvc):  # every turn saved is kept
            assert after_kill[directory.name][0] >= before_kill[directory.name]
            # A worker killed between saving a turn and announcing it leaves that one
            # turn unannounced (the worker contract's one allowed gap, re-announced on
            # resume); never more.
            on_disk = after_kill[directory.name][0]
            assert count_completed_turns(directory) in (on_disk, on_disk - 1)
        assert sessions(first, pvc) == after_kill  # nothing is left to write them

        second = DevStack(root, broker, database)
        restored = second.task("default", "survivor")
        assert restored is not None
        assert restored["metadata"]["uid"] == task["metadata"]["uid"]
        assert restored["metadata"]["creationTimestamp"] == task["metadata"]["creationTimestamp"]
        sandbox_now = kubectl_json(second, "sandboxes.agents.x-k8s.io", "survivor-sbx")
        assert sandbox_now["metadata"]["uid"] == sandbox["metadata"]["uid"]
        assert kubectl_json(second, "pvc", pvc)["metadata"]["uid"] == claim["metadata"]["uid"]
        saved = {agent: turns for agent, (turns, _) in after_kill.items()}
        kept = sessions(second, pvc)
        assert all(kept[agent][0] >= turns for agent, turns in saved.items())
        print(
            f"\nstack processes killed: {len(tree)} gone in {gone_secs:.2f}s; "
            f"turns at the kill {before_kill}, saved {saved}"
            f"\nafter the restart: {second.status('default', 'survivor')}"
        )

        second.kubectl("delete", "ctask", "survivor", timeout=120)
        assert second.task("default", "survivor") is None
        [checkpoint] = second.ledger.list_checkpoints(namespace="default", name="survivor")
        assert checkpoint.task_uid == task["metadata"]["uid"]
        assert checkpoint.reason == "delete"
        print(f"checkpoint: {checkpoint.ref} forced={checkpoint.forced} agents={checkpoint.agents}")
    finally:
        if second is not None:
            second.close()
        first.close()


def test_a_restarted_dev_up_keeps_its_embedded_broker_where_its_pods_look_for_it(
    root: Path,
) -> None:
    """Tried: ``drainctl dev up`` on its embedded broker (the default), a task Running,
    the stack SIGKILLed and started again on its state. Its Sandbox controller brings the
    task's pod back at once, before the operator's first pass: the pod reads the broker
    URL from the Secret the first stack's operator wrote. The broker listens where it did,
    so the pod's consumer connects, and a pause drains the task into a checkpoint (on
    another port, found by the chaos harness's seed 302, the consumer retried a dead
    address for ever and the task never came back)."""
    database = f"sqlite:///{root / 'ledger.db'}"
    first = DevStack(root, None, database)
    second: DevStack | None = None
    try:
        assert first.apply(task_manifest("steady", agents=1)).returncode == 0
        first.wait_phase("default", "steady", "Running")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        first.reap(0)

        second = DevStack(root, None, database)
        pvc = second.pvc_of("steady")
        before = max(second.turns_on_disk(pvc).values())
        second.wait_turns(pvc, 1, before + 3)  # its agent works on under the new stack
        paused = second.kubectl("patch", "ctask", "steady", "--type=merge",
                                "-p", '{"spec": {"lifecycle": {"suspend": true}}}')  # fmt: skip
        assert paused.returncode == 0, paused.stderr
        second.wait_phase("default", "steady", "Suspended", timeout=180)
        assert second.status("default", "steady").get("checkpointRef")
        port = int((second.state / broker.PORT_FILE).read_text())
        pod_log = second.state / "sandboxes" / "logs" / "default.steady-sbx.log"
        assert f"Connected to redis://:**@127.0.0.1:{port}/0" in pod_log.read_text()
    finally:
        if second is not None:
            second.close()
        first.close()
