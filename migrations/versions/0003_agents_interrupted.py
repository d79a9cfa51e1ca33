"""Heartbeats count the agents stopped with work left, so the operator resumes them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

``daemon_activity.agents_interrupted``: agents a daemon reports drained, crashed or
failed (not finished, not killed by a user). A row written before this revision reads 0,
which is what a daemon that does not send the count means.

Hand-written and frozen like 0001; batch mode, so SQLite drops the column on downgrade
by copying the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("daemon_activity") as batch:
        batch.add_column(
            sa.Column("agents_interrupted", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("daemon_activity") as batch:
        batch.drop_column("agents_interrupted")
