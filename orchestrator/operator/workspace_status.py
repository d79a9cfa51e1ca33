"""Each Workspace's status, as caliban-operator's Workspace controller writes it:
``phase`` (Ready or Failed), ``message`` (why it failed; absent while Ready) and
``observedGeneration``, plus a ``Ready`` condition saying the same with a reason.

What decides it is this operator's own judgement of the Workspace
(``workspace.validate``: every provider of a kind the daemon drives, with what that kind
needs, the ``defaultProvider`` one of them, every source and env entry usable), so the
status says whether any task bound to the Workspace could start here, and the message
and reason are the ones such a task's ``WorkspaceResolved`` condition would carry.

``update`` is pure (a Workspace as the API served it → the status to merge into it, or
None when the stored one already says the same: no churn, so the watch event of our
own write ends here); ``observe`` is the shell kopf's event handler calls
(``handlers.workspace_observed``): for every Workspace event while
``Settings.writes_workspace_status`` holds, it writes ``update``'s patch through
``kube.patch_workspace_status`` and posts an Event when the verdict changes. With it
off, nothing is written: caliban-operator's controller owns that status.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Final

import kopf

from orchestrator.operator import kube
from orchestrator.operator import workspace as workspaces
from orchestrator.operator.crd import Manifest
from orchestrator.operator.lifecycle.conditions import Condition, condition, merge_conditions
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

READY: Final = "Ready"
"""The condition type, and the phase of a usable Workspace."""
FAILED: Final = "Failed"
VALID: Final = "Valid"
"""The Ready condition's reason while it is True; a False one carries the problem's
(``InvalidWorkspace``, ``UnsupportedProviderKind``, ``ProviderNotFound``,
``ProviderNeedsBaseUrl``)."""


def _ready_condition(conditions: object) -> Manifest:
    """The Ready condition among ``conditions`` (as stored: anything), or ``{}``."""
    for found in conditions if isinstance(conditions, list) else []:
        if isinstance(found, dict) and found.get("type") == READY:
            return found
    return {}


def desired(workspace: Manifest, now: datetime) -> Manifest:
    """The whole status this operator writes for ``workspace`` now: its verdict, with the
    conditions of other types as stored, and the Ready condition's transition time kept
    while its status holds."""
    meta = workspace.get("metadata") or {}
    generation = meta.get("generation")
    stored = workspace.get("status") or {}
    message: str | None
    try:
        workspaces.validate(workspace)
    except workspaces.WorkspaceProblem as problem:
        phase, message = FAILED, str(problem)
        ready = condition(READY, False, problem.reason, message, now, generation)
    else:
        spec = workspace["spec"]
        phase, message = READY, None
        said = (
            f"Workspace {meta.get('name')}: its {len(spec['providers'])} provider(s) and "
            f"{len(spec['sources'])} source(s) can be used"
        )
        ready = condition(READY, True, VALID, said, now, generation)
    conditions: list[Condition] = merge_conditions(list(stored.get("conditions") or []), ready)
    kept = _ready_condition(conditions)
    if not kept.get("lastTransitionTime"):  # another writer's Ready had none
        kept["lastTransitionTime"] = ready["lastTransitionTime"]
    return {
        "phase": phase,
        "message": message,  # null in a merge patch: removed once Ready
        "observedGeneration": generation,
        "conditions": conditions,
    }


def _verdict(status: Manifest) -> tuple[object, ...]:
    """What a status says, with none of its bookkeeping (transition times, the
    conditions' own generation, which a CRD that does not declare them prunes)."""
    ready = _ready_condition(status.get("conditions"))
    return (
        status.get("phase"),
        status.get("message"),
        status.get("observedGeneration"),
        ready.get("status"),
        ready.get("reason"),
        ready.get("message"),
    )


def update(workspace: Manifest, now: datetime) -> Manifest | None:
    """The status to merge into ``workspace``, or None when what is stored says the same
    as what this operator would write (phase, message, observed generation, the Ready
    condition's status, reason and message)."""
    want = desired(workspace, now)
    if _verdict(workspace.get("status") or {}) == _verdict(want):
        return None
    return want


async def observe(settings: Settings, body: kopf.Body, event: str | None) -> None:
    """One watch event of a Workspace (``event`` None: listed at start-up): its status
    written when it differs from what it should say."""
    if not settings.writes_workspace_status or event == "DELETED":
        return
    workspace: Manifest = dict(body)
    meta = workspace.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return
    patch = update(workspace, datetime.now(UTC))
    if patch is None:
        return
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    written = await kube.patch_workspace_status(namespace, name, patch)
    if written is None:
        return  # deleted meanwhile
    ready = _ready_condition(patch["conditions"])
    log.info(
        "workspace_status namespace=%s name=%s phase=%s generation=%s reason=%s",
        namespace,
        name,
        patch["phase"],
        patch["observedGeneration"],
        ready.get("reason"),
    )
    before = _ready_condition((workspace.get("status") or {}).get("conditions"))
    if (before.get("status"), before.get("reason")) != (ready.get("status"), ready.get("reason")):
        if patch["phase"] == READY:
            kopf.info(body, reason=READY, message=str(ready.get("message")))
        else:
            kopf.warn(body, reason=str(ready.get("reason")), message=str(patch["message"]))
