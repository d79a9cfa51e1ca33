"""The daemon's settings, in one typed place, read from ``DRAIN_DAEMON_*`` variables.

``drainctl daemon`` options override them. Nothing else in ``worker_agent`` reads the
environment for configuration (workers get theirs from the daemon at spawn).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker_agent.layout import default_socket
from worker_agent.proto import MAX_GRACE_SECS

LISTEN_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$"
"""``HOST:PORT``, with an IPv6 host in brackets."""

DEFAULT_WORKER_COMMAND = (
    "{python} -m worker_agent.worker __agent-worker"
    " --manifest {manifest} --socket {socket} --control-socket {control_socket}"
)
"""How the reference worker is launched: upstream caliban's worker arguments, so a real
caliban fits as ``caliban __agent-worker --manifest {manifest} --socket {socket}
--control-socket {control_socket}``. ``WORKER_ARGUMENTS`` lists the placeholders."""

WORKER_ARGUMENTS = {
    "python": "the daemon's Python interpreter",
    "manifest": "the agent's manifest.json (its AgentRecord; spec.resume_session on a resume)",
    "socket": "the agent's attach socket, which the worker binds",
    "control_socket": "the daemon's control socket, for report_status",
    "session_dir": "the agent's session directory",
    "agent_id": "the agent's id",
    "provider": "spec.provider, or empty for the worker's default",
    "model": "spec.model, or empty",
    "resume": "--resume when continuing a session, else nothing (older workers)",
}


class DaemonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DRAIN_DAEMON_", extra="ignore")

    store: Path = Path("./caliban-store")
    socket: Path | None = None
    """Unix control socket; defaults to ``<store>/run/caliband.sock``."""
    listen: str | None = Field(default=None, pattern=LISTEN_PATTERN)
    """``HOST:PORT`` for the network transport (TLS and a bearer token required)."""
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    worker_command: str = DEFAULT_WORKER_COMMAND
    python: str = Field(default_factory=lambda: sys.executable)
    drain_grace_secs: float = Field(default=30.0, ge=0, le=MAX_GRACE_SECS, allow_inf_nan=False)
    """Grace used when the daemon itself is told to stop (SIGTERM, ``shutdown``)."""
    max_agents: int = Field(default=300, ge=1, le=10_000)
    """Agents one daemon keeps at most (live or not); a spawn past it is refused."""
    worker_nice: int = Field(default=5, ge=0, le=19)
    """How much lower than the daemon's own the scheduling priority of its workers is
    (nice levels). A daemon shares its CPUs with its agents: at equal priority a hundred
    busy workers leave it a hundredth of a core, and a drain request (a pod being
    deleted, within its grace period) waits behind their status reports. 0 runs them
    at the daemon's priority."""
    kill_grace_secs: float = Field(default=5.0, ge=0, le=MAX_GRACE_SECS, allow_inf_nan=False)
    """How long ``kill`` waits after SIGTERM before SIGKILL."""
    queue: str | None = Field(default=None, pattern=r"^caliband\.[a-z0-9-]+\.[a-z0-9.-]+$")
    """``caliband.<namespace>.<name>``: run the Celery consumer of this queue beside the
    supervisor (``DRAIN_DAEMON_QUEUE``)."""
    broker_url: str | None = None
    """The consumer's broker; defaults to ``DRAIN_BROKER_URL``."""
    task_uid: str | None = None
    """The CalibanTask uid this pod serves, carried in heartbeats."""
    metrics_port: int = Field(default=9102, ge=0, le=65535)
    """``/metrics``, ``/healthz`` and ``/readyz`` on this port; 0 serves none."""
    metrics_host: str = "0.0.0.0"  # noqa: S104 - a pod's port, reached through its IP
    initial_agents: int = Field(default=0, ge=0, le=64)
    """Agents to spawn when the store holds none yet (a fresh workspace); a store with
    agents (a restart, a resume, a restore) is left for ``resume`` to continue."""
    initial_provider: str = "scripted"
    initial_model: str | None = None
    initial_prompt: str | None = None

    @field_validator("listen")
    @classmethod
    def _port_in_range(cls, value: str | None) -> str | None:
        if value is not None and not 0 <= int(value.rpartition(":")[2]) <= 65535:
            raise ValueError(f"--listen {value!r}: the port must be from 0 to 65535")
        return value

    def socket_path(self) -> Path:
        return self.socket if self.socket is not None else default_socket(self.store)
