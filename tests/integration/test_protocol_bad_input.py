"""Malformed and ill-timed control messages, all sent over ONE connection to a real daemon.

Every bad line must get exactly one ``error`` reply upstream's ``SupervisorError``
parses (``internal`` with ``"bad request: …"`` for a malformed one, as caliband answers
it) whose message names the problem, and the same connection must go on serving
``status`` afterwards. The module ends by checking that none of it hurt the daemon: a
second, concurrent connection is served, the agents the refused requests named are
unchanged, and a new agent runs.

Ids of agents in a given state are not known when the parameters are built, so the
lines hold placeholders (``@DRAINED@``, ``@KILLED@``, ``@LIVE@``) filled in per test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import DaemonProcess, short_tmp, wait_until
from worker_agent.client import SupervisorClient
from worker_agent.proto import MAX_LINE_BYTES, AgentStatus

ONE_TURN = "turns=1,turn_ms=10"


@dataclass(frozen=True)
class Scene:
    daemon: DaemonProcess
    conn: SupervisorClient
    """The one connection every bad line goes over."""
    ids: dict[str, str]
    """``drained``, ``killed`` and ``live`` (idle) agent ids."""

    def fill(self, line: bytes) -> bytes:
        for name, agent_id in self.ids.items():
            line = line.replace(f"@{name.upper()}@".encode(), agent_id.encode())
        return line


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    with short_tmp() as root:
        daemon = DaemonProcess(root).start()
        try:
            with daemon.client(timeout=30) as setup:
                drained = setup.spawn(provider="scripted", model=ONE_TURN).id
                daemon.wait_for_status([drained], {AgentStatus.IDLE}, timeout=20)
                assert [r.id for r in setup.drain(grace_secs=5)] == [drained]
                killed = setup.spawn(provider="scripted", model=ONE_TURN).id
                setup.call("kill", id=killed)
                live = setup.spawn(provider="scripted", model=ONE_TURN).id
            daemon.wait_for_status([live], {AgentStatus.IDLE}, timeout=20)
            records = daemon.records()
            assert records[drained].status is AgentStatus.DRAINED
            assert records[killed].status is AgentStatus.KILLED
            with daemon.client(timeout=30) as conn:
                yield Scene(daemon, conn, {"drained": drained, "killed": killed, "live": live})
        finally:
            daemon.stop()


@dataclass(frozen=True)
class Bad:
    line: bytes
    kind: str
    says: tuple[str, ...]
    """Substrings the error message must hold (placeholders are filled in)."""
    agent: str | None = None
    """The placeholder name of the agent the error's ``id`` must name, if any."""


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


OVERSIZED = b'{"kind": "status", "pad": "' + b"x" * (MAX_LINE_BYTES + 100) + b'"}'

CASES = [
    pytest.param(
        Bad(b"hello daemon", "internal", ("not valid JSON", "Expecting value")),
        id="not_json-bare_words",
    ),
    pytest.param(
        Bad(b'{"kind": "list"', "internal", ("not valid JSON", "delimiter")),
        id="truncated_json-missing_closing_brace",
    ),
    pytest.param(
        Bad(b'["list"]', "internal", ("must be a JSON object", "got list")),
        id="json_array",
    ),
    pytest.param(
        Bad(b'"list"', "internal", ("must be a JSON object", "got str")),
        id="json_string",
    ),
    pytest.param(
        Bad(b"42", "internal", ("must be a JSON object", "got int")),
        id="json_number",
    ),
    pytest.param(
        Bad(b"null", "internal", ("must be a JSON object", "got NoneType")),
        id="json_null",
    ),
    pytest.param(
        Bad(_json({"id": "x"}), "internal", ("no string field 'kind'",)),
        id="object_without_kind",
    ),
    pytest.param(
        Bad(_json({"kind": 5}), "internal", ("no string field 'kind'",)),
        id="kind_is_int",
    ),
    pytest.param(
        Bad(_json({"kind": ["list"]}), "internal", ("no string field 'kind'",)),
        id="kind_is_array",
    ),
    pytest.param(
        Bad(
            _json({"kind": "frobnicate"}),
            "internal",
            ("unknown request kind 'frobnicate'", "expected one of", "drain", "resume"),
        ),
        id="unknown_kind_frobnicate",
    ),
    pytest.param(
        Bad(_json({"kind": "spawn"}), "internal", ("bad spawn request", "spec: Field required")),
        id="spawn_without_spec",
    ),
    pytest.param(
        Bad(
            _json({"kind": "spawn", "spec": "scripted"}),
            "internal",
            ("bad spawn request", "spec:", "valid dictionary"),
        ),
        id="spawn_spec_is_string",
    ),
    pytest.param(
        Bad(
            _json({"kind": "spawn", "spec": {"env": {"A": 1}}}),
            "internal",
            ("spec.env.A:", "valid string"),
        ),
        id="spawn_spec_env_value_is_int",
    ),
    pytest.param(
        Bad(
            _json({"kind": "spawn", "spec": {"env": ["A=1"]}}),
            "internal",
            ("spec.env:", "valid dictionary"),
        ),
        id="spawn_spec_env_is_list",
    ),
    pytest.param(
        Bad(
            _json({"kind": "spawn", "spec": {"provider": "scripted", "model": 3}}),
            "internal",
            ("spec.model:", "valid string"),
        ),
        id="spawn_spec_model_is_int",
    ),
    pytest.param(
        Bad(_json({"kind": "kill"}), "internal", ("bad kill request", "id: Field required")),
        id="kill_without_id",
    ),
    pytest.param(
        Bad(_json({"kind": "kill", "id": 7}), "internal", ("bad kill request", "id:", "string")),
        id="kill_id_is_int",
    ),
    pytest.param(
        Bad(_json({"kind": "kill", "id": "agent-nope"}), "not_found", ("no agent 'agent-nope'",)),
        id="kill_unknown_id",
    ),
    pytest.param(
        Bad(_json({"kind": "rm", "id": "agent-nope"}), "not_found", ("no agent 'agent-nope'",)),
        id="rm_unknown_id",
    ),
    pytest.param(
        Bad(_json({"kind": "attach", "id": "agent-nope"}), "not_found", ("no agent 'agent-nope'",)),
        id="attach_unknown_id",
    ),
    pytest.param(
        Bad(
            _json({"kind": "respawn", "id": "agent-nope"}), "not_found", ("no agent 'agent-nope'",)
        ),
        id="respawn_unknown_id",
    ),
    pytest.param(
        Bad(
            _json({"kind": "drain", "grace": {"secs": "5", "nanos": 0}}),
            "internal",
            ("bad drain request", "grace.secs:", "valid integer"),
        ),
        id="drain_grace_secs_is_string",
    ),
    pytest.param(
        Bad(
            _json({"kind": "drain", "grace": {"secs": -1, "nanos": 0}}),
            "internal",
            ("grace.secs:", "greater than or equal to 0"),
        ),
        id="drain_grace_negative",
    ),
    pytest.param(
        Bad(
            _json({"kind": "drain", "grace": {"secs": 3600, "nanos": 500_000_000}}),
            "internal",
            ("grace:", "at most 3600 seconds"),
        ),
        id="drain_grace_over_3600",
    ),
    pytest.param(
        Bad(b'{"kind": "drain", "grace": {"secs": NaN, "nanos": 0}}', "internal", ("grace.secs:",)),
        id="drain_grace_NaN",
    ),
    pytest.param(
        Bad(
            _json({"kind": "drain", "grace_secs": 5}),
            "internal",
            ("bad drain request", 'grace_secs is replaced by grace: {"secs": N, "nanos": 0}'),
        ),
        id="drain_grace_secs_of_an_earlier_release",
    ),
    pytest.param(
        Bad(
            _json({"kind": "report_status", "id": "@LIVE@", "status": "sleeping"}),
            "internal",
            ("bad report_status request", "'spawning', 'running', 'idle'"),
        ),
        id="report_status_status_sleeping",
    ),
    pytest.param(
        Bad(
            _json({"kind": "report_status", "id": "@LIVE@", "status": "sleeping"}),
            "internal",
            ("status: Input should be 'spawning'",),
        ),
        id="report_status_status_sleeping-message_names_field",
    ),
    pytest.param(
        Bad(
            _json({"kind": "report_status", "id": "@LIVE@", "status": "idle", "turns": -1}),
            "internal",
            ("turns:", "greater than or equal to 0"),
        ),
        id="report_status_negative_turns",
    ),
    pytest.param(
        Bad(
            _json({"kind": "report_status", "id": "agent-nope", "status": "idle"}),
            "not_found",
            ("no agent 'agent-nope'",),
        ),
        id="report_status_unknown_id",
    ),
    pytest.param(
        Bad(
            _json({"kind": "resume", "session_dir": ""}),
            "internal",
            ("bad resume request", "session_dir:", "at least 1 character"),
        ),
        id="resume_empty_session_dir",
    ),
    pytest.param(
        Bad(
            _json({"kind": "rm", "id": "agent-nope", "force": "yes"}),
            "internal",
            ("bad rm request", "force:", "valid boolean"),
        ),
        id="rm_force_is_string",
    ),
    pytest.param(
        Bad(b'{"kind": "list\xff\xfe"}', "internal", ("not valid JSON", "utf-8", "0xff")),
        id="invalid_utf8_bytes_in_string",
    ),
    pytest.param(
        Bad(OVERSIZED, "internal", (f"exceeds {MAX_LINE_BYTES} bytes", "skipped")),
        id="line_over_1MiB",
    ),
    pytest.param(
        Bad(
            _json({"kind": "attach", "id": "@DRAINED@"}),
            "invalid_state",
            ("@DRAINED@ is drained", "resume it before attaching"),
            agent="drained",
        ),
        id="attach_drained_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "kill", "id": "@DRAINED@"}),
            "invalid_state",
            ("@DRAINED@ is drained, not running",),
            agent="drained",
        ),
        id="kill_drained_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "attach", "id": "@KILLED@"}),
            "invalid_state",
            ("@KILLED@ is killed", "resume it before attaching"),
            agent="killed",
        ),
        id="attach_killed_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "kill", "id": "@KILLED@"}),
            "invalid_state",
            ("@KILLED@ is killed, not running",),
            agent="killed",
        ),
        id="kill_killed_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "rm", "id": "@LIVE@"}),
            "invalid_state",
            ("@LIVE@ is idle", "kill it first or pass force"),
            agent="live",
        ),
        id="rm_live_agent_without_force",
    ),
    pytest.param(
        Bad(
            _json({"kind": "resume", "session_dir": "agents/@LIVE@"}),
            "invalid_state",
            ("@LIVE@ is idle", "drain or kill it before resuming"),
            agent="live",
        ),
        id="resume_live_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "spawn", "spec": {"resume_session": "agents/@LIVE@"}}),
            "invalid_state",
            ("@LIVE@ is idle", "drain or kill it before resuming"),
            agent="live",
        ),
        id="spawn_resume_session_of_live_agent",
    ),
    pytest.param(
        Bad(
            _json({"kind": "respawn", "id": "@LIVE@"}),
            "invalid_state",
            ("@LIVE@ is idle",),
            agent="live",
        ),
        id="respawn_live_agent",
    ),
]


@pytest.mark.parametrize("bad", CASES)
def test_bad_line_gets_a_telling_error_and_the_connection_survives(scene: Scene, bad: Bad) -> None:
    reply = scene.conn.call_raw(scene.fill(bad.line))

    assert set(reply) == {"kind", "error"}, reply
    assert reply["kind"] == "error", reply
    error = reply["error"]
    # Upstream's SupervisorError shape (op and status with invalid_state), plus message.
    assert set(error) == {"kind", "message", "id", "op", "status"}, error
    assert error["kind"] == bad.kind, error
    if bad.kind == "invalid_state":
        assert error["op"] == json.loads(scene.fill(bad.line))["kind"], error
        assert error["status"] in {s.value for s in AgentStatus}, error
    if bad.kind == "internal":
        assert error["message"].startswith("bad request: "), error  # as caliband says it
    for fragment in bad.says:
        assert scene.fill(fragment.encode()).decode() in error["message"], error
    expected_id = scene.ids[bad.agent] if bad.agent else None
    if bad.kind == "not_found":
        expected_id = json.loads(bad.line)["id"]
    assert error["id"] == expected_id, error

    # The same connection answers the next, well-formed request.
    assert scene.conn.call_raw(b'{"kind": "status"}')["kind"] == "status"


def test_daemon_unharmed_after_bad_input(scene: Scene) -> None:
    daemon = scene.daemon
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, "the daemon exited"

    # A second connection is served while the first one is still open.
    with daemon.client(timeout=30) as second:
        records = {r.id: r for r in second.agents()}
        assert scene.conn.status().agents == len(records) == 3
        # Refused requests changed nothing: no bad drain drained, no rm removed, no
        # resume restarted.
        assert records[scene.ids["drained"]].status is AgentStatus.DRAINED
        assert records[scene.ids["killed"]].status is AgentStatus.KILLED
        assert records[scene.ids["live"]].status is AgentStatus.IDLE
        assert records[scene.ids["live"]].turns == 1

        # A real agent still spawns and runs its turns to completion.
        fresh = second.spawn(provider="scripted", model="turns=3,turn_ms=20").id

    def finished() -> bool:
        record = daemon.records()[fresh]
        assert record.status.live, record
        return record.status is AgentStatus.IDLE and record.turns == 3

    wait_until(finished, 20, f"agent {fresh} to complete 3 turns")
