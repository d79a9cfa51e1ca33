"""Checkpoint retention: which checkpoints ``drainctl ledger prune`` releases, and doing it.

A checkpoint holds storage: its VolumeSnapshot, and the retained workspace PVC it shares
with the other checkpoints of that workspace. Pruning releases both for checkpoints
nobody can want back, and marks them unavailable in the ledger (the rows stay, so the
history of every task and the one-checkpoint-per-drain audit still hold).

``plan_prune`` decides, purely: per task, the newest ``keep`` checkpoints stay, and so
does every checkpoint younger than ``older_than``, every checkpoint a live CalibanTask
names (``status.checkpointRef``: a suspended task's way back; ``spec.resumeFrom``: a
restore whose PVC may still be filling from the snapshot), and a PVC is deleted only
when no kept checkpoint is on it and no live task owns it (a restored task without
snapshots works on its checkpoint's retained PVC). ``release`` does what a plan says,
after marking each batch as being released in the ledger and looking at the cluster
again (a restore's claim and a prune's release of one checkpoint exclude each other),
through the same Kubernetes calls the operator makes (``kube``), in batches: a batch's
deletions are issued together, then its checkpoints are marked in one ledger
transaction, so a run over thousands of checkpoints neither waits on one request at a
time nor holds a transaction open across the API calls.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from orchestrator.ledger import CheckpointStorageView, CheckpointView, Ledger
from orchestrator.operator import crd, kube

Restorable = CheckpointView | CheckpointStorageView
"""A checkpoint as retention sees it: the full view, or the storage view a prune reads."""

SCAN_PAGE = 5000
"""Checkpoints ``restorable_checkpoints`` reads from the ledger per transaction."""


class PruneAction(StrEnum):
    RELEASE = "release"
    KEEP = "keep"


@dataclass(frozen=True)
class PruneItem:
    ref: str
    namespace: str
    task: str
    created_at: datetime
    action: PruneAction
    why: str
    snapshot: str | None
    """The VolumeSnapshot released with the checkpoint (or kept with it)."""
    pvc: str | None
    """The retained PVC released with the checkpoint; None when it stays or has none."""


def plan_prune(
    checkpoints: Sequence[Restorable],
    *,
    keep: int,
    older_than_secs: float,
    now: datetime,
    named_by_tasks: Mapping[str, str],
    held_pvcs: Mapping[tuple[str, str], str],
) -> list[PruneItem]:
    """What to do with each available checkpoint, newest first.

    ``named_by_tasks``: checkpoint ref → the live task naming it and how;
    ``held_pvcs``: (namespace, PVC) → the live task owning it."""
    live = sorted(
        (c for c in checkpoints if c.available),
        key=lambda c: (c.created_at, c.id),
        reverse=True,
    )
    seen: dict[tuple[str, str], int] = defaultdict(int)
    kept: list[tuple[Restorable, str]] = []
    released: list[Restorable] = []
    for checkpoint in live:
        task = (checkpoint.namespace, checkpoint.task_uid)
        seen[task] += 1
        age = (now - checkpoint.created_at).total_seconds()
        if checkpoint.ref in named_by_tasks:
            kept.append((checkpoint, named_by_tasks[checkpoint.ref]))
        elif seen[task] <= keep:
            kept.append((checkpoint, f"one of its task's newest {keep}"))
        elif age < older_than_secs:
            kept.append((checkpoint, f"younger than {older_than_secs:g}s"))
        else:
            released.append(checkpoint)
    kept_pvcs = {(c.namespace, c.pvc_name) for c, _ in kept if c.pvc_name}
    items = [_item(c, PruneAction.KEEP, why, c.snapshot_name, None) for c, why in kept]
    for c in released:
        where = (c.namespace, c.pvc_name or "")
        if c.pvc_name is None:
            pvc, why = None, "no retained PVC"
        elif where in held_pvcs:
            pvc, why = None, f"PVC {c.pvc_name} kept: the workspace of {held_pvcs[where]}"
        elif where in kept_pvcs:
            pvc, why = None, f"PVC {c.pvc_name} kept: a kept checkpoint is on it"
        else:
            pvc, why = c.pvc_name, f"PVC {c.pvc_name} released"
        items.append(_item(c, PruneAction.RELEASE, why, c.snapshot_name, pvc))
    return sorted(items, key=lambda i: i.created_at, reverse=True)


def _item(
    c: Restorable, action: PruneAction, why: str, snapshot: str | None, pvc: str | None
) -> PruneItem:
    return PruneItem(
        ref=c.ref,
        namespace=c.namespace,
        task=f"{c.namespace}/{c.name}",
        created_at=c.created_at,
        action=action,
        why=why,
        snapshot=snapshot,
        pvc=pvc,
    )


def restorable_checkpoints(ledger: Ledger, page: int = SCAN_PAGE) -> list[CheckpointStorageView]:
    """Every checkpoint a prune may release (the restorable ones), read ``page`` at a
    time in short transactions: a prune looks at all of them, however many."""
    found: list[CheckpointStorageView] = []
    while batch := ledger.restorable_storage_after(found[-1].id if found else 0, page):
        found += batch
    return found


def batches(items: Sequence[PruneItem], size: int) -> list[list[PruneItem]]:
    """The RELEASE items of a plan, ``size`` at a time, in the plan's order."""
    released = [i for i in items if i.action is PruneAction.RELEASE]
    return [released[start : start + size] for start in range(0, len(released), size)]


async def what_is_in_use(
    pvcs: Collection[tuple[str, str]], concurrency: int = 16
) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """From the cluster: the checkpoints live tasks name, and which of ``pvcs``
    ((namespace, name)) they own (read ``concurrency`` PVCs at a time)."""
    tasks = await kube.list_tasks()
    named: dict[str, str] = {}
    uids: dict[str, str] = {}
    for task in tasks:
        meta = task["metadata"]
        who = f"task {meta['namespace']}/{meta['name']}"
        uids[str(meta.get("uid"))] = who
        restore = ((task.get("spec") or {}).get("resumeFrom") or {}).get("checkpointRef")
        current = (task.get("status") or {}).get("checkpointRef")
        if restore:
            named[str(restore)] = f"restored by {who} (spec.resumeFrom)"
        if current:
            named.setdefault(str(current), f"the checkpoint of {who} (status.checkpointRef)")
    held: dict[tuple[str, str], str] = {}
    where = sorted(pvcs)
    for start in range(0, len(where), concurrency):
        chunk = where[start : start + concurrency]
        found = await asyncio.gather(*(kube.get_pvc(ns, name) for ns, name in chunk))
        for (namespace, pvc_name), pvc in zip(chunk, found, strict=True):
            owners = [] if pvc is None else pvc.metadata.owner_references or []
            for owner in owners:
                if owner.kind == crd.KIND and owner.uid in uids:
                    held[(namespace, pvc_name)] = uids[owner.uid]
    return named, held


def pvcs_of(checkpoints: Iterable[Restorable]) -> set[tuple[str, str]]:
    """The retained PVCs of ``checkpoints``, as (namespace, name)."""
    return {(c.namespace, c.pvc_name) for c in checkpoints if c.pvc_name}


async def release(
    ledger: Ledger,
    items: Sequence[PruneItem],
    now: datetime,
    batch: int = 100,
    progress: Callable[[int, int], None] | None = None,
) -> list[PruneItem]:
    """Delete what each RELEASE item frees and mark its checkpoint unavailable, saying so,
    ``batch`` items at a time (``progress(done, total)`` after each); the plan as it was
    carried out. The ledger is written after a batch's deletions: a run stopped half-way
    is finished by the next.

    The plan was made from one look at the cluster; a restore applied since may name a
    checkpoint it releases. So each batch is first marked as being released in the
    ledger (``Ledger.begin_release``: a restore's claim is refused from then on), then
    the cluster is looked at again: a checkpoint a live task names now is kept (its
    mark cleared, the item answered as KEEP), and a PVC a live task owns now stays."""
    if batch < 1:
        raise ValueError(f"batch must be a positive number of checkpoints, not {batch!r}")
    done_items = {i.ref: i for i in items}
    # A mark left by a prune that stopped half-way: what this plan keeps is claimable again.
    ledger.cancel_release([i.ref for i in items if i.action is PruneAction.KEEP])
    deleted_pvcs: set[tuple[str, str]] = set()
    kept_pvcs: set[tuple[str, str]] = set()
    todo = batches(items, batch)
    total, done = sum(map(len, todo)), 0
    for chunk in todo:
        marked = set(ledger.begin_release([i.ref for i in chunk]))
        named, held = await what_is_in_use({(i.namespace, i.pvc) for i in chunk if i.pvc})
        rekept = [i for i in chunk if i.ref in marked and i.ref in named]
        for item in rekept:
            done_items[item.ref] = replace(
                item,
                action=PruneAction.KEEP,
                why=f"{named[item.ref]}: seen when it was about to be released",
                pvc=None,
            )
        ledger.cancel_release([i.ref for i in rekept])
        kept_pvcs |= {(i.namespace, i.pvc) for i in rekept if i.pvc is not None}
        going: list[PruneItem] = []
        for item in chunk:
            if item.ref in named:
                continue
            if item.ref not in marked:  # made unavailable meanwhile: nothing left to free
                done_items[item.ref] = replace(
                    item, snapshot=None, pvc=None, why="made unavailable meanwhile"
                )
                continue
            where = (item.namespace, item.pvc or "")
            if where in held:
                item = replace(item, pvc=None, why=f"PVC {item.pvc} kept: the workspace of "
                               f"{held[where]}, seen when it was about to be deleted")  # fmt: skip
            elif where in kept_pvcs:
                item = replace(item, pvc=None, why=f"PVC {item.pvc} kept: a checkpoint kept "
                               "when it was about to be released is on it")  # fmt: skip
            going.append(item)
            done_items[item.ref] = item
        # Checkpoints on one workspace share its PVC: it is deleted once.
        pvcs = {(i.namespace, i.pvc) for i in going if i.pvc is not None} - deleted_pvcs
        await asyncio.gather(
            *(kube.delete_snapshot(i.namespace, i.snapshot) for i in going if i.snapshot),
            *(kube.delete_pvc(namespace, pvc) for namespace, pvc in sorted(pvcs)),
        )
        deleted_pvcs |= pvcs
        reasons = {}
        for item in going:
            freed = [f"VolumeSnapshot {item.snapshot}"] if item.snapshot is not None else []
            freed += [f"PVC {item.pvc}"] if item.pvc is not None else []
            what = " and ".join(freed) or "nothing held"
            reasons[item.ref] = (
                f"released by drainctl ledger prune at {now:%Y-%m-%dT%H:%M:%SZ} ({what})"
            )
        ledger.mark_checkpoints_unavailable(reasons)
        done += len(chunk)
        if progress is not None:
            progress(done, total)
    return [done_items[i.ref] for i in items]
