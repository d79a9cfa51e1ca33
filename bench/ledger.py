"""Scenario ``ledger``: the checkpoint ledger's reads at 10,000 to 1,000,000 checkpoints.

The ledger is PostgreSQL, migrated by the project's own Alembic migrations (so the reads
walk the indexes a deployment has), holding a realistic history loaded with COPY: tasks
of ``PER_TASK`` checkpoints each (drains by pause, a scale-down now and then, a deletion
closing one task in three), spread over ``NAMESPACES`` namespaces, each checkpoint with
its operation, its ``AGENTS`` agents, a ready VolumeSnapshot and the task's retained
PVC; all but each task's newest ``AVAILABLE_PER_TASK`` released by an earlier prune.
Each size lives in its own PostgreSQL schema of the database and is kept between runs:
a later run whose migrations and shape are the same reuses it (``setup`` says which).

Measured at each size, interleaved, many repetitions after a warm-up, median and p95,
through the repository functions their callers use (``orchestrator.ledger.Ledger``):

- the floor: one checkpoint row read by its primary key, in its own transaction on the
  same engine (the least any read of the ledger costs);
- a task's latest checkpoint (``latest_checkpoint``; the demo, scripts);
- the newest checkpoint of a workspace PVC (``newest_checkpoint_of_pvc``; the operator,
  claiming a retained workspace);
- a page of ``drainctl ledger ls`` (``list_checkpoints(limit=50)``), the first and one
  half-way down the ledger (``--after REF``);
- a page of ``drainctl ledger ls --task NS/NAME``.

At the largest size the scenario records each read's EXPLAIN (ANALYZE, BUFFERS), of the
SQL the repository really sent (caught from the engine), and times the read and the plan
of ``drainctl ledger prune --dry-run`` without a cluster (nothing named, nothing held).
"""

from __future__ import annotations

import hashlib
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from bench.audit_cost import create_database
from bench.report import Check, Scenario, median, percentile
from orchestrator.ledger import Ledger, checkpoint_ref_for, create_ledger_engine
from orchestrator.ledger.migrate import current, head, upgrade
from orchestrator.ledger.models import Checkpoint
from orchestrator.operator.retention import plan_prune, restorable_checkpoints

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000)
PER_TASK = 50
AGENTS = 2
NAMESPACES = 20
AVAILABLE_PER_TASK = 5
PAGE = 50
"""``drainctl ledger ls``'s default ``--limit``."""
REPEAT, QUICK_REPEAT = 200, 30
WARMUP = 10
BUDGET_LATEST_MS, BUDGET_PAGE_MS = 2.0, 20.0
DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/bench_ledger"
"""The database the ledgers go in (one schema per size); created if the server lacks it."""
SHAPE = (
    f"v1 per_task={PER_TASK} agents={AGENTS} namespaces={NAMESPACES} "
    f"available_per_task={AVAILABLE_PER_TASK}"
)
"""What a kept schema must have been loaded with to be reused (with the same migrations)."""
BASE = datetime(2026, 1, 1, tzinfo=UTC)
COPY_ROWS = 50_000
"""Rows generated and sent per COPY write."""


# ---------------------------------------------------------------- the history


def task_of(index: int) -> tuple[str, str, str]:
    """Task number ``index``'s (namespace, name, uid)."""
    return f"team-{index % NAMESPACES:02d}", f"task-{index:06d}", str(uuid.UUID(int=index + 1))


def created_at(task: int, seq: int) -> datetime:
    """A task drains about hourly; tasks are spread across the hour, so the newest
    checkpoints of the ledger come from many tasks."""
    return BASE + timedelta(seconds=seq * 3600 + (task * 7919) % 3600, microseconds=task % 997)


def history_rows(first: int, last: int) -> Iterator[tuple[str, str, str]]:
    """COPY text lines (operation, checkpoint, agents) of checkpoints ``first..last-1``
    (checkpoint ``k`` is number ``k % PER_TASK`` of task ``k // PER_TASK``; id ``k+1``)."""
    for k in range(first, last):
        task, seq = divmod(k, PER_TASK)
        namespace, name, uid = task_of(task)
        at = created_at(task, seq)
        op_id = str(uuid.UUID(int=(1 << 64) | k))
        closing = seq == PER_TASK - 1 and task % 3 == 0
        kind, reason = ("pause", "pause")
        if closing:
            kind, reason = ("delete-drain", "delete")
        elif seq % 10 == 7:
            kind, reason = ("scale-down", "scale-down")
        ref = checkpoint_ref_for(op_id)
        stamp = at.isoformat()
        done = (at + timedelta(seconds=2)).isoformat()
        released = (
            "\\N"
            if seq >= PER_TASK - AVAILABLE_PER_TASK
            else f"released by drainctl ledger prune at {done} (VolumeSnapshot {ref})"
        )
        operation = (
            f"{op_id}\t{kind}\t{uid}\t{namespace}\t{name}\trecorded\t{kind}:{uid}:{seq}\t"
            f'{ref}\t30\t{{"drain": "{op_id}"}}\t\\N\t\\N\t{stamp}\t{done}\t\\N\t{done}\n'
        )
        checkpoint = (
            f"{k + 1}\t{ref}\t{op_id}\t{uid}\t{namespace}\t{name}\t{reason}\t{name}-ws\tf\tt\t"
            f"{done}\t{released}\t{ref}\t{(at + timedelta(seconds=9)).isoformat()}\t\\N\n"
        )
        agents = "".join(
            f"{k * AGENTS + a + 1}\t{k + 1}\tagent-{a}\tagents/agent-{a}\t{seq * 3 + a}\t"
            f"{hashlib.sha256(f'{k}:{a}'.encode()).hexdigest()}\tt\t\\N\t\\N\n"
            for a in range(AGENTS)
        )
        yield operation, checkpoint, agents


COPIES = (
    "COPY operations (id, kind, task_uid, namespace, name, state, idempotency_key, "
    "checkpoint_ref, grace_secs, celery_task_ids, detail, error, created_at, updated_at, "
    "deadline_at, finished_at) FROM STDIN",
    "COPY checkpoints (id, ref, operation_id, task_uid, namespace, name, reason, pvc_name, "
    "forced, verified, created_at, unavailable, snapshot_name, snapshot_ready_at, "
    "snapshot_error) FROM STDIN",
    "COPY checkpoint_agents (id, checkpoint_id, agent_id, session_dir, turns, "
    "session_sha256, clean, exit, error) FROM STDIN",
)


def load(engine: sa.Engine, first: int, last: int) -> None:
    """Checkpoints ``first..last-1`` into the ledger, by COPY, then the id sequences moved
    past them and the tables vacuumed and analysed (as autovacuum keeps a live ledger)."""
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        for start in range(first, last, COPY_ROWS):
            rows = list(history_rows(start, min(last, start + COPY_ROWS)))
            with conn.cursor() as cursor:
                for column, statement in enumerate(COPIES):
                    with cursor.copy(statement) as copy:
                        copy.write("".join(row[column] for row in rows))
            conn.commit()
        with conn.cursor() as cursor:
            cursor.execute("SELECT setval('checkpoints_id_seq', %s)", (last,))
            cursor.execute("SELECT setval('checkpoint_agents_id_seq', %s)", (last * AGENTS,))
        conn.commit()
        conn.autocommit = True
        with conn.cursor() as cursor:
            for table in ("operations", "checkpoints", "checkpoint_agents"):
                cursor.execute(f"VACUUM ANALYZE {table}")
    finally:
        raw.close()


def schema_url(url: str, schema: str) -> str:
    """``url`` with every connection's search_path set to ``schema`` (libpq options)."""
    parsed = sa.make_url(url)
    return parsed.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )


def ensure_loaded(url: str, size: int) -> tuple[str, bool, float]:
    """The URL of a ledger holding ``size`` checkpoints of the history, whether it was
    kept from an earlier run, and the seconds loading it took now (0 if kept)."""
    schema = f"ledger_{size}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    scoped = schema_url(url, schema)
    try:
        with admin.connect() as conn:
            exists = conn.scalar(
                sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}
            )
            marker = None
            if exists:
                marker = conn.scalar(
                    sa.text(
                        "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace "
                        "WHERE nspname = :s"
                    ),
                    {"s": schema},
                )
            wanted = f"{SHAPE} size={size}"
            if marker == wanted and current(scoped) == head():
                return scoped, True, 0.0
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        began = time.perf_counter()
        upgrade(scoped)
        engine = sa.create_engine(scoped, poolclass=sa.pool.NullPool)
        try:
            load(engine, 0, size)
        finally:
            engine.dispose()
        with admin.connect() as conn:
            # Written last: a load stopped half-way is never taken for a whole one.
            conn.execute(sa.text(f"COMMENT ON SCHEMA \"{schema}\" IS '{wanted}'"))
        return scoped, False, time.perf_counter() - began
    finally:
        admin.dispose()


# ------------------------------------------------------------------ measuring


@dataclass
class Timings:
    secs: dict[str, list[float]] = field(default_factory=dict)

    def add(self, what: str, secs: float) -> None:
        self.secs.setdefault(what, []).append(secs)

    def median_ms(self, what: str) -> float:
        return median(self.secs[what]) * 1000

    def p95_ms(self, what: str) -> float:
        return percentile(self.secs[what], 0.95) * 1000


FLOOR = "floor: one checkpoint row by primary key"
LATEST = "a task's latest checkpoint"
PVC_NEWEST = "a workspace PVC's newest checkpoint"
FIRST_PAGE = "ledger ls: the first page"
LATER_PAGE = "ledger ls --after: a page half-way down"
TASK_PAGE = "ledger ls --task: a task's page"
MEASURES = (FLOOR, LATEST, PVC_NEWEST, FIRST_PAGE, LATER_PAGE, TASK_PAGE)


class Reads:
    """The reads measured, over one loaded ledger, each picking its task at random."""

    def __init__(self, ledger: Ledger, engine: sa.Engine, size: int, seed: int) -> None:
        self.ledger, self.engine, self.size = ledger, engine, size
        self.random = random.Random(seed)
        self.tasks = size // PER_TASK
        by_pk = sa.select(Checkpoint.__table__).where(Checkpoint.id == sa.bindparam("id"))
        self.by_pk = by_pk
        newest_first = sa.select(Checkpoint.ref).order_by(
            Checkpoint.created_at.desc(), Checkpoint.id.desc()
        )
        with engine.connect() as conn:
            self.half_way = str(conn.scalar(newest_first.offset(size // 2).limit(1)))

    def task(self) -> tuple[str, str, str]:
        return task_of(self.random.randrange(self.tasks))

    def call(self, what: str) -> Callable[[], object]:
        namespace, name, _ = self.task()
        if what == FLOOR:
            row_id = self.random.randrange(1, self.size + 1)

            def floor() -> object:
                with self.engine.begin() as conn:
                    return conn.execute(self.by_pk, {"id": row_id}).one()

            return floor
        if what == LATEST:
            return lambda: self.ledger.latest_checkpoint(namespace, name)
        if what == PVC_NEWEST:
            return lambda: self.ledger.newest_checkpoint_of_pvc(namespace, f"{name}-ws")
        if what == FIRST_PAGE:
            return lambda: self.ledger.list_checkpoints(limit=PAGE)
        if what == LATER_PAGE:
            return lambda: self.ledger.list_checkpoints(limit=PAGE, after=self.half_way)
        return lambda: self.ledger.list_checkpoints(namespace, name, limit=PAGE)

    def check(self, what: str, answer: object) -> bool:
        """Whether a read answered what the loaded history says it must."""
        if what == FLOOR:
            return answer is not None
        if what in (LATEST, PVC_NEWEST):
            return answer is not None and getattr(answer, "created_at", None) is not None
        return isinstance(answer, list) and len(answer) == PAGE


@contextmanager
def statements(engine: sa.Engine) -> Iterator[list[tuple[str, Any]]]:
    """The SQL statements (and parameters) sent on ``engine`` while inside."""
    sent: list[tuple[str, Any]] = []

    def caught(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        sent.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", caught)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", caught)


def explain(reads: Reads, what: str) -> list[dict[str, str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of each SELECT one ``what`` sends, as it sent it."""
    call = reads.call(what)
    with statements(reads.engine) as sent:
        call()
    plans = []
    for statement, params in sent:
        if not statement.lstrip().upper().startswith("SELECT"):
            continue
        with reads.engine.connect() as conn:
            rows = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", params)
            plans.append({"sql": statement, "plan": "\n".join(str(r[0]) for r in rows)})
    return plans


def measure(reads: Reads, repeat: int) -> tuple[Timings, list[str]]:
    """Every read ``repeat`` times after a warm-up, interleaved in a rotating order;
    the reads that answered wrongly."""
    timings, wrong = Timings(), []
    for rep in range(-WARMUP, repeat):
        order = MEASURES[rep % len(MEASURES) :] + MEASURES[: rep % len(MEASURES)]
        for what in order:
            call = reads.call(what)
            began = time.perf_counter()
            answer = call()
            secs = time.perf_counter() - began
            if not reads.check(what, answer):
                wrong.append(f"{what}: {answer!r:.200}")
            if rep >= 0:
                timings.add(what, secs)
    return timings, wrong


PRUNE_KEYS = ("read_secs", "plan_secs", "restorable", "released")


def prune_plan(ledger: Ledger) -> tuple[float, float, int, int]:
    """``drainctl ledger prune --keep 3 --dry-run``'s work without a cluster: seconds
    reading the restorable checkpoints, seconds planning, how many, how many released."""
    began = time.perf_counter()
    checkpoints = restorable_checkpoints(ledger)
    read = time.perf_counter() - began
    now = datetime.now(UTC)
    began = time.perf_counter()
    items = plan_prune(
        checkpoints, keep=3, older_than_secs=0, now=now, named_by_tasks={}, held_pvcs={}
    )
    planned = time.perf_counter() - began
    return read, planned, len(checkpoints), sum(i.action == "release" for i in items)


# ------------------------------------------------------------------- the run


def run(quick: bool, url: str | None) -> Scenario:
    url = url or DATABASE_URL
    create_database(url)
    sizes, repeat = (QUICK_SIZES, QUICK_REPEAT) if quick else (SIZES, REPEAT)
    table: list[tuple[str, str]] = []
    runs: list[str] = []
    kept_sizes: list[int] = []
    curves: dict[str, list[list[float]]] = {m: [] for m in MEASURES}
    per_size: dict[str, Any] = {}
    wrong: list[str] = []
    plans: dict[str, list[dict[str, str]]] = {}
    prune: tuple[float, float, int, int] | None = None
    for size in sizes:
        scoped, kept, load_secs = ensure_loaded(url, size)
        if kept:
            kept_sizes.append(size)
        engine = create_ledger_engine(scoped)
        ledger = Ledger(engine)
        try:
            reads = Reads(ledger, engine, size, seed=size)
            timings, bad = measure(reads, repeat)
            wrong += [f"{size}: {w}" for w in bad]
            if size == sizes[-1]:
                plans = {what: explain(reads, what) for what in MEASURES}
                prune = prune_plan(ledger)
        finally:
            ledger.dispose()
        per_size[str(size)] = {
            "load_secs": load_secs,
            "kept": kept,
            "median_ms": {m: timings.median_ms(m) for m in MEASURES},
            "p95_ms": {m: timings.p95_ms(m) for m in MEASURES},
        }
        for m in MEASURES:
            curves[m].append([size, timings.median_ms(m)])
            table.append(
                (f"{m} at {size:,} (median / p95)",
                 f"{timings.median_ms(m):.3f} / {timings.p95_ms(m):.3f} ms")
            )  # fmt: skip
        runs.append(
            f"{size:,} checkpoints: "
            + ("kept from an earlier run" if kept else f"loaded in {load_secs:.1f} s")
            + "; "
            + ", ".join(f"{m} {timings.median_ms(m):.3f} ms" for m in MEASURES)
        )
    largest = per_size[str(sizes[-1])]
    ratio = {m: largest["median_ms"][m] / largest["median_ms"][FLOOR] for m in MEASURES}
    for m in MEASURES[1:]:
        table.append((f"{m} at {sizes[-1]:,}: median / floor's", f"{ratio[m]:.1f} times"))
    if prune is not None:
        read, planned, count, released = prune
        table.append(
            (f"prune --keep 3 --dry-run at {sizes[-1]:,}, without a cluster",
             f"{read:.2f} s reading {count:,} restorable checkpoints, {planned:.2f} s "
             f"planning ({released:,} to release)")
        )  # fmt: skip
    checks = [
        Check(
            f"{LATEST} at {sizes[-1]:,}: median < {BUDGET_LATEST_MS:g} ms",
            largest["median_ms"][LATEST] < BUDGET_LATEST_MS,
            f"{largest['median_ms'][LATEST]:.3f} ms, p95 {largest['p95_ms'][LATEST]:.3f} ms",
        ),
        *(
            Check(
                f"{m} at {sizes[-1]:,}: median < {BUDGET_PAGE_MS:g} ms",
                largest["median_ms"][m] < BUDGET_PAGE_MS,
                f"{largest['median_ms'][m]:.3f} ms, p95 {largest['p95_ms'][m]:.3f} ms",
            )
            for m in (FIRST_PAGE, LATER_PAGE, TASK_PAGE)
        ),
        Check(
            "every read answered what the loaded history holds",
            not wrong,
            f"{len(wrong)} wrong" + (f", first: {wrong[0]}" if wrong else ""),
            budget=False,
        ),
    ]
    setup = [
        f"PostgreSQL ledger migrated to {head()} by the project's Alembic migrations, at "
        + ", ".join(f"{s:,}" for s in sizes)
        + f" checkpoints ({PER_TASK} per task, so {sizes[0] // PER_TASK:,} to "
        f"{sizes[-1] // PER_TASK:,} tasks, in {NAMESPACES} namespaces; {AGENTS} agents, "
        f"an operation, a snapshot and a PVC each; the newest {AVAILABLE_PER_TASK} of each "
        "task restorable), loaded by COPY, vacuumed and analysed",
        "kept from an earlier run: "
        + (", ".join(f"{s:,}" for s in kept_sizes) if kept_sizes else "none (all loaded now)"),
        f"each read {repeat} times per size after {WARMUP} warm-ups, interleaved, a task "
        f"picked at random each time; pages of {PAGE} (ledger ls's default --limit); the "
        "floor is one checkpoint row read by primary key in its own transaction",
        f"budgets at {sizes[-1]:,}: a task's latest < {BUDGET_LATEST_MS:g} ms, a page < "
        f"{BUDGET_PAGE_MS:g} ms (medians; p95 beside them)",
    ]
    blocks = [
        (f"EXPLAIN (ANALYZE, BUFFERS) at {sizes[-1]:,}: {what}, query {i + 1} of {len(qs)}",
         f"{q['sql']}\n\n{q['plan']}")
        for what, qs in plans.items()
        for i, q in enumerate(qs)
    ]  # fmt: skip
    return Scenario(
        name="ledger",
        title=f"Ledger: reads at up to {sizes[-1]:,} checkpoints on PostgreSQL",
        setup=setup,
        table=table,
        checks=checks,
        runs=runs,
        data={
            "sizes": list(sizes),
            "repeat": repeat,
            "per_size": per_size,
            "plans": plans,
            "prune_dry_run": None if prune is None else dict(zip(PRUNE_KEYS, prune, strict=True)),
            "curves": {
                "x_label": "checkpoints in the ledger",
                "y_label": "median latency (ms)",
                "log_x": True,
                "series": {
                    ("floor (primary-key read)" if m == FLOOR else m): curves[m] for m in MEASURES
                },
            },
        },
        blocks=blocks,
    )
