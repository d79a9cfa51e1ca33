"""The contract between the halves: the wire shape of every payload, where each is
refused, the one Celery configuration, and the rule that ``worker_agent`` never imports
``orchestrator``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from orchestrator.pipeline.app import app as orchestrator_app
from orchestrator.settings import Settings
from worker_agent import consumer
from worker_agent.contract import (
    ActivityReport,
    AgentResumeOutcome,
    BrokerSettings,
    DrainRequest,
    DrainResult,
    ResumeAgent,
    ResumeRequest,
    ResumeResult,
    TaskNameError,
    make_celery,
    parse_daemon_queue,
)
from worker_agent.proto import ResumeRef

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32
REF = ResumeRef(
    id="agent-a", session_dir="agents/agent-a", turns=3, session_sha256=SHA, clean=True, exit=0
)
REF_JSON = {
    "id": "agent-a",
    "session_dir": "agents/agent-a",
    "turns": 3,
    "session_sha256": SHA,
    "clean": True,
    "exit": 0,
    "error": None,
}

# (model, the JSON Celery carries for it), written out: the shape both sides rely on.
SHAPES: list[tuple[BaseModel, dict[str, Any]]] = [
    (DrainRequest(op_id="op-1", grace_secs=30.0), {"op_id": "op-1", "grace_secs": 30.0}),
    (
        DrainRequest(op_id="op-1", grace_secs=30.0, task_uid="uid-1"),
        {"op_id": "op-1", "grace_secs": 30.0, "task_uid": "uid-1"},
    ),
    (
        DrainResult(op_id="op-1", namespace="team-a", name="task-1", refs=[], error=None,
                    task_uid="uid-1"),
        {"op_id": "op-1", "namespace": "team-a", "name": "task-1", "refs": [], "error": None,
         "task_uid": "uid-1"},
    ),
    (
        ResumeRequest(op_id="op-2", agents=[], task_uid="uid-1"),
        {"op_id": "op-2", "agents": [], "task_uid": "uid-1"},
    ),
    (
        ResumeRequest(op_id="op-2", agents=[], provider="scripted", model="turns=3"),
        {"op_id": "op-2", "agents": [], "provider": "scripted", "model": "turns=3"},
    ),
    (
        DrainResult(op_id="op-1", namespace="team-a", name="task-1", refs=[REF], error=None),
        {"op_id": "op-1", "namespace": "team-a", "name": "task-1", "refs": [REF_JSON],
         "error": None},
    ),
    (
        ResumeRequest(op_id="op-2", agents=[ResumeAgent(id="agent-a", session_dir="agents/a")]),
        {"op_id": "op-2", "agents": [{"id": "agent-a", "session_dir": "agents/a"}]},
    ),
    (
        ResumeRequest(
            op_id="op-2",
            agents=[
                ResumeAgent(id="agent-a", session_dir="agents/a", turns=4, session_sha256="c" * 64)
            ],
        ),
        {
            "op_id": "op-2",
            "agents": [
                {"id": "agent-a", "session_dir": "agents/a", "turns": 4, "session_sha256": "c" * 64}
            ],
        },
    ),
    (
        ResumeResult(
            op_id="op-2",
            results=[
                AgentResumeOutcome(id="a", ok=True),
                AgentResumeOutcome(id="b", ok=True, note="already running"),
                AgentResumeOutcome(id="c", ok=False, error="no session.json"),
            ],
            error=None,
        ),
        {"op_id": "op-2", "error": None, "results": [
            {"id": "a", "ok": True},
            {"id": "b", "ok": True, "note": "already running"},
            {"id": "c", "ok": False, "error": "no session.json"},
        ]},
    ),
    (
        ActivityReport(
            namespace="team-a", name="task-1", task_uid=None, seq=17, reported_at=1700000000.5,
            agents_total=3, agents_live=2, agents_idle=1, all_idle_since=None,
            agents_interrupted=1,
        ),
        {"namespace": "team-a", "name": "task-1", "task_uid": None, "seq": 17,
         "reported_at": 1700000000.5, "agents_total": 3, "agents_live": 2, "agents_idle": 1,
         "all_idle_since": None, "idle_for_secs": None, "agents_interrupted": 1,
         "agents_done": 0},
    ),
    (
        ActivityReport(
            namespace="team-a", name="task-1", task_uid="uid-1", seq=18,
            reported_at=1700000030.5, agents_total=2, agents_live=2, agents_idle=2,
            all_idle_since=1700000000.25, idle_for_secs=29.75, agents_done=0,
        ),
        {"namespace": "team-a", "name": "task-1", "task_uid": "uid-1", "seq": 18,
         "reported_at": 1700000030.5, "agents_total": 2, "agents_live": 2, "agents_idle": 2,
         "all_idle_since": 1700000000.25, "idle_for_secs": 29.75, "agents_interrupted": 0,
         "agents_done": 0},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("model", "wire"), SHAPES, ids=lambda v: type(v).__name__)
def test_each_payload_has_its_pinned_json_shape_and_reads_back_as_itself(
    model: BaseModel, wire: dict[str, Any]
) -> None:
    assert model.model_dump(mode="json") == wire
    carried = json.loads(json.dumps(wire))  # what Celery's JSON serializer delivers
    assert type(model).model_validate(carried) == model


@pytest.mark.parametrize(("model", "wire"), SHAPES, ids=lambda v: type(v).__name__)
def test_an_unknown_field_is_refused(model: BaseModel, wire: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="surprise"):
        type(model).model_validate({**wire, "surprise": 1})


OLD_DAEMONS_HEARTBEAT = {
    "namespace": "team-a", "name": "task-1", "task_uid": None, "seq": 17,
    "reported_at": 1700000030.5, "agents_total": 2, "agents_live": 2, "agents_idle": 2,
    "all_idle_since": 1700000000.0,
}  # fmt: skip


def test_a_heartbeat_from_a_daemon_older_than_idle_for_secs_reads_as_not_measured() -> None:
    report = ActivityReport.model_validate(OLD_DAEMONS_HEARTBEAT)

    assert report.idle_for_secs is None
    assert report.all_idle_since == 1700000000.0  # kept for display, never for the decision


@pytest.mark.parametrize(
    "idle_for", [-0.5, "30", float("inf"), float("nan")], ids=["negative", "string", "inf", "nan"]
)
def test_an_idle_duration_that_is_no_duration_is_refused(idle_for: object) -> None:
    with pytest.raises(ValidationError) as raised:
        ActivityReport.model_validate({**OLD_DAEMONS_HEARTBEAT, "idle_for_secs": idle_for})

    assert [e["loc"] for e in raised.value.errors()] == [("idle_for_secs",)]


@pytest.mark.parametrize("key", ["id", "session_dir", "turns", "session_sha256", "clean", "exit"])
def test_a_drain_result_whose_ref_lacks_a_key_is_refused_by_name(key: str) -> None:
    ref = dict(REF_JSON)
    del ref[key]
    wire = {"op_id": "op-1", "namespace": "n", "name": "t", "refs": [REF_JSON, ref], "error": None}

    with pytest.raises(ValidationError) as raised:
        DrainResult.model_validate(wire)

    assert [(e["loc"], e["type"]) for e in raised.value.errors()] == [(("refs", 1, key), "missing")]


@pytest.mark.parametrize(
    ("field", "value"),
    [("turns", "3"), ("clean", "yes"), ("exit", 1.5), ("session_sha256", 7), ("id", None)],
)
def test_a_drain_result_whose_ref_has_a_wrong_type_is_refused_not_coerced(
    field: str, value: object
) -> None:
    wire = {"op_id": "op-1", "namespace": "n", "name": "t", "error": None,
            "refs": [{**REF_JSON, field: value}]}  # fmt: skip

    with pytest.raises(ValidationError) as raised:
        DrainResult.model_validate(wire)

    assert [e["loc"] for e in raised.value.errors()] == [("refs", 0, field)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"op_id": "op-1"},
        {"op_id": "op-1", "grace_secs": -1},
        {"op_id": "op-1", "grace_secs": "30"},
        {"op_id": "../../etc", "grace_secs": 1},
        {"op_id": "", "grace_secs": 1},
    ],
    ids=["no-grace", "negative-grace", "string-grace", "path-op-id", "empty-op-id"],
)
def test_a_malformed_drain_request_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        DrainRequest.model_validate(kwargs)


def test_daemon_queue_names_parse_back() -> None:
    assert parse_daemon_queue("caliband.team-a.task.v1") == ("team-a", "task.v1")
    for bad in ("orchestrator", "caliband.Team.x", "caliband.team"):
        with pytest.raises(TaskNameError):
            parse_daemon_queue(bad)


# ---------------------------------------------------------------------- settings


def test_each_broker_setting_is_declared_once_and_shared() -> None:
    shared = set(BrokerSettings.model_fields)
    assert shared == {
        "broker_url", "result_backend", "broker_folder", "visibility_timeout_secs",
        "unacked_restore_interval_secs", "broker_heartbeat_secs", "heartbeat_interval_secs",
        "heartbeat_poll_secs",
    }  # fmt: skip
    assert issubclass(Settings, BrokerSettings)
    assert shared.isdisjoint(Settings.__annotations__)  # declared in the contract only
    assert shared <= set(Settings.model_fields)


RABBITMQ = "amqp://guest:guest@rabbitmq:5672//"


@pytest.mark.parametrize(
    ("broker", "backend", "refusal"),
    [
        (RABBITMQ, None, "must be set with a RabbitMQ broker"),
        (RABBITMQ, "", "must be set with a RabbitMQ broker"),
        (RABBITMQ, "rpc://", "rpc:// cannot keep results"),
        (RABBITMQ, "amqp://guest:guest@rabbitmq:5672//", "amqp:// cannot keep results"),
        ("redis://redis:6379/0", "rpc://", "rpc:// cannot keep results"),
    ],
    ids=["amqp-without-backend", "amqp-empty-backend", "amqp-rpc", "amqp-amqp", "redis-rpc"],
)
def test_a_result_backend_no_other_process_can_read_is_refused(
    broker: str, backend: str | None, refusal: str
) -> None:
    for settings in (BrokerSettings, Settings):
        with pytest.raises(ValidationError, match=refusal) as caught:
            settings(broker_url=broker, result_backend=backend)
        assert [e["loc"] for e in caught.value.errors()] == [("result_backend",)]


@pytest.mark.parametrize(
    ("broker", "backend", "used"),
    [
        ("redis://redis:6379/0", None, "redis://redis:6379/0"),
        (RABBITMQ, "redis://redis:6379/1", "redis://redis:6379/1"),
        ("pyamqp://rabbitmq//", "db+postgresql://pg/results", "db+postgresql://pg/results"),
    ],
    ids=["redis-default", "amqp-redis", "pyamqp-database"],
)
def test_the_result_backend_is_the_redis_broker_or_the_one_given(
    broker: str, backend: str | None, used: str
) -> None:
    assert BrokerSettings(broker_url=broker, result_backend=backend).backend() == used


@pytest.mark.parametrize(
    ("broker", "transport_options"),
    [
        (
            "redis://redis:6379/0",
            {"visibility_timeout": 60.0, "unacked_restore_interval": 10.0,
             "unacked_restore_throttle": 1},
        ),
        (RABBITMQ, {"confirm_publish": True}),
    ],
    ids=["redis", "amqp"],
)  # fmt: skip
def test_each_broker_gets_its_own_transport_options(
    broker: str, transport_options: dict[str, object]
) -> None:
    settings = BrokerSettings(broker_url=broker, result_backend="redis://redis:6379/1")
    app = make_celery(settings)
    assert app.conf.broker_transport_options == transport_options
    assert app.conf.broker_heartbeat == 60


@pytest.mark.parametrize(
    ("broker", "redelivery_secs"),
    [("redis://redis:6379/0", 70.0), (RABBITMQ, 120.0)],
    ids=["redis-visibility-timeout", "amqp-two-heartbeats"],
)
def test_redelivery_of_a_dead_consumers_message_is_bounded_per_broker(
    broker: str, redelivery_secs: float
) -> None:
    settings = Settings(broker_url=broker, result_backend="redis://redis:6379/1")
    assert settings.redelivery_secs == redelivery_secs


def test_a_rabbitmq_heartbeat_too_long_for_the_drain_expiry_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"2 \* DRAIN_BROKER_HEARTBEAT_SECS \(300 s\)"):
        Settings(broker_url=RABBITMQ, result_backend="redis://r/1", broker_heartbeat_secs=150)


def test_the_heartbeat_gap_is_the_interval_noticed_at_the_next_poll() -> None:
    assert (
        BrokerSettings(heartbeat_interval_secs=15, heartbeat_poll_secs=1).heartbeat_gap_secs == 16
    )
    assert Settings(heartbeat_interval_secs=2, heartbeat_poll_secs=0.2).heartbeat_gap_secs == 2.2


def test_both_halves_build_their_celery_app_from_the_contract() -> None:
    keys = [
        "task_serializer", "result_serializer", "accept_content", "task_acks_late",
        "task_reject_on_worker_lost", "worker_prefetch_multiplier", "worker_send_task_events",
        "task_default_queue", "task_routes", "broker_transport_options",
    ]  # fmt: skip
    daemon_side = {key: consumer.app.conf[key] for key in keys}
    orchestrator_side = {key: orchestrator_app.conf[key] for key in keys}
    assert daemon_side == orchestrator_side
    assert daemon_side["accept_content"] == ["json"] and daemon_side["task_acks_late"] is True


# ----------------------------------------------------------------- import rules


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_worker_agent_module_imports_orchestrator() -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(
            name for name in _imported_modules(path) if name.split(".")[0] == "orchestrator"
        )
        for path in sorted((REPO / "worker_agent").rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_daemon_side_consumer_loads_without_orchestrator() -> None:
    probe = (
        "import sys, worker_agent.consumer, worker_agent.server\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'orchestrator'))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert loaded.stdout.strip() == "[]"
