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
from worker_agent import transcript as events
from worker_agent.children import descendants
from worker_agent.client import ControlError
from worker_agent.proto import AgentStatus, ResumeRef
from worker_agent.session import count_completed_turns, load_session, message_text
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
    completed = [events.completed_turn(e) for e in transcript(directory)]
    completed = [turn for turn in completed if turn is not None]
    assert completed == list(range(1, session.turns + 1)), f"{ref.id}: {completed}"
    for end in (e for e in transcript(directory) if e["type"] == "TurnEnd"):
        if events.ours(end):  # not one upstream's worker wrote
            assert events.ours(end)["turn"] == end["turn_index"] + 1, end


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
        assert message_text(messages[len(old)]) == f"scripted prompt {turns_at_drain[ref.id] + 1}"
        resumed = [events.resumed_from(e) for e in transcript(daemon.store / ref.session_dir)]
        assert [r for r in resumed if r is not None] == [turns_at_drain[ref.id] + 1]


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
        (
            good.replace(b'"caliban_drain":{"version":2', b'"caliban_drain":{"version":7'),
            "version 7",
        ),
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
    assert [message_text(m) for m in session.messages if m["role"] == "user"] == [
        f"scripted prompt {turn}" for turn in range(1, 7)
    ]


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
    """Tried: a SIGKILL between the session.json write and its TurnEnd record,
    simulated by cutting the transcript's last TurnEnd (and the RunEnd after it)."""
    [_agent_id] = daemon.spawn_working(1, "turns=4,turn_ms=10", 4)
    with daemon.client() as client:
        [ref] = client.drain(grace_secs=5)
    directory = daemon.store / ref.session_dir
    lines = layout.transcript_file(directory).read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if line.startswith('{"type":"TurnEnd"'))
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
                argv = process.cmdline()
                if "worker_agent.worker" in argv and any(agent_id in word for word in argv):
                    return process
        return None

    assert wait_until(worker).nice() == psutil.Process(daemon.pid).nice() + 5


FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"


@pytest.mark.parametrize("with_transcript", [True, False], ids=["its-transcript", "no-transcript"])
def test_a_session_upstreams_types_wrote_resumes_through_the_daemon(
    daemon: DaemonProcess, with_transcript: bool
) -> None:
    """Tried: a drained agent's session.json replaced by one upstream caliban's
    ``PersistedSession`` wrote (two turns, a tool call, a todo; no ``caliban_drain``), its
    transcript by upstream's ``TurnEvent`` records of those turns or removed. The daemon
    resumes it, the worker adopts it as this agent's and continues at turn 3; the next
    drain answers a ref that matches the files, upstream's conversation an exact prefix."""
    [agent_id] = daemon.spawn_working(1, "turns=1,turn_ms=10", 1)
    with daemon.client() as client:
        daemon.wait_for_status([agent_id], {AgentStatus.IDLE})
        [ref] = client.drain(grace_secs=5)
    directory = daemon.store / ref.session_dir
    upstream = json.loads((FORMATS / "session-upstream.json").read_bytes())
    layout.session_file(directory).write_bytes((FORMATS / "session-upstream.json").read_bytes())
    if with_transcript:
        layout.transcript_file(directory).write_bytes((FORMATS / "turn-events.ndjson").read_bytes())
    else:
        layout.transcript_file(directory).unlink()
    with daemon.client() as client:
        assert client.resume(ref.session_dir, model="turns=3,turn_ms=10").id == agent_id
    wait_until(lambda: daemon.records()[agent_id].turns >= 3, 30, "turn 3 after upstream's two")
    with daemon.client() as client:
        [again] = client.drain(grace_secs=5)
    assert again.clean and again.turns == 3
    assert_ref_matches_disk(daemon.store, again)
    session = load_session(directory)
    assert (session.agent_id, session.origin) == (agent_id, "caliban-drain")
    assert session.messages[:4] == upstream["messages"]
    assert message_text(session.messages[4]) == "scripted prompt 3"
    assert session.extra["todos"] == upstream["todos"]
    resumes = [events.resumed_from(e) for e in transcript(directory)]
    assert [r for r in resumes if r is not None] == [3]
