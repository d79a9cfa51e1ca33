"""The metrics' pure parts, the ledger counting each finished operation once, the probes'
HTTP server, and ``deploy/monitoring``: every metric the dashboard and the alert rules
name is one the code's registries define, and the rules file is Prometheus rule groups."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from orchestrator import metrics
from orchestrator.audit.loud import AuditMetrics
from orchestrator.ledger import CheckpointReason, Ledger, OperationKind, OperationState, upgrade
from orchestrator.pipeline.probes import broker_problem, ledger_problem
from tests.probe_support import fetch, parse
from worker_agent import metrics as daemon_metrics
from worker_agent.consumer import resume_outcome
from worker_agent.contract import CHECKPOINT_MISMATCH, BrokerSettings, make_celery
from worker_agent.proto import ResumeRef

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "prometheus-rules.yaml"

SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}


def served_names(registry: CollectorRegistry) -> set[str]:
    """Every series name ``registry`` exposes, read from its collectors' families."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def code_names() -> set[str]:
    registries = [
        metrics.REGISTRY, daemon_metrics.SUPERVISOR, daemon_metrics.CONSUMER,
        AuditMetrics().registry,
    ]  # fmt: skip
    return set().union(*(served_names(r) for r in registries))


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\bcaliban_drain_[a-z0-9_]+", expr))


def dashboard_exprs() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in document["panels"] for t in p.get("targets", [])]


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


# ------------------------------------------------------------------- deploy/monitoring


def test_every_metric_the_dashboard_shows_is_one_the_code_serves() -> None:
    used = set().union(*(names_in(e) for e in dashboard_exprs()))
    assert used, "the dashboard names no metric"
    assert used - code_names() == set()


def test_every_metric_an_alert_rule_reads_is_one_the_code_serves() -> None:
    used = set().union(*(names_in(r["expr"]) for g in rule_groups() for r in g["rules"]))
    assert used, "the rules name no metric"
    assert used - code_names() == set()


def test_the_dashboard_has_a_panel_for_each_thing_an_operator_watches() -> None:
    used = set().union(*(names_in(e) for e in dashboard_exprs()))
    assert {
        "caliban_drain_drain_duration_seconds_count",
        "caliban_drain_drain_duration_seconds_bucket",
        "caliban_drain_forced_deletes_total",
        "caliban_drain_checkpoints_recorded_total",
        "caliban_drain_resume_duration_seconds_bucket",
        "caliban_drain_agents_live",
        "caliban_drain_queue_wait_seconds_bucket",
        "caliban_drain_lost_turns_total",
    } <= used
    assert any('up{job="caliban-drain-operator"}' in e for e in dashboard_exprs())


def test_the_dashboard_is_grafana_json_with_unique_panel_ids_on_the_grid() -> None:
    document = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in document["panels"]]
    assert len(ids) == len(set(ids))
    for panel in document["panels"]:
        assert panel["type"] in ("timeseries", "stat")
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        assert panel["targets"] and all(t["refId"] and t["expr"] for t in panel["targets"])
    assert document["templating"]["list"][0]["type"] == "datasource"


def test_the_rules_file_is_prometheus_rule_groups_with_the_four_alerts() -> None:
    groups = rule_groups()
    assert [set(g) <= {"name", "interval", "rules", "limit"} for g in groups] == [True] * len(
        groups
    )
    alerts = [r for g in groups for r in g["rules"]]
    for rule in alerts:
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert isinstance(rule["alert"], str) and isinstance(rule["expr"], str)
        assert rule["labels"]["severity"] in ("warning", "critical")
        if "for" in rule:
            assert re.fullmatch(r"\d+[smhd]", rule["for"])
    names = [r["alert"] for r in alerts]
    assert len(names) == len(set(names))
    assert {
        "CalibanDrainDrainFailures", "CalibanDrainForcedDelete", "CalibanDrainLostTurns",
        "CalibanDrainOperatorDown",
    } <= set(names)  # fmt: skip
    down = next(r for r in alerts if r["alert"] == "CalibanDrainOperatorDown")
    assert "absent(up{" in down["expr"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("recorded", "found", "lost"),
    [
        pytest.param(5, 3, 2, id="went-back"),
        pytest.param(5, 5, 0, id="same"),
        pytest.param(5, 7, 0, id="moved-on"),
        pytest.param(None, 3, 0, id="nothing-recorded"),
        pytest.param(5, None, 0, id="unreadable"),
    ],
)
def test_lost_turns_are_only_those_a_workspace_went_back_on(
    recorded: int | None, found: int | None, lost: int
) -> None:
    assert daemon_metrics.lost_turns(recorded, found) == lost


@pytest.mark.parametrize(
    ("sent_at", "eta", "started", "wait"),
    [
        pytest.param(100.0, None, 102.5, 2.5, id="from-sent"),
        pytest.param(100.0, "1970-01-01T00:01:50+00:00", 112.0, 2.0, id="from-a-later-eta"),
        pytest.param(100.0, "1970-01-01T00:01:00+00:00", 101.0, 1.0, id="an-earlier-eta"),
        pytest.param(100.0, None, 99.0, 0.0, id="clock-skew-is-0"),
        pytest.param(None, None, 99.0, None, id="unstamped"),
        pytest.param(True, None, 99.0, None, id="not-a-number"),
        pytest.param(100.0, "garbage", 101.0, 1.0, id="bad-eta-ignored"),
    ],
)
def test_queue_wait_counts_from_the_sent_stamp_or_a_later_eta(
    sent_at: object, eta: object, started: float, wait: float | None
) -> None:
    assert daemon_metrics.queue_wait(sent_at, eta, started) == wait


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        pytest.param({"error": None, "results": [{"ok": True}, {"ok": True}]}, "ok", id="ok"),
        pytest.param({"error": None, "results": []}, "ok", id="nothing-to-resume"),
        pytest.param(
            {"error": None, "results": [{"ok": True}, {"ok": False}]}, "partial", id="partial"
        ),
        pytest.param({"error": None, "results": [{"ok": False}]}, "failed", id="all-failed"),
        pytest.param({"error": "supervisor unreachable", "results": []}, "failed", id="error"),
        pytest.param(
            {"error": f"{CHECKPOINT_MISMATCH}; no agent was resumed", "results": []},
            "refused",
            id="refused",
        ),
        pytest.param(None, "failed", id="no-answer"),
    ],
)
def test_a_resume_answer_has_one_outcome(answer: object, outcome: str) -> None:
    assert resume_outcome(answer) == outcome


# ----------------------------------------------------- counted where operations finish


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    ledger = Ledger.from_url(url)
    metrics.count_outcomes()
    yield ledger
    ledger.dispose()


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def begin(ledger: Ledger, key: str, kind: OperationKind = OperationKind.DELETE_DRAIN) -> str:
    op = ledger.begin_operation(
        kind, task_uid=f"uid-{key}", namespace="default", name=key, idempotency_key=key
    )
    return op.id


REF = ResumeRef(
    id="agent-1",
    session_dir="agents/agent-1",
    turns=3,
    session_sha256="0" * 64,
    clean=True,
    exit=0,
)


def test_a_recorded_drain_is_counted_once_however_often_its_record_is_redelivered(
    ledger: Ledger,
) -> None:
    drain = {"kind": "delete-drain", "outcome": "recorded"}
    before = (
        sample("caliban_drain_drain_duration_seconds_count", **drain),
        sample("caliban_drain_operations_total", kind="delete-drain", state="recorded"),
        sample("caliban_drain_checkpoints_recorded_total", reason="delete"),
    )
    op_id = begin(ledger, "recorded-once")
    for _ in range(3):  # the first records; redeliveries answer the same checkpoint
        ledger.record_checkpoint(op_id, [REF], reason=CheckpointReason.DELETE)
    ledger.expire_operation(op_id, "too late")  # finished already: nothing happens

    after = (
        sample("caliban_drain_drain_duration_seconds_count", **drain),
        sample("caliban_drain_operations_total", kind="delete-drain", state="recorded"),
        sample("caliban_drain_checkpoints_recorded_total", reason="delete"),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        pytest.param("deadline passed in state pending", "expired", id="deadline"),
        pytest.param(f"{metrics.SUPERSEDED_BY_FORCE}: no daemon", "forced", id="superseded"),
    ],
)
def test_an_expired_drain_is_expired_or_forced_by_why(
    ledger: Ledger, error: str, outcome: str
) -> None:
    labels = {"kind": "pause", "outcome": outcome}
    before = sample("caliban_drain_drain_duration_seconds_count", **labels)
    op_id = begin(ledger, f"expiring-{outcome}", OperationKind.PAUSE)
    ledger.expire_operation(op_id, error)
    ledger.expire_operation(op_id, error)
    assert sample("caliban_drain_drain_duration_seconds_count", **labels) - before == 1


def test_a_failed_resume_is_a_resume_duration_not_a_drain_duration(ledger: Ledger) -> None:
    labels = {"kind": "resume", "outcome": "failed"}
    before = sample("caliban_drain_resume_duration_seconds_count", **labels)
    drains_before = sample("caliban_drain_drain_duration_seconds_count", **labels)
    op_id = begin(ledger, "resume-fails", OperationKind.RESUME)
    ledger.transition(op_id, OperationState.FAILED, error="no agent came back")
    assert sample("caliban_drain_resume_duration_seconds_count", **labels) - before == 1
    assert sample("caliban_drain_drain_duration_seconds_count", **labels) == drains_before


# ---------------------------------------------------------------------- probe server


def test_the_probe_server_answers_a_generic_503_and_logs_why_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Tried: a check failing with a reason that names the broker's address, three probes
    in a row, then a different reason, then healthy. The body never carries the reason
    (whoever reaches the port reads only "unavailable"); the log says it once per change."""
    registry = CollectorRegistry()
    reason = ["the broker redis://broker.internal:6379/0 is unreachable"]
    checks = {"/healthz": lambda: None, "/readyz": lambda: reason[0] or None}
    server = daemon_metrics.MetricsServer("127.0.0.1", 0, registry, checks, "test").start()
    caplog.set_level(logging.INFO, logger=daemon_metrics.__name__)
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert fetch(base + "/healthz") == (200, "ok\n")
        for _ in range(3):
            assert fetch(base + "/readyz") == (503, "unavailable\n")
        reason[0] = "the consumer has not reported"
        assert fetch(base + "/readyz") == (503, "unavailable\n")
        reason[0] = ""
        assert fetch(base + "/readyz") == (200, "ok\n")
        assert fetch(base + "/nothing")[0] == 404
        status, text = fetch(base + "/metrics")
        assert status == 200
        assert parse(text) == {}
    finally:
        server.close()
    said = [r.getMessage() for r in caplog.records if "route=/readyz" in r.getMessage()]
    assert said == [
        "probe_failing component=test route=/readyz "
        "reason=the broker redis://broker.internal:6379/0 is unreachable",
        "probe_failing component=test route=/readyz reason=the consumer has not reported",
        "probe_passing component=test route=/readyz",
    ]


def test_the_workers_readiness_fails_without_its_broker_and_passes_with_its_ledger(
    ledger: Ledger,
) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    app = make_celery(BrokerSettings(broker_url=f"redis://127.0.0.1:{dead}/0"))
    problem = broker_problem(app)
    assert problem is not None and problem.startswith("the broker is unreachable")
    assert ledger_problem(ledger) is None
