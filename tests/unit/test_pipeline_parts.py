"""Pure parts of the pipeline: queue names, task refs and the activity summary."""

from __future__ import annotations

import pytest

from worker_agent.consumer import ActivityCounts, summarize
from worker_agent.contract import TaskNameError, daemon_queue, parse_task_ref
from worker_agent.proto import AgentRecord, AgentStatus, SpawnSpec


def record(
    agent_id: str, status: AgentStatus, idle_since: float | None, updated: float
) -> AgentRecord:
    return AgentRecord(
        id=agent_id, status=status, spec=SpawnSpec(), session_dir=f"/s/{agent_id}",
        created_at=0.0, updated_at=updated, idle_since=idle_since,
    )  # fmt: skip


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


def test_all_idle_since_is_the_last_agent_to_go_idle() -> None:
    records = [
        record("a", AgentStatus.IDLE, 100.0, 100.0),
        record("b", AgentStatus.IDLE, 150.0, 150.0),
        record("c", AgentStatus.DONE, None, 120.0),
    ]
    assert summarize(records) == ActivityCounts(
        agents_total=3, agents_live=2, agents_idle=2, all_idle_since=150.0,
    )  # fmt: skip


def test_one_working_agent_means_not_idle() -> None:
    records = [
        record("a", AgentStatus.IDLE, 100.0, 100.0),
        record("b", AgentStatus.RUNNING, None, 150.0),
    ]
    assert summarize(records).all_idle_since is None


def test_no_agents_is_not_idle() -> None:
    assert summarize([]).all_idle_since is None
