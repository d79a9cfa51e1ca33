"""The Celery pipeline end to end: drain → record → resume → drain again, with a real
broker (Redis and RabbitMQ), a real ledger (SQLite and PostgreSQL), and the orchestrator
worker, daemons, consumers, agents and ``drainctl`` as real subprocesses."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.ledger import CheckpointView, Ledger, OperationState, OperationView
from orchestrator.operator.batching import DrainBatcher
from orchestrator.pipeline.app import make_app
from orchestrator.pipeline.start import DrainStart, start_drains
from orchestrator.settings import Settings
from tests.pipeline_support import (
    BROKERS,
    PIPELINE_REDIS_DB,
    PipelineBroker,
    Stack,
    fresh_postgres,
    fresh_sqlite,
    pipeline_broker,
    queued_messages,
    redis_db_url,
)
from tests.support import DaemonProcess, wait_until
from worker_agent import layout, transcript
from worker_agent.contract import ACTIVITY, TaskNameError
from worker_agent.session import count_completed_turns, load_session


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Iterator[PipelineBroker]:
    with pipeline_broker(request.param) as b:
        yield b


LEDGERS_AND_BROKERS = [("sqlite", "redis"), ("postgres", "redis"), ("sqlite", "amqp")]
"""Each ledger on the default broker, and RabbitMQ on one of them: the ledger does not see
the broker (the fault tests run RabbitMQ with PostgreSQL)."""


@pytest.fixture(params=LEDGERS_AND_BROKERS, ids=["-".join(p) for p in LEDGERS_AND_BROKERS])
def stack(request: pytest.FixtureRequest, tmp_short: Path) -> Iterator[Stack]:
    ledger, kind = request.param
    with pipeline_broker(kind) as broker:
        database = fresh_sqlite(tmp_short) if ledger == "sqlite" else fresh_postgres()
        s = Stack(tmp_short, broker.url, database, results=broker.results)
        try:
            yield s
        finally:
            s.close()


def assert_checkpoint_matches_disk(checkpoint: CheckpointView, daemon: DaemonProcess) -> None:
    for agent in checkpoint.agents:
        directory = daemon.store / agent.session_dir
        session = load_session(directory)
        assert agent.turns == session.turns == count_completed_turns(directory), agent
        assert agent.session_sha256 == session.sha256
        assert agent.clean


def test_drain_record_resume_drain_again_accounts_for_every_turn(stack: Stack) -> None:
    stack.start_worker()
    daemon = stack.start_daemon("team-a", "task-1")
    ids = daemon.spawn_working(4, "turns=100000,turn_ms=50", 2)

    drained = stack.drainctl("drain", "team-a/task-1", "--grace", "10", "--wait", "--timeout", "90")
    assert drained.returncode == 0, drained.stderr
    first_ref = drained.stdout.strip()
    first = stack.ledger.get_checkpoint(first_ref)
    assert first is not None
    assert sorted(a.agent_id for a in first.agents) == sorted(ids)
    assert first.verified
    assert_checkpoint_matches_disk(first, daemon)
    saved = {a.agent_id: load_session(daemon.store / a.session_dir).messages for a in first.agents}

    resumed = stack.drainctl(
        "resume", "team-a/task-1", "--checkpoint", first_ref, "--wait", "--timeout", "90"
    )
    assert resumed.returncode == 0, resumed.stderr
    turns_then = {a.agent_id: a.turns for a in first.agents}
    wait_until(
        lambda: all(r.turns > turns_then[r.id] for r in daemon.records().values()),
        60,
        "resumed agents to do new turns",
    )

    again = stack.drainctl("drain", "team-a/task-1", "--wait", "--timeout", "90")
    assert again.returncode == 0, again.stderr
    second = stack.ledger.get_checkpoint(again.stdout.strip())
    assert second is not None
    assert second.ref != first.ref
    assert_checkpoint_matches_disk(second, daemon)
    for agent in second.agents:
        assert agent.turns > turns_then[agent.agent_id]
        messages = load_session(daemon.store / agent.session_dir).messages
        assert messages[: len(saved[agent.agent_id])] == saved[agent.agent_id]

    listing = stack.drainctl("ledger", "ls", "--task", "team-a/task-1")
    assert first.ref in listing.stdout
    assert second.ref in listing.stdout
    shown = stack.drainctl("ledger", "--json", "show", first.ref)
    assert '"verified": true' in shown.stdout
    ops = stack.ledger.list_operations(namespace="team-a", name="task-1")
    assert sorted(op.state for op in ops) == ["recorded", "recorded", "resumed"]


def test_heartbeats_report_all_idle_since(stack: Stack) -> None:
    stack.start_worker()
    daemon = stack.start_daemon("team-a", "idle-task")
    daemon.spawn_working(2, "turns=2,turn_ms=10", 2)

    def idle_reported() -> bool:
        activity = stack.ledger.get_activity("team-a", "idle-task")
        return bool(activity and activity.agents_idle == 2 and activity.all_idle_since)

    wait_until(idle_reported, 30, "a heartbeat saying both agents are idle")
    activity = stack.ledger.get_activity("team-a", "idle-task")
    assert activity is not None
    assert (activity.agents_total, activity.agents_live) == (2, 2)
    # The ledger's row is a heartbeat's record: nothing of it in the result backend
    # (each one was kept there a week, as its STARTED and SUCCESS states).
    results = redis.Redis.from_url(stack.env["DRAIN_RESULT_BACKEND"])
    try:
        stored = [json.loads(results.get(key) or b"{}").get("name")
                  for key in results.scan_iter("celery-task-meta-*")]  # fmt: skip
    finally:
        results.close()
    assert ACTIVITY not in stored, f"{stored.count(ACTIVITY)} heartbeat results stored"


def test_resume_of_an_unknown_checkpoint_is_a_recorded_failure(stack: Stack) -> None:
    """Tried: resume naming a checkpoint ref the ledger never had."""
    result = stack.drainctl("resume", "team-a/task-1", "--checkpoint", "ckpt-nope", "--wait")
    assert result.returncode == 1
    assert "unknown checkpoint ref 'ckpt-nope'" in result.stderr
    [op] = stack.ledger.list_operations(namespace="team-a", name="task-1")
    assert op.state == "failed"
    assert op.error is not None
    assert "ckpt-nope" in op.error


def test_resume_with_missing_and_corrupt_session_dirs_resumes_the_rest(stack: Stack) -> None:
    """Tried: one agent's session dir deleted, another's session.json truncated."""
    stack.start_worker()
    daemon = stack.start_daemon("team-a", "task-2")
    healthy, missing, corrupt = daemon.spawn_working(3, "turns=100000,turn_ms=30", 2)
    drained = stack.drainctl("drain", "team-a/task-2", "--wait", "--timeout", "90")
    ref = drained.stdout.strip()
    with daemon.client() as client:
        client.call("rm", id=missing)
    path = layout.session_file(layout.agent_dir(daemon.store, corrupt))
    path.write_bytes(path.read_bytes()[:20])

    resumed = stack.drainctl("resume", "team-a/task-2", "--checkpoint", ref, "--json", "--wait")
    assert resumed.returncode == 0, resumed.stderr
    ops = [op for op in stack.ledger.list_operations(namespace="team-a", name="task-2")]
    [op] = [op for op in ops if op.kind == "resume"]
    assert op.state == "resumed"
    assert op.error is not None
    assert missing in op.error
    assert corrupt in op.error
    assert "not valid JSON" in op.error
    assert op.detail is not None
    outcome = {r["id"]: r["ok"] for r in op.detail["results"]}
    assert outcome == {healthy: True, missing: False, corrupt: False}
    wait_until(lambda: daemon.records()[healthy].status.live, 30, "the healthy agent to run again")


SHORT_EXPIRY = {
    "redis": {
        "DRAIN_DRAIN_EXPIRES_SECS": "2",
        "DRAIN_VISIBILITY_TIMEOUT_SECS": "1",
        "DRAIN_UNACKED_RESTORE_INTERVAL_SECS": "0.5",
        "DRAIN_RECORD_DEADLINE_SECS": "27",
    },
    # A heartbeat shorter than a worker's longest stall (mingle: 3 s) makes RabbitMQ drop
    # its connection over and over; 5 s is the shortest safe one, and a redelivery can
    # take two of them.
    "amqp": {
        "DRAIN_DRAIN_EXPIRES_SECS": "11",
        "DRAIN_BROKER_HEARTBEAT_SECS": "5",
        "DRAIN_RECORD_DEADLINE_SECS": "35",
    },
}
"""Drain expiry shortened so that it is seen in seconds, with the redelivery settings that
Settings then requires of each broker (a redelivery lands before expiry and deadline)."""


def test_a_drain_for_a_daemon_that_is_gone_expires_and_is_reported(
    tmp_short: Path, broker: PipelineBroker
) -> None:
    """Tried: drain a task whose daemon never comes up; later a consumer does start."""
    stack = Stack(
        tmp_short,
        broker.url,
        fresh_sqlite(tmp_short),
        results=broker.results,
        DRAIN_DB_RETRY_WINDOW_SECS="15",
        **SHORT_EXPIRY[broker.kind],
    )
    try:
        stack.start_worker()
        result = stack.drainctl(
            "drain", "team-a/ghost", "--grace", "0", "--wait", "--timeout", "60"
        )
        assert result.returncode == 1
        assert "did not answer" in result.stderr
        [op] = stack.ledger.list_operations(namespace="team-a", name="ghost")
        assert op.state == "failed"
        if broker.kind == "amqp":
            # Celery sends the expiry as the message's TTL too: RabbitMQ drops it itself.
            assert queued_messages(broker.url, "caliband.team-a.ghost") == 0
        # A consumer that shows up late never runs the expired drain: on Redis it reads
        # and discards it; on RabbitMQ it is gone, and the consumer is up and idle.
        daemon = stack.start_daemon("team-a", "ghost")
        if broker.kind == "redis":
            wait_until(
                lambda: (
                    "Discarding revoked task: caliban.daemon.drain"
                    in (daemon.root / "daemon.log").read_text()
                ),
                60,
                "the late consumer to discard the expired message",
            )
        else:
            wait_until(
                lambda: stack.ledger.get_activity("team-a", "ghost"),
                30,
                "the late consumer's first heartbeat",
            )
            assert "caliban.daemon.drain[" not in (daemon.root / "daemon.log").read_text()
        assert not layout.ops_dir(daemon.store).exists()
    finally:
        stack.close()


def test_a_redelivered_resume_resumes_nothing_twice(stack: Stack) -> None:
    """Tried: the same resume message delivered twice (as after a lost ack)."""
    stack.start_worker()
    daemon = stack.start_daemon("team-a", "task-3")
    ids = daemon.spawn_working(2, "turns=100000,turn_ms=30", 1)
    ref = stack.drainctl("drain", "team-a/task-3", "--wait", "--timeout", "90").stdout.strip()
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None
    from orchestrator.pipeline.app import make_app
    from orchestrator.settings import Settings
    from worker_agent.contract import DAEMON_RESUME, ResumeAgent, ResumeRequest, ResumeResult

    app = make_app(
        Settings(
            broker_url=stack.env["DRAIN_BROKER_URL"],
            result_backend=stack.env["DRAIN_RESULT_BACKEND"],
        )
    )
    agents = [ResumeAgent(id=a.agent_id, session_dir=a.session_dir) for a in checkpoint.agents]
    request = ResumeRequest(op_id="op-redelivered", agents=agents).model_dump(mode="json")
    first = app.send_task(DAEMON_RESUME, kwargs=request, queue="caliband.team-a.task-3")
    outcome = ResumeResult.model_validate(first.get(timeout=60))
    assert outcome.error is None
    assert [r.ok for r in outcome.results] == [True, True], outcome
    wait_until(
        lambda: all(
            r.turns > a.turns for a in checkpoint.agents for r in [daemon.records()[a.agent_id]]
        ),
        30,
        "the resumed agents to work",
    )
    with daemon.client() as client:
        client.drain(grace_secs=10)  # the agents stop again; a second resume must not wake them
    second = app.send_task(DAEMON_RESUME, kwargs=request, queue="caliband.team-a.task-3")
    assert second.get(timeout=60) == first.get(timeout=1)
    records = daemon.records()
    assert {records[i].status.value for i in ids} == {"drained"}
    for agent_id in ids:
        path = layout.transcript_file(layout.agent_dir(daemon.store, agent_id))
        resumes = [transcript.resumed_from(e) for e in transcript.events(path)]
        assert len([r for r in resumes if r is not None]) == 1


def test_a_rabbitmq_broker_without_a_result_backend_is_refused_naming_the_setting(
    tmp_short: Path,
) -> None:
    """Tried: ``drainctl drain`` with DRAIN_BROKER_URL=amqp://… and no DRAIN_RESULT_BACKEND
    (RabbitMQ keeps no results; Celery 5 has no amqp:// result backend)."""
    stack = Stack(tmp_short, "amqp://guest:guest@127.0.0.1:5672//", fresh_sqlite(tmp_short))
    try:
        stack.env["DRAIN_RESULT_BACKEND"] = ""  # unset, whatever the environment says
        result = stack.drainctl("drain", "team-a/task-1", "--timeout", "10")
        assert result.returncode == 2, result.stderr
        assert "DRAIN_RESULT_BACKEND" in result.stderr
        assert "must be set with a RabbitMQ broker" in result.stderr
        assert stack.ledger.list_operations() == []  # refused before anything was started
    finally:
        stack.close()


def test_start_drains_begins_sends_and_marks_many_at_once_and_never_twice(
    tmp_short: Path,
) -> None:
    """Many drains in one call: every operation begun in one ledger transaction, one chain
    in each daemon's queue, all ``draining``; the same keys again send nothing more, and
    a batch with a bad name starts none of its drains."""
    broker = redis_db_url(PIPELINE_REDIS_DB)
    database = fresh_sqlite(tmp_short)
    settings = Settings(broker_url=broker, result_backend=broker, database_url=database)
    app, ledger = make_app(settings), Ledger.from_url(database)
    client = redis.Redis.from_url(broker)
    names = [f"task-{i}" for i in range(12)]
    drains = [DrainStart("team-a", n, grace_secs=5, idempotency_key=f"k-{n}") for n in names]
    try:
        ops = start_drains(app, ledger, settings, drains)

        assert [(op.name, op.state) for op in ops] == [(n, OperationState.DRAINING) for n in names]
        assert all(op.celery_task_ids == {"drain": f"{op.id}.drain", "record": f"{op.id}.record"}
                   for op in ops)  # fmt: skip
        assert [client.llen(f"caliband.team-a.{n}") for n in names] == [1] * len(names)

        again = start_drains(app, ledger, settings, drains)

        assert [op.id for op in again] == [op.id for op in ops]
        assert [client.llen(f"caliband.team-a.{n}") for n in names] == [1] * len(names)
        with pytest.raises(TaskNameError):
            start_drains(app, ledger, settings, [DrainStart("team-a", "new"),
                                                 DrainStart("team-a", "Not_A_Name")])  # fmt: skip
        assert len(ledger.list_operations()) == len(names)
        assert client.llen("caliband.team-a.new") == 0
    finally:
        client.close()
        ledger.dispose()


def test_the_operators_drains_asked_together_begin_in_one_batch_and_a_bad_one_alone(
    tmp_short: Path,
) -> None:
    """The operator's batcher: twelve drains asked for at once (as twelve finalizers do)
    begin in one ``start_drains``; a batch with a name the pipeline refuses is begun one
    by one, so only that drain fails."""
    broker = redis_db_url(PIPELINE_REDIS_DB)
    database = fresh_sqlite(tmp_short)
    settings = Settings(broker_url=broker, result_backend=broker, database_url=database)
    app, ledger = make_app(settings), Ledger.from_url(database)
    client = redis.Redis.from_url(broker)
    batcher = DrainBatcher(app, lambda: ledger, settings)
    names = [f"task-{i}" for i in range(12)]

    async def together(drains: list[DrainStart]) -> list[OperationView | BaseException]:
        return list(await asyncio.gather(*(batcher.begin(d) for d in drains),
                                         return_exceptions=True))  # fmt: skip

    try:
        ops = asyncio.run(together([DrainStart("team-b", n, idempotency_key=f"b-{n}")
                                    for n in names]))  # fmt: skip
        assert batcher.batches == [12]
        assert [(o.name, o.state) for o in ops if isinstance(o, OperationView)] == [
            (n, OperationState.DRAINING) for n in names
        ]
        assert [client.llen(f"caliband.team-b.{n}") for n in names] == [1] * len(names)

        mixed = asyncio.run(together([DrainStart("team-b", "fine", idempotency_key="b-fine"),
                                      DrainStart("team-b", "Not_A_Name")]))  # fmt: skip
        assert batcher.batches == [12, 2, 1, 1]
        fine, bad = mixed
        assert isinstance(fine, OperationView) and fine.state is OperationState.DRAINING
        assert isinstance(bad, TaskNameError)
        assert client.llen("caliband.team-b.fine") == 1
    finally:
        client.close()
        ledger.dispose()


def test_a_long_lived_sender_keeps_no_result_subscription_for_the_chains_it_sent(
    tmp_short: Path,
) -> None:
    """The operator sends every drain from one process for weeks and never waits on a
    Celery result (it follows the ledger). The Redis result backend subscribes to a
    task's result channel when it is sent; those subscriptions must not pile up (each
    would hold its channel on the server and its buffered result in the process). Tried:
    20 drains one by one and 40 at once (sent from the thread pool), none consumed."""
    broker = redis_db_url(PIPELINE_REDIS_DB)
    database = fresh_sqlite(tmp_short)
    settings = Settings(broker_url=broker, result_backend=broker, database_url=database)
    app, ledger = make_app(settings), Ledger.from_url(database)
    client = redis.Redis.from_url(broker)
    try:
        for i in range(20):
            start_drains(app, ledger, settings, [DrainStart("team-c", f"one-{i}")])
        start_drains(app, ledger, settings, [DrainStart("team-c", f"many-{i}") for i in range(40)])
        assert client.llen("caliband.team-c.one-0") == 1  # sent, and nobody consumed it
        gc.collect()
        assert client.pubsub_channels("celery-task-meta-*") == []
        consumer = getattr(app.backend, "result_consumer", None)
        assert consumer is None or not consumer.subscribed_to
    finally:
        client.close()
        ledger.dispose()
