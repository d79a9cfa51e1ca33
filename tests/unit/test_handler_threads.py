"""kopf runs a handler written as ``def`` in a thread of its executor; the watch
handlers that wake a steward set an ``asyncio.Event``, which only the event loop's own
thread may do. Tried: each waking handler invoked as kopf invokes it, on a loop in debug
mode (which refuses a loop call from another thread), with a steward waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import kopf
import pytest
from kopf._core.actions.invocation import invoke

from orchestrator.operator import crd, handlers
from orchestrator.operator.events import WorkQueue

KEY = ("default", "woken")


def _task_body() -> kopf.Body:
    raw = {"metadata": {"namespace": KEY[0], "name": KEY[1], "generation": 2,
                        "annotations": {crd.WAKE_ANNOTATION: "now"}}}  # fmt: skip
    return kopf.Body(cast(kopf.RawBody, raw))


def _child_body() -> kopf.Body:
    raw = {"metadata": {"namespace": KEY[0], "name": "woken-sbx",
                        "labels": {crd.TASK_LABEL: KEY[1]}}}  # fmt: skip
    return kopf.Body(cast(kopf.RawBody, raw))


@pytest.mark.parametrize(
    ("handler", "body"),
    [(handlers.noticed, _task_body), (handlers.child_changed, _child_body)],
    ids=["noticed", "child_changed"],
)
def test_a_watch_event_wakes_the_waiting_steward_from_the_loop_thread(
    handler: Callable[..., Any], body: Callable[[], kopf.Body]
) -> None:
    async def scenario() -> None:
        asyncio.get_running_loop().set_debug(True)
        queue = WorkQueue()
        entry = queue.open(KEY)
        memo = kopf.Memo()
        memo.context = SimpleNamespace(stewards=queue)
        waiting = asyncio.ensure_future(entry.wake.wait())
        await asyncio.sleep(0)
        await invoke(handler, kwargs={"body": body(), "memo": memo, "type": "MODIFIED"})
        await asyncio.sleep(0)
        assert entry.cause is not None
        assert waiting.done(), "the steward waiting on its entry was not woken"

    # A handler kopf ran in a thread hangs here (the wake never reaches the loop): the
    # guard turns that into a failure instead of the suite's timeout.
    asyncio.run(asyncio.wait_for(scenario(), 30))
