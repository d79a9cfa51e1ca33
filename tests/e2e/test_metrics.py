"""The metrics of the operator, the orchestrator worker and the daemon, scraped over HTTP
from a dev stack on its embedded defaults (embedded broker, SQLite ledger, free loopback
ports from ``<state>/metrics.json`` and ``<state>/sandboxes/daemon-metrics/``): a task
runs, is deleted (one clean drain) and restored, and each counter moves by exactly what
that did."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from orchestrator.devcluster.sandbox_controller import DAEMON_METRICS_DIR
from orchestrator.devcluster.up import METRICS_FILE, SANDBOXES_DIR
from orchestrator.operator import crd
from tests.e2e.support import DevStack, embedded_stack, task_manifest
from tests.probe_support import Samples, fetch, scrape, value
from tests.support import wait_until
from worker_agent.contract import DAEMON_RESUME, RECORD_CHECKPOINT

pytestmark = pytest.mark.slow


def moved(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def scrape_when(url: str, counted: Callable[[Samples], bool], what: str) -> Samples:
    """A scrape of ``url`` once ``counted`` holds for it (a count written after the
    event the test awaited, e.g. a resume's, in another process)."""
    return wait_until(lambda: s if counted(s := scrape(url)) else None, 60, what)


def base(url: str) -> str:
    return url.removesuffix("/metrics")


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    with embedded_stack("cd-metrics-") as dev:
        yield dev


def urls(stack: DevStack) -> dict[str, str]:
    path = stack.state / METRICS_FILE
    found: dict[str, Any] = wait_until(
        lambda: json.loads(path.read_text()) if path.exists() else None, 30, str(path)
    )
    served = {k: str(v) for k, v in found.items()}
    for url in (served["operator"], served["worker"]):
        wait_until(answering(url), 60, f"{url} to answer")
    return served


def answering(url: str) -> Callable[[], bool]:
    return lambda: fetch(url)[0] == 200


def daemon_url(stack: DevStack, name: str) -> str:
    """The metrics URL of task ``name``'s daemon, which the stand-in files by Sandbox."""
    sandbox = crd.sandbox_name(name)
    path = stack.state / SANDBOXES_DIR / DAEMON_METRICS_DIR / f"default.{sandbox}"
    url = str(wait_until(lambda: path.exists() and path.read_text().strip(), 60, str(path)))
    wait_until(lambda: fetch(base(url) + "/readyz")[0] == 200, 60, f"{url} ready")
    return url


def test_a_drain_and_a_restore_move_each_counter_by_exactly_what_they_did(
    stack: DevStack,
) -> None:
    served = urls(stack)
    worker_url, operator_url = served["worker"], served["operator"]
    assert fetch(base(worker_url) + "/healthz")[0] == 200
    wait_until(lambda: fetch(base(worker_url) + "/readyz")[0] == 200, 30, "the worker ready")

    assert stack.apply(task_manifest("metered", agents=2)).returncode == 0
    stack.wait_phase("default", "metered", "Running")
    pvc = stack.pvc_of("metered")
    stack.wait_turns(pvc, 2, 2)
    daemon = daemon_url(stack, "metered")
    assert fetch(base(daemon) + "/healthz")[0] == 200
    before_drain = scrape(daemon)
    assert value(before_drain, "caliban_drain_agents_live") == 2
    assert value(before_drain, "caliban_drain_lost_turns_total") == 0
    worker0, operator0 = scrape(worker_url), scrape(operator_url)

    stack.kubectl("delete", "ctask", "metered", timeout=120)
    checkpoint = stack.ledger.latest_checkpoint("default", "metered")
    assert checkpoint is not None and checkpoint.verified
    worker1, operator1 = scrape(worker_url), scrape(operator_url)

    drain = {"kind": "delete-drain", "outcome": "recorded"}
    assert moved(worker1, worker0, "caliban_drain_drain_duration_seconds_count", **drain) == 1
    assert moved(worker1, worker0, "caliban_drain_operations_total",
                 kind="delete-drain", state="recorded") == 1  # fmt: skip
    assert moved(worker1, worker0, "caliban_drain_checkpoints_recorded_total", reason="delete") == 1
    assert moved(worker1, worker0, "caliban_drain_queue_wait_seconds_count",
                 task=RECORD_CHECKPOINT) == 1  # fmt: skip
    for outcome in ("forced", "failed", "expired"):
        assert moved(worker1, worker0, "caliban_drain_drain_duration_seconds_count",
                     kind="delete-drain", outcome=outcome) == 0  # fmt: skip
    assert value(operator1, "caliban_drain_forced_deletes_total") == 0
    assert value(operator1, "caliban_drain_checkpoints_recorded_total", reason="forced") == 0
    assert moved(operator1, operator0, "caliban_drain_drain_duration_seconds_count", **drain) == 0

    restored = task_manifest("metered-again", agents=2)
    restored["spec"]["resumeFrom"] = {"checkpointRef": checkpoint.ref}
    assert stack.apply(restored).returncode == 0
    stack.wait_phase("default", "metered-again", "Running")
    daemon = daemon_url(stack, "metered-again")
    resumed = scrape_when(
        daemon,
        lambda s: value(s, "caliban_drain_daemon_resume_duration_seconds_count", outcome="ok") > 0,
        "the daemon's resume to be counted",
    )
    assert value(resumed, "caliban_drain_daemon_resume_duration_seconds_count", outcome="ok") == 1
    assert value(resumed, "caliban_drain_queue_wait_seconds_count",
                 task=DAEMON_RESUME) == 1  # fmt: skip
    assert value(resumed, "caliban_drain_lost_turns_total") == 0
    wait_until(lambda: value(scrape(daemon), "caliban_drain_agents_live") == 2, 30, "2 agents live")
    restore = {"kind": "restore", "outcome": "resumed"}
    worker2 = scrape_when(
        worker_url,
        lambda s: moved(s, worker1, "caliban_drain_resume_duration_seconds_count", **restore) > 0,
        "the worker to count the restore",
    )
    assert moved(worker2, worker1, "caliban_drain_resume_duration_seconds_count", **restore) == 1
    assert moved(worker2, worker1, "caliban_drain_operations_total",
                 kind="restore", state="resumed") == 1  # fmt: skip


def test_a_running_task_at_rest_costs_the_operator_no_pass(stack: DevStack) -> None:
    """The operator reacts to events, not to a timer: while a Running task's daemon keeps
    sending heartbeats that say nothing new, its steward runs no pass (a timer per task
    ran one every reconcile interval, 1 s here)."""
    operator_url = urls(stack)["operator"]
    assert stack.apply(task_manifest("resting", agents=1)).returncode == 0
    stack.wait_phase("default", "resting", "Running")
    stack.wait_turns(stack.pvc_of("resting"), 1, 1)
    causes = ("start", "event", "ledger", "clock")

    def passes() -> dict[str, float]:
        samples = scrape(operator_url)
        return {c: value(samples, "caliban_drain_operator_passes_total", cause=c) for c in causes}

    def quiet() -> dict[str, float] | None:
        """The counts, if no pass ran for 3 s (those that brought it to Running done)."""
        before = passes()
        time.sleep(3)
        return before if passes() == before else None

    settled = wait_until(quiet, 60, "the operator to settle")
    first = stack.ledger.get_activity("default", "resting")
    assert first is not None
    time.sleep(12)  # more than two heartbeat intervals (5 s on the dev stack)
    later = stack.ledger.get_activity("default", "resting")
    assert later is not None and later.received_at and first.received_at
    assert later.received_at > first.received_at  # the daemon kept reporting
    after = passes()
    assert after["event"] == settled["event"]
    assert after["ledger"] == settled["ledger"]
    # The resync falls at a random moment within its first interval (300 s): rarely here.
    assert after["clock"] - settled["clock"] <= 1, (settled, after)
    assert stack.status("default", "resting")["phase"] == "Running"
    stack.kubectl("delete", "ctask", "resting", timeout=120)
