"""The wire shapes of the control protocol, pinned: a caliban client reads these keys.

Changing a key here is a protocol change; these tests make it a deliberate one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from worker_agent import proto
from worker_agent.proto import (
    AgentRecord,
    AgentStatus,
    ErrorKind,
    ProtocolError,
    ResumeRef,
    SpawnSpec,
)

SHA = "ab" * 32


def wire(message: BaseModel) -> dict[str, Any]:
    """What the daemon puts on the wire for ``message``: one line, one JSON object."""
    line = proto.encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    decoded: dict[str, Any] = json.loads(line)
    return decoded


def record() -> AgentRecord:
    return AgentRecord(
        id="agent-0123456789ab",
        status=AgentStatus.RUNNING,
        spec=SpawnSpec(model="turns=2,turn_ms=5", env={"A": "1"}),
        session_dir="/store/agents/agent-0123456789ab",
        created_at=1.5,
        updated_at=2.5,
        turns=1,
    )


def test_drained_with_a_resume_ref_has_exactly_the_ref_keys() -> None:
    ref = ResumeRef(
        id="agent-0123456789ab",
        session_dir="agents/agent-0123456789ab",
        turns=4,
        session_sha256=SHA,
        clean=True,
        exit=0,
    )
    assert wire(proto.Drained(agents=[ref])) == {
        "kind": "drained",
        "agents": [
            {
                "id": "agent-0123456789ab",
                "session_dir": "agents/agent-0123456789ab",
                "turns": 4,
                "session_sha256": SHA,
                "clean": True,
                "exit": 0,
                "error": None,
            }
        ],
    }


def test_unclean_resume_ref_keeps_the_same_keys() -> None:
    ref = ResumeRef(
        id="a1",
        session_dir="agents/a1",
        turns=0,
        session_sha256=None,
        clean=False,
        exit=None,
        error="session.json unreadable: No such file or directory",
    )
    (only,) = wire(proto.Drained(agents=[ref]))["agents"]
    assert set(only) == {"id", "session_dir", "turns", "session_sha256", "clean", "exit", "error"}
    assert only["session_sha256"] is None
    assert only["exit"] is None
    assert only["clean"] is False


def test_error_reply_shape() -> None:
    reply = ProtocolError(ErrorKind.NOT_FOUND, "no agent 'x'", "x").reply()
    assert wire(reply) == {
        "kind": "error",
        "error": {"kind": "not_found", "message": "no agent 'x'", "id": "x"},
    }
    anonymous = ProtocolError(ErrorKind.BAD_REQUEST, "request is not valid JSON").reply()
    assert wire(anonymous)["error"] == {
        "kind": "bad_request",
        "message": "request is not valid JSON",
        "id": None,
    }


def test_error_kinds_are_the_documented_five() -> None:
    assert {k.value for k in ErrorKind} == {
        "not_found",
        "invalid_state",
        "bad_request",
        "unauthorized",
        "internal",
    }


def test_agent_record_keys() -> None:
    doc = wire(record())
    assert set(doc) == {
        "id",
        "status",
        "spec",
        "session_dir",
        "created_at",
        "updated_at",
        "turns",
        "exit",
        "idle_since",
        "error",
        "retired",
    }
    assert doc["status"] == "running"
    assert doc["retired"] is False
    assert doc["spec"] == {
        "name": None,
        "initial_prompt": None,
        "provider": "scripted",
        "model": "turns=2,turn_ms=5",
        "cwd": None,
        "env": {"A": "1"},
        "resume_session": None,
    }
    # The record never carries a pid: a restarted daemon must not signal a stale one.
    assert "pid" not in json.dumps(doc)
    assert AgentRecord.model_validate_json(json.dumps(doc)) == record()


REPLIES: list[Any] = [
    pytest.param(proto.Listed(agents=[]), {"kind": "listed", "agents": []}, id="listed"),
    pytest.param(
        proto.Spawned(id="a1", endpoint="unix:/s/a1/agent.sock"),
        {"kind": "spawned", "id": "a1", "endpoint": "unix:/s/a1/agent.sock"},
        id="spawned",
    ),
    pytest.param(
        proto.AttachAck(endpoint="unix:/s/a1/agent.sock"),
        {"kind": "attach_ack", "endpoint": "unix:/s/a1/agent.sock"},
        id="attach_ack",
    ),
    pytest.param(
        proto.Killed(id="a1", exit=-15), {"kind": "killed", "id": "a1", "exit": -15}, id="killed"
    ),
    pytest.param(proto.Respawned(id="a1"), {"kind": "respawned", "id": "a1"}, id="respawned"),
    pytest.param(proto.Removed(id="a1"), {"kind": "removed", "id": "a1"}, id="removed"),
    pytest.param(
        proto.StatusReply(pid=42, agents=3, uptime_secs=1.25, endpoint="unix:/run/c.sock"),
        {
            "kind": "status",
            "pid": 42,
            "agents": 3,
            "uptime_secs": 1.25,
            "endpoint": "unix:/run/c.sock",
        },
        id="status",
    ),
    pytest.param(proto.ShutdownAck(), {"kind": "shutdown_ack"}, id="shutdown_ack"),
    pytest.param(proto.StatusReported(), {"kind": "status_reported"}, id="status_reported"),
    pytest.param(proto.Drained(agents=[]), {"kind": "drained", "agents": []}, id="drained_empty"),
    pytest.param(proto.Retired(agents=[]), {"kind": "retired", "agents": []}, id="retired_none"),
    pytest.param(
        proto.Resumed(id="a1", endpoint="unix:/s/a1/agent.sock"),
        {"kind": "resumed", "id": "a1", "endpoint": "unix:/s/a1/agent.sock"},
        id="resumed",
    ),
]


@pytest.mark.parametrize(("reply", "expected"), REPLIES)
def test_reply_shape_and_round_trip(reply: BaseModel, expected: dict[str, Any]) -> None:
    assert wire(reply) == expected
    assert proto.parse_reply(proto.encode(reply)) == reply


def test_listed_carries_full_records() -> None:
    doc = wire(proto.Listed(agents=[record()]))
    assert doc["agents"] == [wire(record())]
    assert proto.parse_reply(json.dumps(doc)) == proto.Listed(agents=[record()])


REQUESTS: list[Any] = [
    pytest.param({"kind": "list"}, proto.ListRequest, id="list"),
    pytest.param(
        {"kind": "spawn", "spec": {"provider": "scripted", "model": "turns=1", "env": {"K": "v"}}},
        proto.SpawnRequest,
        id="spawn",
    ),
    pytest.param({"kind": "attach", "id": "a1"}, proto.AttachRequest, id="attach"),
    pytest.param({"kind": "kill", "id": "a1"}, proto.KillRequest, id="kill"),
    pytest.param({"kind": "respawn", "id": "a1"}, proto.RespawnRequest, id="respawn"),
    pytest.param({"kind": "rm", "id": "a1", "force": True}, proto.RmRequest, id="rm"),
    pytest.param({"kind": "status"}, proto.StatusRequest, id="status"),
    pytest.param({"kind": "shutdown"}, proto.ShutdownRequest, id="shutdown"),
    pytest.param(
        {"kind": "report_status", "id": "a1", "status": "idle", "turns": 3},
        proto.ReportStatusRequest,
        id="report_status",
    ),
    pytest.param({"kind": "drain", "grace_secs": 2.5}, proto.DrainRequest, id="drain"),
    pytest.param(
        {"kind": "retire", "keep": 1, "grace_secs": 2.5}, proto.RetireRequest, id="retire"
    ),
    pytest.param(
        {"kind": "resume", "session_dir": "agents/a1", "token": "t" * 16},
        proto.ResumeRequest,
        id="resume_with_token",
    ),
]


def test_a_manifest_written_before_retirement_existed_reads_as_not_retired() -> None:
    doc = wire(record())
    del doc["retired"]
    assert proto.AgentRecord.model_validate_json(json.dumps(doc)).retired is False


@pytest.mark.parametrize(
    "request_",
    [{"kind": "retire", "keep": -1}, {"kind": "retire"}, {"kind": "retire", "keep": "1"},
     {"kind": "retire", "keep": 1, "grace_secs": -1}],
    ids=["negative", "missing", "string", "negative-grace"],
)  # fmt: skip
def test_a_malformed_retire_is_a_bad_request_in_one_line(request_: dict[str, Any]) -> None:
    with pytest.raises(proto.ProtocolError) as refused:
        proto.parse_request(json.dumps(request_))
    assert refused.value.kind is proto.ErrorKind.BAD_REQUEST
    assert "\n" not in refused.value.message and "retire" in refused.value.message


def test_every_request_kind_is_covered() -> None:
    covered = {p.values[0]["kind"] for p in REQUESTS}
    assert covered == set(proto.REQUEST_KINDS)


@pytest.mark.parametrize(("doc", "model"), REQUESTS)
def test_request_round_trip(doc: dict[str, Any], model: type[BaseModel]) -> None:
    request = proto.parse_request(json.dumps(doc).encode())
    assert type(request) is model
    assert request.model_dump(exclude_unset=True) == doc
    again = proto.parse_request(request.model_dump_json(exclude_unset=True))
    assert again == request


def test_request_defaults() -> None:
    drain = proto.parse_request(b'{"kind": "drain"}')
    assert isinstance(drain, proto.DrainRequest)
    assert drain.grace_secs == 30.0
    rm = proto.parse_request(b'{"kind": "rm", "id": "a1"}')
    assert isinstance(rm, proto.RmRequest)
    assert rm.force is False
    assert rm.token is None


def test_spawn_spec_ignores_unknown_fields() -> None:
    spec = SpawnSpec.model_validate(
        {"provider": "scripted", "model": "turns=1", "sandbox": {"image": "x"}, "gpus": 2}
    )
    assert spec == SpawnSpec(provider="scripted", model="turns=1")
    assert "sandbox" not in spec.model_dump()
    # ...also inside a spawn request, whose own fields stay strict.
    request = proto.parse_request(
        json.dumps({"kind": "spawn", "spec": {"model": "turns=1", "future_field": True}})
    )
    assert isinstance(request, proto.SpawnRequest)
    assert request.spec == SpawnSpec(model="turns=1")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param({"provider": 1}, "provider", id="provider_int"),
        pytest.param({"model": ["turns=1"]}, "model", id="model_list"),
        pytest.param({"name": 3.5}, "name", id="name_float"),
        pytest.param({"initial_prompt": False}, "initial_prompt", id="initial_prompt_bool"),
        pytest.param({"cwd": {"path": "/"}}, "cwd", id="cwd_object"),
        pytest.param({"env": {"A": 1}}, "env.A", id="env_value_int"),
        pytest.param({"env": "A=1"}, "env", id="env_string"),
        pytest.param({"resume_session": 7}, "resume_session", id="resume_session_int"),
    ],
)
def test_spawn_spec_rejects_mistyped_known_fields(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as invalid:
        SpawnSpec.model_validate(spec)
    assert field.split(".")[0] in {str(e["loc"][0]) for e in invalid.value.errors()}
    with pytest.raises(ProtocolError) as refused:
        proto.parse_request(json.dumps({"kind": "spawn", "spec": spec}))
    assert refused.value.kind is ErrorKind.BAD_REQUEST
    assert f"spec.{field}:" in refused.value.message


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b'{"kind": "list", "extra": 1}', id="unknown_request_field"),
        pytest.param(b'{"kind": "kill", "id": 5}', id="mistyped_request_field"),
        pytest.param(b'{"kind": "drain", "grace_secs": "5"}', id="numeric_string_not_coerced"),
        pytest.param(b'{"kind": "rm", "id": "a", "force": 1}', id="int_not_coerced_to_bool"),
    ],
)
def test_requests_are_strict(line: bytes) -> None:
    with pytest.raises(ProtocolError) as refused:
        proto.parse_request(line)
    assert refused.value.kind is ErrorKind.BAD_REQUEST
    assert refused.value.message.startswith("bad ")
