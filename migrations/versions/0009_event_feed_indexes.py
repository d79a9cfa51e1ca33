"""Indexes for the operator's event feed: what changed in the ledger since a moment.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05

The operator no longer reads every task's heartbeat and last operation on a timer; one
loop asks the ledger what arrived since it last looked (``Ledger.changes_since``) and
wakes only the tasks concerned. Both reads are range scans on a time column:

- ``ix_daemon_activity_received_at``: heartbeats stored since a moment;
- ``ix_operations_updated_at``: operations that moved since a moment.

Hand-written and frozen like 0001.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_daemon_activity_received_at", "daemon_activity", ["received_at"])
    op.create_index("ix_operations_updated_at", "operations", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_operations_updated_at", table_name="operations")
    op.drop_index("ix_daemon_activity_received_at", table_name="daemon_activity")
