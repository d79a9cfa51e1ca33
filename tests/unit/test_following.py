"""``following.Poller``: the waits a fan-out of deletions shares, one read per poll for
every awaited key, each wait bounded and handed what was read."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping

import pytest

from orchestrator.operator.following import Poller, pause_before_read


class Store:
    """What the poller reads: a dict, and every read it was asked for."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.asked: list[set[str]] = []
        self.failing = False

    async def read(self, keys: Collection[str]) -> Mapping[str, str]:
        self.asked.append(set(keys))
        if self.failing:
            raise ConnectionError("the ledger is away")
        return {k: self.values[k] for k in keys if k in self.values}


def test_fifty_waits_are_served_by_reads_of_every_key_at_once_and_each_wakes_on_its_change() -> (
    None
):
    store = Store()
    store.values = {f"op-{i}": "draining" for i in range(50)}
    poller = Poller("drains", 0.01, store.read)

    async def scenario() -> list[str | None]:
        waits = [poller.until(f"op-{i}", lambda seen: seen == "recorded", 10) for i in range(50)]
        woken = asyncio.gather(*waits)
        await asyncio.sleep(0.05)
        for i in range(50):
            store.values[f"op-{i}"] = "recorded"
        return await woken

    assert asyncio.run(scenario()) == ["recorded"] * 50
    assert {f"op-{i}" for i in range(50)} in store.asked
    assert len(store.asked) < 50  # one read per poll, not one per wait


def test_a_wait_that_sees_no_change_hands_back_what_was_read_last_when_its_bound_is_up() -> None:
    store = Store()
    store.values = {"op-1": "draining"}
    poller = Poller("drains", 0.01, store.read)

    async def scenario() -> tuple[str | None, str | None]:
        seen = await poller.until("op-1", lambda seen: seen == "recorded", 0.1)
        absent = await poller.until("op-2", lambda seen: seen is not None, 0.1)
        return seen, absent

    assert asyncio.run(scenario()) == ("draining", None)


def test_a_read_that_fails_leaves_the_waits_to_their_bound_and_the_next_read_wakes_them() -> None:
    store = Store()
    store.values = {"op-1": "recorded"}
    store.failing = True
    poller = Poller("drains", 0.01, store.read)

    async def scenario() -> tuple[str | None, str | None]:
        bounded = await poller.until("op-1", lambda seen: seen == "recorded", 0.1)
        store.failing = False
        woken = await poller.until("op-1", lambda seen: seen == "recorded", 10)
        return bounded, woken

    assert asyncio.run(scenario()) == (None, "recorded")
    assert len(store.asked) >= 2


def test_a_slow_read_is_spaced_out_so_that_reading_takes_at_most_its_share_of_the_time() -> None:
    """200 deletions followed on a busy machine: a read that takes 40 ms, polled every
    5 ms, read back to back before (about 22 reads a second, the poller always busy)."""
    store = Store()
    store.values = {f"op-{i}": "draining" for i in range(200)}

    async def slow_read(keys: Collection[str]) -> Mapping[str, str]:
        await asyncio.sleep(0.04)
        return await store.read(keys)

    poller = Poller("drains", 0.005, slow_read)

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(
            *(poller.until(f"op-{i}", lambda seen: seen == "recorded", 2.0) for i in range(200))
        )
        return loop.time() - started

    elapsed = asyncio.run(scenario())
    assert poller.reads >= 5  # it still reads, at the pace the reads allow
    # a fifth of the time (BUSY_SHARE), with room for the timer; + the read cut off at the end
    assert poller.reading_secs <= 0.25 * elapsed + 0.04


def test_a_fast_read_keeps_the_interval_and_a_slow_one_takes_at_most_a_fifth_of_the_time() -> None:
    assert pause_before_read(0.005, 0.001) == 0.005  # one deletion, a quiet machine
    assert pause_before_read(0.005, 0.04) == pytest.approx(0.16)  # 40 ms read: 200 ms a cycle
