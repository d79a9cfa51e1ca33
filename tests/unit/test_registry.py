"""``Registry.update`` validates every change: a record the protocol would refuse is
never kept, in memory or in its manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from worker_agent.proto import AgentRecord, AgentStatus, SpawnSpec
from worker_agent.registry import Registry
from worker_agent.store import Store


def registry_with_one_agent(root: Path) -> tuple[Registry, Store, AgentRecord]:
    store = Store(root)
    store.prepare()
    agent_id = store.new_agent_id()
    store.agent_dir(agent_id).mkdir()
    record = AgentRecord.model_validate(dict(  # name, started_at, endpoint derived
        id=agent_id, status=AgentStatus.RUNNING, spec=SpawnSpec(),
        session_dir=str(store.agent_dir(agent_id)), created_at=1.0, updated_at=1.0,
    ))  # fmt: skip
    registry = Registry(store)
    registry.add(record)
    return registry, store, record


def test_a_valid_update_is_kept_and_persisted(tmp_path: Path) -> None:
    registry, store, record = registry_with_one_agent(tmp_path)
    agent = registry.get(record.id)

    registry.update(agent, status=AgentStatus.IDLE, idle_since=5.0, turns=2)

    assert (agent.record.status, agent.record.idle_since, agent.record.turns) == (
        AgentStatus.IDLE, 5.0, 2,
    )  # fmt: skip
    assert agent.record.updated_at > record.updated_at
    assert store.load_manifests() == [agent.record]


@pytest.mark.parametrize(
    "changes",
    [{"status": "sleeping"}, {"turns": "3"}, {"exit": 1.5}, {"pid": 42}],
    ids=["unknown-status", "string-turns", "float-exit", "unknown-field"],
)
def test_a_bad_update_is_refused_and_changes_nothing(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    registry, store, record = registry_with_one_agent(tmp_path)
    agent = registry.get(record.id)

    with pytest.raises(ValidationError):
        registry.update(agent, **changes)

    assert agent.record == record
    assert store.load_manifests() == [record]


def test_save_writes_the_records_given_and_skips_one_it_cannot_write(tmp_path: Path) -> None:
    # A drain keeps its exits in memory and writes each manifest once, in a thread, at
    # the end: what it hands ``save`` is what lands on disk, and an agent whose directory
    # is gone (removed meanwhile) costs a log line, not the other agents' manifests.
    registry, store, record = registry_with_one_agent(tmp_path)
    gone_id = store.new_agent_id()
    gone = record.model_copy(update={"id": gone_id, "session_dir": str(tmp_path / gone_id)})
    agent = registry.get(record.id)
    registry.update(agent, persist=False, status=AgentStatus.DRAINED, exit=0, turns=4)
    assert store.load_manifests() == [record]

    registry.save([gone, agent.record], sync=True)

    assert store.load_manifests() == [agent.record]
    assert (agent.record.status, agent.record.exit, agent.record.turns) == (
        AgentStatus.DRAINED, 0, 4,
    )  # fmt: skip
