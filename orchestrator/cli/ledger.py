"""``drainctl ledger ls|show`` and ``drainctl db upgrade``: the checkpoint ledger.

``open_ledger`` is the one way the command line opens the ledger (the pipeline commands
use it too): a malformed ``DRAIN_DATABASE_URL`` is refused here with exit 2, before any
connection; an unreachable database (exit 4) and a schema that ``db upgrade`` has not
created (exit 1, "run drainctl db upgrade") are explained by ``errors.DrainctlGroup``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from orchestrator.cli.errors import Misconfigured, OperationFailed, hide_password
from orchestrator.cli.operator import kube_options, load_kube
from orchestrator.cli.output import TASK_REF, emit, json_option

if TYPE_CHECKING:
    from orchestrator.ledger import CheckpointView, Ledger
    from orchestrator.operator.retention import PruneItem


def database_url() -> str:
    from orchestrator.settings import get_settings

    return get_settings().database_url


def open_ledger() -> Ledger:
    """The ledger at ``DRAIN_DATABASE_URL`` (the worker's own, shared per process)."""
    from orchestrator.pipeline.tasks import get_ledger

    database_url()  # invalid settings fail here, as themselves (a ValueError, too)
    try:
        return get_ledger()  # parses the URL; connects only when first used
    except ValueError as exc:
        raise Misconfigured(f"DRAIN_DATABASE_URL: {exc}") from None


@click.group()
@json_option
def ledger() -> None:
    """Read the checkpoint ledger (DRAIN_DATABASE_URL)."""


def _checkpoint_table(checkpoints: list[CheckpointView]) -> str:
    header = (
        f"{'REF':<26} {'TASK':<32} {'REASON':<7} {'AGENTS':>6} {'FORCED':<6} "
        f"{'VERIFIED':<8} {'WORKSPACE':<9} {'SNAPSHOT':<8} CREATED"
    )
    rows = [header]
    for c in checkpoints:
        rows.append(
            f"{c.ref:<26} {c.namespace + '/' + c.name:<32} {c.reason:<7} {len(c.agents):>6} "
            f"{_yes_no(c.forced):<6} {_yes_no(c.verified):<8} "
            f"{'kept' if c.available else 'GONE':<9} {_snapshot_word(c):<8} "
            f"{c.created_at:%Y-%m-%d %H:%M:%S}"
        )
    return "\n".join(rows)


def _snapshot_word(c: CheckpointView) -> str:
    """ready (restorable into any number of fresh PVCs), failed, pending (asked for, cut
    or not, and not ready yet: a restore of it waits), or - (none)."""
    if c.snapshot is not None:
        return "ready"
    if c.snapshot_error is not None:
        return "failed"
    return "pending" if c.snapshot_name is not None else "-"


def _snapshot_line(c: CheckpointView) -> str:
    """``ledger show``'s snapshot line: its name, its state, and when it was cut and
    became ready, or why it failed."""
    word = _snapshot_word(c)
    cut = f"cut {c.snapshot_cut_at:%Y-%m-%d %H:%M:%S}" if c.snapshot_cut_at else None
    if word == "ready":
        ready = f"ready {c.snapshot_ready_at:%Y-%m-%d %H:%M:%S}"
        detail = f"{cut}, {ready}" if cut else ready
    elif word == "failed":
        detail = f"{cut}; {c.snapshot_error}" if cut else str(c.snapshot_error)
    else:
        detail = f"{cut}, not readyToUse yet" if cut else "not cut yet"
    return f"  snapshot: {c.snapshot_name or '-'} {word}: {detail}"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


@ledger.command("ls")
@click.option("--task", "task", type=TASK_REF, default=None, help="Only this NS/NAME.")
@click.option(
    "--limit", default=50, show_default=True, type=click.IntRange(1), help="At most this many."
)
@click.option(
    "--after",
    default=None,
    metavar="REF",
    help="The next page: the checkpoints older than REF (the last one listed before).",
)
@click.option(
    "--quiet", "-q", is_flag=True, help="Print only the refs, one per line (for scripts)."
)
@json_option
def ledger_ls(task: tuple[str, str] | None, limit: int, after: str | None, quiet: bool) -> None:
    """Checkpoints, newest first, a page at a time (--limit, then --after the last ref):
    forced (taken without a drain) and verified (every session's sha256 checked) are
    separate columns; WORKSPACE is GONE once a restore found the checkpoint's workspace
    deleted or prune released it (``ledger show`` says why); SNAPSHOT is ready when a
    VolumeSnapshot of the workspace can be restored, pending while it is taken (a pause or
    a deletion goes on once it is cut; a restore waits for ready), failed when it was not
    cut or not ready in time."""
    namespace, name = task if task else (None, None)
    try:
        checkpoints = open_ledger().list_checkpoints(
            namespace=namespace, name=name, limit=limit, after=after
        )
    except LookupError as exc:
        raise OperationFailed(f"--after: {exc}; list them: drainctl ledger ls") from None
    if quiet:
        emit([c.ref for c in checkpoints], "\n".join(c.ref for c in checkpoints))
        return
    emit(checkpoints, lambda: _checkpoint_table(checkpoints))


@ledger.command("show")
@click.argument("ref")
@json_option
def ledger_show(ref: str) -> None:
    """Checkpoint REF (ckpt-…) and its agents."""
    checkpoint = open_ledger().get_checkpoint(ref)
    if checkpoint is None:
        raise OperationFailed(f"no checkpoint {ref!r} in the ledger; list them: drainctl ledger ls")

    def human() -> str:
        lines = [
            f"{checkpoint.ref}  {checkpoint.namespace}/{checkpoint.name}  "
            f"reason={checkpoint.reason} forced={checkpoint.forced} "
            f"verified={checkpoint.verified} pvc={checkpoint.pvc_name}"
        ]
        if checkpoint.unavailable:
            lines.append(f"  unavailable: {checkpoint.unavailable}")
        if checkpoint.snapshot_name or checkpoint.snapshot_error:
            lines.append(_snapshot_line(checkpoint))
        for agent in checkpoint.agents:
            lines.append(
                f"  {agent.agent_id:<20} turns={agent.turns:<5} clean={agent.clean!s:<5} "
                f"{agent.session_dir}  {(agent.session_sha256 or '-')[:16]}"
            )
        return "\n".join(lines)

    emit(checkpoint, human)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``30s``, ``2m``, ``1h30m``, or ``7d``, in seconds."""

    name = "duration"
    _DAYS = re.compile(r"^(\d+)d$")

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        from orchestrator.operator.lifecycle import SpecError, parse_duration

        if isinstance(value, float):
            return value
        text = str(value)
        if days := self._DAYS.match(text):
            return float(days.group(1)) * 86400
        try:
            return parse_duration(text, "older-than")
        except SpecError:
            self.fail(f"{text!r} is not a duration like 12h, 7d or 1h30m", param, ctx)


def _prune_table(items: list[PruneItem], dry_run: bool, batch: int) -> str:
    from orchestrator.operator.retention import batches

    released = [i for i in items if i.action == "release"]
    rows = [f"{'REF':<26} {'TASK':<32} {'ACTION':<8} {'SNAPSHOT':<26} WHY"]
    for i in items:
        rows.append(f"{i.ref:<26} {i.task:<32} {i.action:<8} {i.snapshot or '-':<26} {i.why}")
    verb = "would release" if dry_run else "released"
    rows.append(
        f"{verb} {len(released)} of {len(items)} checkpoints in "
        f"{len(batches(items, batch))} batches of at most {batch}: "
        f"{sum(i.snapshot is not None for i in released)} VolumeSnapshots, "
        f"{len({(i.namespace, i.pvc) for i in released if i.pvc is not None})} PVCs"
        + ("; nothing was changed (--dry-run)" if dry_run else "")
    )
    return "\n".join(rows)


@ledger.command("prune")
@click.option(
    "--keep",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Checkpoints to keep per task, newest first (0: only what live tasks name).",
)
@click.option(
    "--older-than",
    default="0s",
    show_default=True,
    type=Duration(),
    help="Release only checkpoints older than this (e.g. 7d, 12h).",
)
@click.option(
    "--batch",
    default=100,
    show_default=True,
    type=click.IntRange(1),
    help="Checkpoints released together: their deletions at once, then one ledger write.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be released; change nothing.")
@kube_options
@json_option
def ledger_prune(
    keep: int,
    older_than: float,
    batch: int,
    dry_run: bool,
    kubeconfig: Path | None,
    context: str | None,
) -> None:
    """Release old checkpoints: delete their VolumeSnapshots and retained PVCs, and mark
    them unavailable in the ledger, --batch at a time (progress on stderr). Per task the
    newest --keep stay, and so does every checkpoint a live CalibanTask names
    (status.checkpointRef, spec.resumeFrom); a PVC a live task works on, or a kept
    checkpoint is on, stays."""
    import asyncio
    from datetime import UTC, datetime

    from orchestrator.operator import kube
    from orchestrator.operator.retention import (
        plan_prune,
        pvcs_of,
        release,
        restorable_checkpoints,
        what_is_in_use,
    )

    ledger_ = open_ledger()
    load_kube(kubeconfig, context)
    checkpoints = restorable_checkpoints(ledger_)
    now = datetime.now(UTC)

    def progress(done: int, total: int) -> None:
        click.echo(f"released {done} of {total} checkpoints", err=True)

    async def run() -> list[PruneItem]:
        try:
            named, held = await what_is_in_use(pvcs_of(checkpoints))
            items = plan_prune(
                checkpoints,
                keep=keep,
                older_than_secs=older_than,
                now=now,
                named_by_tasks=named,
                held_pvcs=held,
            )
            if not dry_run:
                return await release(ledger_, items, now, batch=batch, progress=progress)
            return items
        finally:
            await kube.close_client()

    items = asyncio.run(run())
    emit(
        {"dry_run": dry_run, "batch": batch, "checkpoints": items},
        lambda: _prune_table(items, dry_run, batch),
    )


@click.group()
def db() -> None:
    """The checkpoint ledger's schema."""


@db.command("upgrade")
@click.option(
    "--revision",
    default="head",
    show_default=True,
    help="Alembic revision to migrate to (head: the newest this version ships).",
)
@json_option
def db_upgrade(revision: str) -> None:
    """Apply the Alembic migrations to DRAIN_DATABASE_URL (idempotent)."""
    from orchestrator.ledger.migrate import current, upgrade

    open_ledger()  # refuses a malformed URL before Alembic sees it
    url = database_url()
    upgrade(url, revision)
    at = current(url)
    emit({"database": hide_password(url), "revision": at}, f"ledger at revision {at}")
