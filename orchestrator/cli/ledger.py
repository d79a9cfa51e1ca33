"""``drainctl ledger ls|show`` and ``drainctl db upgrade``: the checkpoint ledger.

``open_ledger`` is the one way the command line opens the ledger (the pipeline commands
use it too): a malformed ``DRAIN_DATABASE_URL`` is refused here with exit 2, before any
connection; an unreachable database (exit 4) and a schema that ``db upgrade`` has not
created (exit 1, "run drainctl db upgrade") are explained by ``errors.DrainctlGroup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from orchestrator.cli.errors import Misconfigured, OperationFailed, hide_password
from orchestrator.cli.output import TASK_REF, emit, json_option

if TYPE_CHECKING:
    from orchestrator.ledger import CheckpointView, Ledger


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
        f"{'VERIFIED':<8} {'WORKSPACE':<9} CREATED"
    )
    rows = [header]
    for c in checkpoints:
        rows.append(
            f"{c.ref:<26} {c.namespace + '/' + c.name:<32} {c.reason:<7} {len(c.agents):>6} "
            f"{_yes_no(c.forced):<6} {_yes_no(c.verified):<8} "
            f"{'kept' if c.available else 'GONE':<9} {c.created_at:%Y-%m-%d %H:%M:%S}"
        )
    return "\n".join(rows)


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


@ledger.command("ls")
@click.option("--task", "task", type=TASK_REF, default=None, help="Only this NS/NAME.")
@click.option(
    "--limit", default=50, show_default=True, type=click.IntRange(1), help="At most this many."
)
@json_option
def ledger_ls(task: tuple[str, str] | None, limit: int) -> None:
    """Checkpoints, newest first: forced (taken without a drain) and verified (every
    session's sha256 checked) are separate columns; WORKSPACE is GONE once a restore
    found the checkpoint's workspace deleted (``ledger show`` says why)."""
    namespace, name = task if task else (None, None)
    checkpoints = open_ledger().list_checkpoints(namespace=namespace, name=name, limit=limit)
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
        for agent in checkpoint.agents:
            lines.append(
                f"  {agent.agent_id:<20} turns={agent.turns:<5} clean={agent.clean!s:<5} "
                f"{agent.session_dir}  {(agent.session_sha256 or '-')[:16]}"
            )
        return "\n".join(lines)

    emit(checkpoint, human)


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
