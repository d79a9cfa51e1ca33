"""``drainctl ledger prune --keep 0`` racing restores, on a live dev stack: the shared
scenario of ``test_checkpoints.py`` (with snapshots) and
``test_checkpoints_without_snapshots.py`` (without).

A round runs tasks, deletes them (a checkpoint each), then starts a prune and applies
a restore of each checkpoint while it runs, one after another across its run. The
ledger also holds older checkpoints of gone tasks, each on a PVC of its own, as a
ledger in service does: the prune reads each of those PVCs, so its plan takes seconds.
How long is measured once, by a ``--dry-run`` (the same plan, nothing released), and
the restores are spread from a quarter of it to past its end: after the prune has
listed the tasks (the race), while it reads the PVCs, and while it deletes. Every
restore must end one of two ways: Running on its checkpoint's state with the
checkpoint still available, or Failed saying the prune released it before the
restore could claim it, with no agent started. Anything else lost a checkpoint a live
task named.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from orchestrator.ledger import CheckpointReason, CheckpointView, OperationKind, OperationState
from orchestrator.ledger.models import Checkpoint, Operation
from orchestrator.ledger.repository import create_ledger_engine
from tests.e2e.support import DevStack, task_manifest
from worker_agent.testing import DRAINCTL

OLD_CHECKPOINTS = 800
"""Checkpoints of gone tasks in the ledger before each prune: what makes its plan long."""
TERMINAL = ("Running", "Failed")


@dataclass
class Tally:
    restored: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    prune_secs: list[float] = field(default_factory=list)
    said_twice: list[str] = field(default_factory=list)
    """Deleted tasks with other than one ``Checkpointed`` event."""
    plan_secs: float | None = None
    """How long a prune takes to plan (a ``--dry-run``), measured in the first round."""

    @property
    def races(self) -> int:
        return len(self.restored) + len(self.refused) + len(self.lost)


def plant_old_checkpoints(stack: DevStack, count: int, round_: int) -> None:
    """``count`` checkpoints of gone tasks, each on a PVC of its own that no longer
    exists, written to the ledger in one transaction."""
    engine = create_ledger_engine(stack.database_url)
    now = datetime.now(UTC).replace(year=2025)  # long ago: older than any real one
    try:
        with Session(engine) as session, session.begin():
            for i in range(count):
                op_id = str(uuid.uuid4())
                session.add(Operation(
                    id=op_id, kind=OperationKind.DELETE_DRAIN, task_uid=f"gone-{round_}-{i}",
                    namespace="default", name=f"gone-{round_}-{i}",
                    state=OperationState.RECORDED, idempotency_key=f"gone:{round_}:{i}",
                    checkpoint_ref=f"ckpt-gone-{round_}-{i}", celery_task_ids={},
                    created_at=now, updated_at=now, finished_at=now,
                ))  # fmt: skip
                session.flush()
                session.add(Checkpoint(
                    ref=f"ckpt-gone-{round_}-{i}", operation_id=op_id,
                    task_uid=f"gone-{round_}-{i}", namespace="default",
                    name=f"gone-{round_}-{i}", reason=CheckpointReason.DELETE,
                    pvc_name=f"gone-{round_}-{i}-ws", forced=False, verified=True,
                    created_at=now,
                ))  # fmt: skip
    finally:
        engine.dispose()


def remove_planted(stack: DevStack, round_: int) -> None:
    """The rows ``plant_old_checkpoints`` wrote, gone again: the module's audit and
    contradiction checks then read the stack's own."""
    engine = create_ledger_engine(stack.database_url)
    try:
        with Session(engine) as session, session.begin():
            session.execute(delete(Checkpoint).where(Checkpoint.ref.like(f"ckpt-gone-{round_}-%")))
            session.execute(delete(Operation).where(Operation.name.like(f"gone-{round_}-%")))
    finally:
        engine.dispose()


def restoring(name: str, ref: str) -> dict[str, Any]:
    manifest = task_manifest(name, agents=1)
    manifest["spec"]["resumeFrom"] = {"checkpointRef": ref}
    return manifest


def run_races(stack: DevStack, setup: str, rounds: int = 2, tasks: int = 10) -> None:
    """``rounds`` rounds of ``tasks`` races on ``stack`` (``setup`` names it in the line
    printed): every race ends restored or refused, none lost."""
    tally = Tally()
    for round_ in range(rounds):
        race_round(stack, tally, round_, tasks)
    print(f"prune races {setup}: {len(tally.restored)} restored, {len(tally.refused)} "
          f"refused, {len(tally.lost)} lost; planning took {tally.plan_secs:.1f} s, the "
          f"prunes {', '.join(f'{s:.1f}' for s in tally.prune_secs)} s")  # fmt: skip
    assert tally.races == rounds * tasks
    assert tally.lost == [], tally.lost
    # One event for each deletion that took a checkpoint (up to 2 * rounds * tasks).
    assert tally.said_twice == [], tally.said_twice


def race_round(stack: DevStack, tally: Tally, round_: int, tasks: int) -> None:
    """One round: ``tasks`` tasks run and are deleted, then their checkpoints are
    restored one after another, from a quarter of the prune's planning time after it
    starts to a tenth past it (``Tally.plan_secs``)."""
    names = [f"race{round_}-{i}" for i in range(tasks)]
    for name in names:
        assert stack.apply(task_manifest(name, agents=1)).returncode == 0
    for name in names:
        stack.wait_phase("default", name, "Running", timeout=120)
        stack.wait_turns(stack.pvc_of(name), 1, 2)
    stack.kubectl("delete", "ctask", *names, timeout=180)
    tally.said_twice += said_other_than_once(stack, names)
    saved = {}
    for name in names:
        checkpoint = stack.ledger.latest_checkpoint("default", name)
        assert checkpoint is not None and checkpoint.verified, name
        saved[name] = checkpoint
    plant_old_checkpoints(stack, OLD_CHECKPOINTS, round_)

    env = {**os.environ, "DRAIN_DATABASE_URL": stack.database_url}
    prune_cmd = [*DRAINCTL, "ledger", "prune", "--keep", "0", "--kubeconfig", str(stack.kubeconfig)]
    if tally.plan_secs is None:
        started = time.monotonic()
        subprocess.run([*prune_cmd, "--dry-run"], capture_output=True, env=env, check=True)
        tally.plan_secs = time.monotonic() - started
    offsets = [tally.plan_secs * (0.25 + 0.85 * i / max(1, tasks - 1)) for i in range(tasks)]
    started = time.monotonic()
    prune = subprocess.Popen(
        prune_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    for name, offset in zip(names, offsets, strict=True):
        time.sleep(max(0.0, started + offset - time.monotonic()))
        assert stack.apply(restoring(f"{name}-back", saved[name].ref)).returncode == 0
    _, err = prune.communicate(timeout=300)
    tally.prune_secs.append(time.monotonic() - started)
    assert prune.returncode == 0, err
    remove_planted(stack, round_)

    ran: list[str] = []  # the restoring tasks that ran: each deletion is a checkpoint
    for name in names:
        back = f"{name}-back"
        ref = saved[name].ref
        outcome = until_settled(stack, back)
        checkpoint = stack.ledger.get_checkpoint(ref)
        assert checkpoint is not None
        status = stack.status("default", back)
        if outcome == "Running" and checkpoint.available and continued(stack, back, saved[name]):
            tally.restored.append(f"{back}: Running on {ref}")
            ran.append(back)
        elif (
            outcome == "Failed"
            and "released by drainctl ledger prune" in str(status.get("message"))
            and "no agents were started" in str(status.get("message"))
        ):
            tally.refused.append(f"{back}: {status['message']}")
        else:
            tally.lost.append(
                f"{back}: phase {status.get('phase')} ({status.get('message')}); checkpoint "
                f"{ref} unavailable: {checkpoint.unavailable}"
            )
    stack.kubectl("delete", "ctask", *(f"{name}-back" for name in names), timeout=180)
    # A refused restore started nothing: its deletion has no checkpoint to say.
    tally.said_twice += said_other_than_once(stack, ran)


def said_other_than_once(stack: DevStack, names: list[str]) -> list[str]:
    """Of the deleted tasks ``names``, each whose deletion was not said by exactly one
    ``Checkpointed`` event (kopf may run a deletion's handler again after it succeeded)."""
    found = []
    for name in names:
        said = [e for e in stack.events_of(name) if e["reason"] == "Checkpointed"]
        if len(said) != 1:
            found.append(f"{name}: {len(said)} Checkpointed events: {said}")
    return found


def continued(stack: DevStack, name: str, checkpoint: CheckpointView, secs: float = 60) -> bool:
    """Whether every agent of ``checkpoint`` goes on past its turns on the restoring
    task's workspace within ``secs``."""
    pvc = stack.pvc_of(name)
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        on_disk = stack.turns_on_disk(pvc)
        if all(on_disk.get(a.agent_id, 0) > a.turns for a in checkpoint.agents):
            return True
        time.sleep(0.5)
    return False


def until_settled(stack: DevStack, name: str, timeout: float = 90) -> str:
    """The task's phase once Running or Failed, or the phase it is stuck in."""
    deadline = time.monotonic() + timeout
    phase = ""
    while time.monotonic() < deadline:
        phase = str(stack.status("default", name).get("phase"))
        if phase in TERMINAL:
            return phase
        time.sleep(0.5)
    return phase
