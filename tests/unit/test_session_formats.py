"""session.json is upstream caliban's ``PersistedSession`` and stdout.ndjson its ``TurnEvent``
records, as the samples in ``tests/fixtures/formats`` (written by upstream's own types)
show them: our worker writes that shape, our reader takes what upstream writes, and
anything else is refused in one line. The slow tests let upstream's compiled types read
what our worker wrote (skipped where there is no upstream checkout or cargo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker_agent import layout, transcript
from worker_agent.session import (
    DRAIN_KEY,
    ORIGIN_LEGACY,
    ORIGIN_OURS,
    ORIGIN_UPSTREAM,
    SessionError,
    check_transcript,
    count_completed_turns,
    decode_session,
    load_session,
    save_session,
    text_message,
)

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
UPSTREAM_SESSION = FORMATS / "session-upstream.json"
UPSTREAM_EMPTY = FORMATS / "session-upstream-empty.json"
UPSTREAM_EVENTS = FORMATS / "turn-events.ndjson"
OPTIONAL = frozenset({"cache_creation_input_tokens", "cache_read_input_tokens"})
"""``Usage`` fields upstream leaves out when they are None."""


def sample(path: Path) -> dict[str, Any]:
    loaded = json.loads(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def sample_events() -> dict[str, dict[str, Any]]:
    """The first record of each type in upstream's sample transcript."""
    found: dict[str, dict[str, Any]] = {}
    for line in UPSTREAM_EVENTS.read_text().splitlines():
        event = json.loads(line)
        found.setdefault(event["type"], event)
    return found


def run_worker(directory: Path, *args: str, model: str = "turns=3,turn_ms=5,then=exit") -> str:
    """The reference worker run to its end as the daemon runs it; its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALIBAN_")}
    env |= {"CALIBAN_PROVIDER": "scripted", "CALIBAN_MODEL": model}
    with layout.transcript_file(directory).open("ab") as out:
        done = subprocess.run(
            [sys.executable, "-m", "worker_agent.worker", "--session-dir", str(directory),
             "--agent-id", directory.name, *args],
            stdout=out, stderr=subprocess.PIPE, env=env, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr.decode()


@pytest.fixture(scope="module")
def worked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An agent dir after our worker ran three turns and finished."""
    directory = tmp_path_factory.mktemp("formats") / "agent-1"
    directory.mkdir()
    run_worker(directory)
    return directory


def kind(value: Any) -> str:
    return (
        "number"
        if isinstance(value, int | float) and not isinstance(value, bool)
        else (type(value).__name__)
    )


def assert_same_shape(ours: Any, theirs: Any, where: str) -> None:
    """Every key of ``theirs`` is in ``ours`` with a value of the same JSON type, down
    through objects and the first item of lists (``None`` matches anything optional)."""
    if theirs is None or ours is None:
        return
    assert kind(ours) == kind(theirs), f"{where}: {kind(ours)} where upstream has {kind(theirs)}"
    if isinstance(theirs, dict):
        for key, value in theirs.items():
            if key in OPTIONAL and key not in ours:
                continue
            assert key in ours, f"{where}: no {key!r}"
            assert_same_shape(ours[key], value, f"{where}.{key}")
    if isinstance(theirs, list) and theirs and ours:
        assert_same_shape(ours[0], theirs[0], f"{where}[0]")


# ------------------------------------------------------------------ what we write


def test_our_session_has_upstreams_keys_and_types_and_one_key_more(worked: Path) -> None:
    ours = json.loads(layout.session_file(worked).read_bytes())
    theirs = sample(UPSTREAM_SESSION)
    assert list(ours) == [*theirs, DRAIN_KEY]  # upstream's order, ours last
    assert_same_shape(ours, theirs, "session.json")
    assert ours[DRAIN_KEY] == {"version": 2, "agent_id": "agent-1", "turns": 3}
    assert (ours["name"], ours["provider"], ours["plan_mode"]) == ("agent-1", "scripted", False)
    assert [m["role"] for m in ours["messages"]] == ["user", "assistant"] * 3
    assert ours["messages"][0] == text_message("user", "scripted prompt 1")


def test_our_transcript_is_turn_events_shaped_as_upstreams(worked: Path) -> None:
    theirs = sample_events()
    events = list(transcript.events(layout.transcript_file(worked)))
    assert [e["type"] for e in events] == ["TurnStart", "AssistantTextDelta", "TurnEnd"] * 3 + [
        "RunEnd"
    ]
    for event in events:
        fields = {k: v for k, v in event.items() if k != transcript.KEY}
        assert list(fields) == list(theirs[event["type"]]), event["type"]
        assert_same_shape(fields, theirs[event["type"]], event["type"])
        assert isinstance(transcript.stamp(event), float)
    ends = [e for e in events if e["type"] == "TurnEnd"]
    session = load_session(worked)
    assert [e["turn_index"] for e in ends] == [0, 1, 2]
    assert [e["assistant_message"] for e in ends] == session.messages[1::2]
    assert transcript.ours(ends[-1])["session_sha256"] == session.sha256
    assert events[-1]["final_messages"] == session.messages


def test_a_resumed_worker_marks_its_first_record_and_counts_on(tmp_path: Path) -> None:
    directory = tmp_path / "agent-2"
    directory.mkdir()
    run_worker(directory, model="turns=2,turn_ms=5,then=exit")
    run_worker(directory, "--resume", model="turns=4,turn_ms=5,then=exit")
    events = list(transcript.events(layout.transcript_file(directory)))
    resumed = [(i, transcript.resumed_from(e)) for i, e in enumerate(events)]
    assert [(i, r) for i, r in resumed if r is not None] == [(7, 3)]  # after 2 turns + RunEnd
    assert [transcript.completed_turn(e) for e in events if e["type"] == "TurnEnd"] == [1, 2, 3, 4]
    assert load_session(directory).turns == 4 == count_completed_turns(directory)


# ------------------------------------------------------------------ what we read


def test_a_session_upstream_wrote_loads_with_its_turns_and_context_agent() -> None:
    raw = UPSTREAM_SESSION.read_bytes()
    session = decode_session(raw, source="session.json", agent_id="agent-9")
    assert (session.origin, session.agent_id, session.turns) == (ORIGIN_UPSTREAM, "agent-9", 2)
    assert session.messages == sample(UPSTREAM_SESSION)["messages"]
    assert decode_session(raw, source="session.json").agent_id is None
    empty = decode_session(UPSTREAM_EMPTY.read_bytes(), source="session.json")
    assert (empty.turns, empty.messages) == (0, [])


def test_a_session_upstream_wrote_is_rewritten_without_losing_a_field(tmp_path: Path) -> None:
    theirs = sample(UPSTREAM_SESSION)
    session = decode_session(UPSTREAM_SESSION.read_bytes(), source="s", agent_id="agent-9")
    save_session(tmp_path, session)
    ours = json.loads(layout.session_file(tmp_path).read_bytes())
    assert ours.pop(DRAIN_KEY) == {"version": 2, "agent_id": "agent-9", "turns": 2}
    assert ours.pop("updated_at") >= theirs.pop("updated_at")
    assert ours == theirs
    again = load_session(tmp_path)
    assert (again.origin, again.turns, again.messages) == (ORIGIN_OURS, 2, session.messages)


def test_a_version_1_session_of_an_earlier_build_is_read_and_rewritten_as_version_2(
    tmp_path: Path,
) -> None:
    """Kind to an upgrade: an agent drained by an earlier build resumes under this one."""
    old = {"version": 1, "agent_id": "a1", "turns": 1, "model": "m", "messages": [
        {"role": "user", "content": "hi", "turn": 1},
        {"role": "assistant", "content": "hello", "turn": 1},
    ]}  # fmt: skip
    session = decode_session(json.dumps(old).encode(), source="session.json")
    assert (session.origin, session.agent_id, session.turns) == (ORIGIN_LEGACY, "a1", 1)
    assert session.messages == [text_message("user", "hi"), text_message("assistant", "hello")]
    save_session(tmp_path, session)
    rewritten = json.loads(layout.session_file(tmp_path).read_bytes())
    assert rewritten[DRAIN_KEY] == {"version": 2, "agent_id": "a1", "turns": 1}
    assert (rewritten["name"], rewritten["model"]) == ("a1", "m")
    assert "version" not in rewritten


def upstream_with(**changes: Any) -> bytes:
    doc = sample(UPSTREAM_SESSION)
    for key, value in changes.items():
        if value is ...:
            del doc[key]
        else:
            doc[key] = value
    return json.dumps(doc).encode()


def ours_with(**changes: Any) -> bytes:
    return upstream_with(caliban_drain={"version": 2, "agent_id": "a1", "turns": 2, **changes})


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        pytest.param(b"", "not valid JSON", id="empty"),
        pytest.param(UPSTREAM_SESSION.read_bytes()[:200], "not valid JSON", id="truncated"),
        pytest.param(b'"session"', "must hold a JSON object, not str", id="string"),
        pytest.param(b"{}", "neither 'name'", id="empty-object"),
        pytest.param(b"[" * 100_000, "not valid JSON|nests too deeply", id="deep"),
        pytest.param(upstream_with(name=...), "neither 'name'", id="no-name"),
        pytest.param(upstream_with(name=None), "no string 'name'", id="name-null"),
        pytest.param(upstream_with(model=7), "no string 'model'", id="model-number"),
        pytest.param(upstream_with(provider=None), "no string 'provider'", id="provider-null"),
        pytest.param(upstream_with(created_at="yesterday"), "RFC 3339 timestamp 'created_at'",
                     id="created-not-rfc3339"),
        pytest.param(upstream_with(updated_at="2026-07-04T12:00:00"),
                     "RFC 3339 timestamp 'updated_at'", id="updated-no-zone"),
        pytest.param(upstream_with(messages=...), "no 'messages' list", id="no-messages"),
        pytest.param(upstream_with(messages=[{"role": "robot", "content": []}]), "role 'robot'",
                     id="bad-role"),
        pytest.param(upstream_with(messages=[{"role": "user", "content": "hi"}]),
                     "no 'content' list", id="string-content"),
        pytest.param(upstream_with(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
                     "type 'audio'", id="unknown-block"),
        pytest.param(upstream_with(messages=[{"role": "user", "content": [{"type": "text"}]}]),
                     "text block without 'text'", id="text-block-without-text"),
        pytest.param(upstream_with(total_usage=...), "total_usage", id="no-usage"),
        pytest.param(upstream_with(total_usage={"input_tokens": -1, "output_tokens": 0}),
                     "total_usage", id="negative-usage"),
        pytest.param(upstream_with(total_usage={"input_tokens": 2**32, "output_tokens": 0}),
                     "total_usage", id="usage-past-u32"),
        pytest.param(upstream_with(todos=[{"id": "1", "content": "x", "status": "later"}]),
                     "'todos'", id="bad-todo-status"),
        pytest.param(upstream_with(plan_mode="yes"), "'plan_mode'", id="plan-mode-string"),
        pytest.param(upstream_with(caliban_drain=[1]), "'caliban_drain' that is not an object",
                     id="drain-key-not-object"),
        pytest.param(ours_with(version=3), "caliban_drain version 3", id="future-version"),
        pytest.param(ours_with(agent_id=""), "caliban_drain.agent_id", id="no-agent"),
        pytest.param(ours_with(turns=-1), "caliban_drain.turns", id="negative-turns"),
        pytest.param(ours_with(turns=True), "caliban_drain.turns", id="bool-turns"),
        pytest.param(b'{"version": 7, "agent_id": "a"}', "version 7", id="unknown-top-version"),
    ],
)  # fmt: skip
def test_what_is_not_a_session_is_refused_in_one_line(raw: bytes, complaint: str) -> None:
    with pytest.raises(SessionError, match=complaint) as refused:
        decode_session(raw, source="agents/a1/session.json")
    message = str(refused.value)
    assert message.startswith("agents/a1/session.json")
    assert "\n" not in message


# ------------------------------------------------------------------ turns in the transcript


def test_turns_are_counted_from_turn_end_records_and_an_earlier_builds_lines(
    tmp_path: Path,
) -> None:
    lines = UPSTREAM_EVENTS.read_text().splitlines()  # two TurnEnd records
    lines.append(json.dumps({"type": "turn_complete", "turn": 3}))
    delta = transcript.text_delta(4, 'a reply quoting "TurnEnd" and "turn_complete"')
    lines.append(transcript.encode(delta).decode().rstrip("\n"))
    lines.append(lines[3][:40])  # a TurnEnd torn by a crash mid-write
    layout.transcript_file(tmp_path).write_text("\n".join(lines))
    assert count_completed_turns(tmp_path) == 3


def write_transcript(directory: Path, turns: int) -> None:
    reply = text_message("assistant", "r")
    with layout.transcript_file(directory).open("wb") as out:
        for turn in range(1, turns + 1):
            out.write(transcript.encode(transcript.turn_end(turn, reply), turn=turn))


@pytest.mark.parametrize(
    ("origin_doc", "announced", "missing"),
    [
        pytest.param("ours", 2, 0, id="ours-all-announced"),
        pytest.param("ours", 1, 1, id="ours-one-unannounced"),
        pytest.param("ours", 0, None, id="ours-two-unannounced"),
        pytest.param("ours", 3, None, id="ours-announced-past-the-session"),
        pytest.param("upstream", 0, 2, id="upstream-without-transcript"),
        pytest.param("upstream", 2, 0, id="upstream-with-its-transcript"),
        pytest.param("upstream", 3, None, id="upstream-announced-past-the-session"),
    ],
)
def test_unannounced_turns_are_at_most_one_unless_upstream_wrote_the_session(
    tmp_path: Path, origin_doc: str, announced: int, missing: int | None
) -> None:
    raw = ours_with() if origin_doc == "ours" else UPSTREAM_SESSION.read_bytes()
    layout.session_file(tmp_path).write_bytes(raw)
    write_transcript(tmp_path, announced)
    session = load_session(tmp_path, agent_id="a1")
    assert session.turns == 2
    if missing is None:
        with pytest.raises(SessionError, match=f"records 2 completed turns but .* {announced}"):
            check_transcript(tmp_path, session)
    else:
        assert check_transcript(tmp_path, session) == missing


def test_a_worker_adopts_a_session_upstream_wrote_and_announces_its_turns(tmp_path: Path) -> None:
    directory = tmp_path / "agent-3"
    directory.mkdir()
    layout.session_file(directory).write_bytes(UPSTREAM_SESSION.read_bytes())
    run_worker(directory, "--resume", model="turns=3,turn_ms=5,then=exit")
    events = list(transcript.events(layout.transcript_file(directory)))
    recovered = [e for e in events if transcript.ours(e).get("recovered")]
    upstream_replies = sample(UPSTREAM_SESSION)["messages"][1::2]
    assert [e["assistant_message"] for e in recovered] == upstream_replies
    assert [transcript.ours(e) | {"ts": 0} for e in events[:3]] == [
        {"ts": 0, "turn": 1, "recovered": True},
        {"ts": 0, "turn": 2, "recovered": True},
        {"ts": 0, "resumed_from": 3, "adopted": True},
    ]
    assert {k: v for k, v in events[2].items() if k != transcript.KEY} == transcript.text_delta(
        3, ""
    )
    session = load_session(directory)
    assert (session.origin, session.agent_id, session.turns) == (ORIGIN_OURS, "agent-3", 3)
    assert session.messages[:4] == sample(UPSTREAM_SESSION)["messages"]
    assert session.extra["todos"] == sample(UPSTREAM_SESSION)["todos"]
    assert count_completed_turns(directory) == 3
