"""Drain and resume with real daemons and real worker processes.

Every scenario ends by reading the files on disk: the resume reference, session.json
and the transcript must agree on the number of completed turns, and a resumed
conversation must carry the old one as an exact prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import DaemonProcess, wait_until
from worker_agent import layout
from worker_agent.children import descendants
from worker_agent.client import ControlError
from worker_agent.proto import AgentStatus, ResumeRef
from worker_agent.session import count_completed_turns, load_session
from worker_agent.store import lock_is_held

LONG_SCRIPT = "turns=100000,turn_ms=100"


def transcript(session_dir: Path) -> list[dict[str, Any]]:
    lines = layout.transcript_file(session_dir).read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_ref_matches_disk(store: Path, ref: ResumeRef) -> None:
    directory = store / ref.session_dir
    raw = layout.session_file(directory).read_bytes()
    session = load_session(directory)
    assert ref.turns == session.turns == count_completed_turns(directory), ref
    assert ref.session_sha256 == hashlib.sha256(raw).hexdigest()
    completed = [e["turn"] for e in transcript(directory) if e["type"] == "turn_complete"]
    assert completed == list(range(1, session.turns + 1)), f"{ref.id}: {completed}"


@pytest.mark.slow
def test_drain_100_agents_mid_turn_loses_nothing_and_resume_continues(
    daemon: DaemonProcess,
) -> None:
    ids = daemon.spawn_working(100, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client:
        refs = client.drain(grace_secs=30)
    assert sorted(r.id for r in refs) == sorted(ids)
    before: dict[str, list[dict[str, Any]]] = {}
    for ref in refs:
        assert ref.clean, ref
        assert ref.exit == 0
        assert_ref_matches_disk(daemon.store, ref)
        before[ref.id] = load_session(daemon.store / ref.session_dir).messages
    assert all(r.status is AgentStatus.DRAINED for r in daemon.records().values())

    with daemon.client() as client:
        for ref in refs:
            assert client.resume(ref.session_dir).id == ref.id
    turns_at_drain = {r.id: r.turns for r in refs}
    wait_until(
        lambda: all(r.turns > turns_at_drain[r.id] for r in daemon.records().values()),
        120,
        "every resumed agent to complete a new turn",
    )
    with daemon.client() as client:
        again = client.drain(grace_secs=30)
    for ref in again:
        assert ref.clean, ref
        assert_ref_matches_disk(daemon.store, ref)
        messages = load_session(daemon.store / ref.session_dir).messages
        old = before[ref.id]
        assert messages[: len(old)] == old, f"{ref.id}: old conversation is not a prefix"
        assert messages[len(old)]["turn"] == turns_at_drain[ref.id] + 1
        resumed = [e for e in transcript(daemon.store / ref.session_dir) if e["type"] == "resumed"]
        assert resumed == [{**resumed[0], "from_turn": turns_at_drain[ref.id] + 1}]


def test_second_drain_answers_the_same_refs(daemon: DaemonProcess) -> None:
    daemon.spawn_working(3, "turns=100000,turn_ms=20", min_turns=2)
    with daemon.client() as client:
        first = client.drain(grace_secs=10)
        second = client.drain(grace_secs=10)
    assert first == second
    assert all(r.clean for r in first)


def test_agent_ignoring_sigterm_is_killed_after_grace_and_still_resumable(
    daemon: DaemonProcess,
) -> None:
    """Tried: a worker that ignores SIGTERM; drain must SIGKILL it after the grace."""
    [stubborn] = daemon.spawn_working(1, "turns=100000,turn_ms=30,sigterm=ignore", 2)
    [polite] = daemon.spawn_working(1, "turns=100000,turn_ms=30", 2)
    with daemon.client() as client:
        refs = {r.id: r for r in client.drain(grace_secs=1.0)}
    assert refs[stubborn].clean is False
    assert refs[stubborn].exit == -signal.SIGKILL
    assert refs[polite].clean is True
    # Its last completed turn is on disk, intact and resumable.
    session = load_session(daemon.store / refs[stubborn].session_dir)
    assert session.turns == refs[stubborn].turns >= 2
    with daemon.client() as client:
        client.resume(refs[stubborn].session_dir)
    wait_until(
        lambda: daemon.records()[stubborn].turns > session.turns, 30, "the resumed agent to work"
    )
    with daemon.client() as client:
        client.call("kill", id=stubborn)
    messages = load_session(daemon.store / refs[stubborn].session_dir).messages
    assert messages[: len(session.messages)] == session.messages


def test_corrupt_session_json_is_reported_unclean_and_refused_on_resume(
    daemon: DaemonProcess,
) -> None:
    """Tried: session.json truncated mid-document, then a JSON array, then a wrong version."""
    victim, bystander = daemon.spawn_working(2, "turns=100000,turn_ms=20", 2)
    with daemon.client() as client:
        refs = {r.id: r for r in client.drain(grace_secs=10)}
    path = layout.session_file(daemon.store / refs[victim].session_dir)
    good = path.read_bytes()
    for corrupt, complaint in [
        (good[: len(good) // 2], "not valid JSON"),
        (b"[1, 2, 3]", "must hold a JSON object"),
        (good.replace(b'"version":1', b'"version":7'), "version 7"),
    ]:
        path.write_bytes(corrupt)
        with daemon.client() as client:
            ref = {r.id: r for r in client.drain(grace_secs=10)}[victim]
            assert ref.clean is False
            assert ref.error is not None and complaint in ref.error
            with pytest.raises(ControlError) as refused:
                client.resume(refs[victim].session_dir)
        assert refused.value.body.kind == "invalid_state"
        assert complaint in refused.value.body.message
        assert path.read_bytes() == corrupt, "a refused resume must not touch the file"
    with daemon.client() as client:
        client.resume(refs[bystander].session_dir)
    wait_until(
        lambda: daemon.records()[bystander].turns > refs[bystander].turns,
        30,
        "the healthy agent to carry on",
    )


def test_daemon_sigkill_leaves_crashed_agents_that_resume_without_loss(
    daemon: DaemonProcess,
) -> None:
    ids = daemon.spawn_working(5, "turns=100000,turn_ms=50", 2)
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    dirs = [layout.agent_dir(daemon.store, i) for i in ids]
    # Orphaned workers get SIGTERM from the kernel (parent-death signal), flush and exit.
    wait_until(lambda: not any(lock_is_held(d) for d in dirs), 30, "orphans to let go")
    saved = {d.name: load_session(d) for d in dirs}
    for directory in dirs:
        assert count_completed_turns(directory) == saved[directory.name].turns

    daemon.start()
    records = daemon.records()
    assert {records[i].status for i in ids} == {AgentStatus.CRASHED}
    with daemon.client() as client:
        for i in ids:
            client.resume(f"agents/{i}")
    wait_until(
        lambda: all(r.turns > saved[r.id].turns for r in daemon.records().values()),
        60,
        "resumed agents to do new turns",
    )
    with daemon.client() as client:
        refs = client.drain(grace_secs=10)
    for ref in refs:
        assert ref.clean
        assert_ref_matches_disk(daemon.store, ref)
        messages = load_session(daemon.store / ref.session_dir).messages
        assert messages[: len(saved[ref.id].messages)] == saved[ref.id].messages


def test_sigterm_to_the_daemon_drains_its_agents_before_it_exits(
    daemon: DaemonProcess,
) -> None:
    ids = daemon.spawn_working(3, "turns=100000,turn_ms=50", 1)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    for agent_id in ids:
        directory = layout.agent_dir(daemon.store, agent_id)
        manifest = json.loads(layout.manifest_file(directory).read_text())
        assert manifest["status"] == "drained"
        assert manifest["exit"] == 0
        assert load_session(directory).turns == count_completed_turns(directory) >= 1


def test_spawn_with_resume_session_continues_the_conversation(daemon: DaemonProcess) -> None:
    [agent_id] = daemon.spawn_working(1, "turns=3,turn_ms=10", 3)
    with daemon.client() as client:
        wait_until(lambda: daemon.records()[agent_id].status is AgentStatus.IDLE, 30, "idle")
        [ref] = client.drain(grace_secs=5)
        spawned = client.spawn(
            provider="scripted", model="turns=6,turn_ms=10", resume_session=ref.session_dir
        )
    assert spawned.id == agent_id
    wait_until(lambda: daemon.records()[agent_id].turns == 6, 30, "turns 4 to 6")
    session = load_session(daemon.store / ref.session_dir)
    assert [m["turn"] for m in session.messages if m["role"] == "user"] == [1, 2, 3, 4, 5, 6]


def test_kill_respawn_and_rm(daemon: DaemonProcess) -> None:
    [agent_id] = daemon.spawn_working(1, "turns=100000,turn_ms=20", 2)
    with daemon.client() as client:
        killed = client.call("kill", id=agent_id)
        assert killed.kind == "killed"
        assert daemon.records()[agent_id].status is AgentStatus.KILLED
        turns = load_session(layout.agent_dir(daemon.store, agent_id)).turns
        client.call("respawn", id=agent_id)
        wait_until(lambda: daemon.records()[agent_id].turns > turns, 30, "respawned agent")
        with pytest.raises(ControlError) as live:
            client.call("rm", id=agent_id)
        assert live.value.body.kind == "invalid_state"
        client.call("rm", id=agent_id, force=True)
        assert agent_id not in daemon.records()
    assert not layout.agent_dir(daemon.store, agent_id).exists()


def test_missing_transcript_turns_are_recovered_on_resume(daemon: DaemonProcess) -> None:
    """Tried: a SIGKILL between the session.json write and its turn_complete line,
    simulated by cutting the transcript's last turn_complete."""
    [_agent_id] = daemon.spawn_working(1, "turns=4,turn_ms=10", 4)
    with daemon.client() as client:
        [ref] = client.drain(grace_secs=5)
    directory = daemon.store / ref.session_dir
    lines = layout.transcript_file(directory).read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if '"turn_complete"' in line)
    layout.transcript_file(directory).write_text("".join(lines[:last]))
    assert count_completed_turns(directory) == 3
    with daemon.client() as client:
        client.resume(ref.session_dir)
        wait_until(lambda: count_completed_turns(directory) == 4, 30, "the recovered line")
        [after] = client.drain(grace_secs=5)
    assert_ref_matches_disk(daemon.store, after)
    assert after.turns == 4


def test_workers_run_five_nice_levels_below_the_daemon(daemon: DaemonProcess) -> None:
    # So that a hundred busy agents cannot starve the daemon of the CPU a drain needs.
    [agent_id] = daemon.spawn(1, LONG_SCRIPT)

    def worker() -> psutil.Process | None:
        for pid in descendants(daemon.pid):
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if "worker_agent.worker" in process.cmdline() and agent_id in process.cmdline():
                    return process
        return None

    assert wait_until(worker).nice() == psutil.Process(daemon.pid).nice() + 5
