"""The steward: one per CalibanTask (a kopf daemon, ``handlers.task_steward``) runs its passes
one after another, so no two passes over a task ever race; between passes it sleeps
until something wakes it (its work queue in ``events``) or a deadline falls due
(``pacing.requeue_after``). A task at rest costs nothing but its sleeping coroutine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import cast

import kopf

from orchestrator import metrics
from orchestrator.operator import crd, kube, permissions, reconcile
from orchestrator.operator.context import OperatorContext
from orchestrator.operator.crd import Manifest
from orchestrator.operator.failures import one_line
from orchestrator.operator.pacing import (
    Heartbeat,
    Requeue,
    failure_backoff,
    newer,
    requeue_after,
)
from orchestrator.operator.taskpass import TaskPass, utc_now

log = logging.getLogger(__name__)


def watched_fields(body: kopf.Body) -> tuple[object, ...]:
    """What of the object itself a pass reads apart from its own status (the spec by its
    generation, the wake annotation, the labels its children carry): a watch event that
    changes none of it (the status a pass wrote, kopf's own annotations) wakes nobody.
    A deletion is the finalizer's (kopf stops the steward)."""
    return (
        body.meta.get("generation"),
        body.meta.annotations.get(crd.WAKE_ANNOTATION),
        tuple(sorted(body.meta.labels.items())),
    )


def freshest(live: kopf.Body, written: Manifest | None) -> Manifest:
    """The newer of the watched object and what the steward's last patch answered: the
    watch may not have delivered that patch yet, and a pass must read its own status."""
    current = dict(live)
    if written is None:
        return current
    try:
        mine = int(written["metadata"]["resourceVersion"])
        seen = int(current["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return current
    return written if mine > seen else current


async def run(ctx: OperatorContext, body: kopf.Body, stopped: kopf.DaemonStopped) -> None:
    """The steward of the task ``body`` is, until kopf stops it (the task deleted, the
    operator stopping)."""
    key = (str(body.meta.namespace), str(body.meta.name))
    entry = ctx.stewards.open(key)
    settings = ctx.settings
    written: Manifest | None = None
    # The fleet's resyncs spread evenly from the start, not all at once a resync after
    # the operator started.
    resync = settings.resync_interval_secs * random.random()
    cause = "start"
    failures = 0
    try:
        while not stopped and not body.meta.get("deletionTimestamp"):
            metrics.OPERATOR_PASSES.labels(cause).inc()
            entry.cause = None
            current = kopf.Body(cast(kopf.RawBody, freshest(body, written)))
            entry.watched = watched_fields(current)
            (requeue, read), wrote, failed = await one_pass(ctx, current, cause)
            failures = failures + 1 if failed is not None else 0
            entry.beat = newer(entry.beat, read)
            known, written = entry.beat, wrote or written
            resync_at = time.monotonic() + resync
            backoff_until = time.monotonic() + failure_backoff(failures)
            if failed is not None:
                metrics.OPERATOR_PASS_FAILURES.inc()
                log.warning(
                    "pass_failed attempt=%d retry_in=%.0fs error=%s",
                    failures,
                    failure_backoff(failures),
                    one_line(failed),
                )
            cause = "clock"
            while not stopped:
                entry.wake.clear()
                # Backing off, only a change of the object itself asks for a pass sooner.
                if entry.cause and (not failures or entry.cause == "event"):
                    cause = entry.cause
                    break
                if failures:
                    secs = backoff_until - time.monotonic()
                    if secs <= 0:
                        break
                    if not await wait_for_work(entry.wake, stopped, secs):
                        break
                    continue
                secs = requeue_after(
                    utc_now(),
                    requeue,
                    entry.beat,
                    follow_up_secs=settings.reconcile_interval_secs,
                    resync_secs=max(resync_at - time.monotonic(), 0.0),
                    heartbeat_interval_secs=settings.heartbeat_interval_secs,
                    bridge_secs=settings.heartbeat_gap_secs,
                )
                if secs <= 0 and wrote is None and entry.beat is known:
                    # Due again at once, yet the pass changed nothing and no heartbeat came
                    # since: never a busy loop; look again as a task on its way would.
                    secs = settings.reconcile_interval_secs
                if secs <= 0:
                    cause = "clock" if entry.beat is known else "ledger"  # a heartbeat's news
                    break
                if not await wait_for_work(entry.wake, stopped, secs):
                    break  # fell due asleep
            resync = settings.resync_interval_secs
    finally:
        ctx.stewards.close(key)


async def one_pass(
    ctx: OperatorContext, body: kopf.Body, cause: str
) -> tuple[tuple[Requeue | None, Heartbeat | None], Manifest | None, Exception | None]:
    """A pass over the task and its status written: how it left the task, the heartbeat
    it read, the object as its status patch left it (None: nothing to write), and what
    failed it (None: nothing). A failed pass is tried again after a backoff
    (``pacing.failure_backoff``); its traceback is logged at debug level."""
    patch = kopf.Patch()
    p = TaskPass(body, patch, ctx)
    try:
        with permissions.forbidden_reported(warn_forbidden(body)):
            await reconcile.run(p)
        if p.requeue is not None and p.requeue.waiting:
            p.requeue = dataclasses.replace(p.requeue, awaiting=p.beat)
        if p.annotations:  # the phase this operator keeps, before the status showing it
            await kube.annotate_task(p.namespace, p.name, p.annotations)
        status = dict(patch.get("status") or {})
        if not status:
            return (p.requeue, p.beat), None, None
        written = await kube.patch_task_status(p.namespace, p.name, status)
        # One line for a pass that changed the task (none at rest), named by the task and
        # its operation like every line the pass logged.
        log.info(
            "task_pass cause=%s phase=%s changed=%s",
            cause,
            p.phase,
            ",".join(sorted(status)),
        )
        return (p.requeue, p.beat), written, None
    except Exception as exc:
        log.debug("pass over %s/%s failed", p.namespace, p.name, exc_info=True)
        return (None, p.beat), None, exc


async def wait_for_work(wake: asyncio.Event, stopped: kopf.DaemonStopped, secs: float) -> bool:
    """Sleep ``secs``, or until ``wake`` is set or kopf stops the steward; False when
    the whole ``secs`` went by."""
    waits = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        done, _ = await asyncio.wait(waits, timeout=secs, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    return bool(done)


def warn_forbidden(body: kopf.Body) -> Callable[[str], None]:
    return lambda line: kopf.warn(body, reason="Forbidden", message=line)
