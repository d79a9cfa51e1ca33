"""Where the operator's blocking calls run: the ledger (SQLAlchemy) and publishing
(Celery) have no asyncio API, so each call runs in a thread of ``POOL``, sized for the
fan-out of passes, never on kopf's event loop. The Kubernetes calls need none
(``kube``: coroutines on the loop)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

THREADS: Final = 15
"""As many as the ledger's connection pool holds on PostgreSQL (SQLAlchemy's 5 and 10
overflow): a fan-out of passes keeps every connection busy. asyncio's default executor,
which ``asyncio.to_thread`` uses, has min(32, CPUs + 4) threads: 6 on 2 cores."""

POOL: Final = ThreadPoolExecutor(THREADS, thread_name_prefix="caliban-blocking")


async def in_thread(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``fn(*args, **kwargs)`` in a thread of ``POOL``, with the caller's context
    variables (its log context), as ``asyncio.to_thread`` runs it."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(POOL, call)
