"""A checkpoint names its VolumeSnapshot.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

Where the cluster offers CSI volume snapshots, every checkpoint is also an immutable copy
of its workspace: ``checkpoints.snapshot_name`` is the VolumeSnapshot (in the
checkpoint's namespace) the operator took after the drain, ``snapshot_ready_at`` when
the snapshotter reported it ``readyToUse`` (a restore uses only a ready one), and
``snapshot_error`` why the snapshot failed (not ready within the operator's timeout). A
row written before this revision reads NULL in all three: a checkpoint without a
snapshot, restorable only from its retained PVC.

Hand-written and frozen like 0001; batch mode, so SQLite drops the columns on downgrade
by copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("snapshot_name", sa.String(253), nullable=True))
        batch.add_column(sa.Column("snapshot_ready_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("snapshot_error", sa.String(500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("snapshot_error")
        batch.drop_column("snapshot_ready_at")
        batch.drop_column("snapshot_name")
