"""Waits the operator's deletions share: one read per poll for every deletion at once.

A deletion's finalizer (``finalizer.drain_on_delete``) follows its drain in the ledger,
then its checkpoint's VolumeSnapshot in the API, before it releases the task. Polled
task by task, 200 deletions at once are 200 ledger transactions every poll (SQLite takes
them one at a time) and 200 GETs of the API server, which starve the drains and the
snapshotter they wait for. A :class:`Poller` is one loop per kind of wait: it reads
every awaited object in one call and wakes the waits whose object changed.

What must stay true: a wait is bounded and never decides anything. It hands back what
it read last (changed or not, or None), and the caller looks at the task again itself
(``drainTimeout``, a daemon gone, a snapshot that timed out), so a poll that fails or a
change missed costs one bound, never a deletion. This module does no I/O of its own:
the read is the caller's (``handlers``), and it must never import ``handlers``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from orchestrator.operator.pacing import failure_backoff

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False)
class _Wait(Generic[K, V]):
    key: K
    done: Callable[[V | None], bool]
    woken: asyncio.Future[V | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


BUSY_SHARE = 0.2
"""The most of its time a poller spends reading: after a read that took ``t`` seconds it
waits at least ``t * (1 / BUSY_SHARE - 1)`` before the next one."""


def pause_before_read(planned: float, last_read_took: float) -> float:
    """How long a poller waits before its next read: ``planned`` (its interval, stretched
    for the keys awaited), or longer if the last read would otherwise take more than
    :data:`BUSY_SHARE` of the time."""
    return max(planned, last_read_took * (1 / BUSY_SHARE - 1))


class Poller(Generic[K, V]):
    """Every ``interval``, while anything waits: ``read`` the awaited keys in one call
    (a key absent from its answer reads as None) and wake each wait whose ``done``
    holds for what was read. ``per_key`` stretches the interval by that much for each
    key awaited, so a read that grows with the keys is not repeated as often.

    Whatever the interval, reads take at most :data:`BUSY_SHARE` of the time: a read
    that grows with the keys or slows with the machine (200 deletions followed on two
    busy cores) is spaced out to match, instead of reading back to back and taking the
    CPU from the handlers and the services whose progress it waits for. A read of a few
    keys on a quiet machine takes a fraction of ``interval``, which it leaves as is."""

    def __init__(
        self,
        name: str,
        interval: float,
        read: Callable[[Collection[K]], Awaitable[Mapping[K, V]]],
        per_key: float = 0.0,
    ) -> None:
        self.name = name
        self.interval = interval
        self.per_key = per_key
        self.read = read
        self.reads = 0
        """Reads made so far (each one for every key awaited at the time)."""
        self.reading_secs = 0.0
        """Seconds spent in reads so far (their wall time)."""
        self._waits: list[_Wait[K, V]] = []
        self._last: dict[K, V | None] = {}
        self._loop: asyncio.Task[None] | None = None

    async def until(self, key: K, done: Callable[[V | None], bool], within: float) -> V | None:
        """What was read for ``key`` once ``done`` holds for it, or at the latest after
        ``within`` seconds whatever was read last (None: nothing yet, or absent)."""
        wait: _Wait[K, V] = _Wait(key, done)
        self._waits.append(wait)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        try:
            return await asyncio.wait_for(asyncio.shield(wait.woken), within)
        except TimeoutError:
            return self._last.get(key)
        finally:
            self._waits.remove(wait)
            if not any(w.key == key for w in self._waits):
                self._last.pop(key, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        took, failures = 0.0, 0
        while self._waits:
            planned = self.interval + self.per_key * len({w.key for w in self._waits})
            await asyncio.sleep(max(pause_before_read(planned, took), failure_backoff(failures)))
            keys = {w.key for w in self._waits}
            if not keys:
                break
            started = loop.time()
            try:
                read = await self.read(keys)
            except Exception as exc:  # the waits run out their bound and look for themselves
                failures += 1
                # One line per failed read, spaced out as a failing pass is (1 s doubling
                # to 5 min): a ledger down is not a traceback every few milliseconds.
                log.warning(
                    "follow_read_failed poller=%s keys=%d attempt=%d retry_in=%.0fs error=%s",
                    self.name,
                    len(keys),
                    failures,
                    failure_backoff(failures),
                    type(exc).__name__,
                )
                log.debug("follow_read_failed poller=%s", self.name, exc_info=True)
                continue
            finally:
                took = loop.time() - started
                self.reading_secs += took
            failures = 0
            self.reads += 1
            for wait in list(self._waits):
                value = read.get(wait.key)
                self._last[wait.key] = value
                if not wait.woken.done() and wait.done(value):
                    wait.woken.set_result(value)
