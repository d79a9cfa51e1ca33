"""A checkpoint whose workspace is gone says so.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

``checkpoints.unavailable``: why the checkpoint can no longer be restored (its retained
PVC was deleted, with its namespace or by hand), or NULL while it can. The operator sets
it when a restore finds the workspace missing; ``drainctl ledger ls`` shows it. A row
written before this revision reads NULL: nothing was known to be missing.

Hand-written and frozen like 0001; batch mode, so SQLite drops the column on downgrade
by copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("unavailable", sa.String(500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("unavailable")
