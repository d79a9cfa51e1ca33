"""Faults in the pipeline: killed consumers and workers, restarted Redis and PostgreSQL,
forbidden serializers and unknown tasks, on each broker (Redis and RabbitMQ) with the
project's default redelivery settings. Each ends with nothing lost and nothing recorded
twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import OperationalError

from orchestrator.settings import Settings
from tests.pipeline_support import (
    BROKERS,
    PG_URL,
    PipelineBroker,
    PrivatePostgres,
    Stack,
    consumer_pid,
    fresh_postgres,
    fresh_sqlite,
    kill_hard,
    pipeline_broker,
    private_postgres,
    private_redis,
    rabbitmqctl,
    start_redis,
)
from tests.support import DaemonProcess, wait_until
from worker_agent.proto import AgentStatus
from worker_agent.session import MAX_UNANNOUNCED_TURNS, count_completed_turns, load_session

pytestmark = pytest.mark.slow


TIMING = ("DRAIN_VISIBILITY_TIMEOUT_SECS", "DRAIN_UNACKED_RESTORE_INTERVAL_SECS",
          "DRAIN_BROKER_HEARTBEAT_SECS", "DRAIN_SWEEP_INTERVAL_SECS")  # fmt: skip
"""Redelivery and deadline settings: the fault tests run with the project's defaults."""


def default(setting: str) -> float:
    value = Settings.model_fields[setting].default
    assert isinstance(value, int | float)
    return float(value)


REDELIVERY_SECS = {
    "redis": min(
        default("visibility_timeout_secs") + default("unacked_restore_interval_secs") + 60,
        default("drain_expires_secs"),
    ),
    # RabbitMQ redelivers at once when a killed process's connection closes; the bound is
    # the one for a consumer that vanished, noticed within two heartbeats.
    "amqp": min(2 * default("broker_heartbeat_secs") + 60, default("drain_expires_secs")),
}
"""How long a message of a killed consumer or worker may take to come back with the
default settings (never past a drain's expiry, after which it would be discarded)."""


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Iterator[PipelineBroker]:
    with pipeline_broker(request.param) as b:
        yield b


@pytest.fixture
def pg_stack(tmp_short: Path, broker: PipelineBroker) -> Iterator[Stack]:
    s = Stack(tmp_short, broker.url, fresh_postgres(), results=broker.results)
    for setting in TIMING:
        s.env.pop(setting, None)
    try:
        yield s
    finally:
        s.close()


def checkpoint_rows(url: str) -> tuple[int, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            checkpoints = conn.execute(sa.text("SELECT count(*) FROM checkpoints")).scalar_one()
            agents = conn.execute(sa.text("SELECT count(*) FROM checkpoint_agents")).scalar_one()
    finally:
        engine.dispose()
    return int(checkpoints), int(agents)


def assert_nothing_lost(stack: Stack, daemon: DaemonProcess, ref: str) -> None:
    checkpoint = stack.ledger.get_checkpoint(ref)
    assert checkpoint is not None
    for agent in checkpoint.agents:
        directory = daemon.store / agent.session_dir
        assert agent.turns == load_session(directory).turns
        # A SIGKILLed worker may have saved its last turn and not yet announced it.
        unannounced = agent.turns - count_completed_turns(directory)
        assert unannounced == 0 or (not agent.clean and unannounced <= MAX_UNANNOUNCED_TURNS)


def test_consumer_sigkilled_mid_drain_is_redelivered_and_records_once(
    pg_stack: Stack, broker: PipelineBroker
) -> None:
    """Tried: SIGKILL of the daemon-side consumer while its drain task runs."""
    pg_stack.start_worker()
    daemon = pg_stack.start_daemon("team-a", "task-k")
    daemon.spawn_working(2, "turns=100000,turn_ms=50", 2)
    # One agent ignores SIGTERM, so the drain lasts its whole grace (20 s) before the
    # daemon SIGKILLs it, and the consumer is killed while it waits for the reply. Agents
    # that honour SIGTERM alone cannot hold it: ones started together reach a turn's end
    # together, and a drain arriving there is over in a fraction of a second.
    daemon.spawn_working(1, "turns=100000,turn_ms=50,sigterm=ignore", 2)
    # Connected, not only started: a consumer still connecting under load would take the
    # drain late, and the wait below for it to be under way would time out.
    wait_until(
        lambda: "broker_connection state=connected" in daemon.log_text(), 60,
        "the daemon's consumer to connect",
    )  # fmt: skip
    started = pg_stack.drainctl("drain", "team-a/task-k", "--grace", "20")
    assert started.returncode == 0, started.stderr
    wait_until(
        lambda: any(r.status is AgentStatus.DRAINING for r in daemon.records().values()),
        30,
        "the drain to be under way",
    )
    first = consumer_pid(daemon)
    assert first is not None
    kill_hard(first)
    wait_until(lambda: consumer_pid(daemon) not in (None, first), 30, "a restarted consumer")

    [op] = pg_stack.ledger.list_operations(namespace="team-a", name="task-k")
    wait_until(
        lambda: pg_stack.ledger.get_operation(op.id).terminal,  # type: ignore[union-attr]
        REDELIVERY_SECS[broker.kind],
        "the redelivered drain to be recorded",
    )
    final = pg_stack.ledger.get_operation(op.id)
    assert final is not None
    assert final.state == "recorded", final.error
    assert final.checkpoint_ref is not None
    assert checkpoint_rows(PG_URL) == (1, 3)
    assert_nothing_lost(pg_stack, daemon, final.checkpoint_ref)
    assert "agent_drain_killed" in daemon.log_text()  # the drain did last its grace


def test_orchestrator_worker_sigkilled_mid_record_checkpoint_records_once(
    pg_stack: Stack, broker: PipelineBroker
) -> None:
    """Tried: SIGKILL of the orchestrator worker while record_checkpoint is inside its
    transaction (held there by a table lock the test takes)."""
    worker = pg_stack.start_worker("worker-1")
    daemon = pg_stack.start_daemon("team-a", "task-r")
    daemon.spawn_working(3, "turns=100000,turn_ms=30", 2)
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect() as blocker:
            tx = blocker.begin()
            blocker.execute(sa.text("LOCK TABLE checkpoints IN ACCESS EXCLUSIVE MODE"))
            started = pg_stack.drainctl("drain", "team-a/task-r")
            assert started.returncode == 0, started.stderr

            def record_waiting() -> bool:
                rows = blocker.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted "
                        "AND relation = 'checkpoints'::regclass"
                    )
                ).scalar_one()
                return bool(rows)

            wait_until(record_waiting, 60, "record_checkpoint to block on the lock")
            kill_hard(worker.pid)
            worker.wait(10)
            tx.rollback()
    finally:
        engine.dispose()
    pg_stack.start_worker("worker-2")
    [op] = pg_stack.ledger.list_operations(namespace="team-a", name="task-r")
    wait_until(
        lambda: pg_stack.ledger.get_operation(op.id).terminal,  # type: ignore[union-attr]
        REDELIVERY_SECS[broker.kind],
        "the redelivered record_checkpoint",
    )
    final = pg_stack.ledger.get_operation(op.id)
    assert final is not None
    assert final.state == "recorded", final.error
    assert checkpoint_rows(PG_URL) == (1, 3)
    assert final.checkpoint_ref is not None
    assert_nothing_lost(pg_stack, daemon, final.checkpoint_ref)


def test_postgres_restarted_between_drain_and_record_completes(
    tmp_short: Path, broker: PipelineBroker
) -> None:
    """Tried: PostgreSQL down when record_checkpoint runs; it comes back later. The server
    is one of the test's own, so that stopping it fails nothing the other worker runs."""
    with private_postgres() as server:
        stack = Stack(tmp_short, broker.url, server.url, results=broker.results)
        for setting in TIMING:
            stack.env.pop(setting, None)
        try:
            _record_survives_a_postgres_restart(stack, server)
        finally:
            stack.close()


def _record_survives_a_postgres_restart(stack: Stack, server: PrivatePostgres) -> None:
    daemon = stack.start_daemon("team-a", "task-p")
    daemon.spawn_working(2, "turns=100000,turn_ms=30", 2)
    started = stack.drainctl("drain", "team-a/task-p")
    assert started.returncode == 0, started.stderr
    [op] = stack.ledger.list_operations(namespace="team-a", name="task-p")
    wait_until(
        lambda: all(r.status is AgentStatus.DRAINED for r in daemon.records().values()),
        60,
        "the daemon to drain (the record message now waits on the orchestrator queue)",
    )
    stack.ledger.dispose()
    server.stop()
    try:
        stack.start_worker()
        wait_until(lambda: "Retry in" in stack.worker_log(), 60, "record_checkpoint to retry")
    finally:
        server.start()
    wait_until(
        lambda: stack.ledger.get_operation(op.id).state == "recorded",  # type: ignore[union-attr]
        120,
        "the record after PostgreSQL returned",
    )
    assert checkpoint_rows(server.url) == (1, 2)


def test_redis_restarted_mid_chain_completes_or_fails_with_a_reason(tmp_short: Path) -> None:
    """Tried: the broker restarted (losing everything it held) while a drain runs."""
    with private_redis() as (url, proc, port):
        stack = Stack(
            tmp_short,
            url,
            fresh_sqlite(tmp_short),
            # Shortened so a lost chain is failed in seconds; Settings holds them to the
            # same relations as the defaults.
            DRAIN_DRAIN_EXPIRES_SECS="20",
            DRAIN_DB_RETRY_WINDOW_SECS="15",
            DRAIN_RECORD_DEADLINE_SECS="35",
        )
        try:
            stack.start_worker()
            daemon = stack.start_daemon("team-a", "task-b")
            daemon.spawn_working(2, "turns=100000,turn_ms=3000", 1)
            # The drain expires in 20 s here: a consumer still starting under CI's load
            # would discard it, which is another test's subject.
            wait_until(
                lambda: "broker_connection state=connected" in daemon.log_text(),
                60,
                "the daemon's consumer to connect",
            )
            started = stack.drainctl("drain", "team-a/task-b", "--grace", "20")
            assert started.returncode == 0, started.stderr
            # DRAINED counts too: an agent flushes on SIGTERM in milliseconds, so a poll can
            # miss the DRAINING window; either way the record is still ahead of the chain.
            wait_until(
                lambda: any(
                    r.status in (AgentStatus.DRAINING, AgentStatus.DRAINED)
                    for r in daemon.records().values()
                ),
                60,
                "the daemon to begin the drain",
            )
            proc.terminate()
            proc.wait(10)
            proc = start_redis(port)
            [op] = stack.ledger.list_operations(namespace="team-a", name="task-b")

            def settled() -> bool:
                current = stack.ledger.get_operation(op.id)
                return current is not None and current.state in ("recorded", "failed")

            wait_until(settled, 120, "the operation to be recorded or failed")
            final = stack.ledger.get_operation(op.id)
            assert final is not None
            checkpoints = stack.ledger.list_checkpoints(namespace="team-a", name="task-b")
            if final.state == "recorded":
                assert [c.ref for c in checkpoints] == [final.checkpoint_ref]
                assert final.checkpoint_ref is not None
                assert_nothing_lost(stack, daemon, final.checkpoint_ref)
            else:
                assert final.error
                assert checkpoints == []  # never half-recorded
        finally:
            stack.close()
            proc.terminate()


def test_non_json_messages_and_unknown_tasks_are_rejected(
    tmp_short: Path, broker: PipelineBroker
) -> None:
    """Tried: a pickle-serialized message and a task name nobody registered."""
    stack = Stack(tmp_short, broker.url, fresh_sqlite(tmp_short), results=broker.results)
    try:
        stack.start_worker()
        wait_until(lambda: "ready" in stack.worker_log(), 60, "the worker to be ready")
        exchange = Exchange("orchestrator", type="direct")
        queue = Queue("orchestrator", exchange, routing_key="orchestrator")
        with Connection(broker.url) as conn:
            producer = Producer(conn)
            producer.publish(
                {"op_id": "x"},
                serializer="pickle",
                exchange=exchange,
                routing_key="orchestrator",
                declare=[queue],
                headers={"task": "caliban.orchestrator.record_checkpoint", "id": "pickled-1",
                         "lang": "py", "argsrepr": "", "kwargsrepr": ""},
            )  # fmt: skip
        wait_until(
            lambda: (
                "ContentDisallowed" in stack.worker_log()
                or "disallowed content" in stack.worker_log().lower()
            ),
            30,
            "the worker to refuse the pickle message",
        )
        sent = stack.drainctl("drain", "team-a/x")  # keeps the worker honest afterwards
        assert sent.returncode == 0
        from orchestrator.pipeline.app import make_app
        from orchestrator.settings import Settings

        app = make_app(Settings(broker_url=broker.url, result_backend=broker.results))
        app.send_task("caliban.orchestrator.no_such_task", kwargs={}, queue="orchestrator")
        wait_until(
            lambda: "unregistered task" in stack.worker_log().lower(),
            30,
            "the worker to reject the unknown task",
        )
        assert stack.ledger.list_checkpoints() == []
    finally:
        stack.close()


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_drain_rabbitmq_refuses_raises_instead_of_vanishing(broker: PipelineBroker) -> None:
    """Tried: a daemon queue that refuses every message (a max-length 0, reject-publish
    policy, as a full queue would). With publisher confirms the send raises; without, the
    drain would be lost without a word until the sweeper's deadline."""
    from amqp.exceptions import MessageNacked

    from orchestrator.pipeline.app import make_app
    from worker_agent.contract import DAEMON_DRAIN, DrainRequest

    vhost = urlsplit(broker.url).path.lstrip("/")
    rabbitmqctl(
        "set_policy", "-p", vhost, "--apply-to", "queues", "refuse-all", r"^caliband\.",
        '{"max-length": 0, "overflow": "reject-publish"}',
    )  # fmt: skip
    app = make_app(Settings(broker_url=broker.url, result_backend=broker.results))
    request = DrainRequest(op_id="op-refused", grace_secs=0).model_dump(mode="json")
    # kombu counts a nack as recoverable: the publish is retried, then raised.
    with pytest.raises(OperationalError) as caught:
        app.send_task(DAEMON_DRAIN, kwargs=request, queue="caliband.team-a.full")
    assert isinstance(caught.value.__cause__, MessageNacked)
