"""Alembic's entry point for the ledger's migrations, online and offline.

Run by ``orchestrator.ledger.migrate``, which sets ``sqlalchemy.url`` in code, or by the
``alembic`` command with the repository's ``alembic.ini``, where the URL comes from
``DRAIN_DATABASE_URL``. The target metadata is the models' own, so ``alembic revision
--autogenerate`` diffs against them. SQLite runs in batch mode: it alters a table only
by copying it into a new one, which batch mode does for each ``ALTER``.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from orchestrator.ledger.migrate import MIGRATION_LOCK_KEY
from orchestrator.ledger.models import Base, UTCDateTime

config = context.config


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DRAIN_DATABASE_URL")
    if not url:
        raise RuntimeError(
            "no ledger database URL: set DRAIN_DATABASE_URL (e.g. sqlite:///./caliban-drain.db "
            "or postgresql+psycopg://postgres@127.0.0.1:5432/drain) or run drainctl db upgrade"
        )
    return url


def render_item(kind: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Render the models' own column types as plain SQLAlchemy ones in new revisions,
    so a revision never imports application code that may change after it is written."""
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def options(backend: str) -> dict[str, Any]:
    return {
        "target_metadata": Base.metadata,
        "render_as_batch": backend == "sqlite",
        "render_item": render_item,
        "compare_type": True,
    }


def run_migrations_offline() -> None:
    """Emit the SQL to stdout (or the config's output buffer) instead of running it."""
    url = database_url()
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **options(make_url(url).get_backend_name()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(database_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                # A session lock: held through the migrations' own transaction below, and
                # released when the connection closes, whatever happens.
                connection.execute(
                    text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
                connection.commit()
            context.configure(connection=connection, **options(connection.dialect.name))
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if config.config_file_name is not None:
    # Only when run from an alembic.ini: a program that migrates keeps its own logging.
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
