"""A pod can speak only for its own task: with ``DRAIN_MESSAGE_KEY`` set, the
orchestrator worker takes a drain result, resume result or heartbeat only when it is
signed with the key of the task the ledger says it is for.

Tried, on Redis and RabbitMQ, as tenant A's pod could (A's key and the broker URL in
hand): ``record_checkpoint``, ``record_resume`` and ``activity`` for tenant B's task,
unsigned, signed with A's key while claiming B's uid, signed as A, and for a guessed
operation id. None changes the ledger; each is refused, logged once. B's own daemon,
with its key, drains, records and reports as before."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from orchestrator.ledger import OperationKind, OperationState
from tests.pipeline_support import BROKERS, PipelineBroker, Stack, pipeline_broker
from tests.support import wait_until
from worker_agent import signing
from worker_agent.contract import ACTIVITY, RECORD_CHECKPOINT, RECORD_RESUME
from worker_agent.testing import DaemonProcess

pytestmark = pytest.mark.slow

MESSAGE_KEY = secrets.token_hex(32)
A = ("team-a", "task-a", str(uuid.uuid4()))
B = ("team-b", "task-b", str(uuid.uuid4()))


def key_of(task: tuple[str, str, str]) -> bytes:
    return signing.task_key(bytes.fromhex(MESSAGE_KEY), *task)


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Iterator[PipelineBroker]:
    with pipeline_broker(request.param) as b:
        yield b


@pytest.fixture
def stack(tmp_short: Path, broker: PipelineBroker) -> Iterator[Stack]:
    from tests.pipeline_support import fresh_postgres

    s = Stack(tmp_short, broker.url, fresh_postgres(), results=broker.results,
              DRAIN_MESSAGE_KEY=MESSAGE_KEY)  # fmt: skip
    try:
        yield s
    finally:
        s.close()


def start_daemon(stack: Stack, task: tuple[str, str, str]) -> DaemonProcess:
    """Task ``task``'s daemon as its pod runs it: its key, never the message key."""
    namespace, name, uid = task
    directory = stack.root / f"{namespace}.{name}"
    directory.mkdir()
    env = {k: v for k, v in stack.env.items() if k != "DRAIN_MESSAGE_KEY"}
    env[signing.TASK_KEY_ENV] = key_of(task).hex()
    daemon = DaemonProcess(
        directory, "--task-uid", uid, queue=f"caliband.{namespace}.{name}", env=env
    ).start()
    stack.daemons.append(daemon)
    return daemon


def forger(stack: Stack) -> Celery:
    """What tenant A's pod can do with the broker URL it holds."""
    return Celery("tenant-a", broker=stack.env["DRAIN_BROKER_URL"])


def refusals(stack: Stack) -> list[str]:
    return [line for line in stack.worker_log().splitlines() if "message_refused" in line]


def test_a_tenant_cannot_speak_for_another_tasks_operations(stack: Stack) -> None:
    stack.start_worker()
    b_namespace, b_name, b_uid = B
    op = stack.ledger.begin_operation(
        OperationKind.DELETE_DRAIN, task_uid=b_uid, namespace=b_namespace, name=b_name,
        idempotency_key=f"{b_uid}:delete",
    )  # fmt: skip
    resume = stack.ledger.begin_operation(
        OperationKind.RESUME, task_uid=b_uid, namespace=b_namespace, name=b_name,
        idempotency_key=f"{b_uid}:resume:x",
    )  # fmt: skip
    refs = [{"id": "agent-1", "session_dir": "agents/agent-1", "turns": 9, "clean": True,
             "exit": 0, "session_sha256": "ab" * 32}]  # fmt: skip
    drained = {"op_id": op.id, "namespace": b_namespace, "name": b_name, "refs": refs,
               "error": None}  # fmt: skip
    as_b = {**drained, "task_uid": b_uid}
    as_a = {**drained, "task_uid": A[2]}
    guessed = str(uuid.uuid4())
    tries = {
        # (what is sent, the subject and reason the worker logs)
        "unsigned": (as_b, op.id, "unsigned"),
        "a-key-claiming-b": (signing.sign(key_of(A), as_b), op.id, "bad-signature"),
        "signed-as-a": (signing.sign(key_of(A), as_a), op.id, "other-task"),
        "forged-failure": (signing.sign(key_of(A), {**as_b, "refs": [], "error": "boom"}),
                           op.id, "bad-signature"),
        "guessed-op": (signing.sign(key_of(A), {**as_b, "op_id": guessed}), guessed,
                       "unknown-operation"),
    }  # fmt: skip
    app = forger(stack)
    for body, subject, _ in tries.values():
        app.send_task(RECORD_CHECKPOINT, args=[body],
                      kwargs={"op_id": subject, "reason": "delete", "pvc_name": "stolen"},
                      queue="orchestrator")  # fmt: skip
    resumed = {"op_id": resume.id, "results": [{"id": "agent-1", "ok": True}], "error": None}
    app.send_task(RECORD_RESUME, args=[signing.sign(key_of(A), {**resumed, "task_uid": b_uid})],
                  kwargs={"op_id": resume.id}, queue="orchestrator")  # fmt: skip
    heartbeat = {"namespace": b_namespace, "name": b_name, "seq": 1, "reported_at": 1.0,
                 "agents_total": 1, "agents_live": 1, "agents_idle": 1,
                 "all_idle_since": 1.0, "idle_for_secs": 86400.0}  # fmt: skip
    for beat in (
        {**heartbeat, "task_uid": b_uid},
        signing.sign(key_of(A), {**heartbeat, "task_uid": b_uid}),
        signing.sign(key_of(A), {**heartbeat, "task_uid": None}),
    ):
        app.send_task(ACTIVITY, kwargs=beat, queue="orchestrator")
    expected = {f"kind=drain-result subject={s} reason={r}" for _, s, r in tries.values()}
    expected |= {f"kind=resume-result subject={resume.id} reason=bad-signature",
                 f"kind=heartbeat subject={b_namespace}/{b_name} reason=unsigned",
                 f"kind=heartbeat subject={b_namespace}/{b_name} reason=bad-signature"}  # fmt: skip

    def all_refused() -> bool:
        said = "\n".join(refusals(stack))
        return all(line in said for line in expected)

    wait_until(all_refused, 60, f"the worker to refuse {sorted(expected)}")
    # Logged once each: the same forgery again adds no line.
    app.send_task(RECORD_CHECKPOINT, args=[as_b], kwargs={"op_id": op.id, "reason": "delete"},
                  queue="orchestrator")  # fmt: skip
    app.send_task(ACTIVITY, kwargs={**heartbeat, "task_uid": b_uid}, queue="orchestrator")
    count = len(refusals(stack))
    wait_until(lambda: "kind=heartbeat" in stack.worker_log(), 5, "the worker's log")
    for current in (stack.ledger.get_operation(op.id), stack.ledger.get_operation(resume.id)):
        assert current is not None and current.state is OperationState.PENDING, current
    assert stack.ledger.list_checkpoints(namespace=b_namespace, name=b_name) == []
    assert stack.ledger.get_activity(b_namespace, b_name) is None
    assert len(refusals(stack)) == count == len(expected), refusals(stack)
    app.close()


def test_a_tasks_own_daemon_signs_and_is_believed(stack: Stack) -> None:
    stack.start_worker()
    daemon = start_daemon(stack, B)
    namespace, name, uid = B
    daemon.spawn_working(2, "turns=100000,turn_ms=200", 1)
    seen = wait_until(lambda: stack.ledger.get_activity(namespace, name), 60, "B's heartbeat")
    assert seen.task_uid == uid
    started = stack.drainctl("drain", f"{namespace}/{name}", "--grace", "10")
    assert started.returncode == 0, started.stderr
    [op] = stack.ledger.list_operations(namespace=namespace, name=name)
    wait_until(
        lambda: (o := stack.ledger.get_operation(op.id)) is not None and o.terminal, 90,
        "the drain to be recorded",
    )  # fmt: skip
    done = stack.ledger.get_operation(op.id)
    assert done is not None
    assert done.state is OperationState.RECORDED, done.error
    assert refusals(stack) == []
