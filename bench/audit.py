"""Nothing lost: every drained agent checked against its files on disk.

An agent's recorded turns (a ``ResumeRef`` or a ledger checkpoint agent) must equal the
turns in ``session.json`` and the ``TurnEnd`` records in ``stdout.ndjson``, its
sha256 must be the file's, and it must be clean. A lost turn is one on disk (in the
session or announced in the transcript) that the record does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.ledger import Ledger, OperationState, OperationView
from worker_agent.session import SessionError, count_completed_turns, load_session


@dataclass
class Audit:
    agents: int = 0
    turns: int = 0
    lost_turns: int = 0
    problems: list[str] = field(default_factory=list)

    def agent(
        self, where: str, directory: Path, turns: int, sha256: str | None, clean: bool
    ) -> None:
        self.agents += 1
        self.turns += turns
        try:
            session = load_session(directory)
        except SessionError as exc:
            self.problems.append(f"{where}: {exc}")
            return
        announced = count_completed_turns(directory)
        self.lost_turns += max(0, max(session.turns, announced) - turns)
        if not turns == session.turns == announced:
            self.problems.append(
                f"{where}: recorded {turns} turns, session.json {session.turns}, "
                f"{announced} TurnEnd records"
            )
        if sha256 != session.sha256 or not clean:
            self.problems.append(
                f"{where}: clean={clean}, sha256 matches {sha256 == session.sha256}"
            )

    def checkpoint(
        self, ledger: Ledger, op: OperationView, store: Path, expected: list[str]
    ) -> None:
        """Every agent of the operation's checkpoint, and exactly the ``expected`` ones."""
        where = f"{op.namespace}/{op.name} op {op.id}"
        checkpoint = ledger.get_checkpoint(op.checkpoint_ref) if op.checkpoint_ref else None
        if op.state != OperationState.RECORDED or checkpoint is None:
            self.problems.append(f"{where}: state {op.state}, error {op.error!r}")
            return
        if sorted(a.agent_id for a in checkpoint.agents) != sorted(expected):
            self.problems.append(f"{where}: checkpoint agents differ from {sorted(expected)}")
        if not checkpoint.verified:
            self.problems.append(f"{where}: checkpoint {checkpoint.ref} is not verified")
        for agent in checkpoint.agents:
            self.agent(
                f"{where} agent {agent.agent_id}",
                store / agent.session_dir,
                agent.turns,
                agent.session_sha256,
                agent.clean,
            )

    @property
    def ok(self) -> bool:
        return self.lost_turns == 0 and not self.problems

    def summary(self) -> str:
        return (
            f"{self.lost_turns} lost turns, {len(self.problems)} problems over "
            f"{self.agents} checkpoint agents"
        )
