"""Heartbeats count the agents stopped with work left, and say when they arrived.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

``daemon_activity.agents_interrupted``: agents a daemon reports drained, crashed or
failed (not finished, not killed by a user). A row written before this revision reads 0,
which is what a daemon that does not send the count means.
``daemon_activity.received_at``: when the ledger stored the heartbeat, on the
orchestrator's clock; a row from before reads NULL (the operator then uses reported_at).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("daemon_activity") as batch:
        batch.add_column(
            sa.Column("agents_interrupted", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("received_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("daemon_activity") as batch:
        batch.drop_column("received_at")
        batch.drop_column("agents_interrupted")
