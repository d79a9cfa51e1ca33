"""A prune's release and a restore's claim of a checkpoint exclude each other.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

``drainctl ledger prune`` decides from one look at the cluster which checkpoints no live
task names, then deletes their storage. A restore applied in between claimed storage the
prune then deleted. Both now go through the checkpoint's row:

- ``checkpoints.releasing_since``: set by a prune, on the locked rows, before it looks at
  the cluster again and deletes anything; cleared when that second look keeps it;
- ``checkpoints.restore_claimed_at``: set by a restore's claim on the locked row, refused
  while ``releasing_since`` is set;
- ``ix_checkpoints_releasing``: a partial index of the marked rows (none at rest), which
  the audit reads to find a prune that stopped half-way.

Hand-written and frozen like 0001; batch mode, so SQLite drops the columns on downgrade
by copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


RELEASING = "releasing_since IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("releasing_since", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("restore_claimed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_checkpoints_releasing",
        "checkpoints",
        ["releasing_since"],
        postgresql_where=sa.text(RELEASING),
        sqlite_where=sa.text(RELEASING),
    )


def downgrade() -> None:
    op.drop_index("ix_checkpoints_releasing", table_name="checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("restore_claimed_at")
        batch.drop_column("releasing_since")
