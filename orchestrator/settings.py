"""The orchestrator's settings, in one typed place, read from ``DRAIN_*`` variables.

The Celery app, the ledger, the operator and ``drainctl`` all take their configuration
from ``Settings``; no module reads the environment for configuration on its own.
``Settings`` extends the contract's ``BrokerSettings`` (broker, result backend,
visibility timeout, heartbeat timing), which the daemon's consumer reads as well, so
each of those is declared once, in ``worker_agent.contract``.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from worker_agent.contract import BrokerSettings


class Settings(BrokerSettings):
    model_config = SettingsConfigDict(env_prefix="DRAIN_", extra="ignore")

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
    sweep_interval_secs: float = Field(default=15.0, gt=0)
    """How often the orchestrator worker fails operations past their deadline."""

    reconcile_interval_secs: float = Field(default=2.0, gt=0)
    """How often the operator re-examines each CalibanTask (idle, pause, wake, phase)."""
    manage_sandbox: bool = False
    """Provision each task's Sandbox and workspace PVC (``--manage-sandbox``)."""
    daemon_image: str = "ghcr.io/caliban-ai/caliban-drain:latest"
    """The image of the daemon container in provisioned Sandboxes."""
    daemon_broker_url: str | None = None
    """The broker URL daemons use (as seen from their pods); defaults to ``broker_url``."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
