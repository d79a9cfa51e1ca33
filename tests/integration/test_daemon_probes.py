"""The daemon's ``/healthz``, ``/readyz`` and ``/metrics`` (``--metrics-port``), on a real
``drainctl daemon`` with its Celery consumer and a real embedded broker: not ready while
its broker is unreachable (saying why in its log, "unavailable" to whoever probes),
ready once the broker comes; unready again
when the broker stops or stops answering after the consumer connected, while liveness
and the agents are untouched, and ready once it is back; its live agents counted."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.devcluster import broker
from orchestrator.devcluster.apiserver import DevClusterError
from tests.probe_support import fetch, scrape, value
from tests.support import DaemonProcess, wait_until
from worker_agent.proto import AgentRecord
from worker_agent.testing import Subprocess

NOT_CONNECTED_YET = "the consumer is not connected to the broker yet: "


def agents_live(url: str) -> float:
    return value(scrape(url), "caliban_drain_agents_live")


READY_REASON = "probe_failing component=daemon route=/readyz reason="


def unready_because(daemon: DaemonProcess, url: str) -> str:
    """Probe /readyz (a failing probe answers only "unavailable") and answer the reason
    the daemon logged for it: its latest ``probe_failing`` line for the route."""
    assert fetch(url + "/readyz") == (503, "unavailable\n")
    said = [
        line.split(READY_REASON, 1)[1]
        for line in daemon.log.read_text(errors="replace").splitlines()
        if READY_REASON in line
    ]
    assert said, "the daemon answered 503 without logging why"
    return said[-1]


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
    broker_port, metrics_port = broker.free_port(), broker.free_port()
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
        why = unready_because(daemon, url)
        assert why.startswith(
            ("the consumer process is not running", "the consumer has not reported")
        ) or why.startswith(NOT_CONNECTED_YET), why
        # The consumer's report names the broker's own error once it has tried.
        wait_until(lambda: unready_because(daemon, url).startswith(NOT_CONNECTED_YET), 60, "why")
        assert "Connection refused" in unready_because(daemon, url)
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


@dataclass
class Outage:
    """A ready daemon on its own embedded broker, one agent working: the broker's to lose."""

    broker: EmbeddedBroker
    daemon: DaemonProcess
    url: str
    agent: AgentRecord
    """As it was before the outage."""

    def unready_but_live(self) -> str:
        """Wait for /readyz to fail; check /healthz and the agent did not; answer why."""
        wait_until(lambda: fetch(self.url + "/readyz")[0] == 503, 60, "the daemon unready")
        why = unready_because(self.daemon, self.url)
        assert fetch(self.url + "/healthz") == (200, "ok\n")
        during = self.daemon.records()[self.agent.id]
        assert during.status.live and during.created_at == self.agent.created_at
        assert agents_live(self.url + "/metrics") == 1
        return why

    def ready_again(self) -> None:
        wait_until(lambda: fetch(self.url + "/readyz")[0] == 200, 90, "the daemon ready again")
        assert fetch(self.url + "/readyz") == (200, "ok\n")
        after = self.daemon.records()[self.agent.id]
        assert after.status.live and after.created_at == self.agent.created_at
        assert after.turns > self.agent.turns  # it kept working through the outage


@contextlib.contextmanager
def outage_stage(root: Path, queue: str) -> Iterator[Outage]:
    broker_port, metrics_port = broker.free_port(), broker.free_port()
    broker_url = f"redis://127.0.0.1:{broker_port}/0"
    url = f"http://127.0.0.1:{metrics_port}"
    embedded = EmbeddedBroker(root, broker_port).start()
    daemon = DaemonProcess(
        root, "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1", queue=queue,
        env={"DRAIN_BROKER_URL": broker_url, "DRAIN_RESULT_BACKEND": broker_url},
    )  # fmt: skip
    stage = None
    try:
        daemon.start()
        wait_until(lambda: fetch(url + "/readyz")[0] == 200, 90, "the daemon ready")
        [agent_id] = daemon.spawn(1, "turns=100000,turn_ms=100")
        stage = Outage(embedded, daemon, url, daemon.records()[agent_id])
        yield stage
    finally:
        daemon.stop()
        (stage.broker if stage else embedded).stop()


@pytest.mark.slow
def test_a_daemon_whose_broker_stops_is_unready_but_live_and_its_agent_keeps_working(
    tmp_short: Path,
) -> None:
    """A broker lost after the consumer connected (its process gone, its connections
    closed): /readyz turns 503 and the log says why, /healthz stays 200 (a broker outage must not
    get every daemon restarted), the agent keeps working; the broker back on its port,
    the daemon is ready again. Default probe timing."""
    with outage_stage(tmp_short, "caliband.default.stopped") as stage:
        stage.broker.stop()
        why = stage.unready_but_live()
        assert why.startswith(
            ("the consumer lost its broker connection", "the consumer's broker does not answer")
        ), why
        # the broker's own error: refused once it is gone, or a reset when the stop caught
        # the consumer mid-read (seen in CI)
        assert "Connection refused" in why or "Connection reset by peer" in why, why

        stage.broker = EmbeddedBroker(tmp_short, stage.broker.port).start()
        stage.ready_again()


@pytest.mark.slow
def test_a_daemon_whose_broker_stops_answering_is_unready_until_it_answers_again(
    tmp_short: Path,
) -> None:
    """A broker that keeps its connections open but answers nothing (frozen with
    SIGSTOP, as a partitioned or hung broker looks): the consumer's worker does not
    notice, its fresh-connection check times out, and /readyz says so; /healthz and the
    agent are untouched; thawed, the daemon is ready again. Default probe timing."""
    with outage_stage(tmp_short, "caliband.default.frozen") as stage:
        os.kill(stage.broker.pid, signal.SIGSTOP)
        try:
            why = stage.unready_but_live()
        finally:
            os.kill(stage.broker.pid, signal.SIGCONT)
        assert why.startswith("the consumer's broker does not answer: "), why
        assert "Timeout" in why, why

        stage.ready_again()
