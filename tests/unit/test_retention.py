"""Which checkpoints ``drainctl ledger prune`` releases (``retention.plan_prune``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from orchestrator.ledger import CheckpointReason, CheckpointView
from orchestrator.operator.retention import PruneAction, PruneItem, plan_prune

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def checkpoint(
    n: int, *, uid: str = "uid-a", pvc: str | None = "ws-a", hours_ago: float = 0, **extra: object
) -> CheckpointView:
    return CheckpointView(
        id=n, ref=f"ckpt-{n}", operation_id=f"op-{n}", task_uid=uid, namespace="ns",
        name=f"task-{uid}", reason=CheckpointReason.PAUSE, pvc_name=pvc, forced=False,
        verified=True, created_at=NOW - timedelta(hours=hours_ago), agents=(),
        snapshot_name=f"ckpt-{n}", snapshot_ready_at=NOW, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def by_ref(items: list[PruneItem]) -> dict[str, tuple[PruneAction, str | None, str]]:
    return {i.ref: (i.action, i.pvc, i.why) for i in items}


def test_the_newest_per_task_stay_and_the_older_are_released_with_their_snapshots() -> None:
    history = [checkpoint(n, hours_ago=10 - n) for n in range(1, 6)]  # ckpt-5 newest
    items = plan_prune(history, keep=2, older_than_secs=0, now=NOW, named_by_tasks={}, held_pvcs={})
    plan = by_ref(items)
    assert [i.ref for i in items] == ["ckpt-5", "ckpt-4", "ckpt-3", "ckpt-2", "ckpt-1"]
    assert {r for r, (a, _, _) in plan.items() if a is PruneAction.KEEP} == {"ckpt-5", "ckpt-4"}
    released = [i for i in items if i.action is PruneAction.RELEASE]
    assert [i.snapshot for i in released] == ["ckpt-3", "ckpt-2", "ckpt-1"]
    # The shared retained PVC holds the kept ckpt-5: it is never released with the old.
    assert all(i.pvc is None and "a kept checkpoint is on it" in i.why for i in released)


def test_a_checkpoint_a_live_task_names_stays_whatever_its_age() -> None:
    history = [checkpoint(n, hours_ago=100 - n) for n in range(1, 4)]
    named = {"ckpt-1": "restored by task ns/twin (spec.resumeFrom)"}
    plan = by_ref(
        plan_prune(history, keep=1, older_than_secs=0, now=NOW, named_by_tasks=named, held_pvcs={})
    )
    assert plan["ckpt-1"] == (PruneAction.KEEP, None, "restored by task ns/twin (spec.resumeFrom)")
    assert plan["ckpt-2"][0] is PruneAction.RELEASE
    assert plan["ckpt-3"][0] is PruneAction.KEEP


def test_a_pvc_is_released_only_when_nothing_kept_is_on_it_and_no_live_task_owns_it() -> None:
    old_a = checkpoint(1, uid="uid-a", pvc="ws-a", hours_ago=50)
    new_a = checkpoint(2, uid="uid-a", pvc="ws-a2", hours_ago=1)
    old_b = checkpoint(3, uid="uid-b", pvc="ws-b", hours_ago=50)
    new_b = checkpoint(4, uid="uid-b", pvc="ws-b2", hours_ago=1)
    items = plan_prune(
        [old_a, new_a, old_b, new_b], keep=1, older_than_secs=0, now=NOW, named_by_tasks={},
        held_pvcs={("ns", "ws-b"): "task ns/restored"},
    )  # fmt: skip
    plan = by_ref(items)
    assert plan["ckpt-1"] == (PruneAction.RELEASE, "ws-a", "PVC ws-a released")
    assert plan["ckpt-3"] == (
        PruneAction.RELEASE, None, "PVC ws-b kept: the workspace of task ns/restored"
    )  # fmt: skip


def test_young_checkpoints_and_released_ones_are_left_alone() -> None:
    young = checkpoint(1, hours_ago=2)
    gone = checkpoint(2, hours_ago=0.5, unavailable="released by drainctl ledger prune")
    newest = checkpoint(3, hours_ago=0)
    items = plan_prune(
        [young, gone, newest], keep=1, older_than_secs=24 * 3600, now=NOW, named_by_tasks={},
        held_pvcs={},
    )  # fmt: skip
    plan = by_ref(items)
    assert "ckpt-2" not in plan
    assert plan["ckpt-1"] == (PruneAction.KEEP, None, "younger than 86400s")
