"""The daemon's ``/healthz``, ``/readyz`` and ``/metrics`` (``--metrics-port``), on a real
``drainctl daemon`` with its Celery consumer: not ready while its broker is unreachable
(and saying why), ready once the broker comes; its live agents counted."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from orchestrator.devcluster import broker
from orchestrator.devcluster.apiserver import DevClusterError
from tests.probe_support import fetch, scrape, value
from tests.support import DaemonProcess, wait_until
from worker_agent.testing import Subprocess


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def agents_live(url: str) -> float:
    return value(scrape(url), "caliban_drain_agents_live")


class EmbeddedBroker(Subprocess):
    what = "the embedded broker"

    def __init__(self, root: Path, port: int) -> None:
        self.port = port
        argv = [sys.executable, "-m", "orchestrator.devcluster.broker", "--port", str(port)]
        super().__init__(argv, root / "broker.log", {})

    def ready(self) -> bool:
        self.check_alive(self.what)
        try:
            broker.wait_serving(self.port, within=0.5)
        except DevClusterError:
            return False
        return True


def test_a_daemon_is_live_but_not_ready_until_its_consumer_reaches_the_broker(
    tmp_short: Path,
) -> None:
    broker_port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{metrics_port}"
    daemon = DaemonProcess(
        tmp_short, "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
        queue="caliband.default.probed",
        env={"DRAIN_BROKER_URL": f"redis://127.0.0.1:{broker_port}/0",
             "DRAIN_RESULT_BACKEND": f"redis://127.0.0.1:{broker_port}/0"},
    ).start()  # fmt: skip
    embedded = None
    try:
        assert fetch(url + "/healthz") == (200, "ok\n")
        status, why = fetch(url + "/readyz")
        assert status == 503
        assert why.startswith(
            ("the consumer is not consuming yet", "the consumer process is not running")
        )
        with daemon.client() as client:
            client.spawn(provider="scripted", model="turns=1000,turn_ms=100")
        wait_until(lambda: agents_live(url + "/metrics") == 1, 30, "one agent live")

        embedded = EmbeddedBroker(tmp_short, broker_port).start()
        wait_until(lambda: fetch(url + "/readyz")[0] == 200, 90, "the daemon ready")
        assert fetch(url + "/readyz") == (200, "ok\n")
    finally:
        daemon.stop()
        if embedded is not None:
            embedded.stop()
