"""Every read and write of the checkpoint ledger goes through ``Ledger``.

The Celery tasks, the pipeline, the operator and ``drainctl`` call it. Each call is one
short transaction that hands back frozen views (``OperationView``, ``CheckpointView``,
``CheckpointAgentView``, ``ActivityView``), never ORM objects or sessions, so no caller
can hold a transaction open or lazy-load behind the ledger's back. ``models`` defines
the tables; ``migrate`` creates them, and ``Ledger`` assumes they are at head.

The same operation can be driven from several processes at once: a redelivered Celery
message, the deadline sweeper, the operator. Every read-modify-write therefore locks the
operation row first (``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite every transaction
is ``BEGIN IMMEDIATE``, which serialises writers on the whole file), and the unique
constraints (idempotency key, one checkpoint per operation) are the backstop for an
insert that races past a read: the loser's ``IntegrityError`` is answered with the
winner's row. Input is validated before any transaction opens, so a bad call writes
nothing.

The API takes the vocabularies only as their enums (``OperationKind``,
``OperationState``, ``CheckpointReason``; a plain string is refused, and mypy says so
first) and resume refs only as validated ``worker_agent.proto.ResumeRef`` models: the
shape of a ref is checked where the drain result is received (``DrainResult``), and
the ledger checks only what it needs on top (relative, contained session dirs; one
ref per agent; what fits its columns).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import operator
import re
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import Field, dataclass, fields
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from sqlalchemy import (
    ColumnElement,
    Engine,
    Select,
    create_engine,
    event,
    func,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError
from sqlalchemy.orm import Session, joinedload, selectinload, sessionmaker
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.dml import Insert

from orchestrator.ledger.models import (
    AGENT_ID_MAX,
    CHECKPOINTED_STATES,
    IDEMPOTENCY_KEY_MAX,
    LABEL_VALUE_MAX,
    NAME_MAX,
    NAMESPACE_MAX,
    TASK_UID_MAX,
    UNAVAILABLE_MAX,
    Checkpoint,
    CheckpointAgent,
    CheckpointReason,
    DaemonActivity,
    Operation,
    OperationKind,
    OperationState,
)
from worker_agent.k8s_names import is_dns_label
from worker_agent.proto import ResumeRef

SUPPORTED_BACKENDS = ("sqlite", "postgresql")

SQLITE_BUSY_TIMEOUT_SECS = 30.0
"""How long a SQLite transaction waits for another writer before "database is locked"."""


CHECKPOINT_REF_PREFIX = "ckpt-"
IN_LIST_MAX = 500
"""The most values one ``IN (…)`` of the ledger carries (``_in_chunks``). Callers ask
about collections of any size (an audit: every PVC of the cluster), and every value is a
bound parameter (a (namespace, name) pair is two), which both backends cap per
statement: PostgreSQL at 65,535 (its protocol counts them in 16 bits), SQLite at 32,766
since 3.32 (999 before, so a full list of pairs needs 3.32). A longer collection is read
in several statements of the one transaction."""
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")

_E = TypeVar("_E", bound=StrEnum)
_T = TypeVar("_T")
_View = TypeVar("_View", bound="_Dataclass")
_Select = TypeVar("_Select", bound="Select[*tuple[Any, ...]]")


# ------------------------------------------------------------------------------ errors


class LedgerError(Exception):
    """Base of the ledger's own refusals (bad input raises ``ValueError``)."""


class LedgerConflict(LedgerError):
    """The operation is not in a state that allows what was asked; nothing was written."""

    def __init__(self, op_id: str, current: str, wanted: str, why: str) -> None:
        self.op_id = op_id
        self.current = current
        self.wanted = wanted
        super().__init__(f"operation {op_id} is {current}, so it cannot become {wanted}: {why}")


class OtherTask(LedgerError):
    """The refs come from the daemon of another task (one re-created under the same
    name, its uid differs): never recorded as this operation's checkpoint."""

    def __init__(self, op_id: str, answered_by: str, task_uid: str) -> None:
        self.op_id = op_id
        super().__init__(
            f"drain refused by the ledger: the daemon that answered serves task uid "
            f"{answered_by}, the operation is for {task_uid}"
        )


def other_task(op_id: str, task_uid: str, answered_by: str | None) -> OtherTask | None:
    """Why refs from a daemon serving ``answered_by`` are not the checkpoint of the
    operation ``op_id`` for ``task_uid``, or None. Daemons refuse a drain for another uid
    themselves; this is the ledger's own check, whatever the daemon's version. An
    operation begun without a uid (``drainctl drain``: its task_uid is ``namespace/name``,
    which no Kubernetes uid looks like) takes the daemon's word, and so does a daemon
    that serves no uid."""
    if answered_by is None or "/" in task_uid or answered_by == task_uid:
        return None
    return OtherTask(op_id, answered_by, task_uid)


class UnknownOperation(LedgerError, LookupError):
    def __init__(self, op_id: str) -> None:
        self.op_id = op_id
        super().__init__(f"operation {op_id!r} is not in the ledger")


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True, slots=True)
class NewOperation:
    """One operation to begin (``Ledger.begin_operations``): ``begin_operation``'s
    arguments."""

    kind: OperationKind
    task_uid: str
    namespace: str
    name: str
    idempotency_key: str
    grace_secs: float | None = None
    checkpoint_ref: str | None = None
    deadline_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class OperationMove:
    """What ``Ledger.advance_operations`` writes with one operation's new state."""

    op_id: str
    celery_task_ids: Mapping[str, str] | None = None
    detail: Mapping[str, Any] | None = None


# ------------------------------------------------------------------------------- views


@dataclass(frozen=True, slots=True)
class OperationView:
    id: str
    kind: OperationKind
    task_uid: str
    namespace: str
    name: str
    state: OperationState
    idempotency_key: str
    checkpoint_ref: str | None
    grace_secs: float | None
    celery_task_ids: Mapping[str, str]
    detail: Mapping[str, Any] | None
    error: str | None
    created_at: datetime
    updated_at: datetime
    deadline_at: datetime | None
    finished_at: datetime | None

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True, slots=True)
class Finished:
    """An operation this process just moved to a terminal state (committed)."""

    operation: OperationView
    checkpoint_reason: CheckpointReason | None = None
    """The reason of the checkpoint recorded with it, if one was."""
    expired: bool = False
    """Failed by ``expire_operation`` (a deadline, or superseded) rather than by its chain."""


_finished_listeners: list[Callable[[Finished], None]] = []


def on_operation_finished(listener: Callable[[Finished], None]) -> None:
    """Call ``listener`` after every commit in this process that finishes an operation.

    A terminal state is entered exactly once, under the operation's row lock, so each
    finished operation is announced once, by the one process that finished it (a
    redelivered record answering the existing checkpoint announces nothing). The
    metrics count outcomes this way."""
    if listener not in _finished_listeners:
        _finished_listeners.append(listener)


def _announce(finished: Finished) -> None:
    for listener in _finished_listeners:
        listener(finished)


@dataclass(frozen=True, slots=True)
class CheckpointAgentView:
    agent_id: str
    session_dir: str
    """Relative to the PVC root."""
    turns: int
    session_sha256: str | None
    clean: bool
    exit: int | None
    error: str | None

    def resume_ref(self) -> ResumeRef:
        """This agent as the daemon's ``ResumeRef``."""
        return ResumeRef(
            id=self.agent_id,
            session_dir=self.session_dir,
            turns=self.turns,
            session_sha256=self.session_sha256,
            clean=self.clean,
            exit=self.exit,
            error=self.error,
        )


@dataclass(frozen=True, slots=True)
class CheckpointView:
    id: int
    ref: str
    operation_id: str
    task_uid: str
    namespace: str
    name: str
    reason: CheckpointReason
    pvc_name: str | None
    forced: bool
    verified: bool
    created_at: datetime
    agents: tuple[CheckpointAgentView, ...]
    """Ordered by agent id."""
    unavailable: str | None = None
    """Why it can no longer be restored (its workspace is gone); None: nothing known."""
    snapshot_name: str | None = None
    """The VolumeSnapshot taken of the workspace for this checkpoint, if one was."""
    snapshot_ready_at: datetime | None = None
    snapshot_error: str | None = None
    """Why the snapshot failed; the checkpoint then has only its retained PVC."""
    snapshot_cut_at: datetime | None = None
    """When the snapshot was cut (its point in time fixed); it is restorable once ready."""
    releasing_since: datetime | None = None
    """When ``drainctl ledger prune`` began releasing it; a restore waits while it is."""
    restore_claimed_at: datetime | None = None
    """When a restore last claimed it; None: never restored."""

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def snapshot(self) -> str | None:
        """The checkpoint's ready VolumeSnapshot: what a restore copies, or None."""
        return self.snapshot_name if self.snapshot_ready_at is not None else None

    @property
    def snapshot_pending(self) -> bool:
        """Whether its snapshot was asked for and is neither ready nor failed yet (cut or
        not: ``snapshot_cut_at`` says): a restore of it waits for it."""
        return (
            self.snapshot_name is not None
            and self.snapshot_ready_at is None
            and self.snapshot_error is None
        )


@dataclass(frozen=True, slots=True)
class UnsettledSnapshotView:
    """A checkpoint whose snapshot is asked for and neither ready nor failed, as the
    operator's snapshot follower reads it (``Ledger.unsettled_snapshots``)."""

    id: int
    ref: str
    task_uid: str
    namespace: str
    name: str
    pvc_name: str | None
    created_at: datetime
    snapshot_name: str
    snapshot_cut_at: datetime | None


@dataclass(frozen=True, slots=True)
class SnapshotMove:
    """What to record of checkpoint ``ref``'s snapshot (``Ledger.move_snapshots``): cut
    at ``cut_at``, ready at ``ready_at`` (cut then too), or failed for ``error``."""

    ref: str
    cut_at: datetime | None = None
    ready_at: datetime | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class OperationChange:
    """An operation as the operator's event feed sees it: whose it is and where it is."""

    id: str
    namespace: str
    name: str
    state: OperationState
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class CheckpointStorageView:
    """What a checkpoint holds in the cluster and whose it is, without its agents: what
    retention decides on (``Ledger.restorable_storage_after``)."""

    id: int
    ref: str
    task_uid: str
    namespace: str
    name: str
    created_at: datetime
    pvc_name: str | None
    snapshot_name: str | None
    unavailable: str | None = None

    @property
    def available(self) -> bool:
        return self.unavailable is None


@dataclass(frozen=True, slots=True)
class ActivityView:
    namespace: str
    name: str
    task_uid: str | None
    all_idle_since: datetime | None
    agents_total: int
    agents_live: int
    agents_idle: int
    reported_at: datetime
    seq: int
    idle_for_secs: float | None
    """On the daemon host's monotonic clock, when it sent the heartbeat; None: not idle."""
    received_at: datetime | None
    """The orchestrator's clock; None only on a row stored before migration 0002."""
    agents_interrupted: int = 0
    agents_done: int = 0
    """Agents whose worker exited 0 by itself, its work over."""


@dataclass(frozen=True, slots=True)
class DrainRecordProblem:
    """Where the ledger breaks one checkpoint per drain (``drain_record_problems``)."""

    subject: str
    """What it is about: ``operation <id>`` or ``task <namespace>/<name>``."""
    message: str


# ----------------------------------------------------------------------------- engine


def create_ledger_engine(url: str) -> Engine:
    """An engine for the ledger at ``url`` (``sqlite:///…`` or ``postgresql+psycopg://…``).

    SQLite gets what a multi-threaded, multi-process ledger needs: foreign keys on, one
    engine usable from every thread, a busy timeout, and ``BEGIN IMMEDIATE`` so that a
    transaction's reads cannot go stale before its writes (SQLite's stand-in for row locks).
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(
            "the ledger database URL is not a SQLAlchemy URL; use sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST:PORT/DB"
        ) from None
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"the ledger supports SQLite and PostgreSQL, not {backend!r} "
            f"(URL {parsed.render_as_string(hide_password=True)})"
        )
    if backend != "sqlite":
        # pre_ping: a pooled connection that died with a PostgreSQL restart is replaced.
        return create_engine(parsed, pool_pre_ping=True)
    in_memory = parsed.database in (None, "", ":memory:")
    engine = create_engine(
        parsed,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_SECS},
        # An in-memory database lives and dies with its one connection.
        poolclass=StaticPool if in_memory else None,
    )
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to SQLAlchemy (the driver's own BEGIN skips SELECTs).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys = ON")
        # Write-ahead logging: a commit is one append and one fsync of the log (the
        # rollback journal took three or four, ~17 ms a heartbeat), and readers in
        # other processes (the operator, drainctl) never wait for a writer. Still fully
        # synchronous: a committed checkpoint survives a power loss. (A database in
        # memory keeps its own journal: the pragma answers "memory" and changes nothing.)
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
    finally:
        cursor.close()


READ_ONLY_OPTION = "caliban_read_only"
"""Execution option of the engine ``Ledger``'s pure reads go through."""


def _sqlite_on_begin(connection: Connection) -> None:
    # A pure read (a caller polling an operation) takes no write lock: under BEGIN
    # IMMEDIATE every poll would hold off the worker's writes, whose busy handler then
    # sleeps for growing intervals.
    if connection.get_execution_options().get(READ_ONLY_OPTION):
        connection.exec_driver_sql("BEGIN")
    else:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


# ----------------------------------------------------------------------------- ledger


class Ledger:
    """The repository of lifecycle operations, checkpoints and daemon activity."""

    def __init__(self, engine: Engine) -> None:
        if engine.dialect.name not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"the ledger supports SQLite and PostgreSQL, not {engine.dialect.name!r}"
            )
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._reads = sessionmaker(
            engine.execution_options(**{READ_ONLY_OPTION: True}), expire_on_commit=False
        )
        """For reads that write nothing and need no lock (``get_operation(s)``)."""

    @classmethod
    def from_url(cls, url: str) -> Ledger:
        return cls(create_ledger_engine(url))

    @property
    def backend(self) -> str:
        return self._engine.dialect.name

    def dispose(self) -> None:
        """Close the pooled connections (the ledger reconnects if used again)."""
        self._engine.dispose()

    # ------------------------------------------------------------------- operations

    def begin_operation(
        self,
        kind: OperationKind,
        *,
        task_uid: str,
        namespace: str,
        name: str,
        idempotency_key: str,
        grace_secs: float | None = None,
        checkpoint_ref: str | None = None,
        deadline_at: datetime | None = None,
    ) -> OperationView:
        """Start an operation in ``pending``, or answer the one this key already started.

        Reusing a key for a different operation (another kind or task) is refused with
        ``ValueError``, never silently answered with the wrong row.
        """
        new = NewOperation(
            kind,
            task_uid=task_uid,
            namespace=namespace,
            name=name,
            idempotency_key=idempotency_key,
            grace_secs=grace_secs,
            checkpoint_ref=checkpoint_ref,
            deadline_at=deadline_at,
        )
        return self.begin_operations([new])[0]

    def begin_operations(self, new: Sequence[NewOperation]) -> list[OperationView]:
        """``begin_operation`` for each of ``new``, in one transaction: each answer is the
        operation started, or the one its key already names (a key twice in ``new`` is
        one operation). Every entry is validated first, so a bad one writes nothing."""
        rows = [_new_operation_row(each) for each in new]
        keys = list(dict.fromkeys(row.idempotency_key for row in rows))
        try:
            with self._sessions.begin() as session:
                by_key: dict[str, OperationView] = {}
                for chunk in _in_chunks(keys):
                    found = select(Operation).where(Operation.idempotency_key.in_(chunk))
                    by_key.update(
                        (r.idempotency_key, _operation_view(r)) for r in session.scalars(found)
                    )
                fresh: dict[str, Operation] = {}
                for row in rows:
                    if row.idempotency_key not in by_key and row.idempotency_key not in fresh:
                        session.add(row)
                        fresh[row.idempotency_key] = row
                session.flush()
                by_key.update((key, _operation_view(row)) for key, row in fresh.items())
        except IntegrityError:
            # A concurrent call inserted one of these keys first: begin each on its own,
            # which answers the winner's row for that key.
            if len(rows) == 1:
                found_one = self.find_operation(rows[0].idempotency_key)
                if found_one is None:
                    raise
                by_key = {found_one.idempotency_key: found_one}
            else:
                return [self.begin_operations([each])[0] for each in new]
        views = [by_key[row.idempotency_key] for row in rows]
        for row, view in zip(rows, views, strict=True):
            _check_same_operation(view, (row.kind, row.task_uid, row.namespace, row.name))
        return views

    def get_operation(self, op_id: str) -> OperationView | None:
        with self._reads.begin() as session:
            row = session.get(Operation, op_id)
            return None if row is None else _operation_view(row)

    def get_operations(self, op_ids: Collection[str]) -> dict[str, OperationView]:
        """The operations of ``op_ids`` that are in the ledger, by id, in one read."""
        wanted = list(dict.fromkeys(op_ids))
        found: dict[str, OperationView] = {}
        with self._reads.begin() as session:
            for chunk in _in_chunks(wanted):
                rows = session.scalars(select(Operation).where(Operation.id.in_(chunk)))
                found.update((row.id, _operation_view(row)) for row in rows)
        return found

    def operation_states(self, op_ids: Collection[str]) -> dict[str, OperationState]:
        """The states of the operations of ``op_ids`` that are in the ledger, by id, in
        one read of those two columns: what a follower of many operations polls (200 of
        them: about 7 ms of CPU as whole operations, their JSON columns decoded), reading
        the whole operation only once its state has moved."""
        wanted = list(dict.fromkeys(op_ids))
        found: dict[str, OperationState] = {}
        with self._reads.begin() as session:
            for chunk in _in_chunks(wanted):
                rows = session.execute(
                    select(Operation.id, Operation.state).where(Operation.id.in_(chunk))
                )
                found.update((op_id, OperationState(state)) for op_id, state in rows)
        return found

    def find_operation(self, idempotency_key: str) -> OperationView | None:
        with self._sessions.begin() as session:
            row = session.scalar(
                select(Operation).where(Operation.idempotency_key == idempotency_key)
            )
            return None if row is None else _operation_view(row)

    def last_lifecycle_operation(self, task_uid: str) -> OperationView | None:
        """The newest operation of task ``task_uid`` other than its deletion's own (a
        delete drain, a forced checkpoint): what the task was last doing, as the ledger
        saw it, whatever its status says."""
        query = (
            select(Operation)
            .where(
                Operation.task_uid == task_uid,
                Operation.kind.not_in(
                    [OperationKind.DELETE_DRAIN.value, OperationKind.FORCE_DELETE.value]
                ),
            )
            .order_by(Operation.created_at.desc(), Operation.id.desc())
            .limit(1)
        )
        with self._sessions.begin() as session:
            row = session.scalar(query)
            return None if row is None else _operation_view(row)

    def list_operations(
        self, namespace: str | None = None, name: str | None = None, limit: int = 100
    ) -> list[OperationView]:
        """Operations, newest first, optionally of one namespace or one task."""
        query = select(Operation)
        if namespace is not None:
            query = query.where(Operation.namespace == namespace)
        if name is not None:
            query = query.where(Operation.name == name)
        query = query.order_by(Operation.created_at.desc(), Operation.id).limit(_limit(limit))
        with self._sessions.begin() as session:
            return [_operation_view(row) for row in session.scalars(query)]

    def overdue_operations(self, now: datetime, limit: int = 100) -> list[OperationView]:
        """Unfinished operations whose deadline is before ``now``, oldest deadline first."""
        query = (
            select(Operation)
            .where(Operation.state.not_in([s.value for s in OperationState if s.terminal]))
            .where(Operation.deadline_at < _aware("now", now))
            .order_by(Operation.deadline_at, Operation.id)
            .limit(_limit(limit))
        )
        with self._sessions.begin() as session:
            return [_operation_view(row) for row in session.scalars(query)]

    def transition(
        self,
        op_id: str,
        to_state: OperationState,
        *,
        expect: Sequence[OperationState] | None = None,
        error: str | None = None,
        celery_task_ids: Mapping[str, str] | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> OperationView:
        """Move an operation to ``to_state`` if it is in one of ``expect`` (any, if None).

        ``celery_task_ids`` are merged into the stored ones; ``error`` and ``detail``
        replace theirs when given. A terminal state sets ``finished_at`` and is never
        left. ``recorded`` and ``forced`` are entered only by ``record_checkpoint``.
        Raises ``LedgerConflict`` (nothing written) when the state does not allow it.
        """
        wanted, expected = _wanted_state(to_state, expect)
        error = _optional_str("error", error)
        new_ids = None if celery_task_ids is None else _celery_ids(celery_task_ids)
        new_detail = None if detail is None else _json_object("detail", detail)
        with self._sessions.begin() as session:
            row = _lock_operation(session, op_id)
            view = _move(row, wanted, expected, error, new_ids, new_detail)
        if wanted.terminal:
            _announce(Finished(view))
        return view

    def advance_operations(
        self,
        moves: Sequence[OperationMove],
        to_state: OperationState,
        *,
        expect: Sequence[OperationState],
    ) -> list[OperationView]:
        """``transition`` of each operation of ``moves`` to ``to_state``, in one
        transaction; answer each as it is after it. One that is not in a state of
        ``expect`` is answered unchanged (something else moved it on: its chain, the
        sweeper), never raised; an unknown one raises ``UnknownOperation``, nothing
        written."""
        wanted, expected = _wanted_state(to_state, expect)
        changes = [
            (
                move.op_id,
                None if move.celery_task_ids is None else _celery_ids(move.celery_task_ids),
                None if move.detail is None else _json_object("detail", move.detail),
            )
            for move in moves
        ]
        views: dict[str, OperationView] = {}
        finished: list[OperationView] = []
        with self._sessions.begin() as session:
            rows = _lock_operations(session, [op_id for op_id, _, _ in changes])
            for op_id, new_ids, new_detail in changes:
                try:
                    views[op_id] = _move(rows[op_id], wanted, expected, None, new_ids, new_detail)
                except LedgerConflict:
                    views[op_id] = _operation_view(rows[op_id])
                else:
                    if wanted.terminal:
                        finished.append(views[op_id])
        for view in finished:
            _announce(Finished(view))
        return [views[move.op_id] for move in moves]

    def expire_operation(self, op_id: str, reason: str) -> OperationView:
        """Fail an unfinished operation with ``reason``; a finished one is answered as is.

        The deadline watchdog calls this; repeating it, or racing the chain that finishes
        the operation, is harmless: whichever commits first decides.
        """
        reason = _text("reason", reason, max_len=None)
        with self._sessions.begin() as session:
            row = _lock_operation(session, op_id)
            if OperationState(row.state).terminal:
                return _operation_view(row)
            now = _now()
            row.state = OperationState.FAILED
            row.error = reason
            row.updated_at = now
            row.finished_at = now
            view = _operation_view(row)
        _announce(Finished(view, expired=True))
        return view

    # ------------------------------------------------------------------ checkpoints

    def record_checkpoint(
        self,
        op_id: str,
        refs: Sequence[ResumeRef],
        *,
        reason: CheckpointReason,
        pvc_name: str | None = None,
        forced: bool = False,
        answered_by: str | None = None,
    ) -> CheckpointView:
        """Record the operation's checkpoint from the daemon's resume refs, exactly once.

        One transaction writes the checkpoint, its agents, and the operation's move to
        ``recorded`` (``forced`` if ``forced``) with its ``checkpoint_ref``. If the
        operation already has a checkpoint, that one is answered unchanged, whatever
        this call carries: a redelivered task never produces a second. A finished
        operation without one (``failed``), or one that consumes checkpoints (resume,
        restore), is refused with ``LedgerConflict``.

        ``verified`` claims that the daemon drained and checked every agent's session:
        true when the checkpoint is not forced and every ref is clean (vacuously so for a
        daemon with no agents: that drain really did verify all of nothing). A forced
        checkpoint is the PVC as it was, checked by nobody, so it is never verified.

        ``answered_by``: the task uid the daemon that drained serves. Refs from another
        task's daemon are refused with ``OtherTask`` (nothing written; see
        ``other_task``). The check is made in the write's own transaction, on the locked
        row: a drain's record is one transaction, with no read before it.
        """
        why = _member(CheckpointReason, reason, "checkpoint reason")
        pvc = None if pvc_name is None else _text("pvc_name", pvc_name, NAME_MAX)
        if not isinstance(forced, bool):
            raise ValueError(f"forced must be a bool, not {forced!r}")
        agents = _parse_resume_refs(refs)
        wanted = OperationState.FORCED if forced else OperationState.RECORDED
        try:
            with self._sessions.begin() as session:
                op = _lock_operation(session, op_id)
                existing = self._checkpoint_of(session, op_id)
                if existing is not None:
                    return _checkpoint_view(existing)
                if (refused := other_task(op_id, op.task_uid, answered_by)) is not None:
                    raise refused
                current = OperationState(op.state)
                kind = OperationKind(op.kind)
                if not kind.records_checkpoint:
                    raise LedgerConflict(
                        op_id, current, wanted, f"a {kind.value} operation consumes a checkpoint"
                    )
                if current.terminal:
                    raise LedgerConflict(op_id, current, wanted, "it finished without a checkpoint")
                now = _now()
                checkpoint = Checkpoint(
                    ref=checkpoint_ref_for(op_id),
                    operation_id=op_id,
                    task_uid=op.task_uid,
                    namespace=op.namespace,
                    name=op.name,
                    reason=why,
                    pvc_name=pvc,
                    forced=forced,
                    verified=not forced and all(agent.clean for agent in agents),
                    created_at=now,
                    agents=[_agent_row(agent) for agent in agents],
                )
                session.add(checkpoint)
                op.state = wanted
                op.checkpoint_ref = checkpoint.ref
                op.updated_at = now
                op.finished_at = now
                session.flush()
                recorded, finished = _checkpoint_view(checkpoint), _operation_view(op)
            _announce(Finished(finished, checkpoint_reason=why))
            return recorded
        except IntegrityError:
            # UNIQUE(operation_id): a concurrent call recorded this operation first.
            with self._sessions.begin() as session:
                existing = self._checkpoint_of(session, op_id)
                if existing is None:
                    raise
                return _checkpoint_view(existing)

    def get_checkpoint(self, ref: str) -> CheckpointView | None:
        with self._sessions.begin() as session:
            query = (
                select(Checkpoint)
                .where(Checkpoint.ref == ref)
                .options(joinedload(Checkpoint.agents))
            )
            row = session.scalars(query).unique().one_or_none()
            return None if row is None else _checkpoint_view(row)

    def claim_for_restore(self, ref: str) -> CheckpointView | None:
        """Claim checkpoint ``ref`` for a restore, on its locked row, unless it is
        unavailable or being released by a prune; its view either way (None for an
        unknown ref). Claimed exactly when the view is available and not
        ``releasing_since``; ``restore_claimed_at`` then says when.

        A prune marks what it releases (``begin_release``) before it looks at the cluster
        a second time and deletes anything: a claim made before the mark is seen by that
        look (the restoring task names the checkpoint), and one made after it is refused
        here, never granted on storage about to be deleted."""
        with self._sessions.begin() as session:
            row = _lock_checkpoint(session, ref)
            if row is None:
                return None
            if row.unavailable is None and row.releasing_since is None:
                row.restore_claimed_at = _now()
            return _checkpoint_view(row)

    def begin_release(self, refs: Collection[str]) -> list[str]:
        """Mark the available checkpoints among ``refs`` as being released (a prune is
        about to look at the cluster again, then delete their storage), on their locked
        rows; the refs so marked. A mark left by a prune that stopped is taken over."""
        return self._set_releasing(refs, mark=True)

    def cancel_release(self, refs: Collection[str]) -> list[str]:
        """Clear the release mark of the checkpoints among ``refs`` that are still
        available (the prune keeps them after all); the refs so cleared."""
        return self._set_releasing(refs, False, Checkpoint.releasing_since.is_not(None))

    def _set_releasing(
        self, refs: Collection[str], mark: bool, *where: ColumnElement[bool]
    ) -> list[str]:
        """Set ``releasing_since`` (to the time once their rows are locked, or None) of the
        available checkpoints among ``refs`` that match ``where``, locking their rows in id
        order; the refs so set."""
        wanted = sorted({_text("checkpoint ref", ref, LABEL_VALUE_MAX) for ref in refs})
        done: list[str] = []
        with self._sessions.begin() as session:
            for chunk in _in_chunks(wanted):
                rows = session.scalars(
                    select(Checkpoint)
                    .where(Checkpoint.ref.in_(chunk), Checkpoint.unavailable.is_(None), *where)
                    .order_by(Checkpoint.id)
                    .with_for_update()
                ).all()
                since = _now() if mark else None
                for row in rows:
                    row.releasing_since = since
                done += [row.ref for row in rows]
        return done

    def mark_checkpoint_unavailable(self, ref: str, reason: str) -> CheckpointView | None:
        """Say checkpoint ``ref`` can no longer be restored, and why (its workspace is
        gone); None for an unknown ref. The first reason is kept: repeating it, or another
        operator finding the same, changes nothing."""
        reason = _text("reason", reason, max_len=None)[:UNAVAILABLE_MAX]
        with self._sessions.begin() as session:
            row = _lock_checkpoint(session, ref)
            if row is None:
                return None
            if row.unavailable is None:
                row.unavailable = reason
            return _checkpoint_view(row)

    def mark_checkpoints_unavailable(self, reasons: Mapping[str, str]) -> list[str]:
        """``mark_checkpoint_unavailable`` for many checkpoints (ref → reason) in one
        transaction; the refs this call marked (unknown refs and those already marked
        are left as they are)."""
        wanted = {
            _text("checkpoint ref", ref, LABEL_VALUE_MAX): _text("reason", why, None)[
                :UNAVAILABLE_MAX
            ]
            for ref, why in reasons.items()
        }
        if not wanted:
            return []
        with self._sessions.begin() as session:
            rows = session.scalars(
                select(Checkpoint)
                .where(Checkpoint.ref.in_(sorted(wanted)), Checkpoint.unavailable.is_(None))
                .order_by(Checkpoint.id)
                .with_for_update()
            ).all()
            for row in rows:
                row.unavailable = wanted[row.ref]
            return [row.ref for row in rows]

    def mark_workspace_gone(self, namespace: str, pvc_name: str, reason: str) -> list[str]:
        """Say every restorable checkpoint whose only workspace is PVC
        ``namespace/pvc_name`` (no snapshot, or a failed one) can no longer be restored,
        because that PVC is being deleted; the refs so marked. A checkpoint with a ready
        snapshot keeps it and stays restorable, and so does one whose snapshot is still
        on its way."""
        return self._mark_restorable_unavailable(
            reason,
            Checkpoint.namespace == namespace,
            Checkpoint.pvc_name == pvc_name,
            Checkpoint.snapshot_ready_at.is_(None),
            # A snapshot on its way holds the workspace as the checkpoint left it (the
            # external-snapshotter postpones removing its source PVC until it is ready);
            # should it fail after all, the operator marks the checkpoint then.
            or_(Checkpoint.snapshot_name.is_(None), Checkpoint.snapshot_error.is_not(None)),
        )

    def mark_namespace_gone(self, namespace: str, reason: str) -> list[str]:
        """Say every restorable checkpoint of a task in ``namespace`` can no longer be
        restored, because the namespace is being deleted and its workspace PVCs and
        VolumeSnapshots go with it (a restore reads them only from its own namespace);
        the refs so marked."""
        return self._mark_restorable_unavailable(reason, Checkpoint.namespace == namespace)

    def _mark_restorable_unavailable(self, reason: str, *where: ColumnElement[bool]) -> list[str]:
        """Say every restorable checkpoint that matches ``where`` can no longer be
        restored, for ``reason``, locking their rows; the refs so marked."""
        reason = _text("reason", reason, max_len=None)[:UNAVAILABLE_MAX]
        with self._sessions.begin() as session:
            rows = session.scalars(
                select(Checkpoint).where(*where, Checkpoint.unavailable.is_(None)).with_for_update()
            ).all()
            for row in rows:
                row.unavailable = reason
            return [row.ref for row in rows]

    def record_snapshot(
        self,
        ref: str,
        name: str | None,
        *,
        cut_at: datetime | None = None,
        ready_at: datetime | None = None,
        error: str | None = None,
    ) -> CheckpointView | None:
        """Say checkpoint ``ref``'s workspace snapshot is VolumeSnapshot ``name``: asked
        for (no moment, no error), cut at ``cut_at``, ready since ``ready_at`` (and cut
        by then), or failed with ``error`` (``name`` None: none could be asked for, and
        ``error`` says why); None for an unknown ref. A checkpoint has one snapshot:
        another name is refused, and once ready or failed the outcome is kept."""
        if name is not None:
            name = _text("snapshot name", name, max_len=NAME_MAX)
        elif error is None or ready_at is not None or cut_at is not None:
            raise ValueError("a snapshot without a name is one that failed: give its error")
        move = _snapshot_move(SnapshotMove(ref, cut_at, ready_at, error))
        with self._sessions.begin() as session:
            row = _lock_checkpoint(session, ref)
            if row is None:
                return None
            if name is not None and row.snapshot_name not in (None, name):
                raise LedgerError(
                    f"checkpoint {ref} already has snapshot {row.snapshot_name}, not {name}"
                )
            row.snapshot_name = row.snapshot_name or name
            _move_snapshot(row, move)
            return _checkpoint_view(row)

    def stalled_releases(self, before: datetime, limit: int = 100) -> list[CheckpointView]:
        """Up to ``limit`` available checkpoints a prune marked as being released before
        ``before`` and never finished (released or kept): a prune that stopped half-way,
        oldest mark first. A restore of one waits until a prune settles it."""
        query = (
            select(Checkpoint)
            .where(
                Checkpoint.releasing_since.is_not(None),
                Checkpoint.releasing_since < before,
                Checkpoint.unavailable.is_(None),
            )
            .order_by(Checkpoint.releasing_since, Checkpoint.id)
            .limit(_limit(limit))
            .options(selectinload(Checkpoint.agents))
        )
        with self._sessions.begin() as session:
            return [_checkpoint_view(row) for row in session.scalars(query)]

    def unsettled_snapshots(
        self, after_id: int = 0, limit: int = 500
    ) -> list[UnsettledSnapshotView]:
        """Up to ``limit`` checkpoints after id ``after_id``, in id order, whose snapshot
        is asked for and neither ready nor failed: what the operator follows (a partial
        index holds exactly these rows, so the read costs what they are, not the
        ledger's size)."""
        if limit < 1:
            raise ValueError("limit must be a positive integer")
        query = _unsettled_snapshots_query(after_id, limit)
        with self._sessions.begin() as session:
            return [
                UnsettledSnapshotView(
                    row.id,
                    row.ref,
                    row.task_uid,
                    row.namespace,
                    row.name,
                    row.pvc_name,
                    row.created_at,
                    str(row.snapshot_name),
                    row.snapshot_cut_at,
                )
                for row in session.execute(query)
            ]

    def move_snapshots(self, moves: Sequence[SnapshotMove]) -> list[CheckpointView]:
        """Record each of ``moves`` (one transaction, rows locked in ref order); the
        checkpoints this call changed, as they are now. A snapshot already ready or failed
        keeps its outcome, so of two processes recording one outcome, exactly one gets
        the checkpoint back: the one that says so."""
        wanted = {m.ref: _snapshot_move(m) for m in moves}
        if not wanted:
            return []
        changed: list[CheckpointView] = []
        with self._sessions.begin() as session:
            for chunk in _in_chunks(sorted(wanted)):
                rows = session.scalars(
                    select(Checkpoint)
                    .where(Checkpoint.ref.in_(chunk), Checkpoint.snapshot_name.is_not(None))
                    .options(selectinload(Checkpoint.agents))
                    .order_by(Checkpoint.ref)
                    .with_for_update()
                ).all()
                for row in rows:
                    if _move_snapshot(row, wanted[row.ref]):
                        changed.append(_checkpoint_view(row))
        return changed

    def newest_checkpoint_of_pvc(self, namespace: str, pvc_name: str) -> CheckpointView | None:
        """The newest checkpoint recorded of workspace PVC ``namespace/pvc_name``: the only
        one whose state that PVC still holds."""
        query = (
            select(Checkpoint)
            .options(joinedload(Checkpoint.agents))
            .where(Checkpoint.namespace == namespace, Checkpoint.pvc_name == pvc_name)
            .order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc())
            .limit(1)
        )
        with self._sessions.begin() as session:
            row = session.scalars(query).unique().one_or_none()
            return None if row is None else _checkpoint_view(row)

    def list_checkpoints(
        self,
        namespace: str | None = None,
        name: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[CheckpointView]:
        """Checkpoints, newest first, optionally of one namespace or one task; with
        ``after``, the page that follows checkpoint ``after`` (the last ref of the page
        before): a keyset on (created_at, id), so a later page walks the same index as
        the first instead of skipping rows. An unknown ``after`` is a ``LookupError``."""
        # The agents come in the same query (a LEFT JOIN onto the limited rows), not a
        # second SELECT … IN: one round trip fewer on the reads people and the operator
        # wait on (this, ``get_checkpoint``, ``newest_checkpoint_of_pvc``); at 1,000,000
        # checkpoints on PostgreSQL a task's latest went from 1.28 to 0.85 ms (median).
        query = select(Checkpoint).options(joinedload(Checkpoint.agents))
        if namespace is not None:
            query = query.where(Checkpoint.namespace == namespace)
        if name is not None:
            query = query.where(Checkpoint.name == name)
        query = query.order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(
            _limit(limit)
        )
        with self._sessions.begin() as session:
            if after is not None:
                last = session.execute(
                    select(Checkpoint.created_at, Checkpoint.id).where(Checkpoint.ref == after)
                ).one_or_none()
                if last is None:
                    raise LookupError(f"no checkpoint {after!r} in the ledger")
                # A row comparison: PostgreSQL starts the index scan at it.
                query = query.where(tuple_(Checkpoint.created_at, Checkpoint.id) < tuple(last))
            return [_checkpoint_view(row) for row in session.scalars(query).unique()]

    def latest_checkpoint(self, namespace: str, name: str) -> CheckpointView | None:
        """The newest checkpoint of the task ``namespace/name`` (deleted tasks included)."""
        newest = self.list_checkpoints(namespace, name, limit=1)
        return newest[0] if newest else None

    def _checkpoint_of(self, session: Session, op_id: str) -> Checkpoint | None:
        return session.scalar(
            select(Checkpoint)
            .where(Checkpoint.operation_id == op_id)
            .options(selectinload(Checkpoint.agents))
        )

    # --------------------------------------------------------------------- activity

    def record_activity(
        self,
        namespace: str,
        name: str,
        *,
        task_uid: str | None,
        all_idle_since: datetime | None,
        agents_total: int,
        agents_live: int,
        agents_idle: int,
        seq: int,
        reported_at: datetime,
        idle_for_secs: float | None,
        received_at: datetime,
        agents_interrupted: int = 0,
        agents_done: int = 0,
    ) -> ActivityView:
        """Keep a daemon's heartbeat unless a newer one (higher ``seq``) is stored already.

        Answers what is stored afterwards, so a caller sees whether its heartbeat won.
        ``seq`` must grow across daemon restarts (wall-clock nanoseconds do), or a
        restarted daemon's heartbeats are ignored until it passes its old count.
        ``idle_for_secs`` (the daemon's monotonic measure) and ``received_at`` (the
        caller's clock, when it received the heartbeat) are what the idle pause reads.
        """
        if idle_for_secs is not None and not 0 <= idle_for_secs < float("inf"):
            raise ValueError(
                f"activity of {namespace}/{name}: idle_for_secs must be a finite number "
                f">= 0, got {idle_for_secs!r}"
            )
        total = _count("agents_total", agents_total)
        live = _count("agents_live", agents_live)
        idle = _count("agents_idle", agents_idle)
        interrupted = _count("agents_interrupted", agents_interrupted)
        done = _count("agents_done", agents_done)
        if not idle <= live <= total or live + interrupted + done > total:
            raise ValueError(
                f"activity of {namespace}/{name}: need agents_idle <= agents_live <= "
                f"agents_total and agents_live + agents_interrupted + agents_done <= "
                f"agents_total, got {idle}, {live}, {total}, {interrupted}, {done}"
            )
        values: dict[str, Any] = {
            "namespace": _text("namespace", namespace, NAMESPACE_MAX),
            "name": _text("name", name, NAME_MAX),
            "task_uid": None if task_uid is None else _text("task_uid", task_uid, TASK_UID_MAX),
            "all_idle_since": _aware("all_idle_since", all_idle_since),
            "agents_total": total,
            "agents_live": live,
            "agents_idle": idle,
            "agents_interrupted": interrupted,
            "agents_done": done,
            "reported_at": _aware("reported_at", reported_at),
            "seq": _count("seq", seq),
            "idle_for_secs": idle_for_secs,
            "received_at": _aware("received_at", received_at),
        }
        if values["reported_at"] is None or values["received_at"] is None:
            raise ValueError("reported_at and received_at are required")
        with self._sessions.begin() as session:
            session.execute(_newer_heartbeat_upsert(self.backend, values))
            row = session.get(DaemonActivity, (namespace, name), populate_existing=True)
            assert row is not None  # the upsert inserted it or it was there
            return _activity_view(row)

    def get_activity(self, namespace: str, name: str) -> ActivityView | None:
        with self._sessions.begin() as session:
            row = session.get(DaemonActivity, (namespace, name))
            return None if row is None else _activity_view(row)

    # ------------------------------------------------------------------ audit reads
    # What ``orchestrator.audit`` compares with the cluster, in bounded pages.

    def available_checkpoints_after(self, after_id: int, limit: int) -> list[CheckpointView]:
        """Up to ``limit`` restorable checkpoints with an id above ``after_id``, by id."""
        query = _restorable_page(
            select(Checkpoint).options(selectinload(Checkpoint.agents)), after_id, limit
        )
        with self._sessions.begin() as session:
            return [_checkpoint_view(row) for row in session.scalars(query)]

    def restorable_storage_after(self, after_id: int, limit: int) -> list[CheckpointStorageView]:
        """Up to ``limit`` restorable checkpoints with an id above ``after_id``, by id, as
        the storage they hold: one narrow query, no agents, no ORM objects (a prune reads
        every restorable checkpoint of the ledger)."""
        columns = [getattr(Checkpoint, name) for name in _field_names(CheckpointStorageView)]
        query = _restorable_page(select(*columns), after_id, limit)
        with self._sessions.begin() as session:
            return [CheckpointStorageView(*row) for row in session.execute(query)]

    def count_available_checkpoints(self) -> int:
        with self._sessions.begin() as session:
            query = select(func.count()).where(Checkpoint.unavailable.is_(None))
            return int(session.scalar(query.select_from(Checkpoint)) or 0)

    # ------------------------------------------------------------------ event feed
    # What the operator's feed (``orchestrator.operator.events``) reads instead of every
    # task's rows on a timer: what arrived since a moment, oldest first, in bounded pages.

    def activity_received_since(self, after: datetime, limit: int) -> list[ActivityView]:
        """Up to ``limit`` heartbeats stored after ``after`` (by ``received_at``)."""
        query = (
            select(DaemonActivity)
            .where(DaemonActivity.received_at > after)
            .order_by(DaemonActivity.received_at)
            .limit(_limit(limit))
        )
        with self._sessions.begin() as session:
            return [_activity_view(row) for row in session.scalars(query)]

    def operations_moved_since(self, after: datetime, limit: int) -> list[OperationChange]:
        """Up to ``limit`` operations whose row changed after ``after`` (``updated_at``)."""
        columns = [getattr(Operation, name) for name in _field_names(OperationChange)]
        query = (
            select(*columns)
            .where(Operation.updated_at > after)
            .order_by(Operation.updated_at)
            .limit(_limit(limit))
        )
        with self._sessions.begin() as session:
            return [_operation_change(row) for row in session.execute(query)]

    def list_activities(self) -> list[ActivityView]:
        """Every daemon's newest heartbeat (one row per Sandbox)."""
        with self._sessions.begin() as session:
            return [_activity_view(row) for row in session.scalars(select(DaemonActivity))]

    def existing_refs(self, refs: Collection[str]) -> dict[str, str | None]:
        """Those of ``refs`` the ledger holds a checkpoint for, each with why it is
        unavailable (None: it is restorable)."""
        found: dict[str, str | None] = {}
        wanted = sorted(set(refs))
        with self._sessions.begin() as session:
            for chunk in _in_chunks(wanted):
                query = select(Checkpoint.ref, Checkpoint.unavailable).where(
                    Checkpoint.ref.in_(chunk)
                )
                found.update((ref, why) for ref, why in session.execute(query))
        return found

    def resumed_refs(self, refs: Collection[str]) -> set[str]:
        """Those of ``refs`` a resume or restore operation has named: their workspace has
        run agents since, so it no longer holds the checkpoint's state."""
        found: set[str] = set()
        wanted = sorted(set(refs))
        consuming = [k.value for k in OperationKind if not k.records_checkpoint]
        with self._sessions.begin() as session:
            for chunk in _in_chunks(wanted):
                query = select(Operation.checkpoint_ref).where(
                    Operation.kind.in_(consuming), Operation.checkpoint_ref.in_(chunk)
                )
                found.update(ref for ref in session.scalars(query) if ref is not None)
        return found

    def newest_refs_of_pvcs(self, pvcs: Collection[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """For each (namespace, PVC), the ref of its newest checkpoint (available or not)."""
        newest: dict[tuple[str, str], tuple[datetime, int, str]] = {}
        wanted = sorted(set(pvcs))
        with self._sessions.begin() as session:
            for chunk in _in_chunks(wanted):
                query = select(
                    Checkpoint.namespace,
                    Checkpoint.pvc_name,
                    Checkpoint.created_at,
                    Checkpoint.id,
                    Checkpoint.ref,
                ).where(tuple_(Checkpoint.namespace, Checkpoint.pvc_name).in_(chunk))
                for namespace, pvc, created, row_id, ref in session.execute(query):
                    key = (namespace, str(pvc))
                    if key not in newest or newest[key][:2] < (created, row_id):
                        newest[key] = (created, row_id, ref)
        return {key: ref for key, (_, _, ref) in newest.items()}

    def workspace_references(
        self, pvcs: Collection[tuple[str, str]], snapshots: Collection[tuple[str, str]]
    ) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        """Which of ``pvcs`` and ``snapshots`` (namespace, name) a restorable checkpoint
        names as its workspace PVC or its VolumeSnapshot."""
        used_pvcs: set[tuple[str, str]] = set()
        used_snapshots: set[tuple[str, str]] = set()
        with self._sessions.begin() as session:
            for wanted, column, into in (
                (pvcs, Checkpoint.pvc_name, used_pvcs),
                (snapshots, Checkpoint.snapshot_name, used_snapshots),
            ):
                keys = sorted(set(wanted))
                for chunk in _in_chunks(keys):
                    query = select(Checkpoint.namespace, column).where(
                        Checkpoint.unavailable.is_(None),
                        tuple_(Checkpoint.namespace, column).in_(chunk),
                    )
                    into.update((ns, str(name)) for ns, name in session.execute(query))
        return used_pvcs, used_snapshots

    def drain_record_problems(self, limit: int = 100) -> list[DrainRecordProblem]:
        """Where the ledger breaks one checkpoint per drain: an operation recorded (or
        forced) without its checkpoint, one that failed yet has one, and a task with
        more than one deletion checkpoint. At most ``limit`` of each."""
        problems: list[DrainRecordProblem] = []
        with self._sessions.begin() as session:
            produced = select(Checkpoint.operation_id)
            missing = (
                select(Operation)
                .where(
                    Operation.state.in_(
                        [OperationState.RECORDED.value, OperationState.FORCED.value]
                    )
                )
                .where(Operation.id.not_in(produced))
                .limit(_limit(limit))
            )
            for op in session.scalars(missing):
                problems.append(
                    _operation_problem(
                        op, f"is {op.state} but the ledger holds no checkpoint for it"
                    )
                )
            failed = (
                select(Operation, Checkpoint.ref)
                .join(Checkpoint, Checkpoint.operation_id == Operation.id)
                .where(Operation.state == OperationState.FAILED.value)
                .limit(_limit(limit))
            )
            for op, ref in session.execute(failed):
                problems.append(
                    _operation_problem(op, f"failed ({op.error}) yet recorded checkpoint {ref}")
                )
            deletions = [CheckpointReason.DELETE.value, CheckpointReason.FORCED.value]
            doubled = (
                select(Checkpoint.task_uid)
                .where(Checkpoint.reason.in_(deletions))
                .group_by(Checkpoint.task_uid)
                .having(func.count() > 1)
                .limit(_limit(limit))
            )
            for task_uid in list(session.scalars(doubled)):
                rows = session.execute(
                    select(Checkpoint.namespace, Checkpoint.name, Checkpoint.ref)
                    .where(Checkpoint.task_uid == task_uid, Checkpoint.reason.in_(deletions))
                    .order_by(Checkpoint.id)
                ).all()
                namespace, name = rows[0][0], rows[0][1]
                problems.append(
                    DrainRecordProblem(
                        f"task {namespace}/{name}",
                        f"task {namespace}/{name} (uid {task_uid}) has {len(rows)} deletion "
                        f"checkpoints, one deletion records one: {', '.join(r[2] for r in rows)}",
                    )
                )
        return problems


def checkpoint_ref_for(op_id: str) -> str:
    """The checkpoint ref an operation's checkpoint gets: derived from its id alone, so a
    redelivered ``record_checkpoint`` computes the same one. A valid label value."""
    return CHECKPOINT_REF_PREFIX + hashlib.sha256(op_id.encode()).hexdigest()[:20]


def is_label_value(value: str) -> bool:
    """Whether ``value`` is a checkpoint ref's shape: a lowercase label value, which
    also names the checkpoint's VolumeSnapshot (a DNS label)."""
    return is_dns_label(value)


# ---------------------------------------------------------------------------- helpers


def _now() -> datetime:
    return datetime.now(UTC)


def _in_chunks(values: Sequence[_T], size: int = IN_LIST_MAX) -> Iterator[Sequence[_T]]:
    """``values`` in order as consecutive slices of at most ``size``, one ``IN (…)`` each;
    none for no values, so an empty question sends no statement."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _new_operation_row(new: NewOperation) -> Operation:
    """A validated ``pending`` row for ``new``; ``ValueError`` names what is wrong."""
    now = _now()
    return Operation(
        id=str(uuid.uuid4()),
        kind=_member(OperationKind, new.kind, "operation kind"),
        task_uid=_text("task_uid", new.task_uid, TASK_UID_MAX),
        namespace=_text("namespace", new.namespace, NAMESPACE_MAX),
        name=_text("name", new.name, NAME_MAX),
        state=OperationState.PENDING,
        idempotency_key=_text("idempotency_key", new.idempotency_key, IDEMPOTENCY_KEY_MAX),
        checkpoint_ref=None if new.checkpoint_ref is None else _label_value(new.checkpoint_ref),
        grace_secs=_grace(new.grace_secs),
        celery_task_ids={},
        detail=None,
        error=None,
        created_at=now,
        updated_at=now,
        deadline_at=_aware("deadline_at", new.deadline_at),
        finished_at=None,
    )


def _lock_operation(session: Session, op_id: str) -> Operation:
    row = session.scalar(select(Operation).where(Operation.id == op_id).with_for_update())
    if row is None:
        raise UnknownOperation(op_id)
    return row


def _restorable_page(query: _Select, after_id: int, limit: int) -> _Select:
    """``query`` kept to up to ``limit`` restorable checkpoints with an id above
    ``after_id``, by id: the pages the audit and the prune walk."""
    return (
        query.where(Checkpoint.unavailable.is_(None), Checkpoint.id > after_id)
        .order_by(Checkpoint.id)
        .limit(_limit(limit))
    )


def _unsettled_snapshots_query(after_id: int, limit: int) -> Select[*tuple[Any, ...]]:
    """``Ledger.unsettled_snapshots``' read: its WHERE is the partial index's
    (``SNAPSHOT_UNSETTLED``), so it reads that index alone."""
    return (
        select(
            Checkpoint.id,
            Checkpoint.ref,
            Checkpoint.task_uid,
            Checkpoint.namespace,
            Checkpoint.name,
            Checkpoint.pvc_name,
            Checkpoint.created_at,
            Checkpoint.snapshot_name,
            Checkpoint.snapshot_cut_at,
        )
        .where(
            Checkpoint.snapshot_name.is_not(None),
            Checkpoint.snapshot_ready_at.is_(None),
            Checkpoint.snapshot_error.is_(None),
            Checkpoint.id > after_id,
        )
        .order_by(Checkpoint.id)
        .limit(limit)
    )


def _snapshot_move(move: SnapshotMove) -> SnapshotMove:
    """``move`` checked (aware moments, an error that fits), before any transaction."""
    error = move.error
    if error is not None:
        error = _text("error", error, max_len=None)[:UNAVAILABLE_MAX]
    return SnapshotMove(
        move.ref, _aware("cut_at", move.cut_at), _aware("ready_at", move.ready_at), error
    )


def _move_snapshot(row: Checkpoint, move: SnapshotMove) -> bool:
    """Record ``move`` on a locked checkpoint row; whether it changed. A ready or failed
    snapshot is settled and keeps its outcome; ready means cut (at the latest when it was
    seen ready)."""
    if row.snapshot_ready_at is not None or row.snapshot_error is not None:
        return False
    changed = False
    cut_at = move.cut_at or move.ready_at
    if cut_at is not None and row.snapshot_cut_at is None:
        row.snapshot_cut_at = cut_at
        changed = True
    if move.ready_at is not None:
        row.snapshot_ready_at = move.ready_at
        changed = True
    elif move.error is not None:
        row.snapshot_error = move.error
        changed = True
    return changed


def _lock_checkpoint(session: Session, ref: str) -> Checkpoint | None:
    """Checkpoint ``ref`` with its agents, its row locked; None for an unknown ref."""
    return session.scalar(
        select(Checkpoint)
        .where(Checkpoint.ref == ref)
        .options(selectinload(Checkpoint.agents))
        .with_for_update()
    )


def _lock_operations(session: Session, op_ids: Sequence[str]) -> dict[str, Operation]:
    """The rows of ``op_ids``, locked in id order (so two batches never deadlock)."""
    wanted = sorted(set(op_ids))
    rows: dict[str, Operation] = {}
    for chunk in _in_chunks(wanted):
        query = select(Operation).where(Operation.id.in_(chunk)).order_by(Operation.id)
        rows.update((row.id, row) for row in session.scalars(query.with_for_update()))
    for op_id in wanted:
        if op_id not in rows:
            raise UnknownOperation(op_id)
    return rows


def _wanted_state(
    to_state: OperationState, expect: Sequence[OperationState] | None
) -> tuple[OperationState, frozenset[OperationState] | None]:
    """A transition's validated target and expected states."""
    wanted = _member(OperationState, to_state, "operation state")
    if wanted in CHECKPOINTED_STATES:
        raise ValueError(
            f"operation state {wanted.value!r} is entered only by record_checkpoint, which "
            "writes the checkpoint in the same transaction; call that instead"
        )
    expected = (
        None
        if expect is None
        else frozenset(_member(OperationState, s, "expected state") for s in expect)
    )
    return wanted, expected


def _move(
    row: Operation,
    wanted: OperationState,
    expected: frozenset[OperationState] | None,
    error: str | None,
    new_ids: dict[str, str] | None,
    new_detail: dict[str, Any] | None,
) -> OperationView:
    """Move a locked row to ``wanted``, or raise ``LedgerConflict`` leaving it as it is."""
    current = OperationState(row.state)
    if current.terminal:
        raise LedgerConflict(row.id, current, wanted, "it has finished")
    if expected is not None and current not in expected:
        allowed = ", ".join(sorted(expected))
        raise LedgerConflict(row.id, current, wanted, f"the caller expected {allowed}")
    now = _now()
    row.state = wanted
    row.updated_at = now
    if wanted.terminal:
        row.finished_at = now
    if error is not None:
        row.error = error
    if new_ids:
        row.celery_task_ids = {**row.celery_task_ids, **new_ids}
    if new_detail is not None:
        row.detail = new_detail
    return _operation_view(row)


def _newer_heartbeat_upsert(backend: str, values: dict[str, Any]) -> Insert:
    """INSERT … ON CONFLICT DO UPDATE … WHERE stored.seq < new.seq: atomic on both
    backends, so concurrent heartbeats never regress the stored one."""
    updated = [key for key in values if key not in ("namespace", "name")]
    # The two dialects' INSERTs spell ON CONFLICT alike.
    upsert: postgresql.Insert | sqlite.Insert
    if backend == "postgresql":
        upsert = postgresql.insert(DaemonActivity).values(values)
    else:
        upsert = sqlite.insert(DaemonActivity).values(values)
    return upsert.on_conflict_do_update(
        index_elements=[DaemonActivity.namespace, DaemonActivity.name],
        set_={key: upsert.excluded[key] for key in updated},
        where=DaemonActivity.seq < upsert.excluded.seq,
    )


class _Dataclass(Protocol):
    """A dataclass, as ``dataclasses.fields`` takes one: every view is."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


@functools.cache
def _field_names(view: type[_Dataclass]) -> tuple[str, ...]:
    """The fields of a view class in order, read once per class."""
    return tuple(field.name for field in fields(view))


class _ViewOf(Generic[_View]):
    """Makes ``view``s of rows: each field is the row's attribute of the same name, put
    through ``convert[field]`` where one is given (an enum from its stored string, a copy
    of mutable JSON). A column reaches a view by adding the field to the view; only a
    value that needs converting is named here.

    Built once per view class, since it runs for every row read (a fleet's heartbeats, a
    follower's operations): one ``attrgetter`` reads every field and the values go to the
    constructor by position, quicker than naming each field."""

    def __init__(self, view: type[_View], **convert: Callable[[Any], Any]) -> None:
        names = _field_names(view)
        if len(names) < 2 or not all(f.init and not f.kw_only for f in fields(view)):
            # attrgetter of one name returns the value, not a tuple; values go by position.
            raise TypeError(f"{view.__name__}: a view needs two or more positional fields")
        if unknown := sorted(set(convert) - set(names)):
            raise TypeError(f"{view.__name__} has no field {', '.join(unknown)}")
        self._view = view
        self._read = operator.attrgetter(*names)
        self._convert = tuple((names.index(name), how) for name, how in convert.items())

    def __call__(self, row: object) -> _View:
        values: Sequence[Any] = self._read(row)
        if self._convert:
            converted = list(values)
            for index, how in self._convert:
                converted[index] = how(converted[index])
            values = converted
        return self._view(*values)


_agent_view = _ViewOf(CheckpointAgentView)


def _agent_views(rows: Sequence[CheckpointAgent]) -> tuple[CheckpointAgentView, ...]:
    # Sorted here, not by the database, so the order is the same on every collation.
    return tuple(sorted(map(_agent_view, rows), key=lambda agent: agent.agent_id))


_operation_view = _ViewOf(
    OperationView,
    kind=OperationKind,
    state=OperationState,
    # Copies: a view never shares the row's mutable JSON.
    celery_task_ids=dict,
    detail=copy.deepcopy,
)
_checkpoint_view = _ViewOf(CheckpointView, reason=CheckpointReason, agents=_agent_views)
_activity_view = _ViewOf(ActivityView)
_operation_change = _ViewOf(OperationChange, state=OperationState)


def _agent_row(agent: CheckpointAgentView) -> CheckpointAgent:
    """The row of an agent view: its columns are the view's fields."""
    return CheckpointAgent(
        **{name: getattr(agent, name) for name in _field_names(CheckpointAgentView)}
    )


def _check_same_operation(existing: OperationView, wanted: tuple[str, str, str, str]) -> None:
    """``wanted`` is (kind, task_uid, namespace, name) of the operation a caller started."""
    if (existing.kind, existing.task_uid, existing.namespace, existing.name) != wanted:
        kind, _, namespace, name = wanted
        raise ValueError(
            f"idempotency key {existing.idempotency_key!r} already names operation "
            f"{existing.id} ({existing.kind.value} of {existing.namespace}/{existing.name}, "
            f"task {existing.task_uid}); a {kind} of {namespace}/{name} needs its own key"
        )


def _operation_problem(op: Operation, what: str) -> DrainRecordProblem:
    """A drain record problem of operation ``op``: its id, kind and task, then ``what``."""
    return DrainRecordProblem(
        f"operation {op.id}", f"operation {op.id} ({op.kind} of {op.namespace}/{op.name}) {what}"
    )


# ------------------------------------------------------------------- input validation


def _member(enum: type[_E], value: object, what: str) -> _E:
    """``value`` if it is a member of ``enum``; a plain string is refused even when it
    spells one, so every caller names the vocabulary it means."""
    if isinstance(value, enum):
        return value
    allowed = ", ".join(member.value for member in enum)
    if isinstance(value, str) and value in {member.value for member in enum}:
        raise ValueError(
            f"{what} must be a {enum.__name__}, not the string {value!r} "
            f"(pass {enum.__name__}.{enum(value).name})"
        )
    raise ValueError(f"unknown {what} {value!r}; expected one of: {allowed}")


def _text(what: str, value: object, max_len: int | None) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    if max_len is not None and len(value) > max_len:
        raise ValueError(f"{what} {value[:40]!r}… has {len(value)} characters; at most {max_len}")
    return value


def _optional_str(what: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{what} must be a string or None, not {value!r}")
    return value


def _count(what: str, value: object) -> int:
    # bool is an int to Python, never a count to us.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, not {value!r}")
    return value


def _limit(limit: int) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit!r}")
    return limit


def _grace(value: object) -> float | None:
    if value is None:
        return None
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"grace_secs must be a non-negative number of seconds, not {value!r}")
    return float(value)


def _aware(what: str, value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, not {value!r}")
    return value.astimezone(UTC)


def _label_value(value: object) -> str:
    if not isinstance(value, str) or not is_label_value(value):
        raise ValueError(
            f"checkpoint ref {value!r} is not a Kubernetes label value "
            "([a-z0-9]([-a-z0-9]*[a-z0-9])?, at most 63 characters)"
        )
    return value


def _json_object(what: str, value: object) -> dict[str, Any]:
    """A deep copy of a JSON object; anything ``json`` cannot carry is refused."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object (a mapping), not {type(value).__name__}")
    try:
        copied: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None
    return copied


def _celery_ids(value: Mapping[str, str]) -> dict[str, str]:
    ids = _json_object("celery_task_ids", value)
    for step, task_id in ids.items():
        if not isinstance(task_id, str) or not task_id:
            raise ValueError(f"celery_task_ids[{step!r}] must be a task id string, not {task_id!r}")
    return ids


def _relative_dir(what: str, value: object) -> str:
    text = _text(what, value, max_len=None)
    path = PurePosixPath(text)
    if "\x00" in text or path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"{what} {text!r} must be relative to the PVC root, without '..' (e.g. agents/<id>)"
        )
    return text


def _parse_resume_refs(refs: Sequence[ResumeRef]) -> list[CheckpointAgentView]:
    """Validated ``ResumeRef``s as agent views, or ``ValueError`` naming the flaw.

    The model has checked the types; this checks what the ledger itself needs: ids and
    digests that fit their columns, counts that count, session dirs relative to the PVC
    root (so a checkpoint stays valid wherever the PVC is mounted, and never points out
    of it), and each agent once.
    """
    if isinstance(refs, str | bytes) or not isinstance(refs, Sequence):
        raise ValueError(f"refs must be a list of ResumeRef models, not {type(refs).__name__}")
    agents: list[CheckpointAgentView] = []
    seen: set[str] = set()
    for index, ref in enumerate(refs):
        if not isinstance(ref, ResumeRef):
            raise ValueError(
                f"resume ref #{index} is a {type(ref).__name__}, not a ResumeRef; validate "
                "the daemon's answer with worker_agent.contract.DrainResult first"
            )
        agent_id = _text(f"resume ref #{index}: id", ref.id, AGENT_ID_MAX)
        where = f"resume ref of agent {agent_id!r}"
        if agent_id in seen:
            raise ValueError(f"{where} appears twice; a checkpoint holds each agent once")
        seen.add(agent_id)
        sha256 = ref.session_sha256
        if sha256 is not None and not _SHA256_HEX.match(sha256):
            raise ValueError(f"{where}: session_sha256 must be 64 lower-case hex digits or null")
        agents.append(
            CheckpointAgentView(
                agent_id=agent_id,
                session_dir=_relative_dir(f"{where}: session_dir", ref.session_dir),
                turns=_count(f"{where}: turns", ref.turns),
                session_sha256=sha256,
                clean=ref.clean,
                exit=ref.exit,
                error=ref.error,
            )
        )
    return agents
