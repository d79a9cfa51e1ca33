"""Alembic migrations of the checkpoint ledger (PostgreSQL and SQLite).

A package only so that it installs beside ``orchestrator``: ``orchestrator.ledger.migrate``
points Alembic at this directory. ``env.py`` is Alembic's entry point, ``versions/`` the
revisions, each hand-written and portable across both backends.
"""
