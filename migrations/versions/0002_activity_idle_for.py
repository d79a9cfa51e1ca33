"""daemon_activity gains idle_for_secs and received_at: idle timing that no clock step moves.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03

``idle_for_secs`` is how long the daemon's agents had been idle, measured on the daemon
host's monotonic clock; ``received_at`` is the orchestrator's stamp of when it stored the
heartbeat. The operator's idle pause reads these two instead of ``all_idle_since``, which
stays for display. Both are nullable: a row stored before this revision has neither, and
the daemon's next heartbeat replaces it.

Hand-written and frozen like 0001: types spelled out, nothing imported from the models.
Batch mode, so SQLite drops the columns on downgrade by copying the table.
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
    with op.batch_alter_table("daemon_activity") as table:
        table.add_column(sa.Column("idle_for_secs", sa.Double(), nullable=True))
        table.add_column(sa.Column("received_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("daemon_activity") as table:
        table.drop_column("received_at")
        table.drop_column("idle_for_secs")
