"""The CalibanTask operator's registrations with kopf, and nothing else.

- ``configure`` (startup): kopf's settings, the ``OperatorContext`` every handler reads
  from ``memo.context`` (``operator.context``), the RBAC check, the metrics server and
  the ledger's event feed to the stewards and the snapshot follower;
- ``steward`` (a daemon per task): its passes (``operator.steward``, ``reconcile``);
- ``noticed`` (every watch event): wakes the task's steward when something it reads
  changed;
- ``drain_on_delete`` (the finalizer ``crd.FINALIZER``): ``operator.finalizer``;
- ``workspace_observed`` (every watch event of a Workspace): its status
  (``operator.workspace_status``), where ``DRAIN_WORKSPACE_STATUS`` says this operator
  writes it.

``operator.main.run_operator`` (``drainctl operator``) runs them: kopf in the foreground
with the settings it was given, passed to the handlers in kopf's memo (never through the
environment).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from orchestrator import metrics
from orchestrator.operator import (
    crd,
    events,
    finalizer,
    kube,
    permissions,
    steward,
    workspace_status,
)
from orchestrator.operator.context import OperatorContext
from orchestrator.operator.failures import one_line
from orchestrator.operator.pacing import failure_backoff
from orchestrator.settings import Settings
from worker_agent.metrics import MetricsServer, serve

log = logging.getLogger(__name__)

STEWARD_EXIT_POLL_SECS = 0.1
"""How often kopf looks whether a deleted task's steward has finished its pass (it
exits at once when asleep): the finalizer is not released before it has."""


def _context(memo: kopf.Memo) -> OperatorContext:
    context: OperatorContext = memo.context
    return context


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    drain: Settings = memo.get("drain_settings") or Settings()
    settings.persistence.finalizer = crd.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=crd.KOPF_ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.KOPF_ANNOTATION_PREFIX, key=crd.KOPF_DIFFBASE_KEY
    )
    settings.posting.level = logging.INFO
    # The operator's own events (kopf.info, kopf.warn) are posted; kopf's log lines are
    # not: every watch event's "Handler 'noticed' succeeded." would be an Event written.
    settings.posting.loggers = False
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 70
    # Only with --peering (standalone otherwise): see ``operator.peering``.
    settings.peering.lifetime = drain.peering_lifetime_secs
    kube.load_credentials()
    await kube.open_client()
    # A missing RBAC permission stops the operator here, named, instead of kopf retrying
    # a forbidden watch forever (``permissions``; drainctl operator exits with the line).
    permissions.check_startup(
        permissions.needs_of(
            manage_sandbox=drain.manage_sandbox,
            snapshots=drain.snapshots,
            peering=drain.peering is not None,
            workspace_status=drain.writes_workspace_status,
        ),
        broker_secret=drain.daemon_broker_secret,
    )
    context = memo.context = OperatorContext.build(drain)
    # The operator's /metrics (DRAIN_METRICS_HOST:DRAIN_METRICS_PORT), with the ledger
    # counting what this process finishes (``orchestrator.metrics``); its probes are
    # kopf's own liveness endpoint (``drainctl operator --liveness``).
    metrics.count_outcomes()
    if drain.metrics_port:
        memo.metrics = serve(
            drain.metrics_host, drain.metrics_port, metrics.REGISTRY, {}, "operator"
        )
    context.feed = asyncio.create_task(
        events.feed(context.ledger, context.stewards, drain.event_feed_interval_secs),
        name="ledger event feed",
    )
    if drain.manage_sandbox and drain.snapshots:
        # Snapshots cut and not ready yet, of tasks gone or not: the ledger says which.
        context.following = asyncio.create_task(
            context.snapshot_follower.run(), name="snapshot follower"
        )


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    context: OperatorContext | None = memo.get("context")
    if context is not None:
        for task in (context.feed, context.following):
            if task is not None:
                task.cancel()
    server: MetricsServer | None = memo.get("metrics")
    if server is not None:
        server.close()
    await kube.close_client()


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
async def noticed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    # async: kopf runs a ``def`` handler in a thread, and a steward's wake (an
    # asyncio.Event) may only be set from the event loop's thread.
    key = (str(body.meta.namespace), str(body.meta.name))
    stewards = _context(memo).stewards
    entry = stewards.entries.get(key)
    if entry is not None and entry.watched != steward.watched_fields(body):
        stewards.add(key, "event")


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_polling=STEWARD_EXIT_POLL_SECS)
async def task_steward(
    body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
) -> None:
    await steward.run(_context(memo), body, stopped)


@kopf.on.delete(crd.GROUP, crd.VERSION, crd.PLURAL)
async def drain_on_delete(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int, **_: Any
) -> None:
    try:
        with permissions.forbidden_reported(steward.warn_forbidden(body)):
            await finalizer.drain_on_delete(_context(memo), body, patch)
    except (kopf.TemporaryError, kopf.PermanentError):
        raise
    except Exception as exc:
        # One line per failure and a backoff (1 s, doubling up to 5 min), not kopf's
        # traceback every second: a deletion waiting out the ledger's outage.
        delay = failure_backoff(retry + 1)
        log.debug("deletion of %s/%s failed", body.meta.namespace, body.meta.name, exc_info=True)
        raise kopf.TemporaryError(one_line(exc)[:500], delay=delay) from exc


@kopf.on.event(crd.GROUP, crd.VERSION, crd.WORKSPACE_PLURAL)
async def workspace_observed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    with permissions.forbidden_reported(steward.warn_forbidden(body)):
        await workspace_status.observe(_context(memo).settings, body, type)


async def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A task's Sandbox, pod or workspace PVC changed (it became ready, went, was
    deleted by hand): its steward looks, instead of polling for it. (async, as
    ``noticed``.)"""
    task = body.meta.labels.get(crd.TASK_LABEL)
    if task:
        _context(memo).stewards.add((str(body.meta.namespace), str(task)), "child")


def watch_children() -> None:
    """Register ``child_changed`` for the children a managing operator makes: its
    Sandboxes (the version the cluster prefers), pods and PVCs, by the task label they
    carry. Only with ``--manage-sandbox``, whose RBAC lets it watch them."""
    labelled = {crd.TASK_LABEL: kopf.PRESENT}
    sandboxes = kopf.on.event(
        group=crd.SANDBOX_GROUP, plural=crd.SANDBOX_PLURAL, labels=labelled, id="sandbox_changed"
    )
    pods = kopf.on.event("", "v1", "pods", labels=labelled, id="pod_changed")
    pvcs = kopf.on.event("", "v1", "persistentvolumeclaims", labels=labelled, id="pvc_changed")
    for register in (sandboxes, pods, pvcs):
        register(child_changed)
