"""A checkpoint's snapshot is cut before it is ready.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

On a real CSI driver a VolumeSnapshot is cut (``status.creationTime`` set, bound to its
VolumeSnapshotContent: its point in time fixed) at once, and ``readyToUse`` minutes
later, once its data is uploaded. A pause or a deletion now goes on at the cut, and the
operator follows the snapshot until it is ready or failed:

- ``checkpoints.snapshot_cut_at``: when the snapshot was cut. A row written before this
  revision reads NULL: a ready one was cut at some moment before its ``snapshot_ready_at``,
  which nobody recorded, and an unsettled one is looked at again (and its cut recorded) by
  the operator;
- ``ix_checkpoints_snapshot_unsettled``: a partial index of the checkpoints whose
  snapshot is asked for and neither ready nor failed, the few rows the operator's follower
  reads every few seconds among millions (PostgreSQL and SQLite both index a ``WHERE``).

Hand-written and frozen like 0001; batch mode, so SQLite drops the column on downgrade
by copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNSETTLED = "snapshot_name IS NOT NULL AND snapshot_ready_at IS NULL AND snapshot_error IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("snapshot_cut_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_checkpoints_snapshot_unsettled",
        "checkpoints",
        ["id"],
        postgresql_where=sa.text(UNSETTLED),
        sqlite_where=sa.text(UNSETTLED),
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_snapshot_unsettled", table_name="checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("snapshot_cut_at")
