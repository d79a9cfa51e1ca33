"""Schema migrations of the ledger, run in-process by ``drainctl`` and the tests.

Alembic is configured here in code, so no ``alembic.ini`` has to ship: the scripts are
the ``migrations`` package installed beside ``orchestrator`` and ``migrations/env.py``
takes the database URL from this configuration. (The ``alembic.ini`` at the repository
root is for people who run the ``alembic`` command by hand.) ``Ledger`` never creates
tables itself; a database is brought to ``head`` here first.
"""

from __future__ import annotations

import io
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

import migrations

MIGRATION_LOCK_KEY = 0x63616C6962616E  # "caliban"
"""The PostgreSQL advisory lock an upgrade holds (``migrations/env.py``): two started at
once, like the migration init containers of two new operator pods, run one after the
other, and the second finds the ledger at head instead of both creating the same tables
and one failing."""


def alembic_config(url: str, *, output: io.StringIO | None = None) -> Config:
    """An Alembic configuration for the ledger at ``url``; ``output`` receives offline SQL."""
    config = Config(output_buffer=output)
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # Options are interpolated by configparser; a URL-encoded password has '%' in it.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the ledger at ``url`` to ``revision``; at that revision already, a no-op."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Take the ledger back to ``revision`` (``"base"`` drops every table of the ledger)."""
    command.downgrade(alembic_config(url), revision)


def upgrade_sql(url: str, revision: str = "head") -> str:
    """The SQL an upgrade from nothing to ``revision`` would run, for a DBA to review.

    Offline: only the URL's dialect is used, no connection is made.
    """
    output = io.StringIO()
    command.upgrade(alembic_config(url, output=output), revision, sql=True)
    return output.getvalue()


def current(url: str) -> str | None:
    """The revision the ledger at ``url`` is at, or None for a database never migrated."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision this version of caliban-drain ships."""
    revision = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert revision is not None, "the migrations package has no revisions"
    return revision
