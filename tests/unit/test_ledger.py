"""The checkpoint ledger's behaviour, pinned on SQLite (a file in the test's tmp dir).

``LedgerBehaviour`` holds every scenario once; ``TestLedgerOnSQLite`` runs it here and
``tests/integration/test_ledger_postgres.py`` runs the same class against a real
PostgreSQL. A backend supplies two fixtures: ``database_url`` (a blank database, for the
migration scenarios) and ``migrated_url`` (a database at head with empty tables).
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import (
    Engine,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from orchestrator.ledger import (
    CheckpointReason,
    CheckpointStorageView,
    Ledger,
    LedgerConflict,
    LedgerError,
    NewOperation,
    OperationKind,
    OperationMove,
    OperationState,
    OperationView,
    SnapshotMove,
    UnknownOperation,
    checkpoint_ref_for,
    create_ledger_engine,
    current,
    downgrade,
    head,
    is_label_value,
    upgrade,
    upgrade_sql,
)
from orchestrator.ledger.models import Base, Checkpoint, CheckpointAgent, Operation
from orchestrator.ledger.repository import (
    IN_LIST_MAX,
    _checkpoint_view,
    _in_chunks,
    _operation_view,
    _unsettled_snapshots_query,
)
from worker_agent.proto import ResumeRef

T = TypeVar("T")

LEDGER_TABLES = {"operations", "checkpoints", "checkpoint_agents", "daemon_activity"}
SHA = "ab" * 32
THREADS = 8
PLUS_TWO = timezone(timedelta(hours=2))


def resume_ref(agent_id: str, **overrides: Any) -> ResumeRef:
    """A ``ResumeRef`` as the daemon's drain answers it (``worker_agent.proto``)."""
    ref: dict[str, Any] = {
        "id": agent_id,
        "session_dir": f"agents/{agent_id}",
        "turns": 3,
        "session_sha256": SHA,
        "clean": True,
        "exit": 0,
        "error": None,
    }
    ref.update(overrides)
    return ResumeRef(**ref)


def begin(
    ledger: Ledger,
    key: str = "delete-drain:default/task-a:1",
    kind: OperationKind = OperationKind.DELETE_DRAIN,
    name: str = "task-a",
    **extra: Any,
) -> OperationView:
    return ledger.begin_operation(
        kind,
        task_uid=f"uid-{name}",
        namespace="default",
        name=name,
        idempotency_key=key,
        **extra,
    )


@contextlib.contextmanager
def commits() -> Iterator[list[int]]:
    """Counts the commits of every engine while the block runs (``[n]`` after it)."""
    counted = [0]

    def count(_connection: object) -> None:
        counted[0] += 1

    event.listen(Engine, "commit", count)
    try:
        yield counted
    finally:
        event.remove(Engine, "commit", count)


@contextlib.contextmanager
def values_bound_per_select(prefix: str) -> Iterator[list[int]]:
    """For each SELECT of every engine while the block runs, how many of its bound
    parameters are strings starting with ``prefix`` (a SELECT binding none is left out)."""
    counted: list[int] = []

    def count(
        _connection: object, _cursor: object, statement: str, parameters: Any, *_: object
    ) -> None:
        if not statement.lstrip().upper().startswith("SELECT"):
            return
        values = parameters.values() if isinstance(parameters, dict) else parameters
        bound = sum(isinstance(value, str) and value.startswith(prefix) for value in values)
        if bound:
            counted.append(bound)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield counted
    finally:
        event.remove(Engine, "before_cursor_execute", count)


def advance_unknown(ledger: Ledger, op_ids: list[str]) -> None:
    with pytest.raises(UnknownOperation):
        ledger.advance_operations(
            [OperationMove(op_id) for op_id in op_ids],
            OperationState.DRAINING,
            expect=[OperationState.PENDING],
        )


def begin_each(ledger: Ledger, keys: list[str]) -> None:
    ledger.begin_operations([
        NewOperation(OperationKind.PAUSE, task_uid=f"uid-{key}", namespace="default",
                     name=f"task-{key}", idempotency_key=key)
        for key in keys
    ])  # fmt: skip


QUESTIONS_ABOUT_MANY_VALUES = [
    pytest.param(begin_each, [500, 1], id="begin_operations-idempotency-keys"),
    pytest.param(Ledger.get_operations, [500, 1], id="get_operations"),
    pytest.param(Ledger.operation_states, [500, 1], id="operation_states"),
    pytest.param(advance_unknown, [500, 1], id="advance_operations-locks"),
    pytest.param(Ledger.existing_refs, [500, 1], id="existing_refs"),
    pytest.param(Ledger.resumed_refs, [500, 1], id="resumed_refs"),
    pytest.param(lambda ledger, names: ledger.newest_refs_of_pvcs(
        [("default", name) for name in names]), [500, 1], id="newest_refs_of_pvcs"),
    pytest.param(lambda ledger, names: ledger.workspace_references(
        [("default", name) for name in names], [("default", name) for name in names]),
        [500, 1, 500, 1], id="workspace_references-pvcs-then-snapshots"),
]  # fmt: skip
"""Every ledger call that puts a caller's collection into ``IN (…)``, asked about 501
values: how many of them each of its SELECTs binds."""


def rows(database: Engine, table: str) -> int:
    with database.connect() as connection:
        count = connection.execute(select(func.count()).select_from(text(table))).scalar_one()
    return int(count)


def all_at_once(count: int, call: Callable[[], T]) -> list[T]:
    """``call`` from ``count`` threads released together by a barrier."""
    barrier = threading.Barrier(count)

    def run() -> T:
        barrier.wait(timeout=10)
        return call()

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(run) for _ in range(count)]
        return [future.result(timeout=30) for future in futures]


def one_heartbeat(ledger: Ledger, **overrides: Any) -> Any:
    """``record_activity`` of default/task-a: one idle agent, ``overrides`` changed."""
    now = datetime.now(UTC)
    heartbeat: dict[str, Any] = {
        "task_uid": None, "all_idle_since": None, "agents_total": 1, "agents_live": 1,
        "agents_idle": 1, "seq": 1, "reported_at": now, "idle_for_secs": None,
        "received_at": now,
    }  # fmt: skip
    return ledger.record_activity("default", "task-a", **{**heartbeat, **overrides})


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names())
    finally:
        engine.dispose()


class LedgerBehaviour:
    """Every ledger scenario, for any backend that supplies the two URL fixtures."""

    @pytest.fixture
    def ledger(self, migrated_url: str) -> Iterator[Ledger]:
        ledger = Ledger.from_url(migrated_url)
        yield ledger
        ledger.dispose()

    @pytest.fixture
    def database(self, migrated_url: str) -> Iterator[Engine]:
        """The same database for raw SQL, configured as the ledger's (SQLite FKs on)."""
        engine = create_ledger_engine(migrated_url)
        yield engine
        engine.dispose()

    # ----------------------------------------------------------------- event feed

    def test_the_feed_reads_heartbeats_and_operations_stored_after_a_moment(
        self, ledger: Ledger
    ) -> None:
        """What the operator's feed asks instead of every task's rows: only what was
        stored after the moment, oldest first, a page at a time."""
        before = datetime.now(UTC) - timedelta(seconds=1)
        one_heartbeat(ledger, received_at=before - timedelta(seconds=5))
        assert ledger.activity_received_since(before, 10) == []
        stored = one_heartbeat(ledger, seq=2, received_at=before + timedelta(seconds=0.5))
        assert ledger.activity_received_since(before, 10) == [stored]
        assert ledger.operations_moved_since(before - timedelta(days=1), 10) == []

        first, second = begin(ledger), begin(ledger, key="pause:default/task-b:1", name="task-b")
        moved = ledger.operations_moved_since(before, 10)
        assert [(m.id, m.name, m.state) for m in moved] == [
            (first.id, "task-a", first.state), (second.id, "task-b", second.state),
        ]  # fmt: skip
        assert [m.id for m in ledger.operations_moved_since(before, 1)] == [first.id]
        after = moved[-1].updated_at
        assert ledger.operations_moved_since(after, 10) == []
        ledger.transition(first.id, OperationState.FAILED, error="gone")
        again = ledger.operations_moved_since(after, 10)
        assert [(m.id, m.state) for m in again] == [(first.id, OperationState.FAILED)]
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            ledger.activity_received_since(before, 0)

    # ----------------------------------------------------------------- migrations

    def test_upgrade_to_head_creates_every_table_and_repeating_it_is_a_noop(
        self, database_url: str
    ) -> None:
        assert current(database_url) is None
        upgrade(database_url)
        assert table_names(database_url) == LEDGER_TABLES | {"alembic_version"}
        assert current(database_url) == head()
        ledger = Ledger.from_url(database_url)
        try:
            begin(ledger)

            upgrade(database_url)

            assert current(database_url) == head()
            assert len(ledger.list_operations()) == 1
        finally:
            ledger.dispose()

    def test_downgrade_to_base_drops_the_ledger_and_upgrade_rebuilds_it(
        self, database_url: str
    ) -> None:
        upgrade(database_url)
        downgrade(database_url, "base")
        assert current(database_url) is None
        assert table_names(database_url) & LEDGER_TABLES == set()

        upgrade(database_url)

        assert table_names(database_url) >= LEDGER_TABLES
        assert current(database_url) == head()

    def test_models_and_migrations_describe_the_same_schema(self, database_url: str) -> None:
        upgrade(database_url)
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                context = MigrationContext.configure(connection, opts={"compare_type": True})
                differences = compare_metadata(context, Base.metadata)
        finally:
            engine.dispose()
        assert differences == []

    # ----------------------------------------------------------------- operations

    def test_many_operations_are_read_in_one_call_by_id_and_unknown_ids_are_left_out(
        self, ledger: Ledger
    ) -> None:
        ops = [begin(ledger, f"delete-drain:default/task-{i}:1", name=f"task-{i}")
               for i in range(3)]  # fmt: skip
        ledger.transition(ops[1].id, OperationState.DRAINING)

        found = ledger.get_operations([ops[0].id, ops[1].id, "no-such-operation", ops[1].id])

        assert sorted(found) == sorted([ops[0].id, ops[1].id])
        assert found[ops[0].id] == ops[0]
        assert found[ops[1].id].state is OperationState.DRAINING
        assert ledger.get_operations([]) == {}

    def test_the_states_of_many_operations_are_read_in_one_call_and_unknown_ids_left_out(
        self, ledger: Ledger
    ) -> None:
        ops = [begin(ledger, f"delete-drain:default/task-{i}:1", name=f"task-{i}")
               for i in range(3)]  # fmt: skip
        ledger.transition(ops[1].id, OperationState.DRAINING)

        states = ledger.operation_states([ops[0].id, ops[1].id, "no-such-operation", ops[1].id])

        assert states == {ops[0].id: OperationState.PENDING, ops[1].id: OperationState.DRAINING}
        assert ledger.operation_states([]) == {}

    def test_a_new_operation_is_pending_with_utc_timestamps(self, ledger: Ledger) -> None:
        deadline = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=PLUS_TWO)
        op = begin(ledger, grace_secs=12.5, deadline_at=deadline)

        assert op.state is OperationState.PENDING
        assert op.kind is OperationKind.DELETE_DRAIN
        assert (op.grace_secs, op.celery_task_ids, op.detail, op.error) == (12.5, {}, None, None)
        assert op.finished_at is None and not op.terminal
        stored = ledger.get_operation(op.id)
        assert stored == op
        assert stored.deadline_at == deadline
        assert stored.deadline_at.tzinfo is UTC and stored.created_at.tzinfo is UTC

    def test_begin_operation_answers_the_existing_operation_for_a_repeated_key(
        self, ledger: Ledger
    ) -> None:
        first = begin(ledger, key="k1")
        ledger.transition(first.id, OperationState.DRAINING)

        again = begin(ledger, key="k1")
        other = begin(ledger, key="k2")

        assert again.id == first.id and again.state == "draining"
        assert other.id != first.id
        assert ledger.find_operation("k1") == again
        assert ledger.find_operation("nope") is None
        assert len(ledger.list_operations()) == 2

    def test_begin_operation_from_8_threads_with_one_key_makes_one_operation(
        self, ledger: Ledger, database: Engine
    ) -> None:
        ops = all_at_once(THREADS, lambda: begin(ledger, key="racing"))

        assert len({op.id for op in ops}) == 1
        assert rows(database, "operations") == 1

    def test_a_key_reused_for_another_task_is_refused(self, ledger: Ledger) -> None:
        first = begin(ledger, key="shared", name="task-a")

        with pytest.raises(ValueError, match=r"idempotency key 'shared' already names operation"):
            begin(ledger, key="shared", name="task-b")
        with pytest.raises(ValueError, match=first.id):
            begin(ledger, key="shared", kind=OperationKind.PAUSE)

    def test_begin_operations_begins_many_in_one_transaction_and_answers_known_keys(
        self, ledger: Ledger, database: Engine
    ) -> None:
        known = ledger.transition(begin(ledger, key="k1").id, OperationState.DRAINING)
        batch = [
            NewOperation(OperationKind.DELETE_DRAIN, "uid-task-a", "default", "task-a", "k1"),
            NewOperation(OperationKind.PAUSE, "uid-task-b", "default", "task-b", "k2"),
            NewOperation(OperationKind.PAUSE, "uid-task-c", "default", "task-c", "k3"),
            NewOperation(OperationKind.PAUSE, "uid-task-b", "default", "task-b", "k2"),
        ]

        with commits() as counted:
            ops = ledger.begin_operations(batch)

        assert counted == [1]
        assert ops[0] == known
        assert ops[1] == ops[3] and ops[1].id != ops[2].id
        assert [(op.name, op.state) for op in ops[1:3]] == [
            ("task-b", OperationState.PENDING),
            ("task-c", OperationState.PENDING),
        ]
        assert ledger.get_operations([op.id for op in ops]) == {op.id: op for op in ops}
        assert rows(database, "operations") == 3

    def test_begin_operations_with_one_bad_entry_writes_nothing(
        self, ledger: Ledger, database: Engine
    ) -> None:
        good = NewOperation(OperationKind.PAUSE, "uid-a", "default", "task-a", "good")
        bad = NewOperation(OperationKind.PAUSE, "uid-b", "default", "x" * 300, "bad")

        with pytest.raises(ValueError, match="name"):
            ledger.begin_operations([good, bad])

        assert rows(database, "operations") == 0

    def test_advance_operations_moves_the_expected_ones_and_answers_the_others_as_they_are(
        self, ledger: Ledger
    ) -> None:
        pending = begin(ledger, key="a", name="task-a")
        moved_on = ledger.transition(
            begin(ledger, key="b", name="task-b").id, OperationState.FAILED
        )
        moves = [
            OperationMove(pending.id, celery_task_ids={"drain": "a.drain"}, detail={"n": 1}),
            OperationMove(moved_on.id, celery_task_ids={"drain": "b.drain"}),
        ]

        with commits() as counted:
            after = ledger.advance_operations(
                moves, OperationState.DRAINING, expect=[OperationState.PENDING]
            )

        assert counted == [1]
        assert after[0].state is OperationState.DRAINING
        assert (after[0].celery_task_ids, after[0].detail) == ({"drain": "a.drain"}, {"n": 1})
        assert after[1] == moved_on
        assert ledger.get_operations([pending.id, moved_on.id]) == {
            pending.id: after[0],
            moved_on.id: moved_on,
        }

    def test_advance_operations_with_an_unknown_operation_writes_nothing(
        self, ledger: Ledger
    ) -> None:
        op = begin(ledger)

        with pytest.raises(UnknownOperation):
            ledger.advance_operations(
                [OperationMove(op.id), OperationMove("no-such-op")],
                OperationState.DRAINING,
                expect=[OperationState.PENDING],
            )

        assert ledger.get_operation(op.id) == op
        assert ledger.get_operations(["no-such-op"]) == {}

    def test_list_operations_is_newest_first_and_filters_by_task(self, ledger: Ledger) -> None:
        a1 = begin(ledger, key="a1", name="task-a")
        b1 = begin(ledger, key="b1", name="task-b")
        a2 = begin(ledger, key="a2", name="task-a")

        assert [op.id for op in ledger.list_operations()] == [a2.id, b1.id, a1.id]
        assert [op.id for op in ledger.list_operations("default", "task-a")] == [a2.id, a1.id]
        assert [op.id for op in ledger.list_operations(limit=1)] == [a2.id]
        assert ledger.list_operations("elsewhere") == []

    def test_transition_moves_an_expected_state_and_merges_celery_ids(self, ledger: Ledger) -> None:
        op = begin(ledger)

        draining = ledger.transition(
            op.id,
            OperationState.DRAINING,
            expect=(OperationState.PENDING,),
            celery_task_ids={"drain": "t-drain"},
        )
        drained = ledger.transition(
            op.id,
            OperationState.DRAINED,
            expect=[OperationState.DRAINING],
            celery_task_ids={"record": "t-record"},
            detail={"agents": 2},
        )

        assert draining.state == "draining" and draining.updated_at >= op.updated_at
        assert drained.state is OperationState.DRAINED
        assert drained.celery_task_ids == {"drain": "t-drain", "record": "t-record"}
        assert drained.detail == {"agents": 2}
        assert drained.finished_at is None
        assert ledger.get_operation(op.id) == drained

    def test_transition_from_an_unexpected_state_is_a_conflict_and_writes_nothing(
        self, ledger: Ledger
    ) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)

        with pytest.raises(LedgerConflict) as raised:
            ledger.transition(
                op.id,
                OperationState.DRAINING,
                expect=[OperationState.PENDING],
                celery_task_ids={"x": "y"},
            )

        conflict = raised.value
        assert conflict.op_id == op.id
        assert (conflict.current, conflict.wanted) == ("draining", "draining")
        assert op.id in str(conflict) and "pending" in str(conflict)
        assert ledger.get_operation(op.id) == op

    @pytest.mark.parametrize("final", [OperationState.FAILED, OperationState.RESUMED])
    def test_a_terminal_state_sets_finished_at_and_is_never_left(
        self, ledger: Ledger, final: OperationState
    ) -> None:
        op = begin(ledger, kind=OperationKind.RESUME, checkpoint_ref="ckpt-0123")
        finished = ledger.transition(op.id, final, error="why" if final == "failed" else None)
        assert finished.terminal and finished.finished_at is not None

        for wanted in (
            OperationState.PENDING,
            OperationState.RESUMING,
            OperationState.FAILED,
            OperationState.RESUMED,
        ):
            with pytest.raises(LedgerConflict, match="it has finished"):
                ledger.transition(op.id, wanted)
        with pytest.raises(LedgerConflict):
            ledger.transition(op.id, OperationState.FAILED, expect=None, error="again")

        assert ledger.get_operation(op.id) == finished

    def test_a_recorded_operation_is_never_left(self, ledger: Ledger) -> None:
        op = begin(ledger)
        ledger.record_checkpoint(op.id, [resume_ref("agent-a")], reason=CheckpointReason.DELETE)
        recorded = ledger.get_operation(op.id)
        assert recorded is not None and recorded.state == "recorded"

        with pytest.raises(LedgerConflict, match=r"is recorded, so it cannot become failed"):
            ledger.transition(op.id, OperationState.FAILED, error="late drain failure")

        assert ledger.get_operation(op.id) == recorded

    @pytest.mark.parametrize("state", [OperationState.RECORDED, OperationState.FORCED])
    def test_checkpointed_states_are_entered_only_by_record_checkpoint(
        self, ledger: Ledger, state: OperationState
    ) -> None:
        op = begin(ledger)

        with pytest.raises(ValueError, match=rf"'{state}' is entered only by record_checkpoint"):
            ledger.transition(op.id, state)

        assert ledger.get_operation(op.id) == op

    def test_unknown_kinds_states_and_reasons_are_refused_by_name(self, ledger: Ledger) -> None:
        with pytest.raises(ValueError, match=r"unknown operation kind 'evict'; expected one of"):
            begin(ledger, kind="evict")  # type: ignore[arg-type]
        assert ledger.list_operations() == []

        op = begin(ledger)
        with pytest.raises(ValueError, match=r"unknown operation state 'drainng'"):
            ledger.transition(op.id, "drainng")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"unknown expected state 'pendng'"):
            ledger.transition(
                op.id,
                OperationState.DRAINING,
                expect=["pendng"],  # type: ignore[list-item]
            )
        with pytest.raises(ValueError, match=r"unknown checkpoint reason 'whim'"):
            ledger.record_checkpoint(op.id, [], reason="whim")  # type: ignore[arg-type]
        assert ledger.get_operation(op.id) == op

    def test_the_database_itself_refuses_an_unknown_state(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = begin(ledger)

        with pytest.raises(IntegrityError), database.begin() as connection:
            connection.execute(update(Operation).where(Operation.id == op.id).values(state="limbo"))

        assert ledger.get_operation(op.id) == op

    def test_naive_timestamps_and_bad_numbers_are_refused(self, ledger: Ledger) -> None:
        with pytest.raises(ValueError, match="deadline_at must be a timezone-aware datetime"):
            begin(ledger, deadline_at=datetime(2030, 1, 1))
        with pytest.raises(ValueError, match="grace_secs must be a non-negative number"):
            begin(ledger, grace_secs=-1.0)
        with pytest.raises(ValueError, match="is not a Kubernetes label value"):
            begin(ledger, kind=OperationKind.RESUME, checkpoint_ref="Not_A_Label")
        with pytest.raises(ValueError, match="namespace must be a non-empty string"):
            ledger.begin_operation(
                OperationKind.PAUSE, task_uid="u", namespace="", name="n", idempotency_key="k"
            )
        assert ledger.list_operations() == []

    def test_an_unknown_operation_is_reported_as_such(self, ledger: Ledger) -> None:
        missing = "00000000-0000-4000-8000-000000000000"
        assert ledger.get_operation(missing) is None
        with pytest.raises(UnknownOperation, match=missing):
            ledger.transition(missing, OperationState.DRAINING)
        with pytest.raises(UnknownOperation):
            ledger.record_checkpoint(missing, [], reason=CheckpointReason.DELETE)
        with pytest.raises(LookupError):
            ledger.expire_operation(missing, "deadline passed")

    # ---------------------------------------------------- questions about many values

    @pytest.mark.parametrize(("ask", "bound"), QUESTIONS_ABOUT_MANY_VALUES)
    def test_a_question_about_many_values_binds_at_most_500_of_them_a_statement(
        self, ledger: Ledger, ask: Callable[[Ledger, list[str]], object], bound: list[int]
    ) -> None:
        """Tried: 501 values, one more than ``IN_LIST_MAX``, none of them in the ledger;
        a call that put them all into one ``IN (…)`` binds [501]."""
        asked = [f"asked-{i:04d}" for i in range(501)]

        with values_bound_per_select("asked-") as counted:
            ask(ledger, asked)

        assert counted == bound

    # ---------------------------------------------------------------- checkpoints

    def test_record_checkpoint_writes_checkpoint_agents_and_the_recorded_operation(
        self, ledger: Ledger
    ) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)
        refs = [
            resume_ref("agent-c", turns=1),
            resume_ref("agent-a", turns=7),
            resume_ref("agent-b", clean=False, exit=-9, session_sha256=None, error="killed"),
        ]

        checkpoint = ledger.record_checkpoint(
            op.id, refs, reason=CheckpointReason.DELETE, pvc_name="ws-task-a"
        )

        assert checkpoint.ref == checkpoint_ref_for(op.id)
        assert (checkpoint.operation_id, checkpoint.namespace, checkpoint.name) == (
            op.id,
            "default",
            "task-a",
        )
        assert checkpoint.task_uid == "uid-task-a" and checkpoint.pvc_name == "ws-task-a"
        assert checkpoint.reason is CheckpointReason.DELETE
        assert not checkpoint.forced and not checkpoint.verified  # agent-b was killed
        assert [a.agent_id for a in checkpoint.agents] == ["agent-a", "agent-b", "agent-c"]
        killed = checkpoint.agents[1]
        assert killed.resume_ref() == refs[2]
        assert checkpoint.agents[0].resume_ref() == refs[1]

        recorded = ledger.get_operation(op.id)
        assert recorded is not None
        assert recorded.state is OperationState.RECORDED
        assert recorded.checkpoint_ref == checkpoint.ref
        assert recorded.finished_at == checkpoint.created_at
        assert ledger.get_checkpoint(checkpoint.ref) == checkpoint
        assert ledger.latest_checkpoint("default", "task-a") == checkpoint

    def test_a_checkpoint_of_clean_agents_or_of_none_is_verified(self, ledger: Ledger) -> None:
        some = ledger.record_checkpoint(
            begin(ledger, key="k1").id, [resume_ref("agent-a")], reason=CheckpointReason.PAUSE
        )
        none = ledger.record_checkpoint(
            begin(ledger, key="k2").id, [], reason=CheckpointReason.MANUAL
        )

        assert some.verified and none.verified and none.agents == ()

    def test_record_checkpoint_twice_answers_the_first_checkpoint_unchanged(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = begin(ledger)
        first = ledger.record_checkpoint(
            op.id, [resume_ref("agent-a")], reason=CheckpointReason.DELETE
        )

        again = ledger.record_checkpoint(
            op.id,
            [resume_ref("agent-a", turns=9), resume_ref("agent-b")],
            reason=CheckpointReason.FORCED,
            forced=True,
        )

        assert again == first
        assert rows(database, "checkpoints") == 1
        assert rows(database, "checkpoint_agents") == 1
        after = ledger.get_operation(op.id)
        assert after is not None and after.state == "recorded"

    def test_record_checkpoint_from_8_threads_writes_one_checkpoint(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)
        refs = [resume_ref(f"agent-{n}") for n in range(5)]

        results = all_at_once(
            THREADS, lambda: ledger.record_checkpoint(op.id, refs, reason=CheckpointReason.DELETE)
        )

        assert len(set(results)) == 1
        assert rows(database, "checkpoints") == 1
        assert rows(database, "checkpoint_agents") == len(refs)
        assert ledger.get_checkpoint(results[0].ref) == results[0]

    def test_unique_operation_id_answers_a_duplicate_that_got_past_the_lookup(
        self, ledger: Ledger, database: Engine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)
        # What a racing recorder committed between this call's lookup and its insert.
        with database.begin() as connection:
            connection.execute(
                insert(Checkpoint).values(
                    ref=checkpoint_ref_for(op.id),
                    operation_id=op.id,
                    task_uid=op.task_uid,
                    namespace=op.namespace,
                    name=op.name,
                    reason=CheckpointReason.DELETE,
                    forced=False,
                    verified=True,
                    created_at=datetime.now(UTC),
                )
            )
        real_lookup = Ledger._checkpoint_of
        lookups: list[str] = []

        def first_lookup_misses(self: Ledger, session: Any, op_id: str) -> Checkpoint | None:
            lookups.append(op_id)
            return None if len(lookups) == 1 else real_lookup(self, session, op_id)

        monkeypatch.setattr(Ledger, "_checkpoint_of", first_lookup_misses)

        checkpoint = ledger.record_checkpoint(
            op.id, [resume_ref("agent-a")], reason=CheckpointReason.DELETE
        )

        assert lookups == [op.id, op.id]
        assert checkpoint.ref == checkpoint_ref_for(op.id) and checkpoint.agents == ()
        assert rows(database, "checkpoints") == 1
        assert rows(database, "checkpoint_agents") == 0

    def test_record_checkpoint_refuses_a_failed_operation(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.FAILED, error="drain failed")

        with pytest.raises(LedgerConflict, match=r"is failed, so it cannot become recorded"):
            ledger.record_checkpoint(op.id, [resume_ref("agent-a")], reason=CheckpointReason.DELETE)

        assert rows(database, "checkpoints") == 0
        assert ledger.get_operation(op.id) == op

    def test_record_checkpoint_refuses_an_operation_that_consumes_one(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = begin(ledger, kind=OperationKind.RESTORE, checkpoint_ref="ckpt-0123")

        with pytest.raises(LedgerConflict, match="a restore operation consumes a checkpoint"):
            ledger.record_checkpoint(op.id, [], reason=CheckpointReason.MANUAL)

        assert rows(database, "checkpoints") == 0
        assert ledger.get_operation(op.id) == op

    def test_a_forced_checkpoint_marks_the_operation_forced(self, ledger: Ledger) -> None:
        op = begin(ledger, kind=OperationKind.FORCE_DELETE)

        checkpoint = ledger.record_checkpoint(
            op.id, [resume_ref("agent-a", clean=False)], reason=CheckpointReason.FORCED, forced=True
        )

        forced = ledger.get_operation(op.id)
        assert forced is not None and forced.state is OperationState.FORCED and forced.terminal
        assert checkpoint.forced and not checkpoint.verified

    @pytest.mark.parametrize(
        "refs",
        [[], [resume_ref("agent-a"), resume_ref("agent-b")]],
        ids=["no-agents", "clean-agents"],
    )
    def test_a_forced_checkpoint_is_never_verified(
        self, ledger: Ledger, refs: list[ResumeRef]
    ) -> None:
        # A forced checkpoint is the PVC as it was: no drain checked any session, so
        # it claims no verification, not even the vacuous one of an empty agent list.
        op = begin(ledger, kind=OperationKind.FORCE_DELETE)

        checkpoint = ledger.record_checkpoint(
            op.id, refs, reason=CheckpointReason.FORCED, forced=True
        )

        assert checkpoint.forced and not checkpoint.verified
        assert ledger.get_checkpoint(checkpoint.ref) == checkpoint

    def test_a_drained_operation_records_its_checkpoint(self, ledger: Ledger) -> None:
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)
        drained = ledger.transition(op.id, OperationState.DRAINED, expect=[OperationState.DRAINING])
        assert drained.state is OperationState.DRAINED and not drained.terminal

        checkpoint = ledger.record_checkpoint(
            op.id, [resume_ref("agent-a")], reason=CheckpointReason.DELETE
        )

        recorded = ledger.get_operation(op.id)
        assert recorded is not None and recorded.state is OperationState.RECORDED
        assert recorded.checkpoint_ref == checkpoint.ref and checkpoint.verified

    def test_a_plain_string_for_a_vocabulary_is_refused_naming_the_enum(
        self, ledger: Ledger
    ) -> None:
        with pytest.raises(
            ValueError, match=r"not the string 'pause' \(pass OperationKind.PAUSE\)"
        ):
            begin(ledger, kind="pause")  # type: ignore[arg-type]
        op = begin(ledger)
        with pytest.raises(ValueError, match=r"pass OperationState.DRAINING"):
            ledger.transition(op.id, "draining")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"pass CheckpointReason.DELETE"):
            ledger.record_checkpoint(op.id, [], reason="delete")  # type: ignore[arg-type]
        assert ledger.list_operations() == [op]

    def test_the_checkpoint_ref_is_a_label_value_derived_from_the_operation(
        self, ledger: Ledger
    ) -> None:
        ops = [begin(ledger, key=f"k{n}") for n in range(3)]

        refs = [
            ledger.record_checkpoint(op.id, [], reason=CheckpointReason.DELETE).ref for op in ops
        ]

        assert refs == [checkpoint_ref_for(op.id) for op in ops]
        assert len(set(refs)) == 3
        assert all(is_label_value(ref) and ref.startswith("ckpt-") for ref in refs)

    def test_a_resume_ref_that_is_not_a_validated_model_is_refused_and_writes_nothing(
        self, ledger: Ledger, database: Engine
    ) -> None:
        # The shape (every key, JSON types) is DrainResult's to check where the drain
        # result is received (tests/unit/test_contract.py); the ledger takes only models.
        op = ledger.transition(begin(ledger).id, OperationState.DRAINING)
        raw = resume_ref("agent-b").model_dump(mode="json")

        with pytest.raises(ValueError, match=r"resume ref #1 is a dict, not a ResumeRef"):
            ledger.record_checkpoint(
                op.id,
                [resume_ref("agent-a"), raw],  # type: ignore[list-item]
                reason=CheckpointReason.DELETE,
            )

        assert rows(database, "checkpoints") == 0
        assert rows(database, "checkpoint_agents") == 0
        assert ledger.get_operation(op.id) == op

    @pytest.mark.parametrize(
        ("overrides", "message"),
        [
            ({"session_dir": "/pvc/agents/agent-a"}, "must be relative to the PVC root"),
            ({"session_dir": "agents/../../etc"}, "must be relative to the PVC root"),
            ({"turns": -1}, "turns must be a non-negative integer"),
            ({"session_sha256": "xyz"}, "session_sha256 must be 64 lower-case hex digits"),
            ({"id": ""}, "id must be a non-empty string"),
        ],
    )
    def test_a_malformed_resume_ref_is_refused_and_writes_nothing(
        self, ledger: Ledger, database: Engine, overrides: dict[str, Any], message: str
    ) -> None:
        op = begin(ledger)

        with pytest.raises(ValueError, match=message):
            ledger.record_checkpoint(
                op.id, [resume_ref("agent-a", **overrides)], reason=CheckpointReason.DELETE
            )

        assert rows(database, "checkpoints") == 0
        assert ledger.get_operation(op.id) == op

    def test_an_agent_twice_in_one_checkpoint_is_refused(self, ledger: Ledger) -> None:
        op = begin(ledger)

        with pytest.raises(ValueError, match="resume ref of agent 'agent-a' appears twice"):
            ledger.record_checkpoint(
                op.id,
                [resume_ref("agent-a"), resume_ref("agent-a")],
                reason=CheckpointReason.DELETE,
            )

    def test_checkpoints_are_listed_newest_first_and_outlive_their_task(
        self, ledger: Ledger
    ) -> None:
        a1 = ledger.record_checkpoint(begin(ledger, key="a1").id, [], reason=CheckpointReason.PAUSE)
        b1 = ledger.record_checkpoint(
            begin(ledger, key="b1", name="task-b").id, [], reason=CheckpointReason.PAUSE
        )
        a2 = ledger.record_checkpoint(
            begin(ledger, key="a2").id, [], reason=CheckpointReason.DELETE
        )

        assert [c.ref for c in ledger.list_checkpoints()] == [a2.ref, b1.ref, a1.ref]
        assert [c.ref for c in ledger.list_checkpoints("default", "task-a")] == [a2.ref, a1.ref]
        assert ledger.latest_checkpoint("default", "task-a") == a2
        assert ledger.latest_checkpoint("default", "gone") is None
        assert ledger.get_checkpoint("ckpt-unknown") is None

    def test_a_later_page_of_checkpoints_starts_after_the_last_ref_of_the_page_before(
        self, ledger: Ledger
    ) -> None:
        refs = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}", name=name).id, [], reason=CheckpointReason.PAUSE
            ).ref
            for n, name in enumerate(["task-a", "task-b", "task-a", "task-a", "task-b"])
        ]
        a1, b1, a2, a3, b2 = refs

        assert [c.ref for c in ledger.list_checkpoints(limit=2)] == [b2, a3]
        assert [c.ref for c in ledger.list_checkpoints(limit=2, after=a3)] == [a2, b1]
        assert [c.ref for c in ledger.list_checkpoints(limit=2, after=b1)] == [a1]
        assert ledger.list_checkpoints(limit=2, after=a1) == []
        task_a = ledger.list_checkpoints("default", "task-a", limit=1, after=a3)
        assert [c.ref for c in task_a] == [a2]
        with pytest.raises(LookupError, match="no checkpoint 'ckpt-unknown' in the ledger"):
            ledger.list_checkpoints(after="ckpt-unknown")

    def test_a_checkpoint_and_its_agents_are_read_in_one_query(self, ledger: Ledger) -> None:
        """The reads callers wait on (a task's latest, a PVC's newest, a page of ``ledger
        ls``, one by ref) send one SELECT each, the agents joined in, not a second."""
        for n in range(3):
            op = begin(ledger, key=f"k{n}")
            agents = [resume_ref("agent-b"), resume_ref("agent-a")]
            ledger.record_checkpoint(op.id, agents, reason=CheckpointReason.PAUSE, pvc_name="ws")
        newest = ledger.list_checkpoints()[0]
        sent: list[str] = []

        def caught(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if statement.lstrip().upper().startswith("SELECT"):
                sent.append(statement)

        engine = ledger._engine
        event.listen(engine, "before_cursor_execute", caught)
        try:
            reads = [
                ledger.latest_checkpoint("default", "task-a"),
                ledger.newest_checkpoint_of_pvc("default", "ws"),
                ledger.get_checkpoint(newest.ref),
            ]
            page = ledger.list_checkpoints(limit=2)
        finally:
            event.remove(engine, "before_cursor_execute", caught)

        assert len(sent) == 4, sent
        assert reads == [newest, newest, newest]
        assert [a.agent_id for a in newest.agents] == ["agent-a", "agent-b"]
        assert len(page) == 2 and all(len(c.agents) == 2 for c in page)

    def test_the_storage_of_restorable_checkpoints_is_read_in_pages_by_id(
        self, ledger: Ledger
    ) -> None:
        made = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}", name=f"task-{n % 2}").id, [resume_ref("agent-a")],
                reason=CheckpointReason.PAUSE, pvc_name=f"ws-{n % 2}",
            )
            for n in range(4)
        ]  # fmt: skip
        ledger.record_snapshot(made[3].ref, "snap-3")
        ledger.mark_checkpoint_unavailable(made[1].ref, "PVC default/ws-1 gone")

        first = ledger.restorable_storage_after(0, 2)
        rest = ledger.restorable_storage_after(first[-1].id, 2)

        assert [c.ref for c in first + rest] == [made[0].ref, made[2].ref, made[3].ref]
        assert ledger.restorable_storage_after(rest[-1].id, 2) == []
        assert rest[-1] == CheckpointStorageView(
            id=made[3].id, ref=made[3].ref, task_uid="uid-task-1", namespace="default",
            name="task-1", created_at=made[3].created_at, pvc_name="ws-1",
            snapshot_name="snap-3",
        )  # fmt: skip
        assert rest[-1].available

    def test_many_checkpoints_are_marked_unavailable_in_one_call_keeping_a_first_reason(
        self, ledger: Ledger
    ) -> None:
        refs = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}").id, [], reason=CheckpointReason.PAUSE
            ).ref
            for n in range(3)
        ]
        ledger.mark_checkpoint_unavailable(refs[0], "PVC default/ws gone")

        marked = ledger.mark_checkpoints_unavailable(
            {ref: f"released {ref}" for ref in refs} | {"ckpt-unknown": "released"}
        )

        assert marked == refs[1:]
        assert [ledger.get_checkpoint(r).unavailable for r in refs] == [  # type: ignore[union-attr]
            "PVC default/ws gone", f"released {refs[1]}", f"released {refs[2]}"
        ]  # fmt: skip
        assert ledger.mark_checkpoints_unavailable({}) == []

    def test_a_restore_claim_is_refused_while_a_prune_releases_and_granted_once_kept(
        self, ledger: Ledger
    ) -> None:
        """Tried: a claim, a release begun, a claim again, the release cancelled, a claim
        again; then a release finished (marked unavailable) and a claim."""
        ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.DELETE).ref
        first = ledger.claim_for_restore(ref)
        assert first is not None and first.restore_claimed_at is not None
        assert first.releasing_since is None

        assert ledger.begin_release([ref, "ckpt-unknown"]) == [ref]
        refused = ledger.claim_for_restore(ref)
        assert refused is not None and refused.releasing_since is not None
        assert refused.restore_claimed_at == first.restore_claimed_at  # not claimed again

        assert ledger.cancel_release([ref]) == [ref]
        assert ledger.cancel_release([ref]) == []  # nothing left to clear
        again = ledger.claim_for_restore(ref)
        assert again is not None and again.releasing_since is None
        assert again.restore_claimed_at is not None
        assert again.restore_claimed_at >= first.restore_claimed_at

        assert ledger.begin_release([ref]) == [ref]
        ledger.mark_checkpoints_unavailable({ref: "released by drainctl ledger prune"})
        gone = ledger.claim_for_restore(ref)
        assert gone is not None and gone.unavailable == "released by drainctl ledger prune"
        assert gone.restore_claimed_at == again.restore_claimed_at
        assert ledger.begin_release([ref]) == [] and ledger.cancel_release([ref]) == []
        assert ledger.claim_for_restore("ckpt-unknown") is None

    def test_stalled_releases_are_the_marks_older_than_asked_on_available_checkpoints(
        self, ledger: Ledger
    ) -> None:
        """Tried: three checkpoints marked, one then kept (mark cleared), one released
        (unavailable), one left marked; asked with a moment before and after the marks."""
        refs = [
            ledger.record_checkpoint(
                begin(ledger, f"delete-drain:default/task-a:{i}").id, [],
                reason=CheckpointReason.DELETE,
            ).ref
            for i in range(3)
        ]  # fmt: skip
        assert ledger.stalled_releases(datetime.now(UTC) + timedelta(hours=1)) == []
        assert sorted(ledger.begin_release(refs)) == sorted(refs)
        kept, released, stalled = refs
        ledger.cancel_release([kept])
        ledger.mark_checkpoints_unavailable({released: "released by drainctl ledger prune"})
        later = datetime.now(UTC) + timedelta(seconds=1)
        assert [c.ref for c in ledger.stalled_releases(later)] == [stalled]
        assert ledger.stalled_releases(later - timedelta(hours=1)) == []

    def test_a_claim_and_a_release_racing_on_one_checkpoint_never_both_win(
        self, ledger: Ledger
    ) -> None:
        """Tried: 20 times, a restore's claim and a prune's mark released together from
        two threads. Either the claim came first (claimed, then marked: the prune's second
        look at the cluster sees the restoring task), or the mark did (claim refused)."""
        for attempt in range(20):
            key = f"delete-drain:default/task-a:{attempt}"
            ref = ledger.record_checkpoint(
                begin(ledger, key).id, [], reason=CheckpointReason.DELETE
            ).ref
            barrier = threading.Barrier(2)

            def claim(ref: str = ref, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait(timeout=10)
                view = ledger.claim_for_restore(ref)
                return view is not None and view.releasing_since is None

            def mark(ref: str = ref, barrier: threading.Barrier = barrier) -> bool:
                barrier.wait(timeout=10)
                return ledger.begin_release([ref]) == [ref]

            with ThreadPoolExecutor(max_workers=2) as pool:
                claimed, marked = pool.submit(claim), pool.submit(mark)
                assert marked.result(timeout=30)
                won = claimed.result(timeout=30)
            after = ledger.get_checkpoint(ref)
            assert after is not None and after.releasing_since is not None
            # Claimed exactly when the claim's stamp is on the row: never a claim granted
            # on a row already marked.
            assert won == (after.restore_claimed_at is not None)
            if won:
                assert after.restore_claimed_at <= after.releasing_since  # type: ignore[operator]

    def test_a_checkpoint_records_its_snapshot_asked_then_ready_and_keeps_the_outcome(
        self, ledger: Ledger
    ) -> None:
        ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.PAUSE).ref
        assert ledger.get_checkpoint(ref).snapshot is None  # type: ignore[union-attr]

        asked = ledger.record_snapshot(ref, ref)
        assert asked is not None and asked.snapshot_name == ref and asked.snapshot is None
        ready_at = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
        ready = ledger.record_snapshot(ref, ref, ready_at=ready_at)
        assert ready is not None and ready.snapshot == ref and ready.snapshot_ready_at == ready_at
        # Settled: a later failure report (a slow replica timing out) changes nothing.
        again = ledger.record_snapshot(ref, ref, error="not ready within 300s")
        assert again == ready
        assert ledger.get_checkpoint(ref) == ready

    def test_a_snapshot_failure_is_kept_and_another_name_is_refused(self, ledger: Ledger) -> None:
        ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.DELETE).ref
        ledger.record_snapshot(ref, "snap-1")
        failed = ledger.record_snapshot(ref, "snap-1", error="not ready within 300s")
        assert failed is not None and failed.snapshot is None
        assert failed.snapshot_error == "not ready within 300s"
        later = ledger.record_snapshot(ref, "snap-1", ready_at=datetime.now(UTC))
        assert later is not None and later.snapshot is None  # failed stays failed
        with pytest.raises(LedgerError, match="already has snapshot snap-1"):
            ledger.record_snapshot(ref, "snap-2")
        assert ledger.record_snapshot("ckpt-unknown", "snap") is None

    def test_a_snapshot_that_could_not_be_asked_for_needs_its_error(self, ledger: Ledger) -> None:
        ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.DELETE).ref
        with pytest.raises(ValueError, match="give its error"):
            ledger.record_snapshot(ref, None)
        with pytest.raises(ValueError, match="must be a timezone-aware datetime"):
            ledger.record_snapshot(ref, "snap", ready_at=datetime(2026, 1, 1))
        failed = ledger.record_snapshot(ref, None, error="no VolumeSnapshotClass x")
        assert failed is not None and failed.snapshot_name is None
        assert failed.snapshot_error == "no VolumeSnapshotClass x"

    def test_a_snapshot_is_recorded_cut_then_ready_and_pending_in_between(
        self, ledger: Ledger
    ) -> None:
        ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.DELETE).ref
        asked = ledger.record_snapshot(ref, ref)
        assert asked is not None and asked.snapshot_pending and asked.snapshot_cut_at is None
        cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)

        cut = ledger.record_snapshot(ref, ref, cut_at=cut_at)

        assert cut is not None and cut.snapshot_pending and cut.snapshot is None
        assert cut.snapshot_cut_at == cut_at
        ready_at = cut_at + timedelta(minutes=4)
        ready = ledger.record_snapshot(ref, ref, cut_at=ready_at, ready_at=ready_at)
        assert ready is not None and not ready.snapshot_pending and ready.snapshot == ref
        # The first cut is the snapshot's point in time: a later report does not move it.
        assert (ready.snapshot_cut_at, ready.snapshot_ready_at) == (cut_at, ready_at)

    def test_unsettled_snapshots_are_the_asked_and_cut_ones_in_pages_by_id(
        self, ledger: Ledger
    ) -> None:
        """Tried: checkpoints without a snapshot, with one asked for, cut, ready, failed,
        and asked for on a checkpoint since marked unavailable (still followed: its
        snapshot's fate is still to be said)."""
        refs = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}", name=f"task-{n}").id, [],
                reason=CheckpointReason.DELETE, pvc_name=f"ws-{n}",
            ).ref
            for n in range(6)
        ]  # fmt: skip
        cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
        ledger.record_snapshot(refs[1], refs[1])
        ledger.record_snapshot(refs[2], refs[2], cut_at=cut_at)
        ledger.record_snapshot(refs[3], refs[3], ready_at=cut_at)
        ledger.record_snapshot(refs[4], refs[4], error="not cut within 300s")
        ledger.record_snapshot(refs[5], refs[5])
        ledger.mark_checkpoint_unavailable(refs[5], "released by drainctl ledger prune")

        first = ledger.unsettled_snapshots(0, 2)
        rest = ledger.unsettled_snapshots(first[-1].id, 2)

        assert [(u.ref, u.snapshot_name, u.snapshot_cut_at) for u in first + rest] == [
            (refs[1], refs[1], None), (refs[2], refs[2], cut_at), (refs[5], refs[5], None),
        ]  # fmt: skip
        assert (first[0].namespace, first[0].name, first[0].pvc_name) == (
            "default", "task-1", "ws-1",
        )  # fmt: skip
        assert ledger.unsettled_snapshots(rest[-1].id, 2) == []
        with pytest.raises(ValueError, match="limit must be a positive integer"):
            ledger.unsettled_snapshots(0, 0)

    def test_moving_snapshots_hands_back_only_what_this_call_changed(self, ledger: Ledger) -> None:
        """What lets two followers record one outcome and say it once: the second call
        with the same news changes nothing and gets nothing back."""
        refs = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}", name=f"task-{n}").id, [],
                reason=CheckpointReason.PAUSE, pvc_name=f"ws-{n}",
            ).ref
            for n in range(3)
        ]  # fmt: skip
        for ref in refs:
            ledger.record_snapshot(ref, ref)
        cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
        ready_at = cut_at + timedelta(minutes=3)
        moves = [
            SnapshotMove(refs[0], cut_at=cut_at),
            SnapshotMove(refs[1], cut_at=cut_at, ready_at=ready_at),
            SnapshotMove(refs[2], error="not readyToUse within 3600s of the checkpoint"),
            SnapshotMove("ckpt-unknown", ready_at=ready_at),
        ]

        moved = ledger.move_snapshots(moves)

        assert {c.ref: (c.snapshot_cut_at, c.snapshot_ready_at, c.snapshot_error)
                for c in moved} == {
            refs[0]: (cut_at, None, None),
            refs[1]: (cut_at, ready_at, None),
            refs[2]: (None, None, "not readyToUse within 3600s of the checkpoint"),
        }  # fmt: skip
        assert len(moved) == 3
        assert ledger.move_snapshots(moves) == []
        # Settled stays settled: a late ready does not undo a failure, nor a failure a ready.
        late = [SnapshotMove(refs[2], ready_at=ready_at), SnapshotMove(refs[1], error="late")]
        assert ledger.move_snapshots(late) == []
        assert ledger.get_checkpoint(refs[1]).snapshot == refs[1]  # type: ignore[union-attr]
        assert ledger.move_snapshots([]) == []
        with pytest.raises(ValueError, match="must be a timezone-aware datetime"):
            ledger.move_snapshots([SnapshotMove(refs[0], cut_at=datetime(2026, 1, 1))])

    def test_a_deleted_workspace_takes_the_checkpoints_it_alone_holds_not_those_on_snapshots(
        self, ledger: Ledger
    ) -> None:
        """Tried: four checkpoints of PVC ws: none snapshotted, one ready, one on its way
        (cut, not ready: the snapshotter keeps its source PVC until then), one failed."""
        refs = [
            ledger.record_checkpoint(
                begin(ledger, key=f"k{n}").id, [], reason=CheckpointReason.PAUSE, pvc_name="ws"
            ).ref
            for n in range(4)
        ]
        cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
        ledger.record_snapshot(refs[1], refs[1], ready_at=cut_at)
        ledger.record_snapshot(refs[2], refs[2], cut_at=cut_at)
        ledger.record_snapshot(refs[3], refs[3], error="not cut within 300s")

        gone = ledger.mark_workspace_gone("default", "ws", "PVC default/ws deleted with its task")

        assert sorted(gone) == sorted([refs[0], refs[3]])

    def test_the_newest_checkpoint_of_a_workspace_pvc_is_the_one_it_holds(
        self, ledger: Ledger
    ) -> None:
        def recorded(key: str, pvc: str, name: str = "task-a") -> str:
            op = begin(ledger, key=key, name=name)
            return ledger.record_checkpoint(
                op.id, [], reason=CheckpointReason.PAUSE, pvc_name=pvc
            ).ref

        old = recorded("p1", "ws-1")
        other = recorded("p2", "ws-2")
        # A task restored onto the retained ws-1 checkpoints it again, under its own name.
        new = recorded("p3", "ws-1", name="task-b")

        assert ledger.newest_checkpoint_of_pvc("default", "ws-1").ref == new  # type: ignore[union-attr]
        assert ledger.newest_checkpoint_of_pvc("default", "ws-2").ref == other  # type: ignore[union-attr]
        assert ledger.newest_checkpoint_of_pvc("other-ns", "ws-1") is None
        assert old != new

    def test_foreign_keys_hold_and_deleting_a_checkpoint_deletes_its_agents(
        self, ledger: Ledger, database: Engine
    ) -> None:
        op = begin(ledger)
        checkpoint = ledger.record_checkpoint(
            op.id, [resume_ref("agent-a"), resume_ref("agent-b")], reason=CheckpointReason.DELETE
        )

        with pytest.raises(IntegrityError), database.begin() as connection:
            connection.execute(
                insert(CheckpointAgent).values(
                    checkpoint_id=checkpoint.id + 1000,
                    agent_id="orphan",
                    session_dir="agents/orphan",
                    turns=0,
                    clean=True,
                )
            )
        with database.begin() as connection:
            connection.execute(delete(Checkpoint).where(Checkpoint.id == checkpoint.id))

        assert rows(database, "checkpoint_agents") == 0

    # ------------------------------------------------------------ expiry, activity

    def test_expire_operation_fails_only_unfinished_operations(self, ledger: Ledger) -> None:
        waiting = ledger.transition(begin(ledger, key="k1").id, OperationState.DRAINING)
        recorded_op = begin(ledger, key="k2")
        ledger.record_checkpoint(recorded_op.id, [], reason=CheckpointReason.DELETE)
        recorded = ledger.get_operation(recorded_op.id)

        expired = ledger.expire_operation(waiting.id, "deadline passed in draining")
        again = ledger.expire_operation(waiting.id, "a second sweep")

        assert expired.state is OperationState.FAILED and expired.finished_at is not None
        assert expired.error == "deadline passed in draining"
        assert again == expired
        assert ledger.expire_operation(recorded_op.id, "too late") == recorded

    def test_overdue_operations_are_the_unfinished_ones_past_their_deadline(
        self, ledger: Ledger
    ) -> None:
        now = datetime.now(UTC)
        late = begin(ledger, key="late", deadline_at=now - timedelta(seconds=5))
        later = begin(ledger, key="later", deadline_at=now - timedelta(seconds=1))
        begin(ledger, key="on-time", deadline_at=now + timedelta(hours=1))
        begin(ledger, key="no-deadline")
        done = begin(ledger, key="done", deadline_at=now - timedelta(seconds=9))
        ledger.transition(done.id, OperationState.FAILED)

        overdue = ledger.overdue_operations(now)

        assert [op.id for op in overdue] == [late.id, later.id]

    def test_an_older_heartbeat_never_overwrites_a_newer_one(self, ledger: Ledger) -> None:
        idle_since = datetime(2030, 1, 1, tzinfo=UTC)
        reported = datetime.now(UTC)

        def heartbeat(seq: int, idle: int) -> Any:
            return ledger.record_activity(
                "default",
                "task-a",
                task_uid="uid-task-a",
                all_idle_since=idle_since if idle == 2 else None,
                agents_total=3,
                agents_live=2,
                agents_idle=idle,
                seq=seq,
                reported_at=reported + timedelta(seconds=seq),
                idle_for_secs=12.5 if idle == 2 else None,
                received_at=reported + timedelta(seconds=seq, milliseconds=3),
            )

        assert ledger.get_activity("default", "task-a") is None
        first = heartbeat(seq=5, idle=2)
        assert (first.seq, first.agents_idle, first.all_idle_since) == (5, 2, idle_since)
        assert first.idle_for_secs == 12.5
        assert first.received_at == reported + timedelta(seconds=5, milliseconds=3)

        assert heartbeat(seq=3, idle=0) == first
        assert heartbeat(seq=5, idle=0) == first
        newer = heartbeat(seq=6, idle=0)

        assert (newer.seq, newer.agents_idle, newer.all_idle_since) == (6, 0, None)
        assert newer.idle_for_secs is None
        assert ledger.get_activity("default", "task-a") == newer
        assert ledger.get_activity("default", "task-b") is None

    def test_inconsistent_activity_counts_are_refused(self, ledger: Ledger) -> None:
        with pytest.raises(ValueError, match="agents_idle <= agents_live <= agents_total"):
            one_heartbeat(ledger, agents_live=2, agents_idle=0)
        assert ledger.get_activity("default", "task-a") is None

    @pytest.mark.parametrize("idle_for", [-1.0, float("inf"), float("nan")], ids=str)
    def test_an_idle_duration_that_is_no_duration_is_refused(
        self, ledger: Ledger, idle_for: float
    ) -> None:
        with pytest.raises(ValueError, match="idle_for_secs must be a finite number >= 0"):
            one_heartbeat(ledger, idle_for_secs=idle_for)
        assert ledger.get_activity("default", "task-a") is None

    def test_downgrade_to_0001_drops_the_idle_timing_and_keeps_the_heartbeat(
        self, database_url: str
    ) -> None:
        upgrade(database_url)
        ledger = Ledger.from_url(database_url)
        received = datetime(2030, 1, 1, 12, 0, 1, tzinfo=UTC)
        try:
            one_heartbeat(ledger, seq=7, idle_for_secs=30.0, received_at=received)
        finally:
            ledger.dispose()

        downgrade(database_url, "0001")

        assert current(database_url) == "0001"
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                columns = {c["name"] for c in inspect(connection).get_columns("daemon_activity")}
                seq = connection.execute(text("SELECT seq FROM daemon_activity")).scalar_one()
        finally:
            engine.dispose()
        assert {"idle_for_secs", "received_at"} & columns == set()
        assert seq == 7

        upgrade(database_url)

        ledger = Ledger.from_url(database_url)
        try:
            kept = ledger.get_activity("default", "task-a")
        finally:
            ledger.dispose()
        assert kept is not None and (kept.seq, kept.idle_for_secs, kept.received_at) == (
            7, None, None,
        )  # fmt: skip

    def test_0010_adds_the_snapshot_cut_and_a_downgrade_keeps_the_snapshot(
        self, database_url: str
    ) -> None:
        upgrade(database_url)
        ledger = Ledger.from_url(database_url)
        cut_at = datetime(2026, 12, 6, 9, 0, 2, tzinfo=UTC)
        try:
            ref = ledger.record_checkpoint(begin(ledger).id, [], reason=CheckpointReason.PAUSE).ref
            ledger.record_snapshot(ref, ref, cut_at=cut_at)
        finally:
            ledger.dispose()

        downgrade(database_url, "0009")

        assert current(database_url) == "0009"
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                columns = {c["name"] for c in inspect(connection).get_columns("checkpoints")}
                indexes = {i["name"] for i in inspect(connection).get_indexes("checkpoints")}
                kept = connection.execute(text("SELECT snapshot_name FROM checkpoints")).scalar()
        finally:
            engine.dispose()
        assert "snapshot_cut_at" not in columns
        assert "ix_checkpoints_snapshot_unsettled" not in indexes
        assert kept == ref

        upgrade(database_url)

        ledger = Ledger.from_url(database_url)
        try:
            again = ledger.get_checkpoint(ref)
            assert again is not None and again.snapshot_pending
            assert again.snapshot_cut_at is None  # not known any more: looked at again
            assert [u.ref for u in ledger.unsettled_snapshots()] == [ref]
        finally:
            ledger.dispose()

    def test_0007_admits_scale_and_complete_and_a_downgrade_keeps_older_rows(
        self, database_url: str
    ) -> None:
        upgrade(database_url)
        ledger = Ledger.from_url(database_url)
        try:
            for n, kind in enumerate(
                (OperationKind.SCALE_DOWN, OperationKind.SCALE_UP, OperationKind.COMPLETE)
            ):
                assert begin(ledger, key=f"{kind}:{n}", kind=kind).kind is kind
            kept = begin(ledger, key="delete-drain:kept")
            one_heartbeat(ledger, seq=3)
            assert ledger.get_activity("default", "task-a").agents_done == 0  # type: ignore[union-attr]
        finally:
            ledger.dispose()
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.begin() as connection:
                connection.execute(text("DELETE FROM operations WHERE id != :id"), {"id": kept.id})
        finally:
            engine.dispose()

        downgrade(database_url, "0006")

        assert current(database_url) == "0006"
        engine = create_engine(database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                columns = {c["name"] for c in inspect(connection).get_columns("daemon_activity")}
                assert connection.execute(text("SELECT kind FROM operations")).scalars().all() == [
                    "delete-drain"
                ]
                with pytest.raises(IntegrityError):
                    connection.execute(text("UPDATE operations SET kind = 'complete'"))
        finally:
            engine.dispose()
        assert "agents_done" not in columns


# ------------------------------------------------------------------------------ SQLite


@pytest.fixture(scope="session")
def sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite ledger migrated to head; each test gets a copy of the file."""
    path = tmp_path_factory.mktemp("ledger-template") / "ledger.db"
    upgrade(f"sqlite:///{path}")
    return path


class TestLedgerOnSQLite(LedgerBehaviour):
    @pytest.fixture
    def database_url(self, tmp_path: Path) -> str:
        return f"sqlite:///{tmp_path / 'blank.db'}"

    @pytest.fixture
    def migrated_url(self, tmp_path: Path, sqlite_at_head: Path) -> str:
        path = tmp_path / "ledger.db"
        shutil.copyfile(sqlite_at_head, path)
        return f"sqlite:///{path}"

    def test_reading_operations_waits_for_no_writer(self, migrated_url: str) -> None:
        """Tried: every read began with BEGIN IMMEDIATE, so a caller polling an operation
        and the worker recording it took turns on SQLite's write lock."""
        ledger = Ledger.from_url(migrated_url)
        writer = sqlite3.connect(migrated_url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            op = begin(ledger)
            writer.execute("BEGIN IMMEDIATE")  # another process, mid-transaction
            writer.execute("UPDATE operations SET error = 'elsewhere'")

            assert ledger.get_operation(op.id) == op
            assert ledger.get_operations([op.id]) == {op.id: op}
        finally:
            writer.close()
            ledger.dispose()

    def test_a_commit_is_an_append_to_the_write_ahead_log_and_fully_synchronous(
        self, migrated_url: str
    ) -> None:
        """Tried: a ledger file opened as every process opens it. Its journal is the
        write-ahead log (the rollback journal cost three or four fsyncs a commit, ~17 ms
        a heartbeat), synchronous FULL (a committed checkpoint survives a power loss);
        a writer mid-transaction in another process holds off no reader."""
        ledger = Ledger.from_url(migrated_url)
        try:
            with ledger._engine.connect() as connection:
                pragma = connection.exec_driver_sql
                assert pragma("PRAGMA journal_mode").scalar() == "wal"
                assert pragma("PRAGMA synchronous").scalar() == 2  # FULL
            op = begin(ledger)
            writer = sqlite3.connect(migrated_url.removeprefix("sqlite:///"), isolation_level=None)
            try:
                writer.execute("BEGIN IMMEDIATE")
                writer.execute("UPDATE operations SET error = 'elsewhere'")
                assert ledger.get_operation(op.id) == op
            finally:
                writer.close()
        finally:
            ledger.dispose()


# -------------------------------------------------------------------- no database needed


@pytest.mark.parametrize(
    ("count", "lengths"),
    [
        pytest.param(0, [], id="no-values-no-statement"),
        pytest.param(1, [1], id="one-value"),
        pytest.param(500, [500], id="exactly-the-max-in-one"),
        pytest.param(501, [500, 1], id="one-over-the-max-in-two"),
        pytest.param(1234, [500, 500, 234], id="several-then-the-rest"),
    ],
)
def test_in_lists_are_cut_at_the_most_one_statement_carries(count: int, lengths: list[int]) -> None:
    """``IN_LIST_MAX`` is 500; every value comes out once, in order."""
    values = [f"v{i:04d}" for i in range(count)]

    chunks = list(_in_chunks(values))

    assert IN_LIST_MAX == 500
    assert [len(chunk) for chunk in chunks] == lengths
    assert [value for chunk in chunks for value in chunk] == values


def test_in_lists_are_cut_at_a_given_size() -> None:
    chunks = [list(chunk) for chunk in _in_chunks(["a", "b", "c", "d", "e"], size=2)]

    assert chunks == [["a", "b"], ["c", "d"], ["e"]]


def test_an_operation_view_converts_the_vocabularies_and_shares_no_json_with_its_row() -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    row = Operation(
        id="op-1", kind="pause", task_uid="uid-a", namespace="default", name="task-a",
        state="draining", idempotency_key="k1", checkpoint_ref=None, grace_secs=5.0,
        celery_task_ids={"drain": "c-1"}, detail={"agents": {"a1": "draining"}}, error=None,
        created_at=at, updated_at=at, deadline_at=None, finished_at=None,
    )  # fmt: skip

    view = _operation_view(row)
    row.celery_task_ids["record"] = "c-2"
    assert row.detail is not None
    row.detail["agents"]["a1"] = "drained"

    assert view == OperationView(
        id="op-1", kind=OperationKind.PAUSE, task_uid="uid-a", namespace="default",
        name="task-a", state=OperationState.DRAINING, idempotency_key="k1",
        checkpoint_ref=None, grace_secs=5.0, celery_task_ids={"drain": "c-1"},
        detail={"agents": {"a1": "draining"}}, error=None, created_at=at, updated_at=at,
        deadline_at=None, finished_at=None,
    )  # fmt: skip
    assert type(view.kind) is OperationKind
    assert type(view.state) is OperationState


def test_a_checkpoint_view_orders_its_agents_by_id_whatever_the_rows_order() -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    row = Checkpoint(
        id=7, ref="ckpt-7", operation_id="op-1", task_uid="uid-a", namespace="default",
        name="task-a", reason="scale-down", pvc_name="ws-a", forced=False, verified=True,
        created_at=at, unavailable=None, snapshot_name="snap-a", snapshot_ready_at=at,
        snapshot_error=None,
        agents=[CheckpointAgent(agent_id=agent_id, session_dir=f"agents/{agent_id}", turns=1,
                                session_sha256=None, clean=True, exit=0, error=None)
                for agent_id in ("b", "c", "a")],
    )  # fmt: skip

    view = _checkpoint_view(row)

    assert [agent.agent_id for agent in view.agents] == ["a", "b", "c"]
    assert view.agents[0].session_dir == "agents/a"
    assert type(view.reason) is CheckpointReason
    assert (view.id, view.ref, view.reason, view.snapshot) == (
        7, "ckpt-7", CheckpointReason.SCALE_DOWN, "snap-a",
    )  # fmt: skip


def test_checkpoint_refs_are_deterministic_label_values() -> None:
    op_id = "6f1c1f0e-8a59-4f55-9c56-0f5b1f2b7d11"

    assert checkpoint_ref_for(op_id) == checkpoint_ref_for(op_id)
    assert checkpoint_ref_for(op_id) != checkpoint_ref_for(op_id.replace("6f", "7f"))
    assert is_label_value(checkpoint_ref_for(op_id))
    assert len(checkpoint_ref_for(op_id)) == len("ckpt-") + 20


@pytest.mark.parametrize(
    ("value", "valid"),
    [("ckpt-0a1b", True), ("a", True), ("a" * 63, True), ("a" * 64, False), ("-a", False),
     ("a-", False), ("Ckpt", False), ("ckpt_1", False), ("", False)],
)  # fmt: skip
def test_label_values_follow_kubernetes(value: str, valid: bool) -> None:
    assert is_label_value(value) is valid


@pytest.mark.parametrize(
    ("url", "dialect"),
    [("postgresql+psycopg://u@h/db", "TIMESTAMP WITH TIME ZONE"), ("sqlite:///x.db", "DATETIME")],
)
def test_offline_mode_writes_the_upgrade_as_sql(url: str, dialect: str) -> None:
    sql = upgrade_sql(url)

    for table in LEDGER_TABLES:
        assert f"CREATE TABLE {table}" in sql
    assert dialect in sql
    assert "INSERT INTO alembic_version (version_num) VALUES ('0001')" in sql
    assert "ALTER TABLE daemon_activity ADD COLUMN idle_for_secs" in sql
    assert (
        "UPDATE alembic_version SET version_num='0002' WHERE alembic_version.version_num = '0001'"
        in sql
    )


def test_only_sqlite_and_postgresql_urls_make_a_ledger() -> None:
    with pytest.raises(ValueError, match="supports SQLite and PostgreSQL, not 'mysql'") as raised:
        Ledger.from_url("mysql://root:secret@localhost/drain")
    assert "secret" not in str(raised.value)
    with pytest.raises(ValueError, match="not a SQLAlchemy URL"):
        Ledger.from_url("not a url")


def test_the_unsettled_snapshots_are_read_from_their_partial_index(sqlite_at_head: Path) -> None:
    """The snapshot follower reads its few rows every few seconds among up to millions:
    from the partial index of migration 0010 (``ix_checkpoints_snapshot_unsettled``),
    never by a scan of the table."""
    query = _unsettled_snapshots_query(0, 500)
    engine = create_engine(f"sqlite:///{sqlite_at_head}", poolclass=NullPool)
    try:
        with engine.connect() as connection:
            sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
            plan = " ".join(
                str(row[-1]) for row in connection.execute(text(f"EXPLAIN QUERY PLAN {sql}"))
            )
    finally:
        engine.dispose()
    assert plan == "SEARCH checkpoints USING INDEX ix_checkpoints_snapshot_unsettled (id>?)"


@pytest.mark.parametrize(
    ("where", "index"),
    [
        pytest.param((), "ix_checkpoints_created_at_id", id="a-page-of-ledger-ls"),
        pytest.param((Checkpoint.namespace == "default", Checkpoint.name == "task-a"),
                     "ix_checkpoints_namespace_name_created_at_id", id="a-tasks-latest"),
        pytest.param((Checkpoint.namespace == "default", Checkpoint.pvc_name == "ws-a"),
                     "ix_checkpoints_namespace_pvc_name_created_at_id", id="a-pvcs-newest"),
    ],
)  # fmt: skip
def test_newest_first_reads_of_checkpoints_walk_an_index_and_never_sort(
    sqlite_at_head: Path, where: tuple[Any, ...], index: str
) -> None:
    """The ledger's reads of checkpoints (``list_checkpoints``, ``latest_checkpoint``,
    ``newest_checkpoint_of_pvc``) are newest first with a limit: on 1,000,000 rows a sort
    made a page of ``drainctl ledger ls`` 125 ms (migration 0008)."""
    query = (
        select(Checkpoint)
        .where(*where)
        .order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc())
        .limit(50)
    )
    engine = create_engine(f"sqlite:///{sqlite_at_head}", poolclass=NullPool)
    try:
        with engine.connect() as connection:
            sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
            plan = " ".join(
                str(row[-1]) for row in connection.execute(text(f"EXPLAIN QUERY PLAN {sql}"))
            )
    finally:
        engine.dispose()
    assert index in plan, plan
    assert "TEMP B-TREE" not in plan, plan
