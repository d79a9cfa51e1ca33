"""The ledger's audit reads (``Ledger`` section "audit reads") against a real ledger, on
SQLite (a file in the test's tmp dir) and on PostgreSQL (127.0.0.1:5432, database
``test``).

Every row is written through the ledger's public API (``begin_operation``,
``transition``, ``record_checkpoint``, ``mark_checkpoint_unavailable``,
``record_snapshot``, ``record_activity``), except for the two drain records the API
cannot produce (an operation recorded without its checkpoint, a failed one with one):
those are written with raw SQL, as a corrupted ledger would hold them.

PostgreSQL: the tests work in a schema of their own (``search_path`` set through the
URL, as ``test_ledger_postgres`` does) instead of ``pipeline_support.fresh_postgres()``,
which drops the ledger tables of the shared ``test`` database under any other run
(end-to-end tests, another checkout) that uses them at the same time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, text, update

from orchestrator.audit.checks import Thresholds as AuditThresholds
from orchestrator.audit.checks import check_operations
from orchestrator.audit.findings import FindingKind
from orchestrator.ledger import (
    ActivityView,
    CheckpointReason,
    CheckpointView,
    Ledger,
    LedgerConflict,
    OperationKind,
    OperationState,
    OperationView,
    create_ledger_engine,
)
from orchestrator.ledger.models import Operation
from orchestrator.ledger.repository import IN_LIST_MAX
from orchestrator.settings import Settings

# The PostgreSQL fixtures of the ledger's own tests (one private schema at head for the
# module), imported so pytest finds them by name here too.
from tests.integration.test_ledger_postgres import Schema, admin, schema_at_head  # noqa: F401
from tests.pipeline_support import LEDGER_TABLES, fresh_sqlite
from worker_agent.proto import ResumeRef

NS = "default"
SHA = "cd" * 32


# ------------------------------------------------------------------------- backends


@dataclass
class Backend:
    ledger: Ledger
    raw: Engine
    """The same database for raw SQL, configured as the ledger's."""


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        url = fresh_sqlite(tmp_path)
    else:
        schema: Schema = request.getfixturevalue("schema_at_head")  # skips without a server
        url = schema.url
        engine = create_ledger_engine(url)
        with engine.begin() as connection:
            for table in LEDGER_TABLES:  # children first
                connection.execute(text(f"DELETE FROM {table}"))
        engine.dispose()
    ledger = Ledger.from_url(url)
    raw = create_ledger_engine(url)
    yield Backend(ledger, raw)
    ledger.dispose()
    raw.dispose()


@pytest.fixture
def ledger(backend: Backend) -> Ledger:
    return backend.ledger


# -------------------------------------------------------------------------- writers


def ref(agent_id: str, turns: int = 3) -> ResumeRef:
    return ResumeRef(id=agent_id, session_dir=f"agents/{agent_id}", turns=turns,
                     session_sha256=SHA, clean=True, exit=0, error=None)  # fmt: skip


def begin(
    ledger: Ledger,
    key: str,
    *,
    kind: OperationKind = OperationKind.DELETE_DRAIN,
    name: str = "task-a",
    namespace: str = NS,
    uid: str | None = None,
    checkpoint_ref: str | None = None,
    deadline_at: datetime | None = None,
) -> OperationView:
    return ledger.begin_operation(
        kind, task_uid=uid or f"uid-{name}", namespace=namespace, name=name,
        idempotency_key=key, checkpoint_ref=checkpoint_ref, deadline_at=deadline_at,
    )  # fmt: skip


def drained(
    ledger: Ledger,
    key: str,
    *,
    kind: OperationKind = OperationKind.DELETE_DRAIN,
    reason: CheckpointReason = CheckpointReason.DELETE,
    name: str = "task-a",
    namespace: str = NS,
    uid: str | None = None,
    pvc: str | None = "task-a-workspace",
    agents: tuple[str, ...] = ("a1",),
) -> CheckpointView:
    """A drain as the pipeline runs it: begun, draining, drained, its checkpoint recorded."""
    op = begin(ledger, key, kind=kind, name=name, namespace=namespace, uid=uid)
    ledger.transition(op.id, OperationState.DRAINING, expect=[OperationState.PENDING])
    ledger.transition(op.id, OperationState.DRAINED, expect=[OperationState.DRAINING])
    return ledger.record_checkpoint(op.id, [ref(a) for a in agents], reason=reason,
                                    pvc_name=pvc)  # fmt: skip


def forced(ledger: Ledger, key: str, *, name: str = "task-a", uid: str | None = None,
           pvc: str | None = "task-a-workspace") -> CheckpointView:  # fmt: skip
    """A force-delete: pending straight to forced, its checkpoint the PVC as it was."""
    op = begin(ledger, key, kind=OperationKind.FORCE_DELETE, name=name, uid=uid)
    return ledger.record_checkpoint(op.id, [], reason=CheckpointReason.FORCED, pvc_name=pvc,
                                    forced=True)  # fmt: skip


def beat(ledger: Ledger, name: str, *, seq: int, live: int, uid: str | None = None,
         age: float = 0.0) -> ActivityView:  # fmt: skip
    at = datetime.now(UTC) - timedelta(seconds=age)
    return ledger.record_activity(
        NS, name, task_uid=uid, all_idle_since=None, agents_total=2, agents_live=live,
        agents_idle=0, seq=seq, reported_at=at, idle_for_secs=None, received_at=at,
    )  # fmt: skip


# ----------------------------------------------------------- available checkpoints


def test_available_checkpoints_after_pages_by_id(ledger: Ledger) -> None:
    """Tried: seven checkpoints, the 2nd and 5th marked unavailable; pages of 2 from id 0
    until an empty page: every restorable one once, in id order, none unavailable."""
    made = [drained(ledger, f"k{i}", name=f"task-{i}", pvc=f"pvc-{i}",
                    reason=CheckpointReason.PAUSE, kind=OperationKind.PAUSE)
            for i in range(7)]  # fmt: skip
    for gone in (made[1], made[4]):
        assert ledger.mark_checkpoint_unavailable(gone.ref, "its PVC was deleted") is not None
    restorable = [c.id for i, c in enumerate(made) if i not in (1, 4)]
    assert [c.id for c in ledger.available_checkpoints_after(0, 100)] == restorable
    pages: list[list[int]] = []
    after = 0
    while page := ledger.available_checkpoints_after(after, 2):
        pages.append([c.id for c in page])
        after = page[-1].id
    assert pages == [restorable[0:2], restorable[2:4], restorable[4:5]]
    assert ledger.available_checkpoints_after(made[-1].id, 2) == []
    assert [c.id for c in ledger.available_checkpoints_after(made[1].id, 1)] == [made[2].id]
    assert [c.id for c in ledger.available_checkpoints_after(made[3].id, 1)] == [made[5].id]


def test_available_checkpoints_carry_their_agents_and_snapshot(ledger: Ledger) -> None:
    """Tried: a checkpoint of three agents with a ready snapshot: the page's view is the
    one ``get_checkpoint`` answers, agents sorted by id, ``snapshot`` the ready one."""
    ckpt = drained(ledger, "k1", agents=("b2", "a1", "c3"))
    ready = datetime.now(UTC)
    ledger.record_snapshot(ckpt.ref, "snap-1")
    ledger.record_snapshot(ckpt.ref, "snap-1", ready_at=ready)
    [page] = ledger.available_checkpoints_after(0, 10)
    assert page == ledger.get_checkpoint(ckpt.ref)
    assert [a.agent_id for a in page.agents] == ["a1", "b2", "c3"]
    assert page.snapshot == "snap-1"
    assert page.pvc_name == "task-a-workspace"


def test_available_checkpoints_limit_must_be_positive(ledger: Ledger) -> None:
    """Tried: a limit of 0 and -1 (refused before any query)."""
    for bad in (0, -1):
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            ledger.available_checkpoints_after(0, bad)


def test_count_available_checkpoints(ledger: Ledger) -> None:
    """Tried: an empty ledger, three checkpoints, one of them then unavailable (twice)."""
    assert ledger.count_available_checkpoints() == 0
    made = [drained(ledger, f"k{i}", name=f"t{i}") for i in range(3)]
    assert ledger.count_available_checkpoints() == 3
    ledger.mark_checkpoint_unavailable(made[0].ref, "gone")
    ledger.mark_checkpoint_unavailable(made[0].ref, "gone again")
    assert ledger.count_available_checkpoints() == 2


# --------------------------------------------------------------------- activities


def test_list_activities_is_each_daemons_newest_heartbeat(ledger: Ledger) -> None:
    """Tried: no heartbeat; then task-a's seq 1, 3, then a stale seq 2, and task-b's seq 7:
    one row per daemon, task-a's being seq 3."""
    assert ledger.list_activities() == []
    beat(ledger, "task-a", seq=1, live=1, uid="uid-a")
    newest = beat(ledger, "task-a", seq=3, live=2, uid="uid-a")
    beat(ledger, "task-a", seq=2, live=0, uid="uid-a")
    other = beat(ledger, "task-b", seq=7, live=0, age=120)
    listed = {(a.namespace, a.name): a for a in ledger.list_activities()}
    assert listed == {(NS, "task-a"): newest, (NS, "task-b"): other}
    assert len(ledger.list_activities()) == 2
    assert (listed[NS, "task-a"].seq, listed[NS, "task-a"].agents_live) == (3, 2)
    assert listed[NS, "task-b"].task_uid is None


# ------------------------------------------------------------------- refs


def test_existing_refs_are_those_the_ledger_holds_with_why_one_is_unavailable(
    ledger: Ledger,
) -> None:
    """Tried: two checkpoints (one unavailable) asked for among unknown refs; and an empty
    question."""
    kept = drained(ledger, "k1", name="t1")
    gone = drained(ledger, "k2", name="t2")
    ledger.mark_checkpoint_unavailable(gone.ref, "gone")
    asked = [kept.ref, gone.ref, "ckpt-nope", kept.ref]
    assert ledger.existing_refs(asked) == {kept.ref: None, gone.ref: "gone"}
    assert ledger.existing_refs(set()) == {}
    assert ledger.existing_refs(["ckpt-nope"]) == {}


def test_existing_refs_beyond_one_batch(ledger: Ledger) -> None:
    """Tried: more refs than one ``IN (...)`` takes (2.5 batches), the two real ones at
    both ends of the sorted order."""
    first = drained(ledger, "k1", name="t1")
    last = drained(ledger, "k2", name="t2")
    fake = [f"ckpt-{i:08d}" for i in range(IN_LIST_MAX * 5 // 2)]
    assert ledger.existing_refs([*fake, first.ref, last.ref]) == {first.ref: None, last.ref: None}


def test_resumed_refs_are_the_ones_a_resume_or_restore_named(ledger: Ledger) -> None:
    """Tried: checkpoints r1..r4; a resume naming r1 (then failed), a restore naming r2
    (then resumed), a pause drain and a delete drain whose own checkpoints are r3, r4
    (a drain names the ref it produced: that is no resume)."""
    r1 = drained(ledger, "p1", kind=OperationKind.PAUSE, reason=CheckpointReason.PAUSE,
                 name="t1")  # fmt: skip
    r2 = drained(ledger, "d2", name="t2")
    r3 = drained(ledger, "p3", kind=OperationKind.PAUSE, reason=CheckpointReason.PAUSE,
                 name="t3")  # fmt: skip
    r4 = drained(ledger, "d4", name="t4")
    resume = begin(ledger, "r1", kind=OperationKind.RESUME, name="t1", checkpoint_ref=r1.ref)
    ledger.expire_operation(resume.id, "the daemon never answered")
    restore = begin(ledger, "x2", kind=OperationKind.RESTORE, name="new", uid="uid-new",
                    checkpoint_ref=r2.ref)  # fmt: skip
    ledger.transition(restore.id, OperationState.RESUMING)
    ledger.transition(restore.id, OperationState.RESUMED)
    own = ledger.get_operation(r3.operation_id)
    assert own is not None
    assert own.checkpoint_ref == r3.ref
    every = [r1.ref, r2.ref, r3.ref, r4.ref, "ckpt-nope"]
    assert ledger.resumed_refs(every) == {r1.ref, r2.ref}
    assert ledger.resumed_refs([r3.ref, r4.ref]) == set()
    assert ledger.resumed_refs([]) == set()


def test_newest_refs_of_pvcs(ledger: Ledger) -> None:
    """Tried: pvc-a checkpointed by a pause and then a deletion (the newest, even once
    unavailable), pvc-b once, a pvc-a of another namespace once, and a PVC no checkpoint
    names: each asked PVC maps to its own newest ref, per namespace."""
    drained(ledger, "p1", kind=OperationKind.PAUSE, reason=CheckpointReason.PAUSE, pvc="pvc-a")
    newest_a = drained(ledger, "d1", pvc="pvc-a")
    only_b = drained(ledger, "d2", name="task-b", pvc="pvc-b")
    elsewhere = drained(ledger, "d3", namespace="other", pvc="pvc-a")
    drained(ledger, "d4", name="task-c", pvc=None)
    ledger.mark_checkpoint_unavailable(newest_a.ref, "gone")
    asked = [(NS, "pvc-a"), (NS, "pvc-b"), ("other", "pvc-a"), (NS, "pvc-none")]
    assert ledger.newest_refs_of_pvcs(asked) == {
        (NS, "pvc-a"): newest_a.ref, (NS, "pvc-b"): only_b.ref, ("other", "pvc-a"): elsewhere.ref,
    }  # fmt: skip
    assert ledger.newest_refs_of_pvcs([("other", "pvc-b")]) == {}
    assert ledger.newest_refs_of_pvcs([(NS, "pvc-b")]) == {(NS, "pvc-b"): only_b.ref}
    assert ledger.newest_refs_of_pvcs([]) == {}


def test_workspace_references(ledger: Ledger) -> None:
    """Tried: restorable checkpoints naming pvc-a (with snapshot snap-a, ready) and pvc-b
    (snapshot snap-b asked for), an unavailable one naming pvc-c and snap-c: which of the
    asked PVCs and snapshots are referenced, per namespace."""
    a = drained(ledger, "k1", pvc="pvc-a")
    ledger.record_snapshot(a.ref, "snap-a", ready_at=datetime.now(UTC))
    b = drained(ledger, "k2", name="task-b", pvc="pvc-b")
    ledger.record_snapshot(b.ref, "snap-b")
    c = drained(ledger, "k3", name="task-c", pvc="pvc-c")
    ledger.record_snapshot(c.ref, "snap-c", ready_at=datetime.now(UTC))
    ledger.mark_checkpoint_unavailable(c.ref, "gone")
    pvcs = {(NS, "pvc-a"), (NS, "pvc-b"), (NS, "pvc-c"), ("other", "pvc-a"), (NS, "pvc-x")}
    snaps = {(NS, "snap-a"), (NS, "snap-b"), (NS, "snap-c"), ("other", "snap-a")}
    assert ledger.workspace_references(pvcs, snaps) == (
        {(NS, "pvc-a"), (NS, "pvc-b")}, {(NS, "snap-a"), (NS, "snap-b")},
    )  # fmt: skip
    assert ledger.workspace_references(set(), set()) == (set(), set())


def test_workspace_references_beyond_one_batch(ledger: Ledger) -> None:
    """Tried: more PVC names than one ``IN (...)`` takes, the referenced one last."""
    drained(ledger, "k1", pvc="zz-pvc")
    asked = {(NS, f"pvc-{i:06d}") for i in range(IN_LIST_MAX + 7)} | {(NS, "zz-pvc")}
    assert ledger.workspace_references(asked, set()) == ({(NS, "zz-pvc")}, set())


# ------------------------------------------------------------------- drain records


def test_healthy_ledger_has_no_drain_record_problems(ledger: Ledger) -> None:
    """Tried: what a working system leaves: a pause and then the deletion of task-a (one
    deletion checkpoint), a forced deletion of task-b, a drain that failed without a
    checkpoint, an unfinished one, a resume and a restore."""
    pause = drained(ledger, "p1", kind=OperationKind.PAUSE, reason=CheckpointReason.PAUSE)
    resume = begin(ledger, "r1", kind=OperationKind.RESUME, checkpoint_ref=pause.ref)
    ledger.transition(resume.id, OperationState.RESUMING)
    ledger.transition(resume.id, OperationState.RESUMED)
    deletion = drained(ledger, "d1")
    forced(ledger, "f1", name="task-b")
    failed = begin(ledger, "d2", name="task-c")
    ledger.transition(failed.id, OperationState.DRAINING)
    ledger.expire_operation(failed.id, "the drain expired")
    begin(ledger, "d3", name="task-d")
    restore = begin(ledger, "x1", kind=OperationKind.RESTORE, name="task-e",
                    checkpoint_ref=deletion.ref)  # fmt: skip
    ledger.transition(restore.id, OperationState.RESUMING)
    assert ledger.drain_record_problems() == []


def test_task_with_two_deletion_checkpoints_is_a_problem(ledger: Ledger) -> None:
    """Tried: task-a's delete drain recorded (reason delete) and, under another key, a
    force-delete recorded too (reason forced): one line naming the task, its uid and
    both refs in the order they were recorded; it is a DrainRecord finding."""
    first = drained(ledger, "delete-drain:default/task-a:1")
    second = forced(ledger, "force-delete:default/task-a:1")
    assert first.operation_id != second.operation_id
    problems = ledger.drain_record_problems()
    assert [p.message for p in problems] == [
        f"task default/task-a (uid uid-task-a) has 2 deletion checkpoints, one deletion "
        f"records one: {first.ref}, {second.ref}"
    ]
    found = check_operations([], problems, datetime.now(UTC), AuditThresholds.of(Settings()),
                             {})  # fmt: skip
    assert [(f.kind, f.subject) for f in found] == [
        (FindingKind.DRAIN_RECORD, "ledger: task default/task-a")
    ]


def test_deletions_are_counted_per_task_uid(ledger: Ledger) -> None:
    """Tried: two tasks of the same name (a task deleted, then re-created with a new uid)
    each deleted once; a pause plus a deletion of a third: no problem. Then the second
    incarnation deleted again: a problem for it alone."""
    drained(ledger, "d1", uid="uid-old")
    drained(ledger, "d2", uid="uid-new")
    drained(ledger, "p3", kind=OperationKind.PAUSE, reason=CheckpointReason.PAUSE, name="t3")
    drained(ledger, "d3", name="t3")
    assert ledger.drain_record_problems() == []
    forced(ledger, "f2", uid="uid-new")
    [problem] = ledger.drain_record_problems()
    assert problem.subject == "task default/task-a"
    assert problem.message.startswith(
        "task default/task-a (uid uid-new) has 2 deletion checkpoints"
    )


def test_drain_record_problems_limit_each_kind(ledger: Ledger) -> None:
    """Tried: three tasks each deleted twice: all three lines, then ``limit=2`` two."""
    for name in ("t1", "t2", "t3"):
        drained(ledger, f"d-{name}", name=name)
        forced(ledger, f"f-{name}", name=name)
    assert len(ledger.drain_record_problems()) == 3
    assert len(ledger.drain_record_problems(limit=2)) == 2


def test_public_api_cannot_record_without_a_checkpoint(ledger: Ledger) -> None:
    """Tried: reaching ``recorded`` (or ``forced``) without a checkpoint, and a failed
    operation with one, through the public API: every way is refused, so these drain
    records arise only from a ledger written some other way (next tests)."""
    op = begin(ledger, "k1")
    for state in (OperationState.RECORDED, OperationState.FORCED):
        with pytest.raises(ValueError, match="entered only by record_checkpoint"):
            ledger.transition(op.id, state)
    ledger.expire_operation(op.id, "expired")
    with pytest.raises(LedgerConflict, match="finished without a checkpoint"):
        ledger.record_checkpoint(op.id, [ref("a1")], reason=CheckpointReason.DELETE)
    recorded = drained(ledger, "k2", name="t2")
    assert ledger.expire_operation(recorded.operation_id, "late").state is OperationState.RECORDED
    with pytest.raises(LedgerConflict, match="it has finished"):
        ledger.transition(recorded.operation_id, OperationState.FAILED)
    assert ledger.drain_record_problems() == []


def test_operation_recorded_without_checkpoint_is_a_problem(backend: Backend) -> None:
    """Tried: a draining operation set to ``recorded`` by raw SQL (no checkpoint row), and
    one to ``forced``: a line each, naming the operation, its kind, task and state."""
    ledger = backend.ledger
    recorded = begin(ledger, "k1")
    ledger.transition(recorded.id, OperationState.DRAINING)
    force = begin(ledger, "k2", kind=OperationKind.FORCE_DELETE, name="task-b")
    with backend.raw.begin() as connection:
        connection.execute(update(Operation).where(Operation.id == recorded.id)
                           .values(state=OperationState.RECORDED.value))  # fmt: skip
        connection.execute(update(Operation).where(Operation.id == force.id)
                           .values(state=OperationState.FORCED.value))  # fmt: skip
    assert sorted(p.message for p in ledger.drain_record_problems()) == sorted([
        f"operation {recorded.id} (delete-drain of default/task-a) is recorded but the ledger "
        "holds no checkpoint for it",
        f"operation {force.id} (force-delete of default/task-b) is forced but the ledger "
        "holds no checkpoint for it",
    ])  # fmt: skip
    found = check_operations([], ledger.drain_record_problems(), datetime.now(UTC),
                             AuditThresholds.of(Settings()), {})  # fmt: skip
    assert sorted(f.subject for f in found) == sorted(
        [f"ledger: operation {recorded.id}", f"ledger: operation {force.id}"]
    )


def test_failed_operation_with_a_checkpoint_is_a_problem(backend: Backend) -> None:
    """Tried: a recorded drain set to ``failed`` by raw SQL, its checkpoint kept."""
    ledger = backend.ledger
    ckpt = drained(ledger, "k1")
    with backend.raw.begin() as connection:
        connection.execute(update(Operation).where(Operation.id == ckpt.operation_id)
                           .values(state=OperationState.FAILED.value, error="boom"))  # fmt: skip
    assert [p.message for p in ledger.drain_record_problems()] == [
        f"operation {ckpt.operation_id} (delete-drain of default/task-a) failed (boom) yet "
        f"recorded checkpoint {ckpt.ref}"
    ]
