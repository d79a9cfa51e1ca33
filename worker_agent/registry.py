"""Live state: which agents the daemon knows, their status, and their worker processes.

The registry is the only place an ``AgentRecord`` changes. Every lifecycle transition
(spawn, exit, kill, crash on reload) is persisted durably, a drain's exits in one sync
at its end; the frequent ``running`` ⇄ ``idle`` reports and the ``draining`` marker are
kept in memory only, because a restarted daemon turns every live agent into
``crashed`` whatever its last report said. Every change is validated as an
``AgentRecord`` before it is kept, so no record in memory or on disk is one the
protocol would refuse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from pydantic import ValidationError

from worker_agent.process import WorkerProcess
from worker_agent.proto import AgentRecord, AgentStatus, ErrorKind, ProtocolError, SpawnSpec
from worker_agent.session import sync_filesystem
from worker_agent.store import Store

log = logging.getLogger(__name__)


class RecordChanges(TypedDict, total=False):
    """The fields of an ``AgentRecord`` the daemon changes (``updated_at`` is set by
    ``Registry.update``; ``id``, ``session_dir`` and ``created_at`` never change)."""

    status: AgentStatus
    spec: SpawnSpec
    turns: int
    exit: int | None
    idle_since: float | None
    error: str | None
    retired: bool


@dataclass
class Agent:
    record: AgentRecord
    process: WorkerProcess | None = None
    stop_reason: AgentStatus | None = None
    """Set by the daemon before it signals the worker: ``killed`` or ``drained``."""
    force_killed: bool = field(default=False)
    watcher: asyncio.Task[None] | None = None
    """The task that records the worker's exit; awaiting it means the record is final."""

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def live(self) -> bool:
        return self.record.status.live


class Registry:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._agents: dict[str, Agent] = {}

    def reload(self) -> list[str]:
        """Load every manifest; formerly live agents become ``crashed``. Returns their ids."""
        crashed = []
        for record in self.store.load_manifests():
            agent = Agent(record)
            self._agents[record.id] = agent
            if record.status.live:
                self.update(agent, status=AgentStatus.CRASHED, idle_since=None)
                crashed.append(record.id)
        return crashed

    def __iter__(self) -> Iterator[Agent]:
        return iter(sorted(self._agents.values(), key=lambda a: a.record.created_at))

    def __len__(self) -> int:
        return len(self._agents)

    def add(self, record: AgentRecord) -> Agent:
        agent = Agent(record)
        self._agents[record.id] = agent
        self.store.save_manifest(record)
        return agent

    def get(self, agent_id: str) -> Agent:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise ProtocolError(ErrorKind.NOT_FOUND, f"no agent {agent_id!r}", agent_id)
        return agent

    def find(self, agent_id: str) -> Agent | None:
        return self._agents.get(agent_id)

    def remove(self, agent_id: str) -> None:
        self._agents.pop(agent_id, None)

    def update(
        self,
        agent: Agent,
        *,
        durable: bool = True,
        persist: bool = True,
        **changes: Unpack[RecordChanges],
    ) -> None:
        """Change a record; ``persist=False`` keeps a volatile change in memory only.

        The changed record is validated like any ``AgentRecord`` (``model_copy`` would
                not): a bad change raises ``ValidationError`` and leaves the record as it was.

                A manifest that cannot be written (a full or failing disk) leaves the change in
                memory and the old manifest whole on disk, logged: a drain, a stop or a restart
                must go on. The stale manifest errs on the safe side — it still says the agent
                was live, so a restarted daemon marks it ``crashed`` and it can be resumed.
        """
        if unknown := sorted(changes.keys() - AgentRecord.model_fields.keys()):
            # A record ignores unknown fields as it loads (as serde does); a change that
            # names one is a bug here, not data from elsewhere.
            errors: list[Any] = [
                {"type": "extra_forbidden", "loc": (k,), "input": changes[k]}  # type: ignore[literal-required]
                for k in unknown
            ]
            raise ValidationError.from_exception_data("AgentRecord", errors)
        agent.record = AgentRecord.model_validate(
            {**dict(agent.record), **changes, "updated_at": time.time()}
        )
        if persist:
            try:
                self.store.save_manifest(agent.record, durable=durable)
            except OSError as exc:
                log.warning("manifest_unwritten agent=%s error=%s", agent.id, exc)

    def save(self, records: Sequence[AgentRecord], *, sync: bool) -> None:
        """Write these records' manifests as they are (each once, not fsynced), then with
        ``sync`` make the store durable in one syncfs. Blocking: a drain runs it in a
        thread, with ``records`` taken on the event loop (a record is replaced, never
        changed in place, so each is the state it had then). A manifest that cannot be
        written is logged and left as it was, as in ``update``."""
        for record in records:
            try:
                self.store.save_manifest(record, durable=False)
            except OSError as exc:
                log.warning("manifest_unwritten agent=%s error=%s", record.id, exc)
        if sync:
            sync_filesystem(self.store.root)

    def live(self) -> list[Agent]:
        return [a for a in self if a.live]

    def active(self) -> list[Agent]:
        """The task's agents, oldest first: every agent a scale-down has not retired."""
        return [a for a in self if not a.record.retired]
