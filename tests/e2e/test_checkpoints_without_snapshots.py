"""Checkpoints on a cluster without CSI volume snapshots (``drainctl dev up
--no-snapshots``): a checkpoint is its retained workspace PVC, so that PVC serves one
task at a time and holds only its newest checkpoint. A second restore of a checkpoint,
a restore while the original task is only suspended, and a restore of an older
checkpoint each fail with a clear condition and event; never two daemons on one
workspace.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from orchestrator.operator.crd import sandbox_name
from tests.e2e.prune_race import restoring, run_races
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import wait_until

pytestmark = pytest.mark.slow

SUSPEND = '{"spec": {"lifecycle": {"suspend": true}}}'
RESUME = '{"spec": {"lifecycle": {"suspend": false}}}'


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-nosnap-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=7), fresh_postgres(), "--no-snapshots")
    try:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


NOT_DAEMONS = frozenset({"worker_agent.reaper", "worker_agent.consumer"})


class DaemonsPerWorkspace:
    """Counts, on every poll while it runs, the daemons serving one PVC's volume."""

    def __init__(self, stack: DevStack, pvc: str) -> None:
        self.stack, self.pvc = stack, pvc
        self.most = 0
        self.seen: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _daemons(self) -> list[str]:
        found: dict[int, tuple[int, str]] = {}
        for pid in self.stack.daemon_pids(self.pvc):
            try:
                process = psutil.Process(pid)
                argv, parent = process.cmdline(), process.ppid()
            except psutil.Error:
                continue
            # The pod's reaper carries the daemon's argv after ``--``, the daemon's
            # consumer names the store too: count the daemon itself.
            if "daemon" in argv and not NOT_DAEMONS & set(argv):
                found[pid] = (parent, f"pid {pid}: {' '.join(argv)}")
        # A child the daemon has forked and not yet exec'd (an agent's worker being
        # launched) still shows the daemon's argv for that instant: it is not a daemon.
        return [line for parent, line in found.values() if parent not in found]

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            daemons = self._daemons()
            if len(daemons) > self.most:
                self.most, self.seen = len(daemons), daemons

    def __enter__(self) -> DaemonsPerWorkspace:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join()


def refused(stack: DevStack, name: str, reason: str) -> str:
    """The restore failed with ``reason`` before anything was created; its message."""
    stack.wait_phase("default", name, "Failed", timeout=60)
    status = stack.status("default", name)
    resumed = [c for c in status["conditions"] if c["type"] == "Resumed"]
    assert [(c["status"], c["reason"]) for c in resumed] == [("False", reason)]
    warnings = [e for e in stack.events_of(name) if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == [reason]
    assert warnings[0]["message"] == status["message"]
    assert "no agents were started" in status["message"]
    sandboxes = stack.kubectl("get", "sandboxes.v1alpha1.agents.x-k8s.io", "-o", "name").stdout
    assert f"/{sandbox_name(name)}\n" not in sandboxes + "\n"
    return str(status["message"])


def test_a_checkpoint_is_restored_by_one_task_and_a_second_restore_is_refused(
    stack: DevStack,
) -> None:
    """Tried: a task deleted with a checkpoint, then ``twin-a`` and ``twin-b`` created in
    one ``kubectl apply`` with the same ``resumeFrom.checkpointRef``: they race for the
    one workspace the checkpoint has."""
    assert stack.apply(task_manifest("original", agents=1)).returncode == 0
    stack.wait_phase("default", "original", "Running")
    pvc = stack.pvc_of("original")
    stack.wait_turns(pvc, 1, 2)
    stack.kubectl("delete", "ctask", "original", timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", "original")
    assert checkpoint is not None and checkpoint.snapshot_name is None
    assert stack.kubectl("get", "volumesnapshots", check=False).returncode != 0  # no such API

    with DaemonsPerWorkspace(stack, pvc) as daemons:
        twins = [restoring("twin-a", checkpoint.ref), restoring("twin-b", checkpoint.ref)]
        stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(twins))

        def settled() -> bool:
            phases = {stack.status("default", t).get("phase") for t in ("twin-a", "twin-b")}
            return phases == {"Running", "Failed"}

        wait_until(settled, 120, "one twin Running, the other Failed")
        winner, loser = sorted(
            ("twin-a", "twin-b"), key=lambda t: stack.status("default", t)["phase"] != "Running"
        )
        message = refused(stack, loser, "WorkspaceInUse")
        # The winner's phase when the loser looked (it may still have been starting).
        assert f"PVC {pvc} is held by task default/{winner} (" in message
        assert stack.pvc_of(winner) == pvc
        saved = checkpoint.agents[0].turns
        wait_until(lambda: max(stack.turns_on_disk(pvc).values()) > saved + 1, 60,
                   f"{winner}'s agent to continue")  # fmt: skip
    assert daemons.most == 1, f"daemons on one workspace at once: {daemons.seen}"
    for twin in (loser, winner):
        stack.kubectl("delete", "ctask", twin, timeout=120)


def test_a_restore_while_the_original_task_is_only_suspended_is_refused(
    stack: DevStack,
) -> None:
    """Tried: a task paused (``suspend: true``), then a restore of its pause checkpoint
    while the paused task still exists and owns the workspace."""
    assert stack.apply(task_manifest("napping", agents=1)).returncode == 0
    stack.wait_phase("default", "napping", "Running")
    pvc = stack.pvc_of("napping")
    stack.wait_turns(pvc, 1, 2)
    stack.kubectl("patch", "ctask", "napping", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "napping", "Suspended", timeout=120)
    ref = stack.status("default", "napping")["checkpointRef"]

    with DaemonsPerWorkspace(stack, pvc) as daemons:
        assert stack.apply(restoring("impatient", ref)).returncode == 0
        message = refused(stack, "impatient", "WorkspaceInUse")
        assert f"PVC {pvc} is held by task default/napping (Suspended)" in message
        # The paused task is untouched and wakes on its own workspace.
        stack.kubectl("patch", "ctask", "napping", "--type", "merge", "-p", RESUME)
        stack.wait_phase("default", "napping", "Running", timeout=120)
    assert daemons.most == 1, f"daemons on one workspace at once: {daemons.seen}"
    for name in ("impatient", "napping"):
        stack.kubectl("delete", "ctask", name, timeout=120)


def test_an_older_checkpoint_of_a_workspace_is_refused_naming_the_newest(
    stack: DevStack,
) -> None:
    """Tried: a task paused (checkpoint 1), woken, run on, deleted (checkpoint 2), then a
    restore of checkpoint 1, whose state the PVC no longer holds."""
    assert stack.apply(task_manifest("moved-on", agents=1)).returncode == 0
    stack.wait_phase("default", "moved-on", "Running")
    pvc = stack.pvc_of("moved-on")
    stack.wait_turns(pvc, 1, 2)
    stack.kubectl("patch", "ctask", "moved-on", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "moved-on", "Suspended", timeout=120)
    first = stack.status("default", "moved-on")["checkpointRef"]
    stack.kubectl("patch", "ctask", "moved-on", "--type", "merge", "-p", RESUME)
    stack.wait_phase("default", "moved-on", "Running", timeout=120)
    stack.kubectl("delete", "ctask", "moved-on", timeout=120)
    newest = stack.ledger.latest_checkpoint("default", "moved-on")
    assert newest is not None and newest.ref != first
    on_disk = stack.turns_on_disk(pvc)

    assert stack.apply(restoring("back-in-time", first)).returncode == 0
    message = refused(stack, "back-in-time", "CheckpointSuperseded")
    assert f"PVC {pvc} has moved on to the newer checkpoint {newest.ref}" in message
    assert f"restore {newest.ref}" in message
    assert stack.turns_on_disk(pvc) == on_disk  # nothing ran on the workspace
    # The newest checkpoint is restorable, by one task.
    assert stack.apply(restoring("forward", newest.ref)).returncode == 0
    stack.wait_phase("default", "forward", "Running", timeout=120)
    for name in ("back-in-time", "forward"):
        stack.kubectl("delete", "ctask", name, timeout=120)


def test_a_workspace_deleted_with_its_task_takes_its_checkpoints_with_it(stack: DevStack) -> None:
    """Tried: a task with ``onDelete: delete`` paused (a checkpoint, which without
    snapshots is its PVC alone), woken, then deleted: its PVC goes with it, and the
    ledger must say the pause's checkpoint can no longer be restored rather than keep
    calling it restorable (the audit would report it WorkspaceMissing)."""
    manifest = task_manifest("ephemeral", agents=1, onDelete="delete")
    assert stack.apply(manifest).returncode == 0
    stack.wait_phase("default", "ephemeral", "Running")
    pvc = stack.pvc_of("ephemeral")
    stack.wait_turns(pvc, 1, 2)
    stack.kubectl("patch", "ctask", "ephemeral", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "ephemeral", "Suspended")
    stack.kubectl("patch", "ctask", "ephemeral", "--type", "merge", "-p", RESUME)
    stack.wait_phase("default", "ephemeral", "Running")
    paused = stack.ledger.latest_checkpoint("default", "ephemeral")
    assert paused is not None and paused.available
    stack.kubectl("delete", "ctask", "ephemeral", timeout=120)
    wait_until(lambda: stack.kubectl("get", "pvc", pvc, check=False).returncode != 0, 60,
               f"PVC {pvc} to go with its task")  # fmt: skip
    gone = stack.ledger.get_checkpoint(paused.ref)
    assert gone is not None and gone.unavailable is not None
    assert f"its workspace PVC {pvc} was deleted with task default/ephemeral" in gone.unavailable
    assert "CheckpointsReleased" in [e["reason"] for e in stack.events_of("ephemeral")]
    assert stack.audit_findings() == []


@pytest.mark.timeout(900)
def test_restores_racing_a_prune_either_keep_their_checkpoint_or_are_refused(
    stack: DevStack,
) -> None:
    """As ``test_checkpoints.py``'s race, without snapshots: the restore claims the
    checkpoint's retained PVC, which the prune would delete under it. Tried: 2 rounds of
    10 tasks deleted, then ``drainctl ledger prune --keep 0`` with 800 older checkpoints
    of gone tasks, and a restore of each deleted task applied while the prune runs.
    20 races."""
    run_races(stack, "without snapshots")
