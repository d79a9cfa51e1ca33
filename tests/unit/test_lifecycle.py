"""The operator's pure decisions, exhaustively: spec parsing, the delete finalizer,
idle pause, kubectl-driven pause and wake, Sandbox suspension, status churn."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orchestrator.operator.lifecycle import (
    SANDBOX_V1ALPHA1,
    SANDBOX_V1BETA1,
    DeleteAction,
    Phase,
    SpecError,
    TaskSpec,
    Wanted,
    condition,
    decide_delete,
    merge_conditions,
    parse_duration,
    parse_spec,
    running_phase,
    sandbox_is_suspended,
    sandbox_suspension_patch,
    should_idle_pause,
    status_patch,
    wanted_transition,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def spec(**lifecycle: Any) -> TaskSpec:
    return parse_spec({"lifecycle": lifecycle})


@pytest.mark.parametrize(
    ("text", "secs"),
    [("30s", 30), ("2m", 120), ("1h30m", 5400), ("500ms", 0.5), ("1.5s", 1.5), ("0s", 0)],
)
def test_durations(text: str, secs: float) -> None:
    assert parse_duration(text, "f") == secs


@pytest.mark.parametrize("text", ["banana", "", "30", "s", "-1s", "1d", 30, None, "1m banana"])
def test_bad_durations_name_the_field(text: object) -> None:
    with pytest.raises(SpecError, match=r"spec\.lifecycle\.idleTimeout: .* is not a duration"):
        parse_duration(text, "lifecycle.idleTimeout")


def test_empty_spec_takes_the_crd_defaults() -> None:
    parsed = parse_spec({})
    assert parsed == TaskSpec(
        agents=1, provider="scripted", model="", prompt=None, idle_timeout_secs=None,
        on_delete="checkpoint", drain_grace_secs=30, drain_timeout_secs=120, suspend=False,
        resume_from=None, sandbox_api_version=SANDBOX_V1ALPHA1, storage="1Gi",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"lifecycle": {"idleTimeout": "banana"}}, "lifecycle.idleTimeout"),
        ({"lifecycle": {"onDelete": "maybe"}}, "lifecycle.onDelete"),
        ({"lifecycle": {"drainGracePeriod": "soon"}}, "lifecycle.drainGracePeriod"),
        ({"lifecycle": {"drainTimeout": 5}}, "lifecycle.drainTimeout"),
        ({"lifecycle": {"suspend": "yes"}}, "lifecycle.suspend"),
        ({"task": {"agents": -1}}, "task.agents"),
        ({"task": {"agents": 0}}, "task.agents"),
        ({"task": {"agents": 65}}, "task.agents"),
        ({"task": {"agents": "three"}}, "task.agents"),
        ({"task": {"agents": True}}, "task.agents"),
        ({"task": {"provider": ""}}, "task.provider"),
        ({"task": {"model": 7}}, "task.model"),
        ({"task": "all"}, "task"),
        ({"resumeFrom": {"checkpointRef": "Not_A_Ref!"}}, "resumeFrom.checkpointRef"),
        ({"sandbox": {"apiVersion": "v9"}}, "sandbox.apiVersion"),
    ],
)
def test_malformed_specs_name_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(bad)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"spec.{field}: ")


# -------------------------------------------------------------------- delete finalizer

STATES = [None, "pending", "draining", "drained", "recorded", "forced", "failed"]


PHASES = [None, *Phase]


@pytest.mark.parametrize(
    ("on_delete", "phase", "state", "elapsed"),
    list(itertools.product(["checkpoint", "delete"], PHASES, STATES, [None, 10, 119, 120, 500])),
)
def test_delete_decision_table(
    on_delete: str, phase: str | None, state: str | None, elapsed: int | None
) -> None:
    task = spec(onDelete=on_delete, drainTimeout="2m")
    started = None if elapsed is None else NOW - timedelta(seconds=elapsed)
    action = decide_delete(task, phase, state, started, NOW)
    if on_delete == "delete":
        expected = DeleteAction.RELEASE
    elif state is None and phase in (None, Phase.PENDING, Phase.FAILED):
        expected = DeleteAction.RELEASE  # no daemon ever ran: nothing to drain
    elif state is None:
        expected = DeleteAction.START_DRAIN
    elif state in ("recorded", "forced"):
        expected = DeleteAction.RECORDED
    elif state == "failed" or (elapsed is not None and elapsed >= 120):
        expected = DeleteAction.FORCE
    else:
        expected = DeleteAction.WAIT
    assert action is expected


def test_a_task_whose_spec_never_parsed_is_released() -> None:
    assert decide_delete(None, Phase.RUNNING, None, None, NOW) is DeleteAction.RELEASE


# ------------------------------------------------------------------------ idle pause


@pytest.mark.parametrize(
    ("timeout", "phase", "idle_secs", "pause"),
    [
        ("30s", Phase.RUNNING, 30, True),
        ("30s", Phase.RUNNING, 29.9, False),
        ("30s", Phase.RUNNING, None, False),
        (None, Phase.RUNNING, 10_000, False),
        ("30s", Phase.PROVISIONING, 100, False),
        ("30s", Phase.SUSPENDED, 100, False),
        ("30s", Phase.DRAINING, 100, False),
        ("30s", Phase.RESUMING, 100, False),
        ("30s", None, 100, False),
    ],
)
def test_idle_pause(timeout: str | None, phase: str | None, idle_secs: float | None,
                    pause: bool) -> None:  # fmt: skip
    task = spec(idleTimeout=timeout) if timeout else spec()
    since = None if idle_secs is None else NOW - timedelta(seconds=idle_secs)
    assert should_idle_pause(task, phase, since, NOW) is pause


# ------------------------------------------------------------------ pause and wake


@pytest.mark.parametrize(
    ("suspend", "phase", "paused_by", "wake", "last_wake", "wanted"),
    [
        (True, Phase.RUNNING, None, None, None, Wanted.PAUSE),
        (True, Phase.SUSPENDED, "manual", None, None, Wanted.NOTHING),
        (True, Phase.SUSPENDED, "idle", "t1", None, Wanted.NOTHING),  # suspend beats wake
        (True, Phase.PROVISIONING, None, None, None, Wanted.NOTHING),
        (False, Phase.SUSPENDED, "manual", None, None, Wanted.RESUME),
        (False, Phase.SUSPENDED, "idle", None, None, Wanted.NOTHING),
        (False, Phase.SUSPENDED, "idle", "t1", None, Wanted.RESUME),
        (False, Phase.SUSPENDED, "idle", "t1", "t1", Wanted.NOTHING),  # once per value
        (False, Phase.SUSPENDED, "idle", "t2", "t1", Wanted.RESUME),
        (False, Phase.RUNNING, None, "t1", None, Wanted.NOTHING),
        (False, Phase.DRAINING, None, "t1", None, Wanted.NOTHING),
    ],
)
def test_kubectl_driven_transitions(suspend: bool, phase: str, paused_by: str | None,
                                    wake: str | None, last_wake: str | None,
                                    wanted: Wanted) -> None:  # fmt: skip
    task = spec(suspend=suspend)
    assert wanted_transition(task, phase, paused_by, wake, last_wake) is wanted


@pytest.mark.parametrize("api_version", [SANDBOX_V1ALPHA1, SANDBOX_V1BETA1])
@pytest.mark.parametrize("suspended", [True, False])
def test_sandbox_suspension_round_trips(api_version: str, suspended: bool) -> None:
    patch = sandbox_suspension_patch(api_version, suspended)
    assert sandbox_is_suspended(api_version, patch["spec"]) is suspended


def test_sandbox_suspension_shapes() -> None:
    assert sandbox_suspension_patch(SANDBOX_V1BETA1, True) == {
        "spec": {"operatingMode": "Suspended"}
    }
    assert sandbox_suspension_patch(SANDBOX_V1ALPHA1, True) == {"spec": {"replicas": 0}}


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("live", [None, 0, 2])
def test_running_once_the_daemon_reports_live_agents(phase: Phase, live: int | None) -> None:
    expected = Phase.RUNNING if phase in (Phase.PROVISIONING, Phase.RESUMING) and live else None
    assert running_phase(phase, live) == expected


def test_conditions_keep_their_transition_time_while_status_holds() -> None:
    first = condition("Ready", True, "Running", "ok", NOW, 1)
    later = condition("Ready", True, "Running", "still ok", NOW + timedelta(hours=1), 2)
    merged = merge_conditions([first], later)
    assert merged == [{**later, "lastTransitionTime": first["lastTransitionTime"]}]
    flipped = condition("Ready", False, "Draining", "d", NOW + timedelta(hours=2), 2)
    assert merge_conditions(merged, flipped) == [flipped]
    other = condition("Checkpointed", True, "Recorded", "r", NOW, 2)
    assert merge_conditions([first], other) == [first, other]


def test_status_patch_carries_only_differences() -> None:
    current = {"phase": "Running", "checkpointRef": "ckpt-a"}
    assert status_patch(current, {"phase": "Running", "checkpointRef": "ckpt-b"}) == {
        "checkpointRef": "ckpt-b"
    }
    assert status_patch(current, dict(current)) == {}
