"""The reference worker run on its own, as a real process, against the worker contract."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support import DaemonProcess, wait_until
from worker_agent import layout
from worker_agent.proto import AgentStatus
from worker_agent.session import Session, count_completed_turns, load_session, save_session


def start_worker(
    session_dir: Path, *args: str, model: str = "turns=3,turn_ms=10"
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALIBAN_")}
    env |= {"CALIBAN_PROVIDER": "scripted", "CALIBAN_MODEL": model}
    return subprocess.Popen(
        [sys.executable, "-m", "worker_agent.worker", "--session-dir", str(session_dir),
         "--agent-id", session_dir.name, *args],
        stdout=layout.transcript_file(session_dir).open("ab"), stderr=subprocess.PIPE, env=env,
    )  # fmt: skip


def test_resume_refuses_a_corrupt_session_and_leaves_it_alone(tmp_path: Path) -> None:
    """Tried: --resume on a session.json cut in half."""
    directory = tmp_path / "a1"
    directory.mkdir()
    layout.session_file(directory).write_bytes(b'{"version": 1, "agent_id": "a1", "tu')
    worker = start_worker(directory, "--resume")
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 2
    assert b"cannot resume" in err and b"not valid JSON" in err
    assert layout.session_file(directory).read_bytes() == b'{"version": 1, "agent_id": "a1", "tu'


def test_fresh_start_refuses_to_overwrite_an_existing_conversation(tmp_path: Path) -> None:
    directory = tmp_path / "a1"
    directory.mkdir()
    save_session(directory, Session("a1", 4, [{"role": "user", "content": "x"}], {}, ""))
    before = layout.session_file(directory).read_bytes()
    worker = start_worker(directory)
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 2
    assert b"already holds a conversation" in err
    assert layout.session_file(directory).read_bytes() == before


def test_two_workers_never_share_a_session_dir(tmp_path: Path) -> None:
    directory = tmp_path / "a1"
    directory.mkdir()
    first = start_worker(directory, model="turns=100000,turn_ms=20")
    try:
        wait_until(lambda: count_completed_turns(directory) >= 1, 30, "the first worker")
        second = start_worker(directory, "--resume")
        _, err = second.communicate(timeout=30)
        assert second.returncode == 3
        assert b"held by another worker" in err
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
    assert load_session(directory).turns == count_completed_turns(directory)


def test_sigterm_mid_turn_flushes_and_exits_zero(tmp_path: Path) -> None:
    directory = tmp_path / "a1"
    directory.mkdir()
    worker = start_worker(directory, model="turns=100000,turn_ms=50")
    wait_until(lambda: count_completed_turns(directory) >= 2, 30, "two turns")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    events = [json.loads(x) for x in layout.transcript_file(directory).read_text().splitlines()]
    assert events[-1]["type"] == "stopped"
    assert events[-1]["turns"] == load_session(directory).turns == count_completed_turns(directory)


def test_unknown_provider_fails_the_agent_with_a_clear_reason(daemon: DaemonProcess) -> None:
    """Tried: spawn spec provider 'nope'."""
    with daemon.client() as client:
        agent_id = client.spawn(provider="nope").id
    records = daemon.wait_for_status([agent_id], {AgentStatus.FAILED})
    assert records[agent_id].exit == 4
    stderr = layout.stderr_file(layout.agent_dir(daemon.store, agent_id)).read_text()
    assert "unknown provider 'nope'" in stderr


def test_sigterm_during_start_up_still_exits_cleanly(tmp_path: Path) -> None:
    """Tried: SIGTERM a few milliseconds after the worker process starts."""
    directory = tmp_path / "a1"
    directory.mkdir()
    worker = start_worker(directory, model="turns=100000,turn_ms=50")
    wait_until(lambda: layout.lock_file(directory).exists(), 30, "the worker to take its lock")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert load_session(directory).turns == count_completed_turns(directory)
