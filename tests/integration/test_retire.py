"""Scale-down at the daemon: ``retire`` with real daemons and real worker processes.

A retired agent is drained exactly as a drain drains it (its ref verified against the
files on disk), then it is no longer one of the task's agents: a later drain leaves it
out of the checkpoint, a restarted daemon keeps it retired, and only an explicit
``resume`` brings it back, continuing its conversation.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.test_drain_resume import LONG_SCRIPT, assert_ref_matches_disk
from tests.support import DaemonProcess, wait_until
from worker_agent import layout
from worker_agent.client import ControlError
from worker_agent.proto import AgentStatus
from worker_agent.session import load_session, message_text


def test_retire_keeps_the_oldest_and_drains_the_rest_into_verified_refs(
    daemon: DaemonProcess,
) -> None:
    ids = daemon.spawn_working(4, LONG_SCRIPT, min_turns=1)
    oldest_first = sorted(ids, key=lambda i: daemon.records()[i].created_at)

    with daemon.client() as client:
        refs = client.retire(keep=1, grace_secs=30)

    assert [r.id for r in refs] == oldest_first[1:]
    for ref in refs:
        assert ref.clean and ref.exit == 0, ref
        assert_ref_matches_disk(daemon.store, ref)
    records = daemon.records()
    assert records[oldest_first[0]].status.live and not records[oldest_first[0]].retired
    for agent_id in oldest_first[1:]:
        assert records[agent_id].retired
        assert records[agent_id].status is AgentStatus.DRAINED


def test_retiring_to_as_many_agents_as_there_are_retires_nothing(daemon: DaemonProcess) -> None:
    daemon.spawn_working(2, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client:
        assert client.retire(keep=2, grace_secs=5) == []
        assert client.retire(keep=5, grace_secs=5) == []
    assert all(r.status.live and not r.retired for r in daemon.records().values())


def test_a_retired_agent_is_left_out_of_later_drains_and_stays_retired_across_a_restart(
    daemon: DaemonProcess,
) -> None:
    ids = daemon.spawn_working(3, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client:
        retired = {r.id for r in client.retire(keep=2, grace_secs=30)}
        refs = client.drain(grace_secs=30)
    assert {r.id for r in refs} == set(ids) - retired

    daemon.signal(signal.SIGKILL)
    daemon.wait()
    daemon.start()
    records = daemon.records()
    assert all(records[i].retired and records[i].status is AgentStatus.DRAINED for i in retired)
    with daemon.client() as client:
        assert {r.id for r in client.drain(grace_secs=5)} == set(ids) - retired


def test_resume_brings_a_retired_agent_back_at_its_next_turn(daemon: DaemonProcess) -> None:
    daemon.spawn_working(2, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client:
        (ref,) = client.retire(keep=1, grace_secs=30)
        before = load_session(daemon.store / ref.session_dir).messages
        assert client.resume(ref.session_dir).id == ref.id
    wait_until(lambda: daemon.records()[ref.id].turns > ref.turns, 60, "the agent to work again")
    record = daemon.records()[ref.id]
    assert not record.retired and record.status.live
    with daemon.client() as client:
        again = {r.id: r for r in client.drain(grace_secs=30)}
    after = load_session(daemon.store / again[ref.id].session_dir).messages
    assert after[: len(before)] == before
    assert message_text(after[len(before)]) == f"scripted prompt {ref.turns + 1}"


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        ({"keep": -1}, "keep"),
        ({"keep": "all"}, "keep"),
        ({"keep": 1, "grace": {"secs": -3, "nanos": 0}}, "grace.secs"),
    ],
    ids=["negative-keep", "keep-not-a-number", "negative-grace"],
)
def test_a_malformed_retire_is_refused_in_one_line_and_retires_nothing(
    daemon: DaemonProcess, request_: dict[str, object], says: str
) -> None:
    """Tried: a negative count, a count that is a string, a negative grace."""
    daemon.spawn_working(2, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client, pytest.raises(ControlError) as refused:
        client.call("retire", **request_)
    assert refused.value.body.kind == "internal"  # upstream's kind for a malformed request
    assert refused.value.body.message.startswith("bad request: ")
    assert says in refused.value.body.message and "\n" not in refused.value.body.message
    assert all(r.status.live and not r.retired for r in daemon.records().values())


def test_an_agent_drained_before_it_saved_anything_is_left_out_and_retired(
    daemon: DaemonProcess,
) -> None:
    """Tried: an agent spawned and drained at once, its worker still starting (killed by
    SIGTERM before its handler is in place, so it never wrote session.json). It holds
    nothing: the drain's refs leave it out (it was in them, 0 turns, unclean, no sha,
    and its restore went PartlyResumed, then CrashLoop), it is retired so no recovery
    or heartbeat counts it, and the agent that worked is in the refs, clean."""
    [working] = daemon.spawn_working(1, LONG_SCRIPT, min_turns=1)
    with daemon.client() as client:
        fresh = client.spawn(provider="scripted", model=LONG_SCRIPT).id
        refs = client.drain(grace_secs=30)
    records = daemon.records()
    # The premise: the fresh agent's worker never saved a session.
    assert not layout.session_file(Path(records[fresh].session_dir)).exists()
    assert [r.id for r in refs] == [working]
    assert refs[0].clean
    assert records[fresh].retired and not records[working].retired
    with daemon.client() as client:  # and it stays out of every later drain
        assert [r.id for r in client.drain(grace_secs=5)] == [working]
