"""Payloads are validated where they are received: the orchestrator's tasks fail the
operation with a clear reason for a malformed drain or resume result (never a crash
loop), drop a malformed heartbeat, and record a drained operation with one write.

The tasks run in this process (a Celery task called directly runs its body) against a
real SQLite ledger, configured the way ``drainctl worker`` is: ``DRAIN_DATABASE_URL``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from orchestrator.ledger import (
    CheckpointReason,
    Ledger,
    OperationKind,
    OperationState,
    OperationView,
    upgrade,
)
from orchestrator.ledger.models import Operation
from orchestrator.operator.lifecycle import Phase, idle_report, parse_spec, should_idle_pause
from orchestrator.pipeline import tasks
from orchestrator.pipeline.start import wait_for_operations
from orchestrator.settings import get_settings
from tests.unit.test_pipeline_parts import CONFIG, FakeClock
from worker_agent.consumer import Heartbeat
from worker_agent.contract import DrainResult
from worker_agent.proto import AgentRecord, AgentStatus, ResumeRef, SpawnSpec

SHA = "cd" * 32
REF = {"id": "agent-a", "session_dir": "agents/agent-a", "turns": 2, "session_sha256": SHA,
       "clean": True, "exit": 0, "error": None}  # fmt: skip


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    monkeypatch.setenv("DRAIN_DATABASE_URL", url)
    get_settings.cache_clear()
    tasks.get_ledger.cache_clear()
    yield tasks.get_ledger()
    tasks.get_ledger().dispose()
    get_settings.cache_clear()
    tasks.get_ledger.cache_clear()


def begin(ledger: Ledger, kind: OperationKind = OperationKind.DELETE_DRAIN) -> str:
    op = ledger.begin_operation(
        kind, task_uid="uid-1", namespace="team-a", name="task-1", idempotency_key=f"k-{kind}"
    )
    return ledger.transition(
        op.id, OperationState.RESUMING if kind is OperationKind.RESUME else OperationState.DRAINING
    ).id


def drain_result(op_id: str, **changes: object) -> dict[str, object]:
    return {"op_id": op_id, "namespace": "team-a", "name": "task-1", "refs": [REF],
            "error": None, **changes}  # fmt: skip


def test_a_drain_result_records_the_checkpoint(ledger: Ledger) -> None:
    op_id = begin(ledger)

    outcome = tasks.record_checkpoint(drain_result(op_id), op_id=op_id, reason="delete")

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RECORDED
    assert outcome == {"op_id": op_id, "checkpoint_ref": op.checkpoint_ref, "agents": 1,
                       "error": None}  # fmt: skip
    checkpoint = ledger.get_checkpoint(str(op.checkpoint_ref))
    assert checkpoint is not None and checkpoint.reason is CheckpointReason.DELETE
    assert [a.resume_ref().model_dump(mode="json") for a in checkpoint.agents] == [REF]


def test_a_drain_result_moves_its_operation_to_recorded_in_one_write(ledger: Ledger) -> None:
    """Tried: the operation was first written ``drained``, then ``recorded`` in a second
    transaction: a commit (an fsync) more on every drain's path, read by nobody."""
    op_id = begin(ledger)
    written: list[str] = []

    def states(session: Session, *_: object) -> None:
        written.extend(o.state for o in session.dirty if isinstance(o, Operation))

    event.listen(Session, "before_flush", states)
    try:
        tasks.record_checkpoint(drain_result(op_id), op_id=op_id, reason="delete")
    finally:
        event.remove(Session, "before_flush", states)

    assert written == [OperationState.RECORDED]
    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RECORDED


def test_a_drain_result_is_recorded_in_one_transaction_with_no_read_before_it(
    ledger: Ledger,
) -> None:
    """Tried: the task-uid check read the operation in a transaction of its own before the
    record's: one more round trip to the ledger on every drain's path (~1 ms)."""
    op_id = begin(ledger)
    ledger.get_operation(op_id)  # the pool's connection is open before counting
    began: list[object] = []
    engine = ledger._engine  # the transactions this ledger opens

    def begin_seen(connection: object) -> None:
        began.append(connection)

    event.listen(engine, "begin", begin_seen)
    try:
        tasks.record_checkpoint(drain_result(op_id, task_uid="uid-1"), op_id=op_id,
                                reason="delete")  # fmt: skip
    finally:
        event.remove(engine, "begin", begin_seen)

    assert len(began) == 1
    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RECORDED


def test_refs_from_the_daemon_of_another_task_uid_are_not_recorded(ledger: Ledger) -> None:
    """Tried: a drain answered by the daemon of a task re-created under the same name (its
    uid differs): no checkpoint listing the new task's agents under the old one's."""
    op_id = begin(ledger)

    outcome = tasks.record_checkpoint(
        drain_result(op_id, task_uid="uid-2"), op_id=op_id, reason="delete"
    )

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.FAILED
    assert op.error == (
        "drain refused by the ledger: the daemon that answered serves task uid uid-2, the "
        "operation is for uid-1"
    )
    assert outcome["checkpoint_ref"] is None
    assert ledger.list_checkpoints("team-a", "task-1") == []


@pytest.mark.parametrize("answered_by", ["uid-1", None], ids=["same-uid", "no-uid"])
def test_refs_from_the_tasks_own_daemon_or_one_without_a_uid_are_recorded(
    ledger: Ledger, answered_by: str | None
) -> None:
    op_id = begin(ledger)
    result = drain_result(op_id) if answered_by is None else drain_result(
        op_id, task_uid=answered_by
    )  # fmt: skip

    tasks.record_checkpoint(result, op_id=op_id, reason="delete")

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RECORDED


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ("not an object", "drain failed: malformed drain result from the daemon: (payload):"),
        (
            {"refs": [{**REF, "clean": "yes"}]},
            "drain failed: malformed drain result from the daemon: refs.0.clean: Input should "
            "be a valid boolean",
        ),
        (
            {"refs": [{k: v for k, v in REF.items() if k != "turns"}]},
            "drain failed: malformed drain result from the daemon: refs.0.turns: Field required",
        ),
        ({"error": "supervisor unreachable: refused"}, "drain failed: supervisor unreachable"),
        (
            {"refs": [{**REF, "session_dir": "/etc"}]},
            "drain result not recordable: resume ref of agent 'agent-a': session_dir '/etc' "
            "must be relative to the PVC root",
        ),
    ],
    ids=["not-an-object", "wrong-type", "missing-key", "daemon-error", "outside-the-pvc"],
)
def test_a_bad_drain_result_fails_the_operation_with_the_reason(
    ledger: Ledger, result: object, reason: str
) -> None:
    op_id = begin(ledger)
    received = drain_result(op_id, **result) if isinstance(result, dict) else result

    outcome = tasks.record_checkpoint(received, op_id=op_id, reason="delete")

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.FAILED
    assert op.error is not None and op.error.startswith(reason), op.error
    assert outcome["checkpoint_ref"] is None and outcome["error"]
    assert ledger.list_checkpoints() == []


def test_malformed_record_checkpoint_kwargs_are_answered_not_raised(ledger: Ledger) -> None:
    op_id = begin(ledger)

    outcome = tasks.record_checkpoint(drain_result(op_id), op_id=op_id, reason="whim")

    assert outcome["checkpoint_ref"] is None
    assert "malformed record_checkpoint kwargs: reason" in str(outcome["error"])
    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.DRAINING  # left for the sweeper


def test_a_malformed_resume_result_fails_the_resume(ledger: Ledger) -> None:
    op_id = begin(ledger, OperationKind.RESUME)

    tasks.record_resume({"op_id": op_id, "results": [{"id": "a"}], "error": None}, op_id=op_id)

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.FAILED
    assert op.error == ("malformed resume result from the daemon: results.0.ok: Field required")


def test_a_resume_result_keeps_each_outcome_in_the_wire_shape(ledger: Ledger) -> None:
    op_id = begin(ledger, OperationKind.RESUME)
    results = [{"id": "a", "ok": True}, {"id": "b", "ok": False, "error": "gone"}]

    tasks.record_resume({"op_id": op_id, "results": results, "error": None}, op_id=op_id)

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RESUMED
    assert op.detail == {"results": results} and op.error == "b: gone"


def test_a_malformed_heartbeat_is_dropped_and_a_good_one_kept(ledger: Ledger) -> None:
    beat = {"namespace": "team-a", "name": "task-1", "task_uid": None, "seq": 5,
            "reported_at": 1700000000.0, "agents_total": 2, "agents_live": 2,
            "agents_idle": 2, "all_idle_since": 1700000000.0}  # fmt: skip

    tasks.activity(**{**beat, "agents_idle": "2"})
    tasks.activity(**{**beat, "agents_idle": 3})  # more idle than live
    assert ledger.get_activity("team-a", "task-1") is None

    tasks.activity(**beat)
    kept = ledger.get_activity("team-a", "task-1")
    assert kept is not None and (kept.seq, kept.agents_idle) == (5, 2)


@pytest.mark.parametrize("skew", [-86400.0, 0.0, 86400.0], ids=["-1d", "none", "+1d"])
def test_a_heartbeat_is_timed_by_its_idle_duration_and_arrival_whatever_the_daemons_clock(
    ledger: Ledger, skew: float
) -> None:
    now = time.time()
    wall, monotonic = FakeClock(now + skew), FakeClock(1000.0)
    sender = Heartbeat(CONFIG, wall=wall, monotonic=monotonic)
    idle = [AgentRecord.model_validate(dict(
        id="a", status=AgentStatus.IDLE, spec=SpawnSpec(), session_dir="/s/a", created_at=0.0,
        updated_at=wall.now, idle_since=wall.now))]  # fmt: skip
    assert sender.report(idle) is not None  # the period begins
    monotonic.now += 595
    due = sender.report(idle)
    assert due is not None

    tasks.activity(**due[1].model_dump(mode="json"))

    stored = ledger.get_activity("team-a", "task-1")
    assert stored is not None and stored.idle_for_secs == 595.0
    assert stored.received_at is not None
    assert abs((stored.received_at - datetime.now(UTC)).total_seconds()) < 60
    ten_minutes = parse_spec({"lifecycle": {"idleTimeout": "10m"}})
    report = idle_report(stored)
    at_arrival, gap_later = stored.received_at, stored.received_at + timedelta(seconds=16)
    assert not should_idle_pause(ten_minutes, Phase.RUNNING, report, at_arrival, 16.0)
    assert should_idle_pause(ten_minutes, Phase.RUNNING, report, gap_later, 16.0)


def test_a_drained_operation_past_its_deadline_says_the_record_was_late(ledger: Ledger) -> None:
    op = ledger.begin_operation(
        OperationKind.PAUSE, task_uid="u", namespace="team-a", name="task-1",
        idempotency_key="late", deadline_at=datetime.now(UTC) - timedelta(seconds=1),
    )  # fmt: skip
    ledger.transition(op.id, OperationState.DRAINED)

    assert tasks.sweep_overdue(ledger, stored_drain=lambda _: tasks.StoredDrain.NOT_FINISHED) == [
        op.id
    ]

    failed = ledger.get_operation(op.id)
    assert failed is not None and failed.error is not None
    assert "drained its agents but the checkpoint was not recorded in time" in failed.error


def serve(monkeypatch: pytest.MonkeyPatch, store: Path, task_uid: str | None) -> None:
    """The consumer's tasks configured for team-a/task-1 on ``store``, as ``main`` does,
    its supervisor's socket absent."""
    from worker_agent.consumer import ConsumerConfig, ConsumerTask

    config = ConsumerConfig(
        socket=store / "absent.sock", store=store, namespace="team-a", name="task-1",
        task_uid=task_uid,
    )  # fmt: skip
    monkeypatch.setattr(ConsumerTask, "pod", config)


def test_the_consumer_answers_a_malformed_drain_request_with_an_error_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker_agent import consumer

    serve(monkeypatch, tmp_path, task_uid=None)

    answer = consumer.drain(op_id="op-1", grace_secs="soon")

    assert answer == {
        "op_id": "op-1", "namespace": "team-a", "name": "task-1", "refs": [],
        "error": "malformed drain request: grace_secs: Input should be a valid number",
    }  # fmt: skip
    assert not (tmp_path / "ops").exists()  # nothing journaled: nothing was drained


@pytest.mark.parametrize("verb", ["drain", "resume"])
def test_a_message_for_another_task_uid_is_refused_answered_and_journaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    """Tried: a drain and a resume a deleted task left in the queue, consumed by the daemon
    of the task re-created under its name. The supervisor's socket is absent: a refusal
    never reaches it (an attempt would answer "supervisor unreachable" instead)."""
    from worker_agent import consumer
    from worker_agent.contract import ResumeResult
    from worker_agent.journal import OperationJournal

    serve(monkeypatch, tmp_path, task_uid="new-uid")

    if verb == "drain":
        answer = consumer.drain(op_id="op-1", grace_secs=5.0, task_uid="old-uid")
    else:
        answer = consumer.resume(op_id="op-1", agents=[], task_uid="old-uid")

    reason = (
        "refused: the message is for task uid old-uid, this daemon serves team-a/task-1 uid "
        "new-uid (a message of a deleted task of the same name)"
    )
    assert answer["error"] == reason
    journal = OperationJournal(tmp_path)
    journaled = (
        journal.get("op-1", "drain", DrainResult)
        if verb == "drain"
        else journal.get("op-1", "resume", ResumeResult)
    )
    assert journaled is not None and journaled.error == reason


def test_a_torn_journal_entry_counts_as_absent(tmp_path: Path) -> None:
    from worker_agent.contract import DrainResult
    from worker_agent.journal import OperationJournal

    journal = OperationJournal(tmp_path)
    result = DrainResult(op_id="op-1", namespace="n", name="t", refs=[], error=None)
    journal.put("op-1", "drain", result)
    assert journal.get("op-1", "drain", DrainResult) == result

    (tmp_path / "ops" / "op-1.drain.json").write_text('{"op_id": "op-1", "refs": [')
    assert journal.get("op-1", "drain", DrainResult) is None


SHA = "ab" * 32


def overdue_drain(ledger: Ledger, key: str, detail: dict[str, object] | None) -> str:
    op = ledger.begin_operation(
        OperationKind.DELETE_DRAIN, task_uid="u", namespace="team-a", name="task-1",
        idempotency_key=key, deadline_at=datetime.now(UTC) - timedelta(seconds=1),
    )  # fmt: skip
    ledger.transition(op.id, OperationState.DRAINING, detail=detail)
    return op.id


def drained(op_id: str, error: str | None = None) -> DrainResult:
    refs = [] if error else [
        ResumeRef(id="agent-1", session_dir="agents/agent-1", turns=7, session_sha256=SHA,
                  clean=True, exit=0),
    ]  # fmt: skip
    return DrainResult(op_id=op_id, namespace="team-a", name="task-1", refs=refs, error=error)


def test_an_overdue_drain_whose_daemon_answered_is_recorded_not_failed(ledger: Ledger) -> None:
    """Tried: the record message lost after the daemon drained (its result is stored)."""
    op_id = overdue_drain(
        ledger, "lost-record", {"record": {"op_id": "x", "reason": "delete", "pvc_name": "ws-1"}}
    )

    assert tasks.sweep_overdue(ledger, stored_drain=lambda op: drained(op.id)) == []

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.RECORDED and op.checkpoint_ref
    checkpoint = ledger.get_checkpoint(op.checkpoint_ref)
    assert checkpoint is not None
    assert (checkpoint.reason, checkpoint.pvc_name) == (CheckpointReason.DELETE, "ws-1")
    assert [(a.agent_id, a.turns) for a in checkpoint.agents] == [("agent-1", 7)]


def test_the_sweeper_does_not_record_refs_stored_by_the_daemon_of_another_uid(
    ledger: Ledger,
) -> None:
    op_id = overdue_drain(ledger, "other-uid", None)

    def other(op: OperationView) -> DrainResult:
        return drained(op.id).model_copy(update={"task_uid": "someone-else"})

    assert tasks.sweep_overdue(ledger, stored_drain=other) == [op_id]
    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.FAILED
    assert ledger.list_checkpoints("team-a", "task-1") == []


def test_an_overdue_drain_is_left_for_the_next_sweep_while_the_backend_is_unreachable(
    ledger: Ledger,
) -> None:
    op_id = overdue_drain(ledger, "backend-down", None)

    assert tasks.sweep_overdue(ledger, stored_drain=lambda _: tasks.StoredDrain.UNKNOWN) == []

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.DRAINING


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(lambda op: tasks.StoredDrain.NOT_FINISHED, id="drain-never-ran"),
        pytest.param(lambda op: drained(op.id, "supervisor unreachable"), id="drain-failed"),
    ],
)
def test_an_overdue_drain_that_did_not_drain_is_failed_with_the_reason(
    ledger: Ledger, stored: object
) -> None:
    op_id = overdue_drain(ledger, "never", None)

    assert tasks.sweep_overdue(ledger, stored_drain=stored) == [op_id]  # type: ignore[arg-type]

    op = ledger.get_operation(op_id)
    assert op is not None and op.state is OperationState.FAILED
    assert ledger.list_checkpoints("team-a", "task-1") == []


def test_wait_for_operations_answers_each_as_last_read_in_the_order_given(ledger: Ledger) -> None:
    finished = begin(ledger)
    tasks.record_checkpoint(drain_result(finished), op_id=finished, reason="delete")
    running = begin(ledger, OperationKind.RESUME)

    views = wait_for_operations(ledger, [running, finished], timeout=0.05)

    assert [(v.id, v.state) for v in views] == [
        (running, OperationState.RESUMING),
        (finished, OperationState.RECORDED),
    ]
    with pytest.raises(LookupError, match="no-such-op"):
        wait_for_operations(ledger, [finished, "no-such-op"], timeout=1)
