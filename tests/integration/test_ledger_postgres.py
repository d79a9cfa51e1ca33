"""The checkpoint ledger's behaviour on a real PostgreSQL (127.0.0.1:5432, database ``test``).

The scenarios are ``LedgerBehaviour``'s, the same ones the unit tests run on SQLite, so
the two backends are held to one contract: row locks, the unique constraints that make
``record_checkpoint`` exactly-once under 8 concurrent callers, upserts, time zones, and
a migrated schema that matches the models. Each run works in schemas of its own
(``search_path`` set through the URL), so concurrent runs never see each other's rows.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from orchestrator.ledger import upgrade
from tests.unit.test_ledger import LedgerBehaviour

SERVER = URL.create(
    "postgresql+psycopg", username="postgres", host="127.0.0.1", port=5432, database="test"
)
UNREACHABLE = (
    "PostgreSQL not reachable on 127.0.0.1:5432; start it with: "
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
)


class Schema(NamedTuple):
    name: str
    url: str
    """A URL whose connections see only this schema (``options=-csearch_path=…``)."""


@pytest.fixture(scope="module")
def admin() -> Iterator[Engine]:
    engine = create_engine(
        SERVER,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": 3},
    )
    try:
        with engine.connect():
            pass
    except OperationalError:
        engine.dispose()
        pytest.skip(UNREACHABLE)
    yield engine
    engine.dispose()


@contextlib.contextmanager
def fresh_schema(admin: Engine) -> Iterator[Schema]:
    name = f"ledger_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{name}"'))
    url = SERVER.update_query_dict({"options": f"-csearch_path={name}"})
    try:
        yield Schema(name, url.render_as_string(hide_password=False))
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA "{name}" CASCADE'))


@pytest.fixture(scope="module")
def schema_at_head(admin: Engine) -> Iterator[Schema]:
    """One schema migrated once; each test empties its tables instead of re-migrating."""
    with fresh_schema(admin) as schema:
        upgrade(schema.url)
        yield schema


class TestLedgerOnPostgres(LedgerBehaviour):
    @pytest.fixture
    def database_url(self, admin: Engine) -> Iterator[str]:
        with fresh_schema(admin) as schema:
            yield schema.url

    @pytest.fixture
    def migrated_url(self, admin: Engine, schema_at_head: Schema) -> str:
        # DELETE, not TRUNCATE: on tables this small it is the faster of the two.
        with admin.connect() as connection, connection.begin():
            for table in ("checkpoint_agents", "checkpoints", "operations", "daemon_activity"):
                connection.execute(text(f'DELETE FROM "{schema_at_head.name}".{table}'))
        return schema_at_head.url


def test_an_upgrade_waits_for_one_already_running(admin: Engine) -> None:
    """Two ``drainctl db upgrade`` at once (the migration init containers of two new
    operator replicas) run one after the other: an upgrade takes the ledger's advisory
    lock first. Tried: the lock held here, as a running upgrade holds it; the upgrade
    started meanwhile waits on it (PostgreSQL shows it waiting) and migrates nothing
    until it is released, then brings the ledger to head and exits 0."""
    import os
    import subprocess
    import sys

    from orchestrator.ledger.migrate import MIGRATION_LOCK_KEY, current, head
    from tests.support import wait_until

    with fresh_schema(admin) as schema, admin.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        env = {**os.environ, "DRAIN_DATABASE_URL": schema.url}
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "db", "upgrade"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            waiting = text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            )
            wait_until(lambda: holder.execute(waiting).scalar() == 1, timeout=60)
            assert proc.poll() is None
            assert current(schema.url) is None
        finally:
            holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
        output = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == 0, output
        assert current(schema.url) == head()
