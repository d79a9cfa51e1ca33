"""Unit tests of the pieces that need no daemon: session files, the scripted provider's
configuration, and the worker command template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from worker_agent import layout
from worker_agent.process import LaunchError, render_command
from worker_agent.providers import ProviderError, ScriptedConfig, parse_scripted_model
from worker_agent.session import (
    Session,
    SessionError,
    atomic_write,
    count_completed_turns,
    decode_session,
    load_session,
    save_session,
    text_message,
)


def test_save_then_load_round_trips_and_hashes_the_bytes(tmp_path: Path) -> None:
    session = Session("a1", 2, [{"role": "user", "content": "hi"}], {"model": "m"}, "")
    sha = save_session(tmp_path, session)
    raw = layout.session_file(tmp_path).read_bytes()
    assert sha == hashlib.sha256(raw).hexdigest()
    loaded = load_session(tmp_path)
    assert (loaded.agent_id, loaded.turns, loaded.messages, loaded.origin) == (
        "a1", 2, [text_message("user", "hi")], "caliban-drain",
    )  # fmt: skip
    assert (loaded.extra["model"], loaded.extra["name"]) == ("m", "a1")
    assert loaded.sha256 == sha


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    for i in range(5):
        atomic_write(target, str(i).encode())
    assert target.read_text() == "4"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        pytest.param(b'{"version": 1, "agent_id": "a", "tu', "not valid JSON", id="truncated"),
        pytest.param(b"\xff\xfe", "not valid JSON", id="not-utf8"),
        pytest.param(b"[]", "must hold a JSON object", id="array"),
        pytest.param(b'{"agent_id": "a", "turns": 0, "messages": []}', "version", id="no-version"),
        pytest.param(b'{"version": 2, "agent_id": "a", "turns": 0, "messages": []}', "version 2",
                     id="future-version"),
        pytest.param(b'{"version": 1, "turns": 0, "messages": []}', "agent_id", id="no-agent-id"),
        pytest.param(b'{"version": 1, "agent_id": "a", "turns": -1, "messages": []}', "turns",
                     id="negative-turns"),
        pytest.param(b'{"version": 1, "agent_id": "a", "turns": true, "messages": []}', "turns",
                     id="bool-turns"),
        pytest.param(b'{"version": 1, "agent_id": "a", "turns": 0, "messages": {}}', "messages",
                     id="messages-not-list"),
        pytest.param(b'{"version": 1, "agent_id": "a", "turns": 0, "messages": [1]}', "messages",
                     id="message-not-object"),
    ],
)  # fmt: skip
def test_corrupt_session_documents_are_refused_with_the_reason(raw: bytes, complaint: str) -> None:
    with pytest.raises(SessionError, match=complaint):
        decode_session(raw, source=layout.SESSION_FILE)


def test_missing_session_file_says_no_turn_was_saved(tmp_path: Path) -> None:
    with pytest.raises(SessionError, match="never saved a turn"):
        load_session(tmp_path)


def test_transcript_count_of_an_earlier_build_skips_a_torn_last_line(tmp_path: Path) -> None:
    lines = [json.dumps({"type": "turn_complete", "turn": i}) for i in (1, 2)]
    layout.transcript_file(tmp_path).write_text("\n".join(lines) + '\n{"type": "turn_comp')
    assert count_completed_turns(tmp_path) == 2
    assert count_completed_turns(tmp_path / "missing") == 0


def test_scripted_model_defaults_and_keys() -> None:
    assert parse_scripted_model("") == ScriptedConfig()
    assert parse_scripted_model("turns=7") == ScriptedConfig(turns=7)
    assert parse_scripted_model(" turns=2 , turn_ms=5 ,sigterm=ignore") == ScriptedConfig(
        turns=2, turn_ms=5, ignore_sigterm=True
    )
    assert parse_scripted_model("turns=2,then=exit") == ScriptedConfig(turns=2, then_exit=True)
    assert parse_scripted_model("then=wait") == ScriptedConfig(then_exit=False)


@pytest.mark.parametrize(
    ("model", "complaint"),
    [
        ("turns", "not key=value"),
        ("turns=many", "not a whole number"),
        ("turn_ms=-5", "not a whole number"),
        ("colour=blue", "unknown key 'colour'"),
        ("sigterm=maybe", "ignore or honour"),
        ("then=stop", r"then='stop': use wait .* or exit"),
        ("then=", r"then='': use wait .* or exit"),
        ("when=exit", "unknown key 'when'; known: turns, turn_ms, sigterm, then"),
    ],
)
def test_bad_scripted_models_are_refused(model: str, complaint: str) -> None:
    with pytest.raises(ProviderError, match=complaint):
        parse_scripted_model(model)


def test_worker_command_template_fills_words_and_drops_empty_ones() -> None:
    argv = render_command(
        "{python} -m w --dir '{session_dir}' {resume}",
        {"python": "/py", "session_dir": "/s d", "resume": ""},
    )
    assert argv == ["/py", "-m", "w", "--dir", "/s d"]


@pytest.mark.parametrize(
    ("template", "complaint"),
    [("{nope} x", "unknown placeholder"), ("'unclosed", "cannot be split"), ("{resume}", "empty")],
)
def test_bad_worker_command_templates_are_refused(template: str, complaint: str) -> None:
    with pytest.raises(LaunchError, match=complaint):
        render_command(template, {"resume": ""})
