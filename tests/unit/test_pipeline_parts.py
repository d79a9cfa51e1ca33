"""Pure parts of the pipeline: queue names, task refs, the activity summary, and the
daemon-side heartbeat's idle timing under injected clocks (the system clock is never
touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker_agent.consumer import ActivityCounts, ConsumerConfig, Heartbeat, IdleClock, summarize
from worker_agent.contract import TaskNameError, daemon_queue, parse_task_ref
from worker_agent.proto import AgentRecord, AgentStatus, SpawnSpec


def record(
    agent_id: str,
    status: AgentStatus,
    idle_since: float | None,
    updated: float,
    exit: int | None = None,
) -> AgentRecord:
    return AgentRecord.model_validate(dict(  # name, started_at, endpoint derived
        id=agent_id, status=status, spec=SpawnSpec(), session_dir=f"/s/{agent_id}",
        created_at=0.0, updated_at=updated, idle_since=idle_since, exit=exit,
    ))  # fmt: skip


def test_queue_names_are_per_namespace_and_name() -> None:
    assert daemon_queue("team-a", "task.v1") == "caliband.team-a.task.v1"
    assert daemon_queue("a", "b") != daemon_queue("b", "a")


@pytest.mark.parametrize(
    "ref",
    ["no-slash", "Team/x", "team/X", "team/-x", "a" * 64 + "/x", "team/", "/x", "te_am/x"],
)
def test_bad_task_refs_are_refused(ref: str) -> None:
    with pytest.raises(TaskNameError):
        parse_task_ref(ref)


def test_task_ref_parses() -> None:
    assert parse_task_ref("team-a/task-1") == ("team-a", "task-1")


def test_all_idle_since_is_the_last_agent_to_go_idle_or_finish() -> None:
    records = [
        record("a", AgentStatus.IDLE, 100.0, 100.0),
        record("b", AgentStatus.IDLE, 150.0, 150.0),
        record("c", AgentStatus.DONE, None, 120.0, exit=0),
    ]
    assert summarize(records) == ActivityCounts(
        agents_total=3, agents_live=2, agents_idle=2, all_idle_since=150.0, agents_done=1,
    )  # fmt: skip


def test_done_counts_only_agents_that_finished_by_themselves() -> None:
    records = [
        record("a", AgentStatus.DONE, None, 120.0, exit=0),
        record("b", AgentStatus.KILLED, None, 130.0, exit=-15),
        record("c", AgentStatus.FAILED, None, 140.0, exit=1),
    ]
    counts = summarize(records)
    assert (counts.agents_done, counts.agents_interrupted, counts.agents_live) == (1, 1, 0)


def test_one_working_agent_means_not_idle() -> None:
    records = [
        record("a", AgentStatus.IDLE, 100.0, 100.0),
        record("b", AgentStatus.RUNNING, None, 150.0),
    ]
    assert summarize(records).all_idle_since is None


def test_no_agents_is_not_idle() -> None:
    assert summarize([]).all_idle_since is None


IDLE_A = record("a", AgentStatus.IDLE, 100.0, 100.0)


@pytest.mark.parametrize(
    ("records", "all_idle_since"),
    [
        pytest.param([record("a", AgentStatus.CRASHED, None, 200.0, exit=None)], None,
                     id="crashed-alone"),
        pytest.param([record("a", AgentStatus.DRAINED, None, 200.0, exit=0)], None,
                     id="drained-alone"),
        pytest.param([record("a", AgentStatus.DRAINED, None, 200.0, exit=0),
                      record("b", AgentStatus.DRAINED, None, 210.0, exit=-15)], None,
                     id="all-drained-by-the-daemons-sigterm"),
        pytest.param([record("a", AgentStatus.KILLED, None, 200.0, exit=-9)], 200.0,
                     id="killed-by-a-user-alone"),
        pytest.param([IDLE_A, record("b", AgentStatus.KILLED, None, 150.0, exit=-15)], 150.0,
                     id="idle-and-killed-by-a-user-later"),
        pytest.param([record("a", AgentStatus.FAILED, None, 200.0, exit=1)], None,
                     id="failed-alone"),
        pytest.param([record("a", AgentStatus.DONE, None, 200.0, exit=0)], 200.0,
                     id="done-alone"),
        pytest.param([record("a", AgentStatus.DONE, None, 200.0, exit=0),
                      record("b", AgentStatus.DONE, None, 230.0, exit=0)], 230.0,
                     id="all-done"),
        pytest.param([IDLE_A, record("b", AgentStatus.CRASHED, None, 50.0)], None,
                     id="idle-and-crashed"),
        pytest.param([IDLE_A, record("b", AgentStatus.DRAINED, None, 50.0, exit=0)], None,
                     id="idle-and-drained"),
        pytest.param([IDLE_A, record("b", AgentStatus.FAILED, None, 50.0, exit=2)], None,
                     id="idle-and-failed"),
        pytest.param([IDLE_A, record("b", AgentStatus.DONE, None, 50.0, exit=0)], 100.0,
                     id="idle-and-done-earlier"),
        pytest.param([IDLE_A, record("b", AgentStatus.DRAINING, None, 150.0)], None,
                     id="idle-and-draining"),
        pytest.param([IDLE_A, record("b", AgentStatus.SPAWNING, None, 150.0)], None,
                     id="idle-and-spawning"),
    ],
)  # fmt: skip
def test_stopped_agents_are_idle_only_when_they_stopped_on_purpose(
    records: list[AgentRecord], all_idle_since: float | None
) -> None:
    assert summarize(records).all_idle_since == all_idle_since


# ------------------------------------------------------- heartbeat timing, injected clocks


class FakeClock:
    """A clock a test sets and steps; ``Heartbeat`` and ``IdleClock`` call it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


CONFIG = ConsumerConfig(
    socket=Path("/nonexistent/ctl.sock"), store=Path("/nonexistent/store"),
    namespace="team-a", name="task-1", task_uid="uid-1",
)  # fmt: skip
WALL = 1_800_000_000.0
ALL_IDLE = [record("a", AgentStatus.IDLE, WALL - 5, WALL - 5)]


def heartbeat() -> tuple[Heartbeat, FakeClock, FakeClock]:
    wall, monotonic = FakeClock(WALL), FakeClock(5_000.0)
    return Heartbeat(CONFIG, wall=wall, monotonic=monotonic), wall, monotonic


def beat(sender: Heartbeat, records: list[AgentRecord]) -> tuple[int, float | None]:
    """One poll that must send: (seq, idle_for_secs) of the report, marked as sent."""
    due = sender.report(records)
    assert due is not None, "a heartbeat was due"
    counts, report = due
    sender.sent(counts, report)
    return report.seq, report.idle_for_secs


@pytest.mark.parametrize("jump", [3600.0, -3600.0], ids=["forward-1h", "backward-1h"])
def test_a_wall_clock_jump_does_not_move_the_idle_duration_a_heartbeat_reports(
    jump: float,
) -> None:
    sender, wall, monotonic = heartbeat()
    first_seq, first_idle = beat(sender, ALL_IDLE)

    monotonic.now += 60
    wall.now += 60 + jump
    seq, idle_for = beat(sender, ALL_IDLE)

    assert (first_idle, idle_for) == (0.0, 60.0)
    assert seq > first_seq  # even after a backward step: the orchestrator keeps it


def test_an_idle_period_is_timed_from_when_the_consumer_first_sees_it() -> None:
    sender, _, monotonic = heartbeat()
    assert beat(sender, [record("a", AgentStatus.RUNNING, None, WALL - 1)])[1] is None

    monotonic.now += 1
    assert beat(sender, ALL_IDLE)[1] == 0.0  # its idle_since says 5 s ago: not read
    monotonic.now += 20
    assert beat(sender, ALL_IDLE)[1] == 20.0


def test_an_agent_that_worked_between_two_polls_starts_a_new_idle_period() -> None:
    clock = FakeClock(100.0)
    idle = IdleClock(clock)
    assert idle.idle_for(WALL) == 0.0
    clock.now += 30
    assert idle.idle_for(WALL) == 30.0

    clock.now += 1
    assert idle.idle_for(WALL + 30.5) == 0.0  # a later all_idle_since: a new period
    clock.now += 4
    assert idle.idle_for(WALL + 30.5) == 4.0
    assert idle.idle_for(None) is None
    assert idle.idle_for(WALL + 30.5) == 0.0  # after a busy poll, counted afresh


def test_unchanged_counts_wait_for_the_interval_on_the_monotonic_clock() -> None:
    sender, wall, monotonic = heartbeat()
    beat(sender, ALL_IDLE)

    wall.now += 3600  # a wall-clock jump does not make a heartbeat due
    monotonic.now += sender.interval - 0.5
    assert sender.report(ALL_IDLE) is None

    monotonic.now += 0.5
    assert beat(sender, ALL_IDLE)[1] == sender.interval
