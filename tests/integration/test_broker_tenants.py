"""Per-tenant broker identities on a real Redis (its ACLs) and a real RabbitMQ (its
management API): each task namespace's daemons hold a user of their own, made by the
operator's admin connection (``broker_tenants``).

Tried, as tenant B's pod could with the URL its namespace's Secret holds: reading,
popping, purging and publishing to tenant A's queue; reading A's and the orchestrator's
unacknowledged messages; reading the orchestrator's queue; binding a queue of its own to
the orchestrator's exchange (to be handed copies of every message); broadcasting a
remote-control ``shutdown`` to the workers; listing keys, subscribing, flushing. Each is
refused by the broker. Tenant A's own daemon, with its user, consumes a drain, stores
its result and reports to the orchestrator, which records the checkpoint."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from orchestrator.broker_tenants import (
    RabbitTenants,
    RedisTenants,
    TenantError,
    password,
    user_name,
)
from orchestrator.ledger import OperationState
from orchestrator.settings import Settings
from tests.pipeline_support import AMQP_URL, Stack, fresh_postgres, rabbitmq_vhost, redis_db_url
from tests.support import wait_until
from worker_agent import signing
from worker_agent.contract import ORCHESTRATOR_QUEUE, daemon_unacked_keys
from worker_agent.testing import DaemonProcess

pytestmark = pytest.mark.slow

MESSAGE_KEY = secrets.token_hex(32)
KEY = bytes.fromhex(MESSAGE_KEY)
RUN = secrets.token_hex(3)
A_NS, B_NS = f"tenant-a-{RUN}", f"tenant-b-{RUN}"
MANAGEMENT = "http://guest:guest@127.0.0.1:15672"


def drain_one(stack: Stack, daemon_env: dict[str, str], namespace: str) -> None:
    """Namespace ``namespace``'s task drained through the pipeline, its daemon holding
    only ``daemon_env``'s (its tenant's) broker URL: the checkpoint recorded."""
    uid = str(uuid.uuid4())
    directory = stack.root / f"{namespace}.task"
    directory.mkdir()
    env = {k: v for k, v in stack.env.items() if k != "DRAIN_MESSAGE_KEY"}
    env.update(daemon_env)
    env[signing.TASK_KEY_ENV] = signing.task_key(KEY, namespace, "task", uid).hex()
    daemon = DaemonProcess(
        directory, "--task-uid", uid, queue=f"caliband.{namespace}.task", env=env
    ).start()
    stack.daemons.append(daemon)
    daemon.spawn_working(1, "turns=100000,turn_ms=200", 1)
    seen = wait_until(lambda: stack.ledger.get_activity(namespace, "task"), 60, "a heartbeat")
    assert seen.task_uid == uid
    started = stack.drainctl("drain", f"{namespace}/task", "--grace", "10")
    assert started.returncode == 0, started.stderr
    [op] = stack.ledger.list_operations(namespace=namespace, name="task")
    wait_until(
        lambda: (o := stack.ledger.get_operation(op.id)) is not None and o.terminal, 90,
        "the drain recorded",
    )  # fmt: skip
    done = stack.ledger.get_operation(op.id)
    assert done is not None and done.state is OperationState.RECORDED, done
    assert "message_refused" not in stack.worker_log()
    daemon_log = daemon.log.read_text(errors="replace")
    assert "NoPermission" not in daemon_log and "ACCESS_REFUSED" not in daemon_log


# ------------------------------------------------------------------------------ Redis


@pytest.fixture
def redis_stack(tmp_short: Path) -> Iterator[tuple[Stack, str]]:
    import redis

    url = redis_db_url(3)
    stack = Stack(tmp_short, url, fresh_postgres(), DRAIN_MESSAGE_KEY=MESSAGE_KEY)
    try:
        yield stack, url
    finally:
        stack.close()
        with redis.Redis.from_url(url) as admin:
            for namespace in (A_NS, B_NS):
                admin.execute_command("ACL", "DELUSER", user_name(KEY, namespace))


def test_a_redis_tenant_reaches_its_own_queues_and_the_orchestrators_only(
    redis_stack: tuple[Stack, str],
) -> None:
    import redis
    from redis.exceptions import NoPermissionError, ResponseError

    stack, url = redis_stack
    tenants = RedisTenants(url, url, KEY)
    a_url, b_url = tenants.ensure(A_NS), tenants.ensure(B_NS)
    assert tenants.ensure(A_NS) == a_url  # the same user again: nothing to store
    assert urlsplit(a_url).username == user_name(KEY, A_NS)
    assert password(KEY, A_NS) in a_url and password(KEY, A_NS) != password(KEY, B_NS)

    stack.start_worker()
    drain_one(stack, {"DRAIN_BROKER_URL": a_url, "DRAIN_RESULT_BACKEND": a_url}, A_NS)

    # A queue of A's that no consumer reads (A's daemon would take what lands in its own).
    queue_a = f"caliband.{A_NS}.waiting"
    binding_a = f"_kombu.binding.caliband.{A_NS}.task"
    with redis.Redis.from_url(url) as admin:
        admin.lpush(queue_a, b"a message of A's")
        assert admin.exists(daemon_unacked_keys(A_NS)["unacked_key"]) == 0  # all acked
        admin.hset(daemon_unacked_keys(A_NS)["unacked_key"], "tag", b"in flight")
    refused: dict[str, object] = {}
    with redis.Redis.from_url(b_url) as b:
        tries: dict[str, Callable[[], object]] = {
            "read A's queue": lambda: b.lrange(queue_a, 0, -1),
            "pop A's queue": lambda: b.rpop(queue_a),
            "purge A's queue": lambda: b.delete(queue_a),
            "publish to A's queue": lambda: b.lpush(queue_a, b"forged"),
            "read A's unacked messages": lambda: b.hgetall(f"caliband.{A_NS}._unacked"),
            "read the shared unacked messages": lambda: b.hgetall("unacked"),
            "read the orchestrator's queue": lambda: b.lrange(ORCHESTRATOR_QUEUE, 0, -1),
            "pop the orchestrator's queue": lambda: b.rpop(ORCHESTRATOR_QUEUE),
            "bind to the orchestrator's exchange": lambda: b.sadd(
                f"_kombu.binding.{ORCHESTRATOR_QUEUE}", f"x\x06\x16\x06\x16caliband.{B_NS}.t"
            ),
            "unbind A's queue": lambda: b.delete(binding_a),
            "broadcast to the workers": lambda: b.publish("/3.celery.pidbox", b"shutdown"),
            "subscribe to results": lambda: b.execute_command("PSUBSCRIBE", "celery-task-meta-*"),
            "list the keys": lambda: b.keys("*"),
            "scan the keys": lambda: b.scan(0),
            "flush the database": lambda: b.flushdb(),
            "change its own rights": lambda: b.execute_command("ACL", "SETUSER", "x", "on"),
        }
        for what, attempt in tries.items():
            try:
                attempt()
            except (NoPermissionError, ResponseError) as exc:
                refused[what] = str(exc)
        # What B may do: its own queues, and publish to the orchestrator.
        b.lpush(f"caliband.{B_NS}.other", b"its own")
        assert b.llen(f"caliband.{B_NS}.other") == 1
    assert sorted(tries) == sorted(refused), f"allowed: {sorted(set(tries) - set(refused))}"
    with redis.Redis.from_url(url) as admin:
        assert admin.lrange(queue_a, 0, -1) == [b"a message of A's"]
        assert admin.hgetall(daemon_unacked_keys(A_NS)["unacked_key"]) == {b"tag": b"in flight"}
        assert admin.exists(binding_a) == 1
        bound = admin.smembers(f"_kombu.binding.{ORCHESTRATOR_QUEUE}")
        assert all(B_NS.encode() not in member for member in bound)


def test_an_admin_url_the_broker_refuses_is_one_line() -> None:
    """Tried: an admin connection to a port nothing listens on."""
    tenants = RedisTenants("redis://127.0.0.1:1/0", "redis://127.0.0.1:6379/0", KEY)
    with pytest.raises(TenantError, match=r"^Redis refused the tenant user caliban-drain\."):
        tenants.ensure(A_NS)


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"DRAIN_BROKER_ADMIN_URL": "redis://127.0.0.1:6379/0", "DRAIN_MANAGE_SANDBOX": "true"},
         "needs DRAIN_MESSAGE_KEY"),
        ({"DRAIN_BROKER_ADMIN_URL": "ftp://127.0.0.1/", "DRAIN_MESSAGE_KEY": MESSAGE_KEY},
         "is neither redis"),
        ({"DRAIN_BROKER_ADMIN_URL": "http://127.0.0.1:15672", "DRAIN_MESSAGE_KEY": MESSAGE_KEY},
         "a Redis broker's users are made with redis://"),
        ({"DRAIN_BROKER_ADMIN_URL": "redis://127.0.0.1:6379/0", "DRAIN_MESSAGE_KEY": MESSAGE_KEY,
          "DRAIN_DAEMON_BROKER_URL": "amqp://127.0.0.1:5672//"}, "management API"),
    ],
)  # fmt: skip
def test_settings_refuse_tenants_they_cannot_make(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], error: str
) -> None:
    monkeypatch.setenv("DRAIN_BROKER_URL", "redis://127.0.0.1:6379/0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=error):
        Settings()


# --------------------------------------------------------------------------- RabbitMQ


def management_up() -> bool:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(
                "http://127.0.0.1:15672/api/overview",
                headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="},  # guest:guest
            ),
            timeout=5,
        ):
            return True
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def amqp_stack(tmp_short: Path) -> Iterator[tuple[Stack, str]]:
    if not management_up():
        pytest.skip(
            "RabbitMQ's management API is not at 127.0.0.1:15672: "
            "`rabbitmq-plugins enable rabbitmq_management` (scripts/ensure-services.sh)"
        )
    with rabbitmq_vhost() as url:
        stack = Stack(
            tmp_short, url, fresh_postgres(), results=redis_db_url(3),
            DRAIN_MESSAGE_KEY=MESSAGE_KEY,
        )  # fmt: skip
        try:
            yield stack, url
        finally:
            stack.close()
            for namespace in (A_NS, B_NS):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    subprocess.run(["rabbitmqctl", "delete_user", user_name(KEY, namespace)],
                                   capture_output=True, timeout=60, check=False)  # fmt: skip


def test_a_rabbitmq_tenant_reaches_its_own_queues_and_the_orchestrators_only(
    amqp_stack: tuple[Stack, str],
) -> None:
    import amqp
    from kombu import Connection

    stack, url = amqp_stack
    tenants = RabbitTenants(MANAGEMENT, url, KEY)
    a_url, b_url = tenants.ensure(A_NS), tenants.ensure(B_NS)
    assert urlsplit(a_url).username == user_name(KEY, A_NS)

    stack.start_worker()
    drain_one(stack, {"DRAIN_BROKER_URL": a_url}, A_NS)

    queue_a = f"caliband.{A_NS}.task"

    def attempt(what: str, action: object, *args: object) -> str | None:
        """``action`` on a fresh channel of tenant B's; the broker's refusal, or None."""
        with Connection(b_url) as conn:
            channel: Any = conn.channel()
            try:
                if action == "basic_publish":
                    # Confirmed, so that a refusal is an answer, not a later channel close.
                    action = "basic_publish_confirm"
                getattr(channel, str(action))(*args)
            except amqp.exceptions.AccessRefused as exc:
                return str(exc)
            except amqp.exceptions.AMQPError as exc:
                return f"{what}: {exc}"
        return None

    message = amqp.Message(b"forged")
    tries = {
        "read A's queue": ("basic_get", queue_a),
        "consume A's queue": ("basic_consume", queue_a),
        "purge A's queue": ("queue_purge", queue_a),
        "delete A's queue": ("queue_delete", queue_a),
        "publish to A's queue": ("basic_publish", message, queue_a, queue_a),
        "publish through the default exchange": ("basic_publish", message, "", queue_a),
        "read the orchestrator's queue": ("basic_get", ORCHESTRATOR_QUEUE),
        "delete the orchestrator's queue": ("queue_delete", ORCHESTRATOR_QUEUE),
        "bind to the orchestrator's exchange": (
            "queue_bind", f"caliband.{B_NS}.t", ORCHESTRATOR_QUEUE, ORCHESTRATOR_QUEUE
        ),
        "broadcast to the workers": ("basic_publish", message, "celery.pidbox", ""),
    }  # fmt: skip
    with Connection(b_url) as conn:  # a queue of B's own, for the binding attempt
        own: Any = conn.channel()
        own.queue_declare(f"caliband.{B_NS}.t", durable=True, auto_delete=False)
    answers = {what: attempt(what, action, *args) for what, (action, *args) in tries.items()}
    assert [what for what, said in answers.items() if said is None] == [], answers
    with Connection(url) as admin:
        channel: Any = admin.channel()
        _, depth, _ = channel.queue_declare(queue_a, passive=True)
        assert depth == 0
        channel.queue_declare(ORCHESTRATOR_QUEUE, passive=True)  # still there


def test_a_rabbitmq_management_api_that_refuses_is_one_line() -> None:
    """Tried: an admin URL with a wrong password."""
    if not management_up():
        pytest.skip("RabbitMQ's management API is not at 127.0.0.1:15672")
    parts = urlsplit(MANAGEMENT)
    wrong = urlunsplit(parts._replace(netloc="guest:wrong@127.0.0.1:15672"))
    tenants = RabbitTenants(wrong, AMQP_URL, KEY)
    with pytest.raises(
        TenantError, match=r"^RabbitMQ's management API refused PUT /api/users: 401"
    ):
        tenants.ensure(A_NS)
