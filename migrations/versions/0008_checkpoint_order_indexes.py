"""Indexes that serve the ledger's newest-first reads of checkpoints without a sort.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05

A task's latest checkpoint, a workspace PVC's newest, and a page of ``drainctl ledger
ls`` are all read newest first (``ORDER BY created_at DESC, id DESC``). With 1,000,000
checkpoints on PostgreSQL, the page scanned the whole table and sorted it (125 ms), and
a task's latest sorted its rows from the (namespace, name) index (3 ms). Indexes ending
in (created_at, id) give each read a backward index scan that stops at its limit:

- ``ix_checkpoints_created_at_id``: a page of every checkpoint;
- ``ix_checkpoints_namespace_name_created_at_id`` replaces ``ix_checkpoints_namespace_name``
  (its prefix serves every read the old one did);
- ``ix_checkpoints_namespace_pvc_name_created_at_id`` replaces
  ``ix_checkpoints_namespace_pvc_name`` likewise.

Hand-written and frozen like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_checkpoints_created_at_id", "checkpoints", ["created_at", "id"])
    op.create_index(
        "ix_checkpoints_namespace_name_created_at_id",
        "checkpoints",
        ["namespace", "name", "created_at", "id"],
    )
    op.create_index(
        "ix_checkpoints_namespace_pvc_name_created_at_id",
        "checkpoints",
        ["namespace", "pvc_name", "created_at", "id"],
    )
    op.drop_index("ix_checkpoints_namespace_name", table_name="checkpoints")
    op.drop_index("ix_checkpoints_namespace_pvc_name", table_name="checkpoints")


def downgrade() -> None:
    op.create_index("ix_checkpoints_namespace_pvc_name", "checkpoints", ["namespace", "pvc_name"])
    op.create_index("ix_checkpoints_namespace_name", "checkpoints", ["namespace", "name"])
    op.drop_index("ix_checkpoints_namespace_pvc_name_created_at_id", table_name="checkpoints")
    op.drop_index("ix_checkpoints_namespace_name_created_at_id", table_name="checkpoints")
    op.drop_index("ix_checkpoints_created_at_id", table_name="checkpoints")
