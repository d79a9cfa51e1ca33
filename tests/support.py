"""Test helpers: the daemon half of the testing kit (``worker_agent.testing``) under the
names the tests import."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from worker_agent.session import message_text
from worker_agent.testing import DaemonProcess, short_tmp, wait_until

__all__ = ["DaemonProcess", "LoopThread", "short_tmp", "sitecustomize_env", "wait_until"]

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop on a thread of its own: what a test serves from it (the
    embedded API) runs while the test calls it synchronously through ``run``."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine`` run on the loop, its result (30 s at most)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def sitecustomize_env(directory: Path, source: str, **env: str) -> dict[str, str]:
    """The environment (``env`` added) under which every Python process loads ``source``
    as its ``sitecustomize``, written into ``directory`` (created here)."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(source)
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **env}


def prompt_turns(messages: list[dict[str, Any]]) -> list[int]:
    """The turn each user prompt of a scripted conversation was (``scripted prompt k``):
    turn numbers read from the prompts themselves, so a lost or repeated turn shows."""
    prompts = [message_text(m) for m in messages if m.get("role") == "user"]
    return [int(p.removeprefix("scripted prompt ")) for p in prompts]
