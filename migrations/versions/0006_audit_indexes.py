"""Indexes for the reads the audit (and restores) make by workspace and by checkpoint.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

``ix_checkpoints_namespace_pvc_name``: a workspace PVC's checkpoints (its newest, which
restores without snapshots and the audit read; those a deleted PVC takes with it).
``ix_operations_checkpoint_ref``: the resumes and restores that named a checkpoint.
``ix_operations_deadline_at``: unfinished operations past their deadline (the sweeper
and the audit). Without them each of these reads scans its whole table, which the audit
does once per page of checkpoints.

Hand-written and frozen like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_checkpoints_namespace_pvc_name", "checkpoints", ["namespace", "pvc_name"])
    op.create_index("ix_operations_checkpoint_ref", "operations", ["checkpoint_ref"])
    op.create_index("ix_operations_deadline_at", "operations", ["deadline_at"])


def downgrade() -> None:
    op.drop_index("ix_operations_deadline_at", table_name="operations")
    op.drop_index("ix_operations_checkpoint_ref", table_name="operations")
    op.drop_index("ix_checkpoints_namespace_pvc_name", table_name="checkpoints")
