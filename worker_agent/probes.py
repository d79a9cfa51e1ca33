"""The daemon's ``/metrics``, ``/healthz`` and ``/readyz`` (``--metrics-port``, 9102).

- ``/healthz``: the supervisor's event loop is alive: a task on it stamps a tick every
  second, and the probe fails once no tick came for :data:`STALL_SECS` (a wedged loop
  serves no control request, so the pod should be restarted);
- ``/readyz``: the control socket answers a ``status`` request and, when the daemon
  runs a consumer, the consumer process is running and connected to its broker *now*:
  its latest broker report (``worker_agent.broker_state``, a file in the metrics dir)
  comes from the consumer process running now, is at most ``broker_state.STALE_SECS``
  old, and says its worker is connected and the broker answered a fresh connection
  within ``broker_state.CHECK_TIMEOUT_SECS``. A broker lost after the consumer
  connected makes the daemon unready within one report (``broker_state.CHECK_SECS``),
  its log saying why (the probe itself answers only "unavailable"); it is ready again
  once the worker has reconnected.

A lost broker fails readiness only, never liveness: a broker outage reaches every
daemon at once, and a liveness failure would have Kubernetes restart them all and kill
every agent they run, while a daemon without its broker still serves its agents and its
control socket, and its consumer reconnects by itself when the broker is back.

The server runs on its own thread, so a probe never waits on the loop it checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Final

from worker_agent import broker_state, metrics
from worker_agent.children import KeptProcess
from worker_agent.settings import DaemonSettings
from worker_agent.supervisor import Supervisor

TICK_SECS: Final = 1.0
STALL_SECS: Final = 10.0
STATUS_TIMEOUT_SECS: Final = 2.0


class DaemonProbes:
    """The daemon's metrics server and the state its probes read."""

    def __init__(self, settings: DaemonSettings, supervisor: Supervisor) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.last_tick = time.monotonic()
        self.consumer: KeptProcess | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="caliban-drain-metrics-"))
        """The consumer's multiprocess files and its ready marker; removed at close."""
        self.server: metrics.MetricsServer | None = None
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        metrics.AGENTS_LIVE.set_function(
            lambda: sum(1 for agent in self.supervisor.registry if agent.live)
        )
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self.server = metrics.serve(
            self.settings.metrics_host,
            self.settings.metrics_port,
            metrics.daemon_registry(self.dir),
            {"/healthz": self.healthz, "/readyz": self.readyz},
            "daemon",
        )

    def watch_consumer(self, consumer: KeptProcess) -> None:
        """Hand ``consumer`` (not started yet) the metrics dir; readiness waits for it."""
        consumer.env[metrics.MULTIPROC_ENV] = str(self.dir)
        self.consumer = consumer

    async def _tick(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(TICK_SECS)

    def healthz(self) -> str | None:
        """Only the supervisor's own loop: never the broker (see the module docstring)."""
        stalled = time.monotonic() - self.last_tick
        if stalled > STALL_SECS:
            return f"the supervisor's loop has not run for {stalled:.0f}s"
        return None

    def readyz(self) -> str | None:
        from worker_agent.client import SupervisorClient

        try:
            with SupervisorClient(
                socket_path=self.supervisor.socket_path, timeout=STATUS_TIMEOUT_SECS
            ) as client:
                client.call("status")
        except Exception as exc:  # unreachable, refused, timed out: not ready
            return f"the control socket does not answer: {exc}"
        if self.consumer is None:
            return None
        process = self.consumer.process
        if process is None or process.returncode is not None:
            return "the consumer process is not running"
        report, written = broker_state.read(self.dir)
        return broker_state.verdict(report, time.time() - written, process.pid)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self.server is not None:
            self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)
