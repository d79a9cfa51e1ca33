"""The operator's work queue: what wakes a task's steward besides its own deadlines.

Each CalibanTask has one steward (``operator.steward``, a kopf daemon) that runs a pass,
then sleeps until ``pacing.requeue_after`` says or until its entry in the queue wakes it:

- ``WorkQueue.add``: a change of the object itself (kopf's watch: spec, annotations,
  deletion), or an operation of the task that moved in the ledger;
- ``WorkQueue.add_heartbeat``: a heartbeat stored for the task. It only wakes the
  steward to work out its deadlines again; a pass follows when the heartbeat's signature
  differs from the one the last pass decided on, or a deadline fell due.

``feed`` is the one loop that reads the ledger for all tasks: every
``event_feed_interval_secs`` it asks what was stored since it last looked (two indexed
range reads, whatever the number of tasks) and hands each row to its task's steward.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from orchestrator.ledger import Ledger, LedgerError
from orchestrator.operator import blocking
from orchestrator.operator.failures import one_line
from orchestrator.operator.pacing import Heartbeat, heartbeat_of, newer

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name) of a CalibanTask."""

FEED_PAGE = 1000
"""Rows the feed reads in one query; a fuller page is followed at once by the next."""
FEED_OVERLAP_SECS = 1.0
"""How far before its last row the feed looks again: a row stamped earlier may commit
later (two worker processes, one slower), and is still seen. Rows seen twice are
recognised (a heartbeat by its receive time, an operation by its update time)."""

_T = TypeVar("_T")


@dataclass
class QueueEntry:
    """One task's entry in the work queue: its steward's wake-ups."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cause: str | None = None
    """A pass is wanted, and why (``WorkQueue.add``'s cause); None: only a fresh look at
    the deadlines."""
    beat: Heartbeat | None = None
    """The newest heartbeat the feed (or a pass) has seen for the task."""
    watched: tuple[object, ...] = ()
    """What of the object the last pass read (``steward.watched_fields``)."""


class WorkQueue:
    """The entries of the tasks this operator looks after, by (namespace, name)."""

    def __init__(self) -> None:
        self.entries: dict[Key, QueueEntry] = {}

    def open(self, key: Key) -> QueueEntry:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = QueueEntry()
        return entry

    def close(self, key: Key) -> None:
        self.entries.pop(key, None)

    def add(self, key: Key, cause: str) -> None:
        """Ask for a pass over ``key`` now (nothing if no steward looks after it); ``cause``
        is what asks (``event``: the object changed; ``ledger``: the feed)."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.cause = entry.cause or cause
            entry.wake.set()

    def add_heartbeat(self, key: Key, beat: Heartbeat) -> None:
        entry = self.entries.get(key)
        if entry is None:
            return
        known = entry.beat
        entry.beat = newer(known, beat)
        if entry.beat is not known:
            entry.wake.set()


async def _read(call: Callable[[], _T]) -> _T:
    return await blocking.in_thread(call)


@dataclass
class Feed:
    """The feed's place in the ledger: how far it has read, and what it saw last."""

    heartbeats_after: datetime
    operations_after: datetime
    seen_operations: dict[str, datetime] = field(default_factory=dict)

    @classmethod
    def starting(cls, now: datetime) -> Feed:
        """From ``now``: every steward's first pass reads what was stored before."""
        start = now - timedelta(seconds=FEED_OVERLAP_SECS)
        return cls(start, start)


async def read_once(ledger: Ledger, stewards: WorkQueue, place: Feed) -> int:
    """Hand what the ledger stored since ``place`` to the stewards; the rows read."""
    read = 0
    while True:
        beats = await _read(
            lambda: ledger.activity_received_since(place.heartbeats_after, FEED_PAGE)
        )
        for activity in beats:
            beat = heartbeat_of(activity)
            if beat is not None:
                stewards.add_heartbeat((activity.namespace, activity.name), beat)
        read += len(beats)
        if len(beats) < FEED_PAGE:
            break
        last = beats[-1].received_at
        assert last is not None  # the query reads received_at > a moment
        place.heartbeats_after = last
    newest = max((b.received_at for b in beats if b.received_at), default=None)
    if newest is not None:
        place.heartbeats_after = max(
            place.heartbeats_after, newest - timedelta(seconds=FEED_OVERLAP_SECS)
        )
    while True:
        moves = await _read(
            lambda: ledger.operations_moved_since(place.operations_after, FEED_PAGE)
        )
        for move in moves:
            if place.seen_operations.get(move.id) == move.updated_at:
                continue
            place.seen_operations[move.id] = move.updated_at
            stewards.add((move.namespace, move.name), "ledger")
        read += len(moves)
        if len(moves) < FEED_PAGE:
            break
        place.operations_after = moves[-1].updated_at
    if moves:
        place.operations_after = max(
            place.operations_after, moves[-1].updated_at - timedelta(seconds=FEED_OVERLAP_SECS)
        )
    horizon = place.operations_after
    for op_id in [k for k, at in place.seen_operations.items() if at <= horizon]:
        del place.seen_operations[op_id]
    return read


async def feed(ledger: Ledger, stewards: WorkQueue, interval_secs: float) -> None:
    """Read the ledger's changes every ``interval_secs`` for as long as the operator
    runs; a ledger that cannot be read is tried again (stewards keep their own
    deadlines and the resync meanwhile)."""
    place = Feed.starting(datetime.now(UTC))
    failing = False
    while True:
        try:
            await read_once(ledger, stewards, place)
            if failing:
                log.info("event feed: the ledger answers again")
            failing = False
        except (LedgerError, OSError, RuntimeError) as exc:
            if not failing:
                log.warning("event feed: cannot read the ledger (%s); trying again", one_line(exc))
            failing = True
        except Exception as exc:
            if not failing:
                log.warning(
                    "event feed: reading the ledger failed (%s); trying again", one_line(exc)
                )
            failing = True
        await asyncio.sleep(interval_secs)
