"""Drains begun together: the operator's many deletions (or pauses) in one ledger write.

When 200 CalibanTasks are deleted at once, kopf runs 200 finalizers side by side; each
used to begin its drain alone (a ledger transaction and a chain publish each, in a
thread of a small pool), so they queued one after another. ``DrainBatcher`` begins
the drains asked for with one ``pipeline.start_drains`` call per batch: one transaction
for every operation row, the chains published concurrently. Each caller gets its own
operation, as ``start_drain`` answers. No drain waits for company: a batch is what was
asked for in the same turn of the event loop, and then whatever was asked for while the
batch before it was being begun (a group commit), so a lone deletion starts at once and
200 at once share a few transactions.

A batch that ``start_drains`` refuses as a whole (one bad name starts nothing) is begun
again one drain at a time, so one task's error is that task's alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from celery import Celery

from orchestrator.ledger import Ledger, OperationView
from orchestrator.operator import blocking
from orchestrator.pipeline.start import DrainStart, start_drains
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

BATCH_MAX = 200
"""At most this many drains in one ``start_drains`` call."""


@dataclass
class _Waiting:
    drain: DrainStart
    answer: asyncio.Future[OperationView] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class DrainBatcher:
    """Begins drains in batches (``begin``), on the running event loop."""

    def __init__(self, app: Celery, ledger_of: Callable[[], Ledger], settings: Settings) -> None:
        self.app = app
        self.ledger_of = ledger_of
        self.settings = settings
        self.waiting: list[_Waiting] = []
        self.flushing: asyncio.Task[None] | None = None
        self.batches: list[int] = []
        """The size of every batch begun (for the tests and the benchmark)."""

    async def begin(self, drain: DrainStart) -> OperationView:
        """``start_drain`` of ``drain``, begun with whatever else is asked meanwhile."""
        waiting = _Waiting(drain)
        self.waiting.append(waiting)
        if self.flushing is None or self.flushing.done():
            self.flushing = asyncio.create_task(self._flush(), name="drain batch")
        return await waiting.answer

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the drains asked for in this turn of the loop join
        while self.waiting:
            batch, self.waiting = self.waiting[:BATCH_MAX], self.waiting[BATCH_MAX:]
            await self._begin(batch)

    async def _begin(self, batch: list[_Waiting]) -> None:
        self.batches.append(len(batch))
        drains = [w.drain for w in batch]
        ledger = self.ledger_of()
        try:
            views = await blocking.in_thread(start_drains, self.app, ledger, self.settings, drains)
        except Exception as exc:
            if len(batch) == 1:
                if not batch[0].answer.done():
                    batch[0].answer.set_exception(exc)
                return
            log.warning("a batch of %d drains was refused; beginning each alone", len(batch))
            for one in batch:
                await self._begin([one])
            return
        for one, view in zip(batch, views, strict=True):
            if not one.answer.done():
                one.answer.set_result(view)
