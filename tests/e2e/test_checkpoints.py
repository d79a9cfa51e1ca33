"""Checkpoints you can trust, on a cluster with CSI volume snapshots: every checkpoint is
an immutable VolumeSnapshot of its workspace, any number of tasks restore it each into
its own fresh PVC, an older checkpoint restores exactly its own state, a workspace that
is not what its checkpoint recorded is refused before any agent resumes, and
``drainctl ledger prune`` releases what it should and keeps what is in use.

``drainctl dev up`` serves the external-snapshotter's CRDs and its stand-in controller
plays the CSI driver (a snapshot is a copy of the volume's folder, a PVC with a
``dataSource`` is filled from it), so the operator's code here is a real cluster's.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.ledger import CheckpointView, OperationState
from orchestrator.operator.crd import CHECKPOINT_LABEL, TASK_LABEL, TASK_UID_LABEL
from tests.e2e.prune_race import run_races
from tests.e2e.support import DevStack, task_manifest
from tests.pipeline_support import fresh_postgres, redis_db_url
from tests.support import prompt_turns, wait_until
from worker_agent import layout
from worker_agent.session import load_session
from worker_agent.testing import DRAINCTL

pytestmark = pytest.mark.slow

SUSPEND = '{"spec": {"lifecycle": {"suspend": true}}}'
RESUME = '{"spec": {"lifecycle": {"suspend": false}}}'


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    root = Path(tempfile.mkdtemp(prefix="cd-ckpt-", dir="/tmp"))
    dev = DevStack(root, redis_db_url(db=9), fresh_postgres())
    try:
        yield dev
        assert dev.ledger_contradictions() == []
        assert dev.audit_findings() == []
    finally:
        dev.close()


def restoring(name: str, ref: str, agents: int = 1) -> dict[str, Any]:
    manifest = task_manifest(name, agents=agents)
    manifest["spec"]["resumeFrom"] = {"checkpointRef": ref}
    return manifest


def run_then_delete(stack: DevStack, name: str, agents: int = 1) -> tuple[CheckpointView, str]:
    assert stack.apply(task_manifest(name, agents=agents)).returncode == 0
    stack.wait_phase("default", name, "Running")
    pvc = stack.pvc_of(name)
    stack.wait_turns(pvc, agents, 2)
    stack.kubectl("delete", "ctask", name, timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", name)
    assert checkpoint is not None and checkpoint.verified
    return checkpoint, pvc


def sessions_of(directory: Path) -> dict[str, tuple[int, str]]:
    """Each agent's (turns, session sha256) in a volume or a snapshot's copy of one."""
    agents = layout.agents_dir(directory)
    found = {}
    for agent in sorted(agents.iterdir()) if agents.is_dir() else []:
        if layout.session_file(agent).exists():
            session = load_session(agent)
            found[agent.name] = (session.turns, session.sha256)
    return found


def recorded(checkpoint: CheckpointView) -> dict[str, tuple[int, str]]:
    return {a.agent_id: (a.turns, str(a.session_sha256)) for a in checkpoint.agents}


def user_turns(stack: DevStack, pvc: str, agent: str) -> list[int]:
    session = load_session(layout.agents_dir(stack.volume("default", pvc)) / agent)
    return prompt_turns(session.messages)


def continued(stack: DevStack, pvc: str, saved: dict[str, int]) -> Callable[[], bool]:
    """Whether every saved agent did two more turns than the checkpoint on ``pvc``."""
    return lambda: all(stack.turns_on_disk(pvc).get(a, 0) > t + 1 for a, t in saved.items())


def never(condition: Callable[[], bool], secs: float, what: str) -> None:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        assert not condition(), f"unexpected: {what}"
        time.sleep(0.1)


def pvc_spec(stack: DevStack, pvc: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(stack.kubectl("get", "pvc", pvc, "-o", "json").stdout)["spec"]
    return spec


def drainctl(stack: DevStack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRAIN_DATABASE_URL": stack.database_url}
    return subprocess.run(
        [*DRAINCTL, *args, "--kubeconfig", str(stack.kubeconfig)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip


# ------------------------------------------------------------- a snapshot per checkpoint


def test_two_tasks_restore_one_checkpoint_each_into_its_own_workspace(stack: DevStack) -> None:
    """Tried: a task deleted with a checkpoint, then ``twin-a`` and ``twin-b`` created in
    one ``kubectl apply`` with the same ``resumeFrom.checkpointRef``."""
    checkpoint, pvc = run_then_delete(stack, "original", agents=2)
    ref = checkpoint.ref
    assert checkpoint.snapshot == ref  # taken after the drain, ready before the release
    snapshot = stack.snapshot(ref)
    assert snapshot is not None and snapshot["status"]["readyToUse"] is True
    assert snapshot["spec"]["source"]["persistentVolumeClaimName"] == pvc
    labels = snapshot["metadata"]["labels"]
    assert (labels[CHECKPOINT_LABEL], labels[TASK_LABEL], labels[TASK_UID_LABEL]) == (
        ref, "original", checkpoint.task_uid
    )  # fmt: skip
    assert sessions_of(stack.snapshot_copy(ref)) == recorded(checkpoint)

    twins = [restoring("twin-a", ref, agents=2), restoring("twin-b", ref, agents=2)]
    stack.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(twins))
    for twin in ("twin-a", "twin-b"):
        stack.wait_phase("default", twin, "Running", timeout=120)
    pvc_a, pvc_b = stack.pvc_of("twin-a"), stack.pvc_of("twin-b")
    assert len({pvc, pvc_a, pvc_b}) == 3, "each twin must have its own workspace"
    for twin_pvc in (pvc_a, pvc_b):
        assert pvc_spec(stack, twin_pvc)["dataSource"] == {
            "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": ref,
        }  # fmt: skip
        pids = stack.daemon_pids(twin_pvc)
        assert pids and not set(pids) & set(
            stack.daemon_pids(pvc_a if twin_pvc == pvc_b else pvc_b)
        )
    assert stack.daemon_pids(pvc) == []  # the original's retained PVC: nobody runs on it
    saved = {a.agent_id: a.turns for a in checkpoint.agents}
    for twin_pvc in (pvc_a, pvc_b):
        wait_until(continued(stack, twin_pvc, saved), 60, f"every agent in {twin_pvc} to go on")
        for agent, turns in saved.items():
            # Each continues at turns + 1 from the checkpoint's own session.
            assert user_turns(stack, twin_pvc, agent)[: turns + 2] == list(range(1, turns + 3))
    for twin in ("twin-a", "twin-b"):
        resumed = [c for c in stack.status("default", twin)["conditions"]
                   if c["type"] == "Resumed"]  # fmt: skip
        assert [(c["status"], c["reason"]) for c in resumed] == [("True", "Resumed")]

    # Without interference: twin-a paused, twin-b goes on, twin-a's sessions do not move.
    stack.kubectl("patch", "ctask", "twin-a", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "twin-a", "Suspended", timeout=120)
    frozen = sessions_of(stack.volume("default", pvc_a))
    growing = stack.turns_on_disk(pvc_b)
    wait_until(
        lambda: all(stack.turns_on_disk(pvc_b)[a] > t + 2 for a, t in growing.items()),
        60,
        "twin-b to go on while twin-a is paused",
    )
    assert sessions_of(stack.volume("default", pvc_a)) == frozen
    assert sessions_of(stack.volume("default", pvc_b)) != frozen  # the two have diverged
    # And the checkpoint itself has not moved: its snapshot still holds what it recorded.
    assert sessions_of(stack.snapshot_copy(ref)) == recorded(checkpoint)
    for twin in ("twin-a", "twin-b"):
        stack.kubectl("delete", "ctask", twin, timeout=120)
        latest = stack.ledger.latest_checkpoint("default", twin)
        assert latest is not None and latest.snapshot is not None


def test_a_task_restored_from_its_older_checkpoint_has_exactly_that_checkpoints_state(
    stack: DevStack,
) -> None:
    """Tried: a task paused (checkpoint 1), woken, run on, deleted (checkpoint 2); then a
    restore of checkpoint 1, which the workspace PVC has long moved on from."""
    assert stack.apply(task_manifest("history", agents=1)).returncode == 0
    stack.wait_phase("default", "history", "Running")
    pvc = stack.pvc_of("history")
    stack.wait_turns(pvc, 1, 2)
    stack.kubectl("patch", "ctask", "history", "--type", "merge", "-p", SUSPEND)
    stack.wait_phase("default", "history", "Suspended", timeout=120)
    first = stack.ledger.get_checkpoint(stack.status("default", "history")["checkpointRef"])
    assert first is not None and first.snapshot == first.ref
    (agent,) = first.agents
    stack.kubectl("patch", "ctask", "history", "--type", "merge", "-p", RESUME)
    stack.wait_phase("default", "history", "Running", timeout=120)
    stack.wait_turns(pvc, 1, agent.turns + 5)
    stack.kubectl("delete", "ctask", "history", timeout=120)
    second = stack.ledger.latest_checkpoint("default", "history")
    assert second is not None and second.ref != first.ref
    assert second.agents[0].turns > agent.turns + 4

    assert stack.apply(restoring("rewind", first.ref)).returncode == 0
    stack.wait_phase("default", "rewind", "Running", timeout=120)
    rewound = stack.pvc_of("rewind")
    assert pvc_spec(stack, rewound)["dataSource"]["name"] == first.ref
    uid = stack.task("default", "rewind")["metadata"]["uid"]  # type: ignore[index]
    restore = stack.ledger.find_operation(f"{uid}:restore")
    assert restore is not None and restore.state is OperationState.RESUMED
    assert restore.checkpoint_ref == first.ref
    # It continued from checkpoint 1's turn, not from the workspace's newest one.
    transcript = layout.transcript_file(layout.agents_dir(stack.volume("default", rewound))
                                        / agent.agent_id).read_text()  # fmt: skip
    assert f'"resumed_from":{agent.turns + 1}' in transcript
    assert f'"resumed_from":{second.agents[0].turns + 1}' not in transcript
    assert user_turns(stack, rewound, agent.agent_id)[: agent.turns + 1] == list(
        range(1, agent.turns + 2)
    )
    assert sessions_of(stack.snapshot_copy(first.ref)) == recorded(first)
    stack.kubectl("delete", "ctask", "rewind", timeout=120)


def test_a_workspace_that_is_not_what_its_checkpoint_recorded_is_refused_before_any_agent(
    stack: DevStack,
) -> None:
    """Tried: a checkpoint's snapshot edited behind the ledger's back (one session's
    content changed), then a restore of it: the session sha256 check must refuse it
    before any agent resumes, and no recovery may resume it either."""
    checkpoint, _ = run_then_delete(stack, "tampered", agents=2)
    copy = stack.snapshot_copy(checkpoint.ref)
    victim = checkpoint.agents[0].agent_id
    session_file = layout.session_file(layout.agents_dir(copy) / victim)
    original = session_file.read_bytes()
    session = json.loads(original)
    session["messages"][0]["content"][0]["text"] = "edited behind the ledger's back"
    session_file.write_text(json.dumps(session))
    before = sessions_of(copy)
    assert before[victim] != recorded(checkpoint)[victim]

    assert stack.apply(restoring("tampered-again", checkpoint.ref, agents=2)).returncode == 0
    stack.wait_phase("default", "tampered-again", "Failed", timeout=120)
    status = stack.status("default", "tampered-again")
    resumed = [c for c in status["conditions"] if c["type"] == "Resumed"]
    assert [(c["status"], c["reason"]) for c in resumed] == [("False", "CheckpointMismatch")]
    assert "the workspace does not hold this checkpoint; no agent was resumed" in status["message"]
    assert f"{victim}: cannot resume {victim} from this checkpoint" in status["message"]
    warnings = [e["reason"] for e in stack.events_of("tampered-again") if e["type"] == "Warning"]
    assert warnings == ["CheckpointMismatch"]
    pvc = stack.pvc_of("tampered-again")
    # Neither agent ran a turn: not the edited one, not the intact one beside it.
    never(lambda: sessions_of(stack.volume("default", pvc)) != before, 5, "an agent to run")
    assert status.get("agents", 0) == 0
    stack.kubectl("delete", "ctask", "tampered-again", timeout=120)
    # The audit reports the tampered snapshot as long as it stays tampered.
    found = {(f["kind"], f["subject"]) for f in stack.audit()["findings"]}
    assert ("SessionMismatch", f"checkpoint {checkpoint.ref}") in found
    session_file.write_bytes(original)  # the snapshot as its checkpoint recorded it again


# ------------------------------------------------------------------- retention


def test_prune_releases_old_checkpoints_and_keeps_what_live_tasks_name(stack: DevStack) -> None:
    """Tried: a task paused and woken three times (three pause checkpoints), a second
    task restored from the first of them, a third task deleted; then ``drainctl ledger
    prune --keep 0`` as a dry run and for real."""
    assert stack.apply(task_manifest("keeper", agents=1)).returncode == 0
    stack.wait_phase("default", "keeper", "Running")
    keeper_pvc = stack.pvc_of("keeper")
    refs: list[str] = []
    for _ in range(3):
        stack.wait_turns(keeper_pvc, 1, 2 + 2 * len(refs))
        stack.kubectl("patch", "ctask", "keeper", "--type", "merge", "-p", SUSPEND)
        stack.wait_phase("default", "keeper", "Suspended", timeout=120)
        refs.append(stack.status("default", "keeper")["checkpointRef"])
        stack.kubectl("patch", "ctask", "keeper", "--type", "merge", "-p", RESUME)
        stack.wait_phase("default", "keeper", "Running", timeout=120)
    c1, c2, c3 = refs
    assert stack.apply(restoring("from-c1", c1)).returncode == 0
    stack.wait_phase("default", "from-c1", "Running", timeout=120)
    brief, brief_pvc = run_then_delete(stack, "brief")

    dry = drainctl(stack, "ledger", "prune", "--keep", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = {i["ref"]: i for i in json.loads(dry.stdout)["checkpoints"]}
    assert plan[c1]["action"] == "keep" and "restored by task default/from-c1" in plan[c1]["why"]
    assert plan[c3]["action"] == "keep" and "status.checkpointRef" in plan[c3]["why"]
    assert (plan[c2]["action"], plan[c2]["snapshot"], plan[c2]["pvc"]) == ("release", c2, None)
    assert "the workspace of task default/keeper" in plan[c2]["why"]
    assert (plan[brief.ref]["action"], plan[brief.ref]["pvc"]) == ("release", brief_pvc)
    # A dry run changes nothing.
    assert stack.snapshot(c2) is not None and stack.snapshot(brief.ref) is not None
    assert all(stack.ledger.get_checkpoint(r).available for r in (c2, brief.ref))  # type: ignore[union-attr]

    real = drainctl(stack, "ledger", "prune", "--keep", "0")
    assert real.returncode == 0, real.stderr
    assert "released" in real.stdout.splitlines()[-1]
    wait_until(lambda: stack.snapshot(c2) is None and stack.snapshot(brief.ref) is None, 30,
               "the released snapshots to be deleted")  # fmt: skip
    wait_until(lambda: stack.kubectl("get", "pvc", brief_pvc, check=False).returncode != 0, 30,
               "the released PVC to be deleted")  # fmt: skip
    assert stack.snapshot(c1) is not None and stack.snapshot(c3) is not None
    assert stack.kubectl("get", "pvc", keeper_pvc, check=False).returncode == 0
    released = stack.ledger.get_checkpoint(c2)
    assert released is not None and "released by drainctl ledger prune" in str(released.unavailable)
    assert stack.status("default", "keeper")["phase"] == "Running"
    assert stack.status("default", "from-c1")["phase"] == "Running"

    # A released checkpoint cannot be restored, and says why.
    assert stack.apply(restoring("from-c2", c2)).returncode == 0
    stack.wait_phase("default", "from-c2", "Failed", timeout=60)
    message = stack.status("default", "from-c2")["message"]
    assert "released by drainctl ledger prune" in message and "no agents were started" in message
    for name in ("from-c2", "from-c1", "keeper"):
        stack.kubectl("delete", "ctask", name, timeout=120)


@pytest.mark.timeout(900)
def test_restores_racing_a_prune_either_keep_their_checkpoint_or_are_refused(
    stack: DevStack,
) -> None:
    """Tried: 2 rounds of 10 tasks deleted, then ``drainctl ledger prune --keep 0`` with
    800 older checkpoints of gone tasks in the ledger, and a restore of each deleted
    task applied while the prune runs: after it has listed the tasks, while it reads
    the PVCs, and while it deletes. 20 races."""
    run_races(stack, "with snapshots")
