"""The testing kit, orchestrator half: ``drainctl worker`` and ``drainctl dev up`` as real
subprocesses, and the servers they share (a flushed Redis database, a fresh ledger).

Built on ``worker_agent.testing`` (the daemon half, which imports nothing from here):
the same ``Subprocess`` lifecycle — own session, SIGTERM then SIGKILL of the group and
every descendant seen, nothing left running when the interpreter exits. Tests, the
benchmarks and ``drainctl demo`` use it; nothing here knows about pytest, so a caller
turns ``ServerUnavailable`` into a skip or an error message as it sees fit.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import yaml

from orchestrator.operator import crd
from worker_agent.testing import (
    DRAINCTL,
    DaemonProcess,
    Subprocess,
    WaitTimeout,
    child_env,
    wait_until,
)

__all__ = [
    "DaemonProcess",
    "DevStackProcess",
    "OperatorProcess",
    "ServerUnavailable",
    "WaitTimeout",
    "WorkerProcess",
    "flushed_redis",
    "fresh_ledger",
    "wait_until",
]

REDIS_HINT = (
    "Redis not reachable on 127.0.0.1:{port}; start it with: redis-server --daemonize yes "
    '--bind 127.0.0.1 --port {port} --save "" --appendonly no'
)
PG_HINT = (
    "PostgreSQL not reachable at {url}; start it with: "
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
)
LEDGER_TABLES = ("checkpoint_agents", "checkpoints", "operations", "daemon_activity")
CRD_PATH = f"/apis/{crd.GROUP}/{crd.VERSION}"
"""Served once the dev stack's API has its CalibanTask CRD: the stack's readiness probe."""


class ServerUnavailable(Exception):
    """Redis or PostgreSQL is not reachable; the message says how to start it."""


def flushed_redis(port: int = 6379, db: int = 9) -> str:
    """The URL of database ``db`` of the Redis on 127.0.0.1:``port``, flushed."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, db=db, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.ConnectionError:
        raise ServerUnavailable(REDIS_HINT.format(port=port)) from None
    finally:
        client.close()
    return f"redis://127.0.0.1:{port}/{db}"


def fresh_ledger(url: str) -> str:
    """``url`` with the ledger migrated to head; on PostgreSQL its tables dropped first."""
    import sqlalchemy as sa

    from orchestrator.ledger.migrate import upgrade

    if not url.startswith("sqlite"):
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                for table in (*LEDGER_TABLES, "alembic_version"):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {table} CASCADE"))
        except sa.exc.OperationalError:
            raise ServerUnavailable(PG_HINT.format(url=url)) from None
        finally:
            engine.dispose()
    upgrade(url)
    return url


def pipeline_env(broker: str, database: str, **extra: str) -> dict[str, str]:
    """The environment that points a stack's processes at ``broker`` (its broker and
    result backend) and the ledger ``database``, plus ``extra`` settings."""
    return {
        "DRAIN_BROKER_URL": broker,
        "DRAIN_RESULT_BACKEND": broker,
        "DRAIN_DATABASE_URL": database,
        **extra,
    }


_READY = re.compile(r"@\S+ ready\.")


class WorkerProcess(Subprocess):
    """``drainctl worker`` (queue ``orchestrator``), ready when Celery logs ``… ready.``
    (it has connected to the broker and consumes)."""

    def __init__(
        self, log: Path, env: Mapping[str, str] | None = None, *, concurrency: int = 2
    ) -> None:
        argv = [*DRAINCTL, "worker", "--concurrency", str(concurrency)]
        super().__init__(argv, log, child_env(env))

    what = "the orchestrator worker"
    ready_timeout = 60.0

    def ready(self) -> bool:
        self.check_alive(self.what)
        return bool(_READY.search(self.log_text()))


class OperatorProcess(Subprocess):
    """``drainctl operator --manage-sandbox`` serving kopf's liveness probe on
    ``127.0.0.1:liveness_port/healthz``, ready once the probe answers 200 (kopf serves it
    after its startup handlers, an active replica or a paused standby alike). With
    ``peering``, one of several replicas; ``identity`` is its key in the peering object's
    status (kopf takes it from ``POD_ID``, as in a pod)."""

    def __init__(
        self,
        log: Path,
        env: Mapping[str, str],
        *,
        liveness_port: int,
        peering: str | None = None,
        identity: str | None = None,
    ) -> None:
        self.liveness_url = f"http://127.0.0.1:{liveness_port}/healthz"
        self.identity = identity
        argv = [*DRAINCTL, "operator", "--manage-sandbox", "--liveness", self.liveness_url]
        if peering is not None:
            argv += ["--peering", peering]
        extra = {"POD_ID": identity} if identity is not None else {}
        super().__init__(argv, log, child_env({**env, **extra}))

    what = "drainctl operator (until its liveness probe answers)"
    ready_timeout = 60.0

    def ready(self) -> bool:
        self.check_alive(self.what)
        return self.liveness_status() == 200

    def liveness_status(self) -> int | None:
        """The HTTP status of GET on the liveness URL; None when nothing answers."""
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=5) as response:  # noqa: S310
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None


class DevStackProcess(Subprocess):
    """``drainctl dev up`` in ``root`` (kubeconfig ``root/kubeconfig.yaml``, state
    ``root/state``), ready when the kubeconfig exists and its API serves the CalibanTask
    CRD."""

    def __init__(
        self, root: Path, *extra: str, env: Mapping[str, str] | None = None, log_level: str = "INFO"
    ) -> None:
        self.root = root
        self.kubeconfig = root / "kubeconfig.yaml"
        self.state = root / "state"
        argv = [
            *DRAINCTL, "dev", "up", "--kubeconfig", str(self.kubeconfig),
            "--state-dir", str(self.state), "--log-level", log_level, *extra,
        ]  # fmt: skip
        super().__init__(argv, root / "dev-up.log", child_env(env))

    what = f"drainctl dev up (until it serves {CRD_PATH})"
    ready_timeout = 90.0

    def ready(self) -> bool:
        self.check_alive(self.what)
        if not self.kubeconfig.exists():
            return False
        try:
            return self.api_get(CRD_PATH) is not None
        except OSError:
            return False

    def api_get(self, path: str) -> dict[str, object] | None:
        """GET ``path`` from the stack's API (its kubeconfig's server and token); None on
        404. The server is the embedded API on 127.0.0.1."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        server = str(config["clusters"][0]["cluster"]["server"])
        token = str(config["users"][0]["user"]["token"])
        if not server.startswith(("http://127.0.0.1:", "https://127.0.0.1:")):
            raise ValueError(f"{self.kubeconfig}: {server} is not the embedded API on 127.0.0.1")
        headers = {"Authorization": f"Bearer {token}"}
        request = urllib.request.Request(server + path, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                loaded: dict[str, object] = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return loaded
