"""The consumer's operation journal: what each lifecycle operation already did here.

Celery delivers at least once. A drain or resume redelivered after it completed (a
consumer killed before its ack, a broker restart) must not act twice: a stale drain
arriving after a later resume would stop agents that are working again. So each
completed operation's result is written under ``<store>/ops/<op_id>.<verb>.json`` on
the workspace volume, and a redelivery answers from there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ValidationError

from worker_agent.contract import OP_ID_PATTERN
from worker_agent.layout import op_entry, ops_dir
from worker_agent.session import atomic_write

_OP_ID = re.compile(OP_ID_PATTERN)
KEEP = 500
"""Entries kept; older ones are pruned (an operation is never redelivered that late)."""

Verb = Literal["drain", "resume", "scale_down", "scale_up"]
_Result = TypeVar("_Result", bound=BaseModel)


class OperationJournal:
    """``<store>/ops``: one file per completed (operation, verb), written atomically."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.directory = ops_dir(store)

    def _path(self, op_id: str, verb: Verb) -> Path:
        if not _OP_ID.match(op_id):
            raise ValueError(f"operation id {op_id!r} is not a valid id")
        return op_entry(self.store, op_id, verb)

    def get(self, op_id: str, verb: Verb, model: type[_Result]) -> _Result | None:
        """The result this operation's ``verb`` answered here, or None if it has not run.

        An entry that does not parse as ``model`` (torn by a crash, written by another
        version) counts as absent: the verb runs again, which drain and resume allow."""
        try:
            return model.model_validate_json(self._path(op_id, verb).read_bytes())
        except (FileNotFoundError, ValidationError):
            return None

    def put(self, op_id: str, verb: Verb, result: BaseModel) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self._path(op_id, verb), result.model_dump_json().encode())
        self._prune()

    def _prune(self) -> None:
        entries = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink(missing_ok=True)
