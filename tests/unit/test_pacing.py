"""When the operator looks at a task again (``operator.pacing``), and what wakes it
(``operator.events``: the stewards' mailboxes and the ledger feed, on a real SQLite
ledger)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from orchestrator.ledger import Ledger, OperationKind, OperationState, upgrade
from orchestrator.operator.events import Feed, WorkQueue, read_once
from orchestrator.operator.lifecycle import HEARTBEATS_MISSED_BEFORE_SILENT, idle_secs
from orchestrator.operator.lifecycle import IdleReport as Idle
from orchestrator.operator.pacing import (
    DUE_SLACK_SECS,
    Heartbeat,
    Requeue,
    RunningWatch,
    failure_backoff,
    idle_due,
    requeue_after,
    streak_resets_at,
)

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SIG = ("uid", 2, 2, 0, 0, True, None)
FOLLOW, RESYNC, INTERVAL, BRIDGE = 2.0, 300.0, 15.0, 16.0


def look(rest: Requeue | None, beat: Heartbeat | None, now: datetime = NOW) -> float:
    return requeue_after(now, rest, beat, follow_up_secs=FOLLOW, resync_secs=RESYNC,
                     heartbeat_interval_secs=INTERVAL, bridge_secs=BRIDGE)  # fmt: skip


def beat(
    ago: float = 0.0, idle_for: float | None = None, signature: tuple[object, ...] = SIG
) -> Heartbeat:
    return Heartbeat(NOW - timedelta(seconds=ago), idle_for, signature)


def running(idle_timeout: float | None = None, streak_at: datetime | None = None) -> Requeue:
    return Requeue(RunningWatch(SIG, idle_timeout, streak_at))


SILENCE = HEARTBEATS_MISSED_BEFORE_SILENT * INTERVAL


@pytest.mark.parametrize(
    ("rest", "heartbeat", "expected"),
    [
        # Something on its way: followed every interval, as the timer did.
        (None, beat(), FOLLOW),
        (None, None, FOLLOW),
        # Quiet (Suspended, Completed, Failed): only events, and the resync.
        (Requeue(), beat(), RESYNC),
        (Requeue(), None, RESYNC),
        # Running at rest: the silence deadline of the newest heartbeat.
        (running(), beat(0), SILENCE + DUE_SLACK_SECS),
        (running(), beat(10), SILENCE - 10 + DUE_SLACK_SECS),
        (running(), beat(SILENCE + 5), 0.0),
        # A heartbeat that says something else (an agent failed, all done): now.
        (running(), beat(0, signature=("uid", 2, 1, 1, 0, True, None)), 0.0),
        (running(), None, 0.0),
        # Idle: the moment the timeout is reached on this heartbeat, if within a bridge.
        (running(idle_timeout=30), beat(0, idle_for=20), 10 + DUE_SLACK_SECS),
        (running(idle_timeout=30), beat(4, idle_for=20), 6 + DUE_SLACK_SECS),
        (running(idle_timeout=30), beat(0, idle_for=35), DUE_SLACK_SECS),
        # Further than one bridge: a later heartbeat must bring it (silence meanwhile).
        (running(idle_timeout=300), beat(0, idle_for=20), SILENCE + DUE_SLACK_SECS),
        (running(idle_timeout=30), beat(0, idle_for=None), SILENCE + DUE_SLACK_SECS),
        # A heartbeat from before the phase began (a resume) sets no idle deadline.
        (
            Requeue(RunningWatch(SIG, 30, None, fresh_since=NOW)),
            beat(1, idle_for=29),
            SILENCE - 1 + DUE_SLACK_SECS,
        ),
        (
            Requeue(RunningWatch(SIG, 30, None, fresh_since=NOW - timedelta(seconds=2))),
            beat(1, idle_for=29),
            DUE_SLACK_SECS,
        ),
        # A recovery streak that ends before anything else.
        (running(streak_at=NOW + timedelta(seconds=7)), beat(0), 7 + DUE_SLACK_SECS),
    ],
)
def test_requeue_after(rest: Requeue | None, heartbeat: Heartbeat | None, expected: float) -> None:
    assert look(rest, heartbeat) == pytest.approx(expected)


def test_a_long_idle_timeout_or_silence_never_waits_past_the_resync() -> None:
    assert look(running(), beat(0)) <= RESYNC
    long_silence = requeue_after(NOW, running(), beat(0), follow_up_secs=FOLLOW, resync_secs=10,
                             heartbeat_interval_secs=INTERVAL, bridge_secs=BRIDGE)  # fmt: skip
    assert long_silence == 10


@pytest.mark.parametrize(
    ("idle_for", "timeout"), [(0.0, 10.0), (5.0, 10.0), (9.5, 10.0), (3.0, 19.0)]
)
def test_idle_due_is_when_the_idle_pause_decides(idle_for: float, timeout: float) -> None:
    """At the moment ``idle_due`` names, ``lifecycle.idle_secs`` (what the pause reads)
    reaches the timeout, and not a moment before."""
    b = beat(0, idle_for=idle_for)
    due = idle_due(b, timeout, BRIDGE)
    assert due is not None
    report = Idle(idle_for_secs=idle_for, received_at=b.received_at)
    assert idle_secs(report, due, BRIDGE) == pytest.approx(timeout)
    assert idle_secs(report, due - timedelta(seconds=0.5), BRIDGE) < timeout


def test_idle_due_is_none_beyond_one_bridge() -> None:
    assert idle_due(beat(0, idle_for=1.0), 1.0 + BRIDGE + 0.1, BRIDGE) is None


def test_a_streak_resets_only_when_there_is_one() -> None:
    assert streak_resets_at(0, NOW) is None
    assert streak_resets_at(2, None) is None
    assert streak_resets_at(2, NOW) is not None


# ----------------------------------------------------------------------- the feed


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    return Ledger.from_url(url)


def heartbeat(ledger: Ledger, name: str, seq: int, *, live: int = 1) -> None:
    now = datetime.now(UTC)
    ledger.record_activity(
        "default", name, task_uid=f"uid-{name}", all_idle_since=None, agents_total=1,
        agents_live=live, agents_idle=0, seq=seq, reported_at=now, idle_for_secs=None,
        received_at=now,
    )  # fmt: skip


def test_the_feed_wakes_only_the_stewards_of_what_changed(ledger: Ledger) -> None:
    async def scenario() -> None:
        stewards = WorkQueue()
        a, b = stewards.open(("default", "a")), stewards.open(("default", "b"))
        place = Feed.starting(datetime.now(UTC))
        assert await read_once(ledger, stewards, place) == 0
        assert not a.wake.is_set() and not b.wake.is_set()

        heartbeat(ledger, "a", 1)
        await read_once(ledger, stewards, place)
        assert a.wake.is_set() and a.beat is not None and not a.cause  # deadlines, no pass
        assert not b.wake.is_set() and b.beat is None
        a.wake.clear()
        await read_once(ledger, stewards, place)  # the same row, read again in the overlap
        assert not a.wake.is_set()

        op = ledger.begin_operation(
            OperationKind.PAUSE, task_uid="uid-b", namespace="default", name="b",
            idempotency_key="pause:b:1",
        )  # fmt: skip
        await read_once(ledger, stewards, place)
        assert b.cause == "ledger" and b.wake.is_set()
        b.cause = None
        b.wake.clear()
        await read_once(ledger, stewards, place)
        assert not b.cause  # seen already
        ledger.transition(op.id, OperationState.FAILED, error="no daemon")
        await read_once(ledger, stewards, place)
        assert b.cause == "ledger"  # it moved again
        assert not a.cause

        stewards.close(("default", "a"))
        heartbeat(ledger, "a", 2)
        await read_once(ledger, stewards, place)  # nobody looks after it: nothing to wake

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("failures", "secs"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (9, 256.0), (10, 300.0), (11, 300.0),
     (1000, 300.0)],
)  # fmt: skip
def test_a_failing_pass_backs_off_from_a_second_doubling_to_five_minutes(
    failures: int, secs: float
) -> None:
    assert failure_backoff(failures) == secs


@pytest.mark.parametrize(
    ("awaiting", "newest", "expected"),
    [
        (None, None, RESYNC),  # no heartbeat yet, none come: only the resync
        (None, beat(ago=1), 0.0),  # the first heartbeat: now
        (beat(ago=5), beat(ago=5), RESYNC),  # the one the pass read: nothing new
        (beat(ago=5), beat(ago=1), 0.0),  # a newer one: now
    ],
    ids=["none-yet", "the-first", "the-one-read", "a-newer-one"],
)
def test_a_task_waiting_for_its_daemon_is_looked_at_on_a_heartbeat_never_polled(
    awaiting: Heartbeat | None, newest: Heartbeat | None, expected: float
) -> None:
    waiting = Requeue(awaiting=awaiting, waiting=True)
    secs = requeue_after(
        NOW, waiting, newest, follow_up_secs=FOLLOW, resync_secs=RESYNC,
        heartbeat_interval_secs=INTERVAL, bridge_secs=BRIDGE,
    )  # fmt: skip
    assert secs == expected
