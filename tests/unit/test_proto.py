"""The wire shapes of the control protocol, pinned: a caliban client reads these keys.

Changing a key here is a protocol change; these tests make it a deliberate one. That
upstream's own types read them is proved against its vectors (test_caliban_wire.py).
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


SOCK = proto.UnixEndpoint(path="/s/a1/agent.sock")
SOCK_WIRE = {"scheme": "unix", "path": "/s/a1/agent.sock"}


def record() -> AgentRecord:
    return AgentRecord(
        id="agent-0123456789ab",
        name="agent-agent-0123456789ab",
        status=AgentStatus.RUNNING,
        started_at="1970-01-01T00:00:01.500000+00:00",
        spec=SpawnSpec(model="turns=2,turn_ms=5", env={"A": "1"}),
        session_dir="/store/agents/agent-0123456789ab",
        endpoint=proto.UnixEndpoint(path="/store/agents/agent-0123456789ab/agent.sock"),
        working_dir="/store/agents/agent-0123456789ab",
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
        "error": {"kind": "not_found", "message": "no agent 'x'", "id": "x", "op": None,
                  "status": None},
    }  # fmt: skip
    # A malformed request is answered as caliband answers one: internal, "bad request: …".
    anonymous = ProtocolError(ErrorKind.BAD_REQUEST, "request is not valid JSON").reply()
    assert wire(anonymous)["error"]["kind"] == "internal"
    assert wire(anonymous)["error"]["message"] == "bad request: request is not valid JSON"


def test_invalid_state_goes_on_the_wire_only_with_agent_op_and_status() -> None:
    """Upstream's invalid_state requires op, id and status; a daemon-wide refusal has no
    agent, so it is internal with the same message (and still reads as stopping)."""
    named = ProtocolError(
        ErrorKind.INVALID_STATE, "agent a1 is done", "a1", op="kill", status=AgentStatus.DONE
    ).reply()
    assert wire(named)["error"] == {
        "kind": "invalid_state", "message": "agent a1 is done", "id": "a1", "op": "kill",
        "status": "done",
    }  # fmt: skip
    stopping = ProtocolError(ErrorKind.INVALID_STATE, f"cannot spawn: {proto.DAEMON_STOPPING}")
    body = stopping.reply().error
    assert body.kind == "internal"
    assert proto.says_daemon_stopping(body.kind, body.message)


def test_error_kinds_on_the_wire_are_upstreams_three() -> None:
    assert set(proto.WIRE_ERROR_KINDS) == {"not_found", "invalid_state", "internal"}
    for kind in ErrorKind:
        body = ProtocolError(kind, "m", "a1", op="kill", status=AgentStatus.DONE).reply().error
        assert body.kind in proto.WIRE_ERROR_KINDS


def test_agent_record_keys() -> None:
    doc = wire(record())
    assert set(doc) == {
        "id",
        "name",
        "status",
        "started_at",
        "spec",
        "session_dir",
        "endpoint",
        "working_dir",
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
        "label": None,
        "frontmatter_path": None,
        "initial_prompt": "",
        "model": "turns=2,turn_ms=5",
        "provider": None,
        "tool_allowlist": None,
        "isolation_worktree": False,
        "inherit_hooks": True,
        "interactive": False,
        "inherited_hooks_config": None,
        "source": None,
        "cwd": None,
        "env": {"A": "1"},
        "resume_session": None,
    }
    assert doc["endpoint"] == {
        "scheme": "unix",
        "path": "/store/agents/agent-0123456789ab/agent.sock",
    }
    # The record never carries a pid: a restarted daemon must not signal a stale one.
    assert "pid" not in json.dumps(doc)
    assert AgentRecord.model_validate_json(json.dumps(doc)) == record()


REPLIES: list[Any] = [
    pytest.param(proto.Listed(agents=[]), {"kind": "listed", "agents": []}, id="listed"),
    pytest.param(
        proto.Spawned(id="a1", endpoint=SOCK),
        {"kind": "spawned", "id": "a1", "endpoint": SOCK_WIRE},
        id="spawned",
    ),
    pytest.param(
        proto.AttachAck(endpoint=proto.TcpEndpoint(addr="127.0.0.1:7101")),
        {"kind": "attach_ack", "endpoint": {"scheme": "tcp", "addr": "127.0.0.1:7101"}},
        id="attach_ack_tcp",
    ),
    pytest.param(
        proto.Killed(id="a1", exit=-15), {"kind": "killed", "id": "a1", "exit": -15}, id="killed"
    ),
    pytest.param(proto.Respawned(id="a1"), {"kind": "respawned", "id": "a1"}, id="respawned"),
    pytest.param(proto.Removed(id="a1"), {"kind": "removed", "id": "a1"}, id="removed"),
    pytest.param(
        proto.StatusReply(pid=42, agents=3, uptime_secs=125, endpoint=SOCK),
        {"kind": "status", "pid": 42, "agents": 3, "uptime_secs": 125, "endpoint": SOCK_WIRE},
        id="status",
    ),
    pytest.param(proto.ShutdownAck(), {"kind": "shutdown_ack"}, id="shutdown_ack"),
    pytest.param(proto.StatusReported(), {"kind": "status_reported"}, id="status_reported"),
    pytest.param(proto.Drained(agents=[]), {"kind": "drained", "agents": []}, id="drained_empty"),
    pytest.param(proto.Retired(agents=[]), {"kind": "retired", "agents": []}, id="retired_none"),
    pytest.param(
        proto.Resumed(id="a1", endpoint=SOCK),
        {"kind": "resumed", "id": "a1", "endpoint": SOCK_WIRE},
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
    pytest.param(
        {"kind": "drain", "grace": {"secs": 2, "nanos": 500_000_000}},
        proto.DrainRequest,
        id="drain",
    ),
    pytest.param(
        {"kind": "retire", "keep": 1, "grace": {"secs": 2, "nanos": 0}},
        proto.RetireRequest,
        id="retire",
    ),
    pytest.param({"kind": "resume", "session_dir": "agents/a1"}, proto.ResumeRequest, id="resume"),
]


def test_a_manifest_written_before_retirement_existed_reads_as_not_retired() -> None:
    doc = wire(record())
    del doc["retired"]
    assert proto.AgentRecord.model_validate_json(json.dumps(doc)).retired is False


@pytest.mark.parametrize(
    "request_",
    [{"kind": "retire", "keep": -1}, {"kind": "retire"}, {"kind": "retire", "keep": "1"},
     {"kind": "retire", "keep": 1, "grace": {"secs": -1, "nanos": 0}},
     {"kind": "retire", "keep": 1, "grace_secs": 5}],
    ids=["negative", "missing", "string", "negative-grace", "grace-secs-replaced"],
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
    assert drain.grace.seconds == 30.0
    rm = proto.parse_request(b'{"kind": "rm", "id": "a1"}')
    assert isinstance(rm, proto.RmRequest)
    assert rm.force is False


@pytest.mark.parametrize(
    ("grace", "why"),
    [({"secs": 3601, "nanos": 0}, "less than or equal to 3600"),
     ({"secs": 3600, "nanos": 1}, "at most 3600 seconds"),
     ({"secs": 1, "nanos": 1_000_000_000}, "less than 1000000000"),
     ({"secs": 1.5, "nanos": 0}, "valid integer"), (5, "valid dictionary")],
    ids=["over-max", "over-max-by-a-nano", "nanos-overflow", "float-secs", "bare-number"],
)  # fmt: skip
def test_a_bad_grace_is_refused_in_one_line(grace: object, why: str) -> None:
    """Tried: graces a serde Duration would not be, or past the daemon's maximum."""
    with pytest.raises(ProtocolError) as refused:
        proto.parse_request(json.dumps({"kind": "drain", "grace": grace}))
    assert refused.value.kind is ErrorKind.BAD_REQUEST
    assert why in refused.value.message and "\n" not in refused.value.message


def test_spawn_spec_ignores_unknown_fields() -> None:
    spec = SpawnSpec.model_validate(
        {"provider": "scripted", "model": "turns=1", "sandbox": {"image": "x"}, "gpus": 2}
    )
    assert spec == SpawnSpec(provider="scripted", model="turns=1")
    assert "sandbox" not in spec.model_dump()
    # ...also inside a spawn request.
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
        pytest.param({"label": 3.5}, "label", id="label_float"),
        pytest.param({"tool_allowlist": "Bash"}, "tool_allowlist", id="allowlist_string"),
        pytest.param({"inherit_hooks": "yes"}, "inherit_hooks", id="inherit_hooks_string"),
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
        pytest.param(b'{"kind": "kill", "id": 5}', id="mistyped_request_field"),
        pytest.param(
            b'{"kind": "drain", "grace": {"secs": "5", "nanos": 0}}',
            id="numeric_string_not_coerced",
        ),
        pytest.param(b'{"kind": "rm", "id": "a", "force": 1}', id="int_not_coerced_to_bool"),
    ],
)
def test_requests_are_strict(line: bytes) -> None:
    with pytest.raises(ProtocolError) as refused:
        proto.parse_request(line)
    assert refused.value.kind is ErrorKind.BAD_REQUEST
    assert refused.value.message.startswith("bad ")


def test_unknown_request_fields_are_ignored_as_serde_does() -> None:
    """Upstream's types ignore fields they do not know; so does the daemon, so a newer
    caliban client's request is served."""
    request = proto.parse_request(b'{"kind": "list", "extra": 1}')
    assert isinstance(request, proto.ListRequest)


def test_a_manifest_of_an_earlier_release_gets_upstreams_fields_derived() -> None:
    old = {"id": "a1", "status": "drained", "spec": {"provider": "scripted", "name": "x"},
           "session_dir": "/store/agents/a1", "created_at": 0.0, "updated_at": 1.0}  # fmt: skip
    loaded = AgentRecord.model_validate_json(json.dumps(old))
    assert loaded.name == "agent-a1"
    assert loaded.started_at == "1970-01-01T00:00:00+00:00"
    assert loaded.endpoint == proto.UnixEndpoint(path="/store/agents/a1/agent.sock")
    assert loaded.working_dir == "/store/agents/a1"


def test_a_caliband_record_gets_our_times_from_started_at() -> None:
    upstream = {"id": "a1", "name": "n", "status": "running",
                "started_at": "2026-12-06T17:32:58.123456789+00:00", "session_dir": "/s/a1",
                "endpoint": SOCK_WIRE, "spec": {"initial_prompt": "hi"}}  # fmt: skip
    loaded = AgentRecord.model_validate_json(json.dumps(upstream))
    assert loaded.created_at == pytest.approx(1796578378.123456)
    assert loaded.updated_at == loaded.created_at
    assert loaded.working_dir == ""


def test_upstream_errors_without_a_message_get_upstreams_display_text() -> None:
    not_found = proto.parse_reply('{"kind":"error","error":{"kind":"not_found","id":"a9"}}')
    assert isinstance(not_found, proto.ErrorReply)
    assert not_found.error.message == "agent not found: a9"
    invalid = proto.parse_reply(
        '{"kind":"error","error":{"kind":"invalid_state","op":"kill","id":"a9","status":"idle"}}'
    )
    assert isinstance(invalid, proto.ErrorReply)
    assert invalid.error.message == "invalid state for kill: agent a9 is Idle"


def test_duration_of_seconds_round_trips() -> None:
    assert proto.Duration.of(2.5) == proto.Duration(secs=2, nanos=500_000_000)
    assert proto.Duration.of(30).seconds == 30.0
