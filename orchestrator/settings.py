"""The orchestrator's settings, in one typed place, read from ``DRAIN_*`` variables.

The Celery app, the ledger, the operator and ``drainctl`` all take their configuration
from ``Settings``; no module reads the environment for configuration on its own.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DRAIN_", extra="ignore")

    broker_url: str = "redis://127.0.0.1:6379/0"
    """Celery broker (``DRAIN_BROKER_URL``): ``redis://`` (default) or ``amqp://``."""
    result_backend: str | None = None
    """Celery result backend (``DRAIN_RESULT_BACKEND``); defaults to the broker URL, or
    to a results folder beside the embedded broker's."""
    broker_folder: str | None = None
    """With ``DRAIN_BROKER_URL=filesystem://`` (the embedded broker of ``drainctl dev
    up``): the folder the processes exchange messages through."""
    database_url: str = "sqlite:///./caliban-drain.db"
    """The checkpoint ledger (``DRAIN_DATABASE_URL``): SQLite or ``postgresql+psycopg://``."""

    default_grace_secs: float = Field(default=30.0, ge=0)
    """Drain grace when a caller gives none."""
    drain_expires_secs: float = Field(default=300.0, gt=0)
    """A drain message not picked up by its daemon within this expires unrun."""
    resume_expires_secs: float = Field(default=3600.0, gt=0)
    """A resume waits in its daemon's queue this long for the new pod's consumer."""
    record_deadline_secs: float = Field(default=600.0, gt=0)
    """How long after a drain's expiry its operation may still be recorded."""
    visibility_timeout_secs: float = Field(default=7200.0, gt=0)
    """Redis redelivers an unacknowledged message after this; longer than any drain."""
    unacked_restore_interval_secs: float = Field(default=10.0, gt=0)
    """How often a worker sweeps for messages whose visibility timeout has passed."""
    sweep_interval_secs: float = Field(default=15.0, gt=0)
    """How often the orchestrator worker fails operations past their deadline."""
    heartbeat_interval_secs: float = Field(default=15.0, gt=0)
    """Daemons send an activity heartbeat at least this often (and on every change)."""
    heartbeat_poll_secs: float = Field(default=1.0, gt=0)
    """How often a daemon's consumer looks for activity changes."""

    reconcile_interval_secs: float = Field(default=2.0, gt=0)
    """How often the operator re-examines each CalibanTask (idle, pause, wake, phase)."""
    manage_sandbox: bool = False
    """Provision each task's Sandbox and workspace PVC (``--manage-sandbox``)."""
    daemon_image: str = "ghcr.io/caliban-ai/caliban-drain:latest"
    """The image of the daemon container in provisioned Sandboxes."""
    daemon_broker_url: str | None = None
    """The broker URL daemons use (as seen from their pods); defaults to ``broker_url``."""

    def backend(self) -> str:
        if self.result_backend:
            return self.result_backend
        if self.broker_url.startswith("filesystem://"):
            return f"file://{self.broker_folder or '.'}/results"
        return self.broker_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
