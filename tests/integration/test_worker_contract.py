"""The reference worker run on its own, as a real process, against the worker contract."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert [e["type"] for e in events].count("RunEnd") == 1
    assert (events[-1]["type"], events[-1]["stopped_for"]) == ("RunEnd", "Cancelled")
    assert events[-1]["caliban_drain"]["stop"] == "drain"
    session = load_session(directory)
    assert events[-1]["caliban_drain"]["turns"] == session.turns == count_completed_turns(directory)
    assert events[-1]["final_messages"] == session.messages


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


def test_a_scripted_worker_told_then_exit_saves_its_turns_and_exits_zero_by_itself(
    tmp_path: Path,
) -> None:
    """Tried: ``then=exit`` after two turns; the same session resumed with ``then=exit``
    (nothing left to do: it exits at once) and with the default ``then=wait`` (it waits)."""
    directory = tmp_path / "a1"
    directory.mkdir()
    worker = start_worker(directory, model="turns=2,turn_ms=10,then=exit")
    assert worker.wait(30) == 0
    session = load_session(directory)
    assert session.turns == 2 == count_completed_turns(directory)
    events = [json.loads(x) for x in layout.transcript_file(directory).read_text().splitlines()]
    assert [e["type"] for e in events] == ["TurnStart", "AssistantTextDelta", "TurnEnd"] * 2 + [
        "RunEnd"
    ]
    assert (events[-1]["stopped_for"], events[-1]["turn_count"]) == ("EndOfTurn", 2)
    assert events[-1]["caliban_drain"]["stop"] == "finished"
    assert events[-1]["caliban_drain"]["turns"] == 2

    again = start_worker(directory, "--resume", model="turns=2,turn_ms=10,then=exit")
    assert again.wait(30) == 0
    assert load_session(directory).sha256 == session.sha256  # nothing re-run, nothing lost

    waiting = start_worker(directory, "--resume", model="turns=2,turn_ms=10")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(1.0)  # then=wait (the default): it waits for prompts
    finally:
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(30) == 0


def test_an_agent_whose_worker_finishes_by_itself_is_done(daemon: DaemonProcess) -> None:
    """Tried: two agents spawned with ``turns=2,turn_ms=10,then=exit``, then a drain of
    the daemon whose agents are all done: it answers clean refs of both at turn 2 and
    they stay ``done`` (a drain stops nothing that already stopped)."""
    ids = daemon.spawn(2, "turns=2,turn_ms=10,then=exit")
    records = daemon.wait_for_status(ids, {AgentStatus.DONE})
    assert {r.exit for r in records.values()} == {0}
    assert {r.turns for r in records.values()} == {2}
    with daemon.client() as client:
        refs = client.drain(5.0)
    assert sorted((r.id, r.turns, r.clean, r.exit) for r in refs) == sorted(
        (i, 2, True, 0) for i in ids
    )
    assert {r.status for r in daemon.records().values()} == {AgentStatus.DONE}


def test_a_turn_the_provider_cannot_answer_fails_the_agent_never_finishes_it(
    daemon: DaemonProcess,
) -> None:
    """Tried: an agent on the openai provider whose endpoint refuses connections
    (127.0.0.1 port 1). Exiting 0 would make it ``done`` — finished, never resumed, and a
    task whose agents are all done completes — so it must exit non-zero: ``failed``."""
    with daemon.client() as client:
        agent_id = client.spawn(
            provider="openai", model="m", initial_prompt="hello",
            env={"OPENAI_BASE_URL": "http://127.0.0.1:1/v1", "OPENAI_TIMEOUT_SECS": "5"},
        ).id  # fmt: skip
    records = daemon.wait_for_status([agent_id], {AgentStatus.FAILED, AgentStatus.DONE})
    assert records[agent_id].status is AgentStatus.FAILED
    assert records[agent_id].exit == 5
    directory = layout.agent_dir(daemon.store, agent_id)
    stderr = layout.stderr_file(directory).read_text()
    assert "turn 1 failed, stopping: chat completion at" in stderr
    events = [json.loads(x) for x in layout.transcript_file(directory).read_text().splitlines()]
    assert [e["type"] for e in events] == ["TurnStart", "RunEnd"]
    assert events[-1]["stopped_for"]["ProviderError"].startswith("chat completion at")
    assert events[-1]["caliban_drain"]["stop"] == "failed"
    assert load_session(directory).turns == 0  # the failed turn is re-run on resume


def agent_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker_agent.worker", "__agent-worker", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("manifest", "args", "says"),
    [
        pytest.param(None, ["--socket", "S", "--listen", "0.0.0.0:7101"],
                     "the reference worker serves a Unix socket only", id="listen"),
        pytest.param(None, [], "--socket is required", id="no-socket"),
        pytest.param(None, ["--socket", "S"], "cannot read --manifest", id="no-manifest-file"),
        pytest.param("not json", ["--socket", "S"], "is not JSON", id="not-json"),
        pytest.param('{"id": "a1"}', ["--socket", "S"], "is not an agent record", id="no-spec"),
        pytest.param('{"id": "a1", "spec": {"provider": 7}}', ["--socket", "S"],
                     "spec.provider must be a string or null", id="provider-int"),
    ],
)  # fmt: skip
def test_bad_agent_worker_arguments_exit_4_in_one_line(
    tmp_path: Path, manifest: str | None, args: list[str], says: str
) -> None:
    """Tried: upstream's network-mode ``--listen``, no ``--socket``, and manifests that are
    missing, not JSON, not a record, or mistyped. Nothing is written."""
    path = tmp_path / "agents" / "a1" / "manifest.json"
    path.parent.mkdir(parents=True)
    if manifest is not None:
        path.write_text(manifest)
    done = agent_worker(
        "--manifest", str(path), *[a.replace("S", str(tmp_path / "s")) for a in args]
    )
    assert done.returncode == 4, done
    assert says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in path.parent.iterdir()) == (["manifest.json"] if manifest else [])


def test_the_daemon_starts_workers_with_upstreams_arguments_and_a_manifest_they_read(
    tmp_short: Path,
) -> None:
    """The worker's command line is upstream's ``__agent-worker --manifest --socket
    --control-socket``; the manifest has upstream's AgentRecord fields."""
    import psutil

    daemon = DaemonProcess(tmp_short).start()
    try:
        [agent_id] = daemon.spawn(1, "turns=100000,turn_ms=50")
        directory = daemon.records()[agent_id].session_dir

        def argv() -> list[str] | None:
            for child in psutil.Process(daemon.pid).children(recursive=True):
                words = child.cmdline()
                if "__agent-worker" in words:
                    return words
            return None

        words = wait_until(argv, 30, "the worker to start")
        assert words[words.index("__agent-worker") + 1 :] == [
            "--manifest", f"{directory}/manifest.json", "--socket", f"{directory}/agent.sock",
            "--control-socket", str(daemon.socket),
        ]  # fmt: skip
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
        for field in ("id", "name", "status", "started_at", "session_dir", "endpoint", "spec"):
            assert field in manifest, field
        assert manifest["endpoint"] == {"scheme": "unix", "path": f"{directory}/agent.sock"}
        assert manifest["spec"]["initial_prompt"] == ""
    finally:
        daemon.stop()


def test_a_spawn_without_a_prompt_takes_the_workers_default(tmp_short: Path) -> None:
    """A scale-up spawns with the task's prompt, which may be none: the client leaves the
    field out (upstream's ``initial_prompt`` is a string, never null)."""
    daemon = DaemonProcess(tmp_short).start()
    try:
        with daemon.client() as client:
            agent_id = client.spawn(provider="scripted", model="turns=2,turn_ms=5",
                                    initial_prompt=None).id  # fmt: skip
        daemon.wait_for_status([agent_id], {AgentStatus.IDLE}, 30)
        assert daemon.records()[agent_id].spec.initial_prompt == ""
    finally:
        daemon.stop()
