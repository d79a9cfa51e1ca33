"""What wakes a task's steward: watch events, the ledger's feed, and its own deadlines.

Each CalibanTask has one steward (``handlers.steward``, a kopf daemon) that runs a pass,
then sleeps until ``pacing.next_look`` says or until something wakes it here:

- ``Stewards.look``: a change of the object itself (kopf's watch: spec, annotations,
  deletion), or an operation of the task that moved in the ledger;
- ``Stewards.heartbeat``: a heartbeat stored for the task. It only wakes the steward to
  work out its deadlines again; a pass follows when the heartbeat's signature differs
  from the one the last pass decided on, or a deadline fell due.

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
from orchestrator.operator.pacing import Beat, beat_of, newer

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
class Mailbox:
    """One steward's wake-ups."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    look: str | None = None
    """A pass is wanted, and why (``Stewards.look``'s cause); None: only a fresh look at
    the deadlines."""
    beat: Beat | None = None
    """The newest heartbeat the feed (or a pass) has seen for the task."""
    noticed: tuple[object, ...] = ()
    """What of the object the last pass read (``handlers._noticed``)."""


class Stewards:
    """The mailboxes of the tasks this operator looks after, by (namespace, name)."""

    def __init__(self) -> None:
        self.boxes: dict[Key, Mailbox] = {}

    def open(self, key: Key) -> Mailbox:
        box = self.boxes.get(key)
        if box is None:
            box = self.boxes[key] = Mailbox()
        return box

    def close(self, key: Key) -> None:
        self.boxes.pop(key, None)

    def look(self, key: Key, cause: str) -> None:
        """Ask for a pass over ``key`` now (nothing if no steward looks after it); ``cause``
        is what asks (``event``: the object changed; ``ledger``: the feed)."""
        box = self.boxes.get(key)
        if box is not None:
            box.look = box.look or cause
            box.wake.set()

    def heartbeat(self, key: Key, beat: Beat) -> None:
        box = self.boxes.get(key)
        if box is None:
            return
        known = box.beat
        box.beat = newer(known, beat)
        if box.beat is not known:
            box.wake.set()


async def _read(call: Callable[[], _T]) -> _T:
    return await asyncio.to_thread(call)


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


async def read_once(ledger: Ledger, stewards: Stewards, place: Feed) -> int:
    """Hand what the ledger stored since ``place`` to the stewards; the rows read."""
    read = 0
    while True:
        beats = await _read(lambda: ledger.activity_received_since(place.heartbeats_after,
                                                                   FEED_PAGE))  # fmt: skip
        for activity in beats:
            beat = beat_of(activity)
            if beat is not None:
                stewards.heartbeat((activity.namespace, activity.name), beat)
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
        moves = await _read(lambda: ledger.operations_moved_since(place.operations_after,
                                                                  FEED_PAGE))  # fmt: skip
        for move in moves:
            if place.seen_operations.get(move.id) == move.updated_at:
                continue
            place.seen_operations[move.id] = move.updated_at
            stewards.look((move.namespace, move.name), "ledger")
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


async def feed(ledger: Ledger, stewards: Stewards, interval_secs: float) -> None:
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
                log.warning("event feed: cannot read the ledger (%s); trying again", exc)
            failing = True
        except Exception as exc:
            if not failing:
                log.warning("event feed: reading the ledger failed (%s); trying again", exc)
            failing = True
        await asyncio.sleep(interval_secs)
