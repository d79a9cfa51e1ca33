"""``persistence.StateSaver``: the last save, on a clean stop, has everything, even when
the stop comes while an earlier save is still writing (what a ``drainctl dev up``
restart relies on to keep, say, a VolumeSnapshot made ready just before it stopped)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from orchestrator.devcluster import persistence, resources
from orchestrator.devcluster.emulator import DevClusterEmulator
from orchestrator.devcluster.store import Snapshot


def test_a_close_during_a_save_still_saves_the_changes_that_save_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / persistence.API_STATE_FILE
    writing, release = threading.Event(), threading.Event()
    write = persistence.write_atomically

    def first_write_held(target: Path, text: str) -> None:
        if not writing.is_set():
            writing.set()
            release.wait(10)
        write(target, text)

    monkeypatch.setattr(persistence, "write_atomically", first_write_held)

    async def scenario() -> None:
        state = DevClusterEmulator().state
        namespaces = state.registry.lookup(*resources.NAMESPACES)
        assert namespaces is not None
        saver = persistence.StateSaver(state, path, interval=0.01)
        saver.start()
        state.create(namespaces, None, {"metadata": {"name": "first"}})
        assert await asyncio.to_thread(writing.wait, 10)  # the save of "first" is writing
        state.create(namespaces, None, {"metadata": {"name": "second"}})
        closing = asyncio.get_running_loop().create_task(saver.close())
        await asyncio.sleep(0)  # the stop arrives while that save still writes
        release.set()
        await asyncio.wait_for(closing, 10)

    asyncio.run(scenario())
    saved = persistence.load(path)
    assert [obj["metadata"]["name"] for _, obj in saved.objects] == ["first", "second"]


def test_the_saver_holds_the_event_loop_a_tenth_of_the_time_at_most_however_large_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that takes 30 ms to encode, changed all the time: saved every 10 ms, the
    encoding would hold the loop three quarters of the time."""
    encodings: list[float] = []
    encode = persistence.encode

    def large(snapshot: Snapshot) -> str:
        started = time.monotonic()
        time.sleep(0.03)  # on the event loop, as encoding a large state is
        encodings.append(time.monotonic() - started)
        return encode(snapshot)

    monkeypatch.setattr(persistence, "encode", large)

    async def scenario() -> float:
        state = DevClusterEmulator().state
        namespaces = state.registry.lookup(*resources.NAMESPACES)
        assert namespaces is not None
        saver = persistence.StateSaver(state, tmp_path / persistence.API_STATE_FILE, 0.01)
        saver.start()
        started = time.monotonic()
        for i in range(100):
            state.create(namespaces, None, {"metadata": {"name": f"ns-{i}"}})
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        await saver.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    assert sum(encodings[:-1]) <= 0.25 * elapsed, (len(encodings), elapsed)
