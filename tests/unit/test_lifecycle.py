"""The operator's pure decisions, exhaustively: spec parsing, the delete finalizer,
idle pause, kubectl-driven pause and wake, Sandbox suspension, waiting for the daemon
(Running, restart recovery), the resume outcome, idempotency keys, status churn.

Every expected value is written out in the tables below, never derived from the rules
under test."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from orchestrator.ledger import ActivityView, OperationKind, OperationState
from orchestrator.operator.crd import SANDBOX_V1ALPHA1, SANDBOX_V1BETA1
from orchestrator.operator.lifecycle import (
    COMPLETION_RETRY_SECS,
    CRASH_LOOP_LIMIT,
    CREATED_SUSPENDED,
    HEARTBEATS_MISSED_BEFORE_SILENT,
    MAX_PROMPT_BYTES,
    RECOVERY_BACKOFF_SECS,
    RECOVERY_STREAK_RESET_SECS,
    AgentCounts,
    Availability,
    CompletedAnswer,
    CompletionDecision,
    CompletionStep,
    ConditionChange,
    DeleteAction,
    DeletionObserved,
    IdleReport,
    LaunchStep,
    Phase,
    Purpose,
    RecoveryHistory,
    ResumeOutcome,
    SandboxApi,
    ScaleStep,
    SnapshotClass,
    SnapshotProgress,
    SnapshotState,
    SpecError,
    TaskSpec,
    Wanted,
    adopts_drain,
    availability,
    choose_snapshot_class,
    completed_request,
    completing,
    completion_step,
    condition,
    decide_delete,
    default_sandbox_api_version,
    every_agent_done,
    idle_report,
    idle_secs,
    launch_step,
    merge_conditions,
    on_existing_sandbox,
    operation_key,
    parse_duration,
    parse_spec,
    readiness,
    resume_outcome,
    retries_failure,
    sandbox_api_version_choice,
    sandbox_readiness,
    sandbox_service_fqdn,
    sandbox_suspension_patch,
    sandbox_version_problem,
    sandbox_workspace_claim,
    scale_outcome,
    scale_step,
    should_idle_pause,
    snapshot_state,
    snapshot_timed_out,
    status_patch,
    wanted_transition,
)
from worker_agent.contract import CHECKPOINT_MISMATCH

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
MISMATCH = f"{CHECKPOINT_MISMATCH}; no agent was resumed: agent-1: it moved on"


def spec(**lifecycle: Any) -> TaskSpec:
    return parse_spec({"lifecycle": lifecycle})


@pytest.mark.parametrize(
    ("text", "secs"),
    [("30s", 30), ("2m", 120), ("1h30m", 5400), ("500ms", 0.5), ("1.5s", 1.5), ("0s", 0),
     ("1d", 86400), ("1d12h", 129600)],
)  # fmt: skip
def test_durations(text: str, secs: float) -> None:
    assert parse_duration(text, "f") == secs


@pytest.mark.parametrize("text", ["banana", "", "30", "s", "-1s", "1w", 30, None, "1m banana"])
def test_bad_durations_name_the_field(text: object) -> None:
    with pytest.raises(SpecError, match=r"spec\.lifecycle\.idleTimeout: .* is not a duration"):
        parse_duration(text, "lifecycle.idleTimeout")


def test_empty_spec_takes_the_crd_defaults() -> None:
    parsed = parse_spec({})
    assert parsed == TaskSpec(
        agents=1, provider="scripted", model="", prompt=None, idle_timeout_secs=None,
        on_delete="checkpoint", drain_grace_secs=30, drain_timeout_secs=120, suspend=False,
        resume_from=None, sandbox_api_version=None, storage="1Gi",
    )  # fmt: skip


def test_an_unset_sandbox_version_is_never_silently_one_until_resolved() -> None:
    parsed = parse_spec({"sandbox": {"apiVersion": None}})
    assert parsed.sandbox_api_version is None
    with pytest.raises(ValueError, match="not resolved"):
        _ = parsed.sandbox_version
    assert parsed.with_sandbox_api_version(SANDBOX_V1BETA1).sandbox_version == SANDBOX_V1BETA1
    named = parse_spec({"sandbox": {"apiVersion": SANDBOX_V1ALPHA1}})
    assert named.sandbox_version == SANDBOX_V1ALPHA1


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"lifecycle": {"idleTimeout": "banana"}}, "lifecycle.idleTimeout"),
        ({"lifecycle": {"onDelete": "maybe"}}, "lifecycle.onDelete"),
        ({"lifecycle": {"onDelete": 1}}, "lifecycle.onDelete"),
        ({"task": {"prompt": "p" * (MAX_PROMPT_BYTES + 1)}}, "task.prompt"),
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
        ({"sandbox": {"name": "Not_A_Name"}}, "sandbox.name"),
        ({"task": {"env": [{"name": "DRAIN_BROKER_URL", "value": "redis://x"}]}}, "task.env"),
        ({"task": {"env": [{"name": "DRAIN_LOG_FORMAT", "value": "json"}]}}, "task.env"),
        ({"task": {"env": [{"value": "v"}]}}, "task.env"),
        ({"task": {"env": {"A": "b"}}}, "task.env"),
        ({"task": {"env": [{"name": "A", "value": 3}]}}, "task.env"),
        ({"task": {"image": 5}}, "task.image"),
        ({"workspace": {"storageClassName": 5}}, "workspace.storageClassName"),
        ({"sandbox": {"name": 7}}, "sandbox.name"),
        ({"sandbox": {"name": "x" * 64}}, "sandbox.name"),
        ({"sandbox": {"podTemplate": "nodeSelector: a"}}, "sandbox.podTemplate"),
        (
            {"sandbox": {"podTemplate": {"nodeSelector": {"a": "b"}}}},
            "sandbox.podTemplate.nodeSelector",
        ),
        ({"sandbox": {"podTemplate": {"spec": []}}}, "sandbox.podTemplate.spec"),
        ({"sandbox": {"podTemplate": {"metadata": "x"}}}, "sandbox.podTemplate.metadata"),
        (
            {"sandbox": {"podTemplate": {"spec": {"containers": {"name": "c"}}}}},
            "sandbox.podTemplate.spec.containers",
        ),
        (
            {"sandbox": {"podTemplate": {"spec": {"volumes": [{"emptyDir": {}}]}}}},
            "sandbox.podTemplate.spec.volumes",
        ),
    ],
)
def test_malformed_specs_name_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(bad)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"spec.{field}: ")


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("lifecycle.onDelete", "InvalidLifecycleOnDelete"),
        ("task.prompt", "InvalidTaskPrompt"),
        ("resumeFrom.checkpointRef", "InvalidResumeFromCheckpointRef"),
        ("task", "InvalidTask"),
    ],
)
def test_a_spec_error_reason_names_its_field(field: str, reason: str) -> None:
    assert SpecError(field, "bad").reason == reason


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"lifecycle": {"onDelete": "Checkpoint"}}, {"on_delete": "checkpoint"}),
        ({"lifecycle": {"onDelete": "Delete"}}, {"on_delete": "delete"}),
        ({"lifecycle": {"idleTimeout": "1d"}}, {"idle_timeout_secs": 86400.0}),
        ({"lifecycle": {"onDelete": None, "idleTimeout": None, "drainTimeout": None}},
         {"on_delete": "checkpoint", "idle_timeout_secs": None, "drain_timeout_secs": 120}),
        ({"task": {"agents": None, "provider": None, "prompt": None}},
         {"agents": 1, "provider": "scripted", "prompt": None}),
        ({"lifecycle": None, "task": None}, {"on_delete": "checkpoint", "agents": 1}),
    ],
)  # fmt: skip
def test_upstream_values_and_nulls_keep_their_meaning(
    given: dict[str, Any], expected: dict[str, Any]
) -> None:
    """caliban-operator's schema admits any case of onDelete, days in idleTimeout, and a
    null for every field (meaning unset)."""
    parsed = parse_spec(given)
    assert {name: getattr(parsed, name) for name in expected} == expected


# -------------------------------------------------------------------- delete finalizer

REL = DeleteAction.RELEASE
KEEP = DeleteAction.KEEP_PAUSE_CHECKPOINT
KEEPC = DeleteAction.KEEP_COMPLETED_CHECKPOINT
START = DeleteAction.START_DRAIN
WAIT = DeleteAction.WAIT
REC = DeleteAction.RECORDED
FORCE = DeleteAction.FORCE

NODRAIN = DeleteAction.NOTHING_TO_DRAIN

DRAIN_STATES = [
    OperationState.PENDING,
    OperationState.DRAINING,
    OperationState.DRAINED,
    OperationState.RECORDED,
    OperationState.FORCED,
    OperationState.FAILED,
]
RAN = DeletionObserved(ran=True)
NEVER_RAN = DeletionObserved(ran=False)
PAUSED = DeletionObserved(OperationKind.PAUSE, OperationState.RECORDED, "ck-paused", ran=True)
COMPLETED = DeletionObserved(OperationKind.COMPLETE, OperationState.RECORDED, "ck-done", ran=True)
PAUSED_THEN_LIVE = DeletionObserved(
    OperationKind.PAUSE, OperationState.RECORDED, "ck-paused", live_since=True, ran=True
)
PAUSE_FAILED = DeletionObserved(OperationKind.PAUSE, OperationState.FAILED, ran=True)
RESUMED = DeletionObserved(OperationKind.RESUME, OperationState.RESUMED, "ck-paused", ran=True)
SCALED_DOWN = DeletionObserved(
    OperationKind.SCALE_DOWN, OperationState.RECORDED, "ck-scale", ran=True
)
# Each row: what the finalizer does for a task the ledger and the cluster observe so, by
# the state of the deletion's own drain. Never a status field: another writer can set
# those. A pending drain was begun in the ledger and never sent (its operator died in
# between): it is started again under its key.
#                      not begun pending draining drained recorded forced failed
CHECKPOINT_WITHIN_TIMEOUT = {  # onDelete: checkpoint, drain begun < drainTimeout ago
    "ran":              (START,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "never-ran":        (NODRAIN, START, WAIT,    WAIT,   REC,     REC,   FORCE),
    "paused":           (KEEP,   START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "completed":        (KEEPC,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "paused-then-live": (START,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "pause-failed":     (START,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "resumed":          (START,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
    "scaled-down":      (START,  START,  WAIT,    WAIT,   REC,     REC,   FORCE),
}  # fmt: skip
CHECKPOINT_PAST_TIMEOUT = {  # onDelete: checkpoint, drain begun >= drainTimeout ago
    "ran":              (START,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "never-ran":        (NODRAIN, FORCE, FORCE,   FORCE,  REC,     REC,   FORCE),
    "paused":           (KEEP,   FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "completed":        (KEEPC,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "paused-then-live": (START,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "pause-failed":     (START,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "resumed":          (START,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
    "scaled-down":      (START,  FORCE,  FORCE,   FORCE,  REC,     REC,   FORCE),
}  # fmt: skip
ON_DELETE_DELETE = {observed: (REL,) * 7 for observed in CHECKPOINT_WITHIN_TIMEOUT}
OBSERVED = {
    "ran": RAN, "never-ran": NEVER_RAN, "paused": PAUSED, "completed": COMPLETED,
    "paused-then-live": PAUSED_THEN_LIVE, "pause-failed": PAUSE_FAILED, "resumed": RESUMED,
    "scaled-down": SCALED_DOWN,
}  # fmt: skip
# Seconds since the drain began (None: no start time known), against drainTimeout: 2m.
TABLE_BY_ELAPSED = {
    ("checkpoint", None): CHECKPOINT_WITHIN_TIMEOUT,
    ("checkpoint", 10): CHECKPOINT_WITHIN_TIMEOUT,
    ("checkpoint", 119): CHECKPOINT_WITHIN_TIMEOUT,
    ("checkpoint", 120): CHECKPOINT_PAST_TIMEOUT,
    ("checkpoint", 500): CHECKPOINT_PAST_TIMEOUT,
    ("delete", None): ON_DELETE_DELETE,
    ("delete", 10): ON_DELETE_DELETE,
    ("delete", 119): ON_DELETE_DELETE,
    ("delete", 120): ON_DELETE_DELETE,
    ("delete", 500): ON_DELETE_DELETE,
}


def _delete_case(
    on_delete: str, observed: str, state: OperationState | None, elapsed: int | None
) -> Any:
    table = TABLE_BY_ELAPSED[(on_delete, elapsed)]
    column = 0 if state is None else 1 + DRAIN_STATES.index(state)
    expected = table[observed][column]
    case_id = "-".join([
        on_delete, observed, str(state or "not-begun"),
        "no-start" if elapsed is None else f"{elapsed}s",
    ])  # fmt: skip
    return pytest.param(on_delete, observed, state, elapsed, expected, id=case_id)


DELETE_CASES = [
    _delete_case(on_delete, observed, state, elapsed)
    for on_delete, observed, state, elapsed in itertools.product(
        ["checkpoint", "delete"], list(OBSERVED), [None, *DRAIN_STATES],
        [None, 10, 119, 120, 500],
    )
]  # fmt: skip


def test_the_delete_tables_cover_every_observation() -> None:
    for table in (CHECKPOINT_WITHIN_TIMEOUT, CHECKPOINT_PAST_TIMEOUT, ON_DELETE_DELETE):
        assert list(table) == list(OBSERVED)
    assert len(DELETE_CASES) == 560


@pytest.mark.parametrize(("on_delete", "observed", "state", "elapsed", "expected"), DELETE_CASES)
def test_delete_decision_table(
    on_delete: str,
    observed: str,
    state: OperationState | None,
    elapsed: int | None,
    expected: DeleteAction,
) -> None:
    task = spec(onDelete=on_delete, drainTimeout="2m")
    started = None if elapsed is None else NOW - timedelta(seconds=elapsed)
    action = decide_delete(
        task, observed=OBSERVED[observed], op_state=state, drain_started=started, now=NOW
    )
    assert action is expected


ADOPTED_STATES = [OperationState.PENDING, OperationState.DRAINING, OperationState.DRAINED]


@pytest.mark.parametrize("kind", [None, *OperationKind], ids=lambda k: str(k or "no-op"))
@pytest.mark.parametrize("state", [None, *OperationState], ids=lambda s: str(s or "none"))
def test_a_deletion_during_a_pause_or_completion_drain_takes_that_drain_over(
    kind: OperationKind | None, state: OperationState | None
) -> None:
    # Only a pause or a completion the ledger shows on its way: any other deletion drains
    # for itself (a failed one drained nothing; a checkpointed one is kept, above).
    expected = kind in (OperationKind.PAUSE, OperationKind.COMPLETE) and state in ADOPTED_STATES
    assert adopts_drain(DeletionObserved(kind, state, ran=True)) is expected


# ------------------------------------------------------------------------ idle pause

GAP = 16.0
"""The heartbeat gap the operator bridges (the default interval 15 s plus a 1 s poll)."""


def received(idle_for: float, secs_ago: float) -> IdleReport:
    """A heartbeat saying ``idle_for`` seconds idle, stored ``secs_ago`` before NOW."""
    return IdleReport(idle_for_secs=idle_for, received_at=NOW - timedelta(seconds=secs_ago))


@pytest.mark.parametrize(
    ("timeout", "phase", "report", "pause"),
    [
        ("30s", Phase.RUNNING, received(30, 0), True),
        ("30s", Phase.RUNNING, received(29.9, 0), False),
        ("30s", Phase.RUNNING, received(20, 10), True),  # bridged since it arrived
        ("30s", Phase.RUNNING, received(20, 9.9), False),
        ("30s", Phase.RUNNING, None, False),  # not idle, or a daemon too old to say
        (None, Phase.RUNNING, received(10_000, 0), False),
        ("30s", Phase.PROVISIONING, received(100, 0), False),
        ("30s", Phase.SUSPENDED, received(100, 0), False),
        ("30s", Phase.DRAINING, received(100, 0), False),
        ("30s", Phase.RESUMING, received(100, 0), False),
        ("30s", None, received(100, 0), False),
        ("0s", Phase.RUNNING, received(0, 0), True),
        ("0s", Phase.RUNNING, received(0, -5), True),  # stored "ahead" of this clock
        ("30s", Phase.RUNNING, received(25, -5), False),  # ... bridges nothing
        ("1m", Phase.RUNNING, received(44, 20), True),  # a whole gap bridged: 44 + 16
        ("1m", Phase.RUNNING, received(43, 600), False),  # ... and never more: 43 + 16
    ],
)
def test_idle_pause(timeout: str | None, phase: str | None, report: IdleReport | None,
                    pause: bool) -> None:  # fmt: skip
    task = spec(idleTimeout=timeout) if timeout else spec()
    assert should_idle_pause(task, phase, report, NOW, GAP) is pause


@pytest.mark.parametrize(
    ("idle_for", "secs_ago", "idle"),
    [
        (60.0, 0.0, 60.0),
        (60.0, 5.0, 65.0),
        (60.0, 16.0, 76.0),
        (60.0, 3600.0, 76.0),  # this clock jumped an hour forward: at most one gap more
        (60.0, -3600.0, 60.0),  # an hour back: never less than the daemon measured
    ],
)
def test_idle_secs_is_the_daemons_measure_plus_a_bounded_bridge(
    idle_for: float, secs_ago: float, idle: float
) -> None:
    assert idle_secs(received(idle_for, secs_ago), NOW, GAP) == idle


def test_a_forward_clock_jump_between_heartbeats_does_not_pause_a_task_idle_for_a_minute() -> None:
    task = spec(idleTimeout="10m")
    one_minute_idle = received(60, secs_ago=0)
    an_hour_later_by_the_clock = NOW + timedelta(hours=1)

    assert not should_idle_pause(
        task, Phase.RUNNING, one_minute_idle, an_hour_later_by_the_clock, GAP
    )


def test_a_backward_clock_jump_does_not_stop_a_pause_that_is_due() -> None:
    task = spec(idleTimeout="10m")
    ten_minutes_idle = received(600, secs_ago=0)
    an_hour_earlier_by_the_clock = NOW - timedelta(hours=1)

    assert should_idle_pause(
        task, Phase.RUNNING, ten_minutes_idle, an_hour_earlier_by_the_clock, GAP
    )


def activity(daemon_clock: datetime, idle_for: float | None) -> ActivityView:
    """A stored heartbeat whose daemon-side stamps read ``daemon_clock``, received 5 s
    before NOW by the orchestrator."""
    return ActivityView(
        namespace="default", name="task-a", task_uid="uid-a",
        all_idle_since=None if idle_for is None else daemon_clock - timedelta(seconds=idle_for),
        agents_total=2, agents_live=2, agents_idle=2 if idle_for is not None else 0,
        reported_at=daemon_clock, seq=1, idle_for_secs=idle_for,
        received_at=NOW - timedelta(seconds=5),
    )  # fmt: skip


@pytest.mark.parametrize(
    "skew", [timedelta(days=-1), timedelta(0), timedelta(days=1)], ids=["-1d", "none", "+1d"]
)
@pytest.mark.parametrize(("idle_for", "pause"), [(590.0, False), (595.0, True), (None, False)])
def test_skew_between_the_daemons_clock_and_the_operators_is_irrelevant(
    skew: timedelta, idle_for: float | None, pause: bool
) -> None:
    stored = activity(NOW + skew, idle_for)

    report = idle_report(stored)

    assert should_idle_pause(spec(idleTimeout="10m"), Phase.RUNNING, report, NOW, GAP) is pause


def test_a_heartbeat_without_an_idle_duration_or_receive_stamp_makes_no_idle_decision() -> None:
    from_an_old_daemon = activity(NOW - timedelta(hours=2), idle_for=None)
    from_an_old_daemon = replace(from_an_old_daemon, all_idle_since=NOW - timedelta(hours=2))
    stored_before_0002 = replace(activity(NOW, idle_for=7200), received_at=None)

    assert idle_report(from_an_old_daemon) is None
    assert idle_report(stored_before_0002) is None
    assert idle_report(None) is None


# ------------------------------------------------------------------ pause and wake


@pytest.mark.parametrize(
    ("suspend", "phase", "paused_by", "wake", "last_wake", "wanted"),
    [
        (True, Phase.RUNNING, None, None, None, Wanted.PAUSE),
        (True, Phase.SUSPENDED, "manual", None, None, Wanted.NOTHING),
        (True, Phase.SUSPENDED, "manual", "t1", None, Wanted.WAKE_HELD),  # said, not dropped
        (True, Phase.SUSPENDED, "manual", "t1", "t1", Wanted.NOTHING),  # once per value
        (True, Phase.SUSPENDED, "idle", "t1", None, Wanted.WAKE_HELD),  # suspend beats wake
        (True, Phase.SUSPENDED, "idle", None, None, Wanted.ADOPT),  # the spec holds it now
        (True, Phase.SUSPENDED, "idle", "t1", "t1", Wanted.ADOPT),
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


@pytest.mark.parametrize(
    ("api_version", "suspended", "patch"),
    [
        pytest.param(SANDBOX_V1BETA1, True, {"spec": {"operatingMode": "Suspended"}},
                     id="v1beta1-suspend"),
        pytest.param(SANDBOX_V1BETA1, False, {"spec": {"operatingMode": "Running"}},
                     id="v1beta1-run"),
        pytest.param(SANDBOX_V1ALPHA1, True, {"spec": {"replicas": 0}}, id="v1alpha1-suspend"),
        pytest.param(SANDBOX_V1ALPHA1, False, {"spec": {"replicas": 1}}, id="v1alpha1-run"),
    ],
)  # fmt: skip
def test_sandbox_suspension_shapes(
    api_version: str, suspended: bool, patch: dict[str, Any]
) -> None:
    assert sandbox_suspension_patch(api_version, suspended) == patch


# ------------------------------------------------------ waiting for the daemon's agents

NO_HEARTBEAT = None
NO_AGENTS = AgentCounts(total=0, live=0)
ALL_INTERRUPTED = AgentCounts(total=3, live=0, interrupted=3)
ALL_FINISHED = AgentCounts(total=3, live=0, interrupted=0)
SOME_LIVE = AgentCounts(total=3, live=2, interrupted=1)
W, RUN, RECOVER = LaunchStep.WAIT, LaunchStep.RUNNING, LaunchStep.RECOVER
#                     no heartbeat  no agents  interrupted  finished  some live
LAUNCH_TABLE = {
    None:               (W,         W,         W,           W,        W),
    Phase.PENDING:      (W,         W,         W,           W,        W),
    Phase.PROVISIONING: (W,         W,         RECOVER,     RUN,      RUN),
    Phase.RUNNING:      (W,         W,         W,           W,        W),
    Phase.DRAINING:     (W,         W,         W,           W,        W),
    Phase.SUSPENDED:    (W,         W,         W,           W,        W),
    Phase.RESUMING:     (W,         W,         RECOVER,     RUN,      RUN),
    Phase.COMPLETED:    (W,         W,         W,           W,        W),
    Phase.FAILED:       (W,         W,         W,           W,        W),
}  # fmt: skip
"""Agents stopped on purpose or finished (killed, done) are never resumed: a daemon that
comes back with only those is Running with nothing to run (AgentsAvailable says so),
not a recovery that would resume nothing, over and over."""
REPORTS = [
    ("no-heartbeat", NO_HEARTBEAT),
    ("no-agents", NO_AGENTS),
    ("all-interrupted", ALL_INTERRUPTED),
    ("all-finished", ALL_FINISHED),
    ("some-live", SOME_LIVE),
]


@pytest.mark.parametrize(
    ("phase", "reported", "expected"),
    [
        pytest.param(phase, reported, LAUNCH_TABLE[phase][column],
                     id=f"{phase or 'no-phase'}-{name}")
        for phase in LAUNCH_TABLE
        for column, (name, reported) in enumerate(REPORTS)
    ],
)  # fmt: skip
def test_a_task_waiting_for_its_daemon_runs_once_agents_are_live_and_recovers_stopped_ones(
    phase: Phase | None, reported: AgentCounts | None, expected: LaunchStep
) -> None:
    assert launch_step(phase, reported) is expected


CORRUPT = "a2: session.json does not parse"


@pytest.mark.parametrize(
    ("state", "error", "expected"),
    [
        pytest.param(OperationState.PENDING, None, ResumeOutcome(still_resuming=True),
                     id="pending"),
        pytest.param(OperationState.RESUMING, None, ResumeOutcome(still_resuming=True),
                     id="resuming"),
        pytest.param(OperationState.RESUMING, CORRUPT, ResumeOutcome(still_resuming=True),
                     id="resuming-with-error"),
        pytest.param(
            OperationState.RESUMED, None,
            ResumeOutcome(False, ConditionChange("Resumed", True, "Resumed",
                                                 "every agent continues")),
            id="resumed",
        ),
        pytest.param(
            OperationState.RESUMED, CORRUPT,
            ResumeOutcome(False, ConditionChange("Resumed", False, "PartlyResumed", CORRUPT)),
            id="resumed-but-some-did-not",
        ),
        pytest.param(
            OperationState.FAILED, CORRUPT,
            ResumeOutcome(False, ConditionChange("Resumed", False, "ResumeFailed", CORRUPT)),
            id="failed",
        ),
        pytest.param(
            OperationState.FAILED, None,
            ResumeOutcome(False, ConditionChange("Resumed", False, "ResumeFailed", "failed")),
            id="failed-without-a-reason",
        ),
        pytest.param(
            OperationState.FAILED, MISMATCH,
            ResumeOutcome(False, ConditionChange("Resumed", False, "CheckpointMismatch",
                                                 MISMATCH)),
            id="the-workspace-is-not-the-checkpoint",
        ),
        # A wake with no checkpoint to resume from leaves the pause's drain as the last
        # operation: finished, but no resume to judge.
        pytest.param(OperationState.RECORDED, None, ResumeOutcome(still_resuming=False),
                     id="a-recorded-pause"),
        pytest.param(OperationState.FORCED, None, ResumeOutcome(still_resuming=False),
                     id="a-forced-checkpoint"),
        pytest.param(OperationState.DRAINING, None, ResumeOutcome(still_resuming=True),
                     id="a-drain-under-way"),
        pytest.param(OperationState.DRAINED, None, ResumeOutcome(still_resuming=True),
                     id="a-drained-drain"),
    ],
)  # fmt: skip
def test_a_finished_resume_sets_the_resumed_condition(
    state: OperationState, error: str | None, expected: ResumeOutcome
) -> None:
    assert resume_outcome(state, error) == expected


# ------------------------------------------------------------------ idempotency keys

UID = "0c5a1e9e-7f3b-4c1a-9d2e-5b6f7a8c9d0e"


@pytest.mark.parametrize(
    ("purpose", "which", "key"),
    [
        pytest.param(Purpose.DELETE, None, f"{UID}:delete", id="delete"),
        pytest.param(Purpose.FORCE, None, f"{UID}:force", id="force"),
        pytest.param(Purpose.RESTORE, None, f"{UID}:restore", id="restore"),
        pytest.param(Purpose.PAUSE, 1, f"{UID}:pause:1", id="first-pause"),
        pytest.param(Purpose.PAUSE, 12, f"{UID}:pause:12", id="twelfth-pause"),
        pytest.param(Purpose.RESUME, "ckpt-7f3a", f"{UID}:resume:ckpt-7f3a", id="resume"),
        pytest.param(Purpose.RECOVER, 0, f"{UID}:recover:0", id="recover-seq-0"),
        pytest.param(Purpose.RECOVER, 41, f"{UID}:recover:41", id="recover"),
        pytest.param(Purpose.SCALE, 2, f"{UID}:scale:2", id="scale"),
        pytest.param(Purpose.COMPLETE, 1, f"{UID}:complete:1", id="first-completion"),
        pytest.param(Purpose.COMPLETE, 2, f"{UID}:complete:2", id="completion-retried"),
    ],
)
def test_operation_keys_are_the_uid_the_purpose_and_which_one(
    purpose: Purpose, which: int | str | None, key: str
) -> None:
    assert operation_key(UID, purpose, which) == key


@pytest.mark.parametrize(
    ("purpose", "which"),
    [
        pytest.param(Purpose.DELETE, 1, id="a-second-delete"),
        pytest.param(Purpose.FORCE, "x", id="a-second-force"),
        pytest.param(Purpose.RESTORE, 2, id="a-second-restore"),
        pytest.param(Purpose.PAUSE, None, id="a-pause-without-its-count"),
        pytest.param(Purpose.RESUME, None, id="a-resume-without-its-checkpoint"),
        pytest.param(Purpose.RECOVER, None, id="a-recovery-without-its-heartbeat"),
        pytest.param(Purpose.SCALE, None, id="a-scale-without-its-count"),
        pytest.param(Purpose.COMPLETE, None, id="a-completion-without-its-attempt"),
    ],
)
def test_an_operation_key_names_which_repetition_exactly_when_the_purpose_repeats(
    purpose: Purpose, which: int | str | None
) -> None:
    with pytest.raises(ValueError, match=purpose.value):
        operation_key(UID, purpose, which)


# ------------------------------------------------------------------------ status


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


def test_status_patch_removes_what_a_new_object_value_no_longer_has() -> None:
    """Tried: ``lastOperation`` of a finished pause replaced by a resume on its way (no
    ``finishedAt``, no ``error``). A merge patch merges objects, so the stale keys are
    sent as null; applied as the API applies it (RFC 7386), the stored status is the new
    value, and the next pass finds nothing to write. (The stale ``finishedAt`` stayed,
    every pass wrote the field again, and a steward waiting on the resume looped: 232
    writes in 2.7 s on one wake.)"""
    from orchestrator.devcluster.patching import merge_patch

    finished = {"id": "op-pause", "kind": "pause", "state": "recorded",
                "startedAt": "t0", "finishedAt": "t1", "error": "late"}  # fmt: skip
    resuming = {"id": "op-resume", "kind": "resume", "state": "dispatched", "startedAt": "t2"}
    current = {"phase": "Resuming", "lastOperation": finished}
    patch = status_patch(current, {"lastOperation": resuming})
    assert patch == {"lastOperation": {**resuming, "finishedAt": None, "error": None}}
    stored = merge_patch(current, patch)
    assert stored["lastOperation"] == resuming
    assert status_patch(stored, {"lastOperation": resuming}) == {}


# ---------------------------------------------------------------------- disruptions

INTERVAL = 15.0  # the default heartbeat interval
FRESH = 1.0


def _available(counts: AgentCounts | None, age: float | None = FRESH,
               history: RecoveryHistory | None = None) -> Any:  # fmt: skip
    return availability(counts, age, INTERVAL, history or RecoveryHistory(), NOW)


def test_every_agent_live_is_available_and_says_how_many() -> None:
    decision = _available(AgentCounts(total=3, live=3))
    assert decision.step is Availability.AVAILABLE
    assert (decision.condition.type, decision.condition.status) == ("AgentsAvailable", True)
    assert decision.condition.message == "3 of 3 agents live"


def test_a_daemon_back_with_every_agent_interrupted_is_recovered_at_once() -> None:
    decision = _available(AgentCounts(total=3, live=0, interrupted=3))
    assert decision.step is Availability.RECOVER
    assert decision.condition.status is False
    assert decision.condition.reason == "DaemonRestarted"
    assert "3 interrupted" in decision.condition.message


def test_one_agent_crashed_in_a_running_daemon_is_recovered_as_agents_stopped() -> None:
    decision = _available(AgentCounts(total=3, live=2, interrupted=1))
    assert decision.step is Availability.RECOVER
    assert decision.condition.reason == "AgentsStopped"


def test_agents_killed_or_done_on_purpose_are_not_brought_back() -> None:
    decision = _available(AgentCounts(total=3, live=1, interrupted=0))
    assert decision.step is Availability.AVAILABLE
    assert "2 stopped on purpose or finished" in decision.condition.message
    every_one_finished = _available(AgentCounts(total=3, live=0, interrupted=0))
    assert every_one_finished.step is Availability.AVAILABLE
    assert every_one_finished.condition.status is False
    assert every_one_finished.condition.reason == "AgentsFinished"


@pytest.mark.parametrize("age", [None, HEARTBEATS_MISSED_BEFORE_SILENT * INTERVAL + 0.5, 3600.0])
def test_no_recent_heartbeat_is_a_silent_daemon_never_the_last_count(age: float | None) -> None:
    decision = _available(AgentCounts(total=3, live=3), age=age)
    assert decision.step is Availability.DAEMON_SILENT
    assert (decision.condition.status, decision.condition.reason) == (False, "DaemonSilent")


def test_a_heartbeat_just_inside_the_silence_bound_still_counts() -> None:
    age = HEARTBEATS_MISSED_BEFORE_SILENT * INTERVAL
    assert _available(AgentCounts(total=3, live=3), age=age).step is Availability.AVAILABLE


def test_repeated_crashes_back_off_then_stop_as_a_crash_loop() -> None:
    stopped = AgentCounts(total=1, live=0, interrupted=1)
    for streak in range(1, CRASH_LOOP_LIMIT):
        backoff = RECOVERY_BACKOFF_SECS[streak]
        too_soon = RecoveryHistory(streak, streak, NOW - timedelta(seconds=backoff - 1))
        waiting = _available(stopped, history=too_soon)
        assert waiting.step is Availability.BACKOFF, streak
        assert waiting.wait_secs == pytest.approx(1.0)
        due = RecoveryHistory(streak, streak, NOW - timedelta(seconds=backoff))
        assert _available(stopped, history=due).step is Availability.RECOVER, streak
    looping = RecoveryHistory(9, CRASH_LOOP_LIMIT, NOW - timedelta(seconds=30))
    decision = _available(stopped, history=looping)
    assert decision.step is Availability.CRASH_LOOP
    assert decision.condition.reason == "CrashLoop"
    assert "wake annotation" in decision.condition.message


def test_a_streak_ends_once_the_agents_ran_undisturbed_long_enough() -> None:
    old = RecoveryHistory(7, CRASH_LOOP_LIMIT, NOW - timedelta(seconds=RECOVERY_STREAK_RESET_SECS))
    quiet = _available(AgentCounts(total=2, live=2), history=old)
    assert quiet.step is Availability.AVAILABLE and quiet.streak_over
    # A disruption after the quiet spell is a first one again: resumed at once.
    again = _available(AgentCounts(total=2, live=0, interrupted=2), history=old)
    assert again.step is Availability.RECOVER and again.streak_over


def test_the_first_recovery_of_a_task_never_waits() -> None:
    decision = _available(AgentCounts(total=2, live=0, interrupted=2), history=RecoveryHistory())
    assert decision.step is Availability.RECOVER
    assert RECOVERY_BACKOFF_SECS[0] == 0


# ------------------------------------------------------------ the cluster's Sandbox API

BOTH = ("v1alpha1", "v1beta1")


@pytest.mark.parametrize(
    ("api", "chosen"),
    [
        pytest.param(SandboxApi(BOTH, "v1beta1", True), SANDBOX_V1BETA1,
                     id="agent-sandbox-0.5-both-served-webhook"),
        pytest.param(SandboxApi(("v1beta1",), "v1beta1", False), SANDBOX_V1BETA1,
                     id="v1beta1-only"),
        pytest.param(SandboxApi(("v1alpha1",), "v1alpha1", False), SANDBOX_V1ALPHA1,
                     id="v1alpha1-only-older-release"),
        pytest.param(SandboxApi(BOTH, "v1beta1", False), SANDBOX_V1BETA1,
                     id="both-stored-beta-no-webhook"),
        pytest.param(SandboxApi(BOTH, "v1alpha1", False), SANDBOX_V1ALPHA1,
                     id="both-stored-alpha-no-webhook-beta-would-not-reach-it"),
        pytest.param(SandboxApi(BOTH, "v1alpha1", True), SANDBOX_V1BETA1,
                     id="both-stored-alpha-webhook"),
        pytest.param(SandboxApi(BOTH, None, False), SANDBOX_V1BETA1, id="no-storage-reported"),
        pytest.param(SandboxApi((), "v1beta1", False), SANDBOX_V1ALPHA1, id="none-served"),
        pytest.param(None, SANDBOX_V1ALPHA1, id="no-sandbox-crd"),
    ],
)  # fmt: skip
def test_an_unset_sandbox_version_is_v1beta1_where_the_cluster_serves_it(
    api: SandboxApi | None, chosen: str
) -> None:
    assert default_sandbox_api_version(api) == chosen


@pytest.mark.parametrize(
    ("requested", "pinned", "started", "chosen"),
    [
        pytest.param(SANDBOX_V1ALPHA1, None, False, SANDBOX_V1ALPHA1, id="named-new"),
        pytest.param(SANDBOX_V1ALPHA1, SANDBOX_V1BETA1, True, SANDBOX_V1ALPHA1,
                     id="named-wins-over-pinned"),
        pytest.param(SANDBOX_V1BETA1, None, True, SANDBOX_V1BETA1, id="named-old-task"),
        pytest.param(None, SANDBOX_V1BETA1, True, SANDBOX_V1BETA1, id="pinned"),
        pytest.param(None, SANDBOX_V1ALPHA1, False, SANDBOX_V1ALPHA1, id="pinned-not-started"),
        pytest.param(None, None, False, None, id="new-task-asks-the-cluster"),
        pytest.param(None, None, True, SANDBOX_V1ALPHA1,
                     id="started-before-pinning-was-v1alpha1"),
        pytest.param(None, "agents.x-k8s.io/v2", False, None, id="pinned-junk-asks-again"),
        pytest.param(None, 3, True, SANDBOX_V1ALPHA1, id="pinned-junk-started"),
    ],
)  # fmt: skip
def test_a_task_keeps_the_sandbox_version_it_was_created_with(
    requested: str | None, pinned: object, started: bool, chosen: str | None
) -> None:
    assert sandbox_api_version_choice(requested, pinned, started=started) == chosen


@pytest.mark.parametrize(
    ("wanted", "api", "problem"),
    [
        (SANDBOX_V1ALPHA1, SandboxApi(BOTH, "v1alpha1", False), None),
        (SANDBOX_V1BETA1, SandboxApi(BOTH, "v1beta1", False), None),
        (SANDBOX_V1ALPHA1, SandboxApi(BOTH, "v1beta1", True), None),  # upstream: a webhook
        (SANDBOX_V1ALPHA1, SandboxApi(BOTH, "v1beta1", False), "stores Sandboxes as v1beta1"),
        (SANDBOX_V1BETA1, SandboxApi(BOTH, "v1alpha1", False), "stores Sandboxes as v1alpha1"),
        (SANDBOX_V1BETA1, SandboxApi(("v1alpha1",), "v1alpha1", False), "is not served"),
        (SANDBOX_V1ALPHA1, None, "has no Sandbox API"),
    ],
)
def test_a_sandbox_version_the_cluster_cannot_suspend_through_is_named(
    wanted: str, api: SandboxApi | None, problem: str | None
) -> None:
    found = sandbox_version_problem(wanted, api)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


# ------------------------------------------------------------------ snapshots

HOSTPATH = SnapshotClass("hostpath-snap", "hostpath.csi.k8s.io", default=False)
EBS = SnapshotClass("ebs-snap", "ebs.csi.aws.com", default=False)
EBS_DEFAULT = SnapshotClass("ebs-default", "ebs.csi.aws.com", default=True)


@pytest.mark.parametrize(
    ("classes", "driver", "chosen"),
    [
        pytest.param([], "ebs.csi.aws.com", None, id="no-class-at-all"),
        pytest.param([HOSTPATH], "ebs.csi.aws.com", None, id="only-another-drivers-class"),
        pytest.param([HOSTPATH, EBS], "ebs.csi.aws.com", "ebs-snap", id="the-drivers-class"),
        pytest.param([EBS, EBS_DEFAULT], "ebs.csi.aws.com", "ebs-default",
                     id="the-drivers-default-among-several"),
        pytest.param([HOSTPATH, EBS], None, None, id="unknown-driver-several-no-default"),
        pytest.param([HOSTPATH, EBS_DEFAULT], None, "ebs-default",
                     id="unknown-driver-the-default"),
        pytest.param([HOSTPATH], None, "hostpath-snap", id="unknown-driver-the-only-class"),
    ],
)  # fmt: skip
def test_the_snapshot_class_fits_the_workspace_drivers(
    classes: list[SnapshotClass], driver: str | None, chosen: str | None
) -> None:
    assert choose_snapshot_class(classes, driver) == chosen


@pytest.mark.parametrize(
    ("snapshot", "state"),
    [
        pytest.param(None, SnapshotState(SnapshotProgress.MISSING), id="gone"),
        pytest.param({"metadata": {"deletionTimestamp": "2026-12-03T10:00:00Z"},
                      "status": {"readyToUse": True}},
                     SnapshotState(SnapshotProgress.MISSING), id="being-deleted"),
        pytest.param({"metadata": {}}, SnapshotState(SnapshotProgress.PENDING), id="no-status"),
        pytest.param({"metadata": {}, "status": {"readyToUse": False,
                                                 "error": {"message": "no such PVC"}}},
                     SnapshotState(SnapshotProgress.PENDING, "no such PVC"), id="an-error"),
        pytest.param({"metadata": {}, "status": {"readyToUse": True, "restoreSize": "1Gi"}},
                     SnapshotState(SnapshotProgress.READY, None, "1Gi"), id="ready"),
        pytest.param({"metadata": {}, "status": {"readyToUse": "true"}},
                     SnapshotState(SnapshotProgress.PENDING), id="a-string-is-not-ready"),
    ],
)  # fmt: skip
def test_a_volume_snapshot_says_whether_its_copy_is_ready(
    snapshot: dict[str, Any] | None, state: SnapshotState
) -> None:
    assert snapshot_state(snapshot) == state


def test_a_snapshot_times_out_only_past_its_timeout() -> None:
    assert not snapshot_timed_out(NOW, NOW + timedelta(seconds=300), 300)
    assert snapshot_timed_out(NOW, NOW + timedelta(seconds=300.5), 300)


# ----------------------------------------------------------------------------- Ready


@pytest.mark.parametrize(
    ("phase", "counts", "why", "ready"),
    [
        pytest.param("Running", AgentCounts(total=3, live=3), None,
                     ConditionChange("Ready", True, "AgentsLive", "Running; 3 of 3 agents live"),
                     id="running-every-agent-live"),
        pytest.param("Running", AgentCounts(total=3, live=2, interrupted=1), None,
                     ConditionChange("Ready", False, "AgentsNotLive",
                                     "Running, but not every agent is live: 2 of 3 agents live, "
                                     "1 interrupted"),
                     id="running-one-interrupted"),
        pytest.param("Running", AgentCounts(total=2, live=0, interrupted=2), None,
                     ConditionChange("Ready", False, "AgentsNotLive",
                                     "Running, but not every agent is live: 0 of 2 agents live, "
                                     "2 interrupted"),
                     id="running-daemon-restarted"),
        pytest.param("Running", AgentCounts(total=2, live=1), None,
                     ConditionChange("Ready", False, "AgentsFinished",
                                     "Running, but not every agent is live: 1 of 2 agents live, "
                                     "1 stopped on purpose or finished"),
                     id="running-one-finished"),
        pytest.param("Running", AgentCounts(total=0, live=0), None,
                     ConditionChange("Ready", False, "NoAgents",
                                     "Running, but the daemon runs no agents"),
                     id="running-no-agents"),
        pytest.param("Running", None, "pause abandoned",
                     ConditionChange("Ready", None, "AgentsUnknown",
                                     "Running; no heartbeat from the daemon read yet"),
                     id="running-no-heartbeat-read-is-unknown"),
        pytest.param(None, None, None,
                     ConditionChange("Ready", False, "Pending", "not provisioned yet"),
                     id="new"),
        pytest.param("Pending", None, "waiting for pod x",
                     ConditionChange("Ready", False, "Pending",
                                     "not provisioned yet: waiting for pod x"),
                     id="pending"),
        pytest.param("Provisioning", AgentCounts(total=2, live=2), "waiting for the daemon",
                     ConditionChange("Ready", False, "Provisioning",
                                     "waiting for the daemon to report its agents live: waiting "
                                     "for the daemon"),
                     id="provisioning-even-with-live-counts"),
        pytest.param("Resuming", None, None,
                     ConditionChange("Ready", False, "Resuming",
                                     "waiting for the daemon to bring its agents back"),
                     id="resuming"),
        pytest.param("Draining", AgentCounts(total=2, live=2), None,
                     ConditionChange("Ready", False, "Draining",
                                     "draining agents to a checkpoint"),
                     id="draining-even-with-live-counts"),
        pytest.param("Suspended", None, "suspended with checkpoint ck-1",
                     ConditionChange("Ready", False, "Paused",
                                     "paused: agents drained to a checkpoint, the Sandbox "
                                     "suspended: suspended with checkpoint ck-1"),
                     id="suspended-is-paused"),
        pytest.param("Completed", None, None,
                     ConditionChange("Ready", False, "Completed",
                                     "completed: every agent finished its work, checkpointed, "
                                     "the Sandbox suspended"),
                     id="completed"),
        pytest.param("Completed", AgentCounts(total=2, live=0, done=2), "checkpoint ck-9",
                     ConditionChange("Ready", False, "Completed",
                                     "completed: every agent finished its work, checkpointed, "
                                     "the Sandbox suspended: checkpoint ck-9"),
                     id="completed-with-its-checkpoint"),
        pytest.param("Running", AgentCounts(total=2, live=0, done=2), None,
                     ConditionChange("Ready", False, "AgentsFinished",
                                     "Running, but not every agent is live: 0 of 2 agents live, "
                                     "2 stopped on purpose or finished"),
                     id="running-every-agent-done-before-it-completes"),
        pytest.param("Failed", None, "unknown checkpoint ref 'nope'",
                     ConditionChange("Ready", False, "Failed",
                                     "the task failed: unknown checkpoint ref 'nope'"),
                     id="failed"),
    ],
)  # fmt: skip
def test_a_task_is_ready_only_when_running_with_every_agent_live(
    phase: str | None, counts: AgentCounts | None, why: str | None, ready: ConditionChange
) -> None:
    assert readiness(phase, counts, why) == ready


@pytest.mark.parametrize(
    ("status", "written"),
    [pytest.param(True, "True", id="true"), pytest.param(False, "False", id="false"),
     pytest.param(None, "Unknown", id="unknown")],
)  # fmt: skip
def test_a_condition_status_is_true_false_or_unknown(status: bool | None, written: str) -> None:
    assert condition("Ready", status, "AgentsLive", "m", NOW, 4) == {
        "type": "Ready", "status": written, "reason": "AgentsLive", "message": "m",
        "lastTransitionTime": "2026-12-02T12:00:00Z", "observedGeneration": 4,
    }  # fmt: skip


def test_ready_keeps_its_transition_time_while_its_status_holds() -> None:
    live = condition("Ready", True, "AgentsLive", "2 of 2", NOW, 1)
    later = condition("Ready", True, "AgentsLive", "3 of 3", NOW + timedelta(minutes=5), 2)
    kept = merge_conditions([live], later)
    assert kept == [{**later, "lastTransitionTime": "2026-12-02T12:00:00Z"}]
    paused = condition("Ready", False, "Paused", "paused", NOW + timedelta(minutes=9), 3)
    assert merge_conditions(kept, paused) == [paused]


# ------------------------------------------------------------------ created suspended


@pytest.mark.parametrize(
    ("suspend", "phase", "paused_by", "wake", "last_wake", "wanted"),
    [
        pytest.param(True, None, None, None, None, Wanted.HOLD, id="new-suspended-holds"),
        pytest.param(True, Phase.PENDING, None, None, None, Wanted.HOLD,
                     id="pending-suspended-holds"),
        pytest.param(True, None, None, "t1", None, Wanted.HOLD, id="new-suspended-wake-holds"),
        pytest.param(False, None, None, None, None, Wanted.NOTHING, id="new-provisions"),
        pytest.param(False, Phase.PENDING, None, "t1", None, Wanted.NOTHING,
                     id="pending-provisions"),
        pytest.param(True, Phase.SUSPENDED, CREATED_SUSPENDED, None, None, Wanted.NOTHING,
                     id="still-suspended-stays"),
        pytest.param(True, Phase.SUSPENDED, CREATED_SUSPENDED, "t1", None, Wanted.WAKE_HELD,
                     id="wake-alone-does-not-start-and-says-so"),
        pytest.param(False, Phase.SUSPENDED, CREATED_SUSPENDED, None, None, Wanted.START,
                     id="suspend-false-starts"),
        pytest.param(False, Phase.SUSPENDED, CREATED_SUSPENDED, "t1", "t0", Wanted.START,
                     id="drainctl-wake-starts"),
        pytest.param(False, Phase.SUSPENDED, "manual", None, None, Wanted.RESUME,
                     id="a-paused-task-resumes-not-starts"),
    ],
)  # fmt: skip
def test_a_task_created_suspended_starts_nothing_until_resumed(
    suspend: bool, phase: str | None, paused_by: str | None, wake: str | None,
    last_wake: str | None, wanted: Wanted,
) -> None:  # fmt: skip
    task = spec(suspend=suspend)
    assert wanted_transition(task, phase, paused_by, wake, last_wake) is wanted


def test_a_restore_created_suspended_holds_too() -> None:
    task = parse_spec({"lifecycle": {"suspend": True}, "resumeFrom": {"checkpointRef": "ck-1"}})
    assert wanted_transition(task, None, None, None, None) is Wanted.HOLD


@pytest.mark.parametrize(
    ("on_delete", "state", "expected"),
    [
        pytest.param("checkpoint", None, DeleteAction.NOTHING_TO_DRAIN, id="never-started"),
        pytest.param("delete", None, DeleteAction.RELEASE, id="on-delete-delete"),
        pytest.param("checkpoint", OperationState.DRAINING, DeleteAction.WAIT,
                     id="a-drain-begun-is-followed"),
        pytest.param("checkpoint", OperationState.RECORDED, DeleteAction.RECORDED,
                     id="a-drain-recorded-is-kept"),
    ],
)  # fmt: skip
def test_deleting_a_task_created_suspended_releases_at_once(
    on_delete: str, state: OperationState | None, expected: DeleteAction
) -> None:
    # Created suspended, nothing ran: whatever its status says (a ref written by hand).
    task = spec(onDelete=on_delete, suspend=True)
    action = decide_delete(
        task, observed=NEVER_RAN, op_state=state, drain_started=NOW - timedelta(seconds=10),
        now=NOW,
    )  # fmt: skip
    assert action is expected


@pytest.mark.parametrize(
    ("paused_by", "ready"),
    [
        pytest.param(CREATED_SUSPENDED,
                     ConditionChange("Ready", False, "Paused",
                                     "created suspended: nothing started: set suspend false"),
                     id="created-suspended"),
        pytest.param("manual",
                     ConditionChange("Ready", False, "Paused",
                                     "paused: agents drained to a checkpoint, the Sandbox "
                                     "suspended: set suspend false"),
                     id="paused"),
    ],
)  # fmt: skip
def test_a_task_created_suspended_is_paused_not_ready_and_says_nothing_started(
    paused_by: str, ready: ConditionChange
) -> None:
    assert readiness(Phase.SUSPENDED, None, "set suspend false", paused_by) == ready


@pytest.mark.parametrize(
    ("spec", "existing"),
    [({}, None), ({"sandbox": {"name": None}}, None), ({"sandbox": {"name": "mine"}}, "mine")],
)
def test_spec_sandbox_name_names_an_existing_sandbox(
    spec: dict[str, Any], existing: str | None
) -> None:
    assert parse_spec(spec).sandbox_name == existing


def _with_volumes(*volumes: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"podTemplate": {"spec": {"volumes": list(volumes)}}}}


@pytest.mark.parametrize(
    ("sandbox", "claim"),
    [
        ({}, None),
        (_with_volumes({"name": "run", "emptyDir": {}}), None),
        (_with_volumes({"name": "w", "persistentVolumeClaim": {"claimName": "ws"}},
                       {"name": "run", "emptyDir": {}}), "ws"),
        (_with_volumes({"name": "a", "persistentVolumeClaim": {"claimName": "a"}},
                       {"name": "b", "persistentVolumeClaim": {"claimName": "b"}}), None),
    ],
)  # fmt: skip
def test_an_existing_sandboxs_workspace_is_its_only_claim(
    sandbox: dict[str, Any], claim: str | None
) -> None:
    assert sandbox_workspace_claim(sandbox) == claim


@pytest.mark.parametrize(
    ("task", "workspace", "image", "env", "storage_class"),
    [
        ({}, {}, None, (), None),
        ({"image": "", "env": None}, {"storageClassName": None}, None, (), None),
        ({"image": "reg.example/caliband:1"}, {"storageClassName": "fast"},
         "reg.example/caliband:1", (), "fast"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "B"}]}, {}, None,
         (("A", "1"), ("B", "")), None),
    ],
)  # fmt: skip
def test_image_env_and_storage_class_are_read_from_the_spec(
    task: dict[str, Any], workspace: dict[str, Any], image: str | None,
    env: tuple[tuple[str, str], ...], storage_class: str | None,
) -> None:  # fmt: skip
    parsed = parse_spec({"task": task, "workspace": workspace})
    assert (parsed.image, parsed.env, parsed.storage_class) == (image, env, storage_class)


def _sandbox(status: dict[str, Any] | None) -> dict[str, Any]:
    return {"metadata": {"name": "t-sbx"}, **({"status": status} if status is not None else {})}


@pytest.mark.parametrize(
    ("status", "ok", "reason", "says"),
    [
        (None, None, "NoSandboxStatus", "Sandbox t-sbx has no Ready condition yet"),
        ({"conditions": []}, None, "NoSandboxStatus", "has no Ready condition"),
        ({"conditions": [{"type": "Suspended", "status": "True"}]}, None, "NoSandboxStatus",
         "has no Ready condition"),
        ({"conditions": [{"type": "Ready", "status": "True", "reason": "DependenciesReady"}]},
         True, "DependenciesReady", "Sandbox t-sbx is Ready"),
        ({"conditions": [{"type": "Ready", "status": "False", "reason": "DependenciesNotReady",
                          "message": "secret ollama-key not found"}]},
         False, "DependenciesNotReady", "is not Ready: secret ollama-key not found"),
        ({"conditions": [{"type": "Ready", "status": "Unknown"}]}, None, "SandboxReported",
         "reports Ready Unknown"),
    ],
)  # fmt: skip
def test_the_sandboxes_ready_condition_is_reflected_on_the_task(
    status: dict[str, Any] | None, ok: bool | None, reason: str, says: str
) -> None:
    change = sandbox_readiness(_sandbox(status))
    assert (change.type, change.status, change.reason) == ("SandboxReady", ok, reason)
    assert says in change.message


@pytest.mark.parametrize(
    ("status", "fqdn"),
    [
        (None, None),
        ({"serviceFQDN": ""}, None),
        ({"serviceFQDN": 5}, None),
        ({"serviceFQDN": "t-sbx.ns.svc.cluster.local"}, "t-sbx.ns.svc.cluster.local"),
    ],
)
def test_the_sandboxes_service_fqdn_is_read_only_where_written(
    status: dict[str, Any] | None, fqdn: str | None
) -> None:
    assert sandbox_service_fqdn(_sandbox(status)) == fqdn


@pytest.mark.parametrize(
    ("phase", "failed_generation", "generation", "retries"),
    [
        (Phase.FAILED, 3, 4, True),  # failed before anything was created; spec changed
        (Phase.FAILED, 3, 3, False),  # the same spec: it would fail the same way
        (Phase.FAILED, None, 9, False),  # failed after its agents ran: stays Failed
        (Phase.FAILED, "3", 4, False),  # not a generation (a hand-edited status)
        (Phase.RUNNING, 3, 4, False),
        (Phase.PENDING, 3, 4, False),
        (None, None, 1, False),
    ],
)
def test_a_failed_task_retries_only_when_nothing_was_created_and_its_spec_changed(
    phase: Phase | None, failed_generation: object, generation: object, retries: bool
) -> None:
    assert retries_failure(phase, failed_generation, generation) is retries


# -------------------------------------------------------------------------- scaling


@pytest.mark.parametrize(
    ("wanted", "applied", "counts", "step"),
    [
        pytest.param(3, None, AgentCounts(3, 3), ScaleStep.ADOPT, id="never-recorded-adopts"),
        pytest.param(3, None, None, ScaleStep.ADOPT, id="never-recorded-no-heartbeat-adopts"),
        pytest.param(3, True, AgentCounts(1, 1), ScaleStep.ADOPT, id="a-bool-is-no-count"),
        pytest.param(3, 3, AgentCounts(3, 3), ScaleStep.HOLD, id="unchanged"),
        pytest.param(1, 1, AgentCounts(3, 3), ScaleStep.HOLD, id="restored-3-spec-1-unchanged"),
        pytest.param(1, 3, None, ScaleStep.HOLD, id="changed-no-fresh-heartbeat-waits"),
        pytest.param(1, 3, AgentCounts(3, 3), ScaleStep.DOWN, id="3-to-1-down"),
        pytest.param(2, 3, AgentCounts(3, 2, 0, 1), ScaleStep.DOWN, id="done-agents-count"),
        pytest.param(5, 3, AgentCounts(3, 3), ScaleStep.UP, id="3-to-5-up"),
        pytest.param(2, 1, AgentCounts(1, 1), ScaleStep.UP, id="1-to-2-up"),
        pytest.param(2, 3, AgentCounts(2, 2), ScaleStep.ADOPT, id="already-there-adopts"),
    ],
)
def test_only_a_changed_agent_count_scales_and_toward_what_the_daemon_runs(
    wanted: int, applied: object, counts: AgentCounts | None, step: ScaleStep
) -> None:
    assert scale_step(wanted, applied, counts) is step


@pytest.mark.parametrize(
    ("kind", "state", "error", "ref", "expected"),
    [
        pytest.param(
            OperationKind.SCALE_DOWN, OperationState.RECORDED, None, "ckpt-1",
            ("Scaled", True, "ScaledDown",
             "scaled from 3 to 1 agents: the 2 removed agent(s) drained into checkpoint ckpt-1"),
            id="down-recorded",
        ),
        pytest.param(
            OperationKind.SCALE_DOWN, OperationState.FAILED, "drain failed: refused", None,
            ("Scaled", False, "ScaleDownFailed",
             "scaling from 3 to 1 agents failed, no agent was removed: drain failed: refused"),
            id="down-failed",
        ),
        pytest.param(
            OperationKind.SCALE_UP, OperationState.RESUMED, None, None,
            ("Scaled", True, "ScaledUp", "scaled from 3 to 1 agents"),
            id="up-resumed",
        ),
        pytest.param(
            OperationKind.SCALE_UP, OperationState.RESUMED, "(new): the daemon is draining", None,
            ("Scaled", False, "PartlyScaledUp",
             "scaling from 3 to 1 agents: not every agent came: (new): the daemon is draining"),
            id="up-partly",
        ),
        pytest.param(
            OperationKind.SCALE_UP, OperationState.FAILED, "supervisor unreachable", None,
            ("Scaled", False, "ScaleUpFailed",
             "scaling from 3 to 1 agents failed: supervisor unreachable"),
            id="up-failed",
        ),
    ],
)  # fmt: skip
def test_a_finished_scale_says_how_it_went(
    kind: OperationKind,
    state: OperationState,
    error: str | None,
    ref: str | None,
    expected: tuple[str, bool, str, str],
) -> None:
    change = scale_outcome(kind, state, error, ref, 3, 1)
    assert (change.type, change.status, change.reason, change.message) == expected


# ---------------------------------------------------------- Sandboxes made elsewhere


@pytest.mark.parametrize(
    ("sandbox", "existing", "runs_in"),
    [
        pytest.param({}, False, None, id="ours-to-make"),
        pytest.param({}, True, "napper-sbx", id="made-elsewhere-as-caliban-operator-names-it"),
        pytest.param({"name": "mine"}, True, "mine", id="named-wins-elsewhere"),
        pytest.param({"name": "mine"}, False, "mine", id="named-wins-here"),
    ],
)
def test_a_task_runs_in_the_sandbox_made_elsewhere_when_sandboxes_are_not_ours_to_make(
    sandbox: dict[str, Any], existing: bool, runs_in: str | None
) -> None:
    spec = parse_spec({"sandbox": sandbox} if sandbox else {})
    assert on_existing_sandbox(spec, "napper", existing).sandbox_name == runs_in


def test_existing_sandboxes_imply_operating_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.settings import Settings

    monkeypatch.setenv("DRAIN_EXISTING_SANDBOXES", "true")
    monkeypatch.delenv("DRAIN_MANAGE_SANDBOX", raising=False)
    settings = Settings()
    assert settings.existing_sandboxes and settings.manage_sandbox


# ------------------------------------------------------------------------ completion

DONE_2 = AgentCounts(total=2, live=0, done=2)
COMPLETE = CompletionDecision(CompletionStep.COMPLETE)
NOT_DONE = CompletionDecision(CompletionStep.NOT_DONE)
K_COMPLETE, K_PAUSE = OperationKind.COMPLETE, OperationKind.PAUSE
S_FAILED, S_RECORDED = OperationState.FAILED, OperationState.RECORDED


@pytest.mark.parametrize(
    ("counts", "done"),
    [
        pytest.param(None, False, id="no-heartbeat"),
        pytest.param(AgentCounts(total=0, live=0), False, id="no-agents"),
        pytest.param(AgentCounts(total=2, live=0, done=2), True, id="every-agent-done"),
        pytest.param(AgentCounts(total=1, live=0, done=1), True, id="the-only-agent-done"),
        pytest.param(AgentCounts(total=2, live=1, done=1), False, id="one-still-live"),
        pytest.param(AgentCounts(total=2, live=0, done=1), False, id="one-killed-by-a-user"),
        pytest.param(AgentCounts(total=2, live=0, interrupted=1, done=1), False,
                     id="one-interrupted"),
        pytest.param(AgentCounts(total=2, live=0), False, id="both-killed"),
        pytest.param(AgentCounts(total=2, live=0, interrupted=2), False, id="both-interrupted"),
    ],
)  # fmt: skip
def test_a_tasks_work_is_over_only_when_every_one_of_its_agents_is_done(
    counts: AgentCounts | None, done: bool
) -> None:
    assert every_agent_done(counts) is done


def _finished(secs_ago: float) -> datetime:
    return NOW - timedelta(seconds=secs_ago)


@pytest.mark.parametrize(
    ("counts", "silent", "attempts", "kind", "state", "finished", "decision"),
    [
        pytest.param(DONE_2, False, 0, None, None, None, COMPLETE, id="first-time-all-done"),
        pytest.param(DONE_2, False, 0, OperationKind.RESTORE, OperationState.RESUMED,
                     _finished(1), COMPLETE, id="all-done-right-after-a-restore"),
        pytest.param(DONE_2, False, 1, K_PAUSE, S_FAILED, _finished(1), COMPLETE,
                     id="a-failed-pause-is-no-reason-to-wait"),
        pytest.param(DONE_2, True, 0, None, None, None, NOT_DONE,
                     id="silent-daemon-nothing-known"),
        pytest.param(None, False, 0, None, None, None, NOT_DONE, id="no-heartbeat"),
        pytest.param(AgentCounts(total=2, live=0, done=1), False, 0, None, None, None, NOT_DONE,
                     id="one-killed-is-not-finished-work"),
        pytest.param(AgentCounts(total=2, live=0, interrupted=1, done=1), False, 0, None, None,
                     None, NOT_DONE, id="one-interrupted-is-recovered-not-completed"),
        pytest.param(AgentCounts(total=2, live=1, done=1), False, 0, None, None, None, NOT_DONE,
                     id="one-still-working"),
        pytest.param(DONE_2, False, 1, K_COMPLETE, S_FAILED, _finished(4),
                     CompletionDecision(CompletionStep.RETRY_LATER, 6.0),
                     id="first-failure-waits-10s"),
        pytest.param(DONE_2, False, 1, K_COMPLETE, S_FAILED, _finished(10), COMPLETE,
                     id="first-failure-retried-after-10s"),
        pytest.param(DONE_2, False, 2, K_COMPLETE, S_FAILED, _finished(10),
                     CompletionDecision(CompletionStep.RETRY_LATER, 20.0),
                     id="second-failure-waits-30s"),
        pytest.param(DONE_2, False, 9, K_COMPLETE, S_FAILED, _finished(200),
                     CompletionDecision(CompletionStep.RETRY_LATER, 100.0),
                     id="later-failures-wait-300s"),
        pytest.param(DONE_2, False, 9, K_COMPLETE, S_FAILED, _finished(300), COMPLETE,
                     id="later-failures-retried-after-300s"),
        pytest.param(DONE_2, False, 1, K_COMPLETE, S_FAILED, None, COMPLETE,
                     id="failure-time-unknown-retries"),
        pytest.param(DONE_2, False, 1, K_COMPLETE, S_RECORDED, _finished(1), COMPLETE,
                     id="recorded-but-running-again-after-a-restore-of-itself"),
        pytest.param(AgentCounts(total=2, live=0, done=1), False, 1, K_COMPLETE, S_FAILED,
                     _finished(1), NOT_DONE, id="failed-then-not-all-done-any-more"),
    ],
)  # fmt: skip
def test_a_running_task_completes_when_every_agent_is_done_and_retries_a_failed_completion(
    counts: AgentCounts | None, silent: bool, attempts: int, kind: OperationKind | None,
    state: OperationState | None, finished: datetime | None, decision: CompletionDecision,
) -> None:  # fmt: skip
    got = completion_step(
        counts, silent=silent, attempts=attempts, last_kind=kind, last_state=state,
        last_finished_at=finished, now=NOW,
    )  # fmt: skip
    assert got == decision


def test_completion_retries_back_off_to_five_minutes() -> None:
    assert COMPLETION_RETRY_SECS == (10.0, 30.0, 60.0, 120.0, 300.0)


def test_a_task_whose_agents_are_all_done_is_idle_yet_completes_rather_than_pausing() -> None:
    """The daemon reports a task whose agents are all done as idle (``summarize``): the
    idle pause alone would pause it; completion is decided first and wins, and while it
    waits to retry the pass decides nothing else."""
    task = spec(idleTimeout="1m")
    idle = received(idle_for=600.0, secs_ago=1.0)
    assert should_idle_pause(task, Phase.RUNNING, idle, NOW, GAP) is True
    first = completion_step(DONE_2, silent=False, attempts=0, last_kind=None, last_state=None,
                            last_finished_at=None, now=NOW)  # fmt: skip
    assert first.step is CompletionStep.COMPLETE
    retry = completion_step(
        DONE_2, silent=False, attempts=1, last_kind=K_COMPLETE, last_state=S_FAILED,
        last_finished_at=_finished(1), now=NOW,
    )  # fmt: skip
    assert retry.step is CompletionStep.RETRY_LATER


@pytest.mark.parametrize("phase", [None, *Phase], ids=lambda p: str(p or "no-phase"))
@pytest.mark.parametrize("kind", [None, *OperationKind], ids=lambda k: str(k or "no-op"))
def test_a_draining_task_is_completing_only_when_its_drain_is_a_completions(
    phase: Phase | None, kind: OperationKind | None
) -> None:
    expected = phase is Phase.DRAINING and kind is OperationKind.COMPLETE
    assert completing(phase, kind) is expected


NOTHING = CompletedAnswer.NOTHING
NO_RESUME = CompletedAnswer.NOTHING_TO_RESUME
NO_PAUSE = CompletedAnswer.NOTHING_TO_PAUSE


@pytest.mark.parametrize(
    ("suspend", "last_suspend", "wake", "last_wake", "answer"),
    [
        pytest.param(False, False, None, None, NOTHING, id="at-rest"),
        pytest.param(False, False, "w1", "w1", NOTHING, id="a-spent-wake"),
        pytest.param(False, False, "w2", "w1", NO_RESUME, id="a-new-wake"),
        pytest.param(False, False, "w1", None, NO_RESUME, id="a-first-wake"),
        pytest.param(False, False, "", None, NOTHING, id="an-empty-wake"),
        pytest.param(True, False, None, None, NO_PAUSE, id="suspend-set-true"),
        pytest.param(True, True, None, None, NOTHING, id="suspend-true-answered"),
        pytest.param(False, True, None, None, NO_RESUME, id="suspend-set-false"),
        pytest.param(False, True, "w2", "w1", NO_RESUME, id="drainctl-wake-is-one-request"),
        pytest.param(True, False, "w2", "w1", NO_RESUME, id="a-wake-while-suspend-is-set"),
        pytest.param(True, None, None, None, NOTHING, id="nothing-recorded-to-compare"),
        pytest.param(False, None, None, None, NOTHING, id="nothing-recorded-default"),
    ],
)  # fmt: skip
def test_a_completed_task_answers_a_wake_or_suspend_once_with_nothing_to_do(
    suspend: bool, last_suspend: bool | None, wake: str | None, last_wake: str | None,
    answer: CompletedAnswer,
) -> None:  # fmt: skip
    assert completed_request(suspend, last_suspend, wake, last_wake) is answer


@pytest.mark.parametrize(
    ("suspend", "paused_by", "wake", "last_wake"),
    [(False, None, None, None), (True, None, None, None), (False, None, "w2", "w1"),
     (True, "manual", "w2", "w1"), (False, "idle", "w3", None)],
)  # fmt: skip
def test_kubectl_never_pauses_or_resumes_a_completed_task(
    suspend: bool, paused_by: str | None, wake: str | None, last_wake: str | None
) -> None:
    task = spec(suspend=suspend)
    assert wanted_transition(task, Phase.COMPLETED, paused_by, wake, last_wake) is Wanted.NOTHING


@pytest.mark.parametrize(
    ("on_delete", "observed", "state", "expected"),
    [
        pytest.param("checkpoint", COMPLETED, None, DeleteAction.KEEP_COMPLETED_CHECKPOINT,
                     id="the-completed-checkpoint-is-kept-no-second-drain"),
        pytest.param("delete", COMPLETED, None, DeleteAction.RELEASE,
                     id="on-delete-delete-releases"),
        pytest.param("checkpoint", DeletionObserved(OperationKind.COMPLETE,
                     OperationState.RECORDED, None, ran=True), None, DeleteAction.START_DRAIN,
                     id="no-ref-drains-as-any-other"),
        pytest.param("checkpoint", COMPLETED, OperationState.RECORDED, DeleteAction.RECORDED,
                     id="a-drain-begun-is-followed"),
    ],
)  # fmt: skip
def test_deleting_a_completed_task_keeps_its_checkpoint_and_releases_at_once(
    on_delete: str, observed: DeletionObserved, state: OperationState | None,
    expected: DeleteAction,
) -> None:  # fmt: skip
    action = decide_delete(
        spec(onDelete=on_delete), observed=observed, op_state=state,
        drain_started=NOW - timedelta(seconds=1), now=NOW,
    )  # fmt: skip
    assert action is expected
