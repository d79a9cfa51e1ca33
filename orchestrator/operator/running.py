"""A task on its way to Running and while it runs: the daemon's heartbeats decide
whether its agents are available, interrupted (a recovery) or silent (the Sandbox is
looked after); a running task at rest hands over to ``completion``, ``suspended`` (a
pause), ``scaling`` or ``recovery`` when a ``lifecycle`` decision says so.
"""

from __future__ import annotations

import logging

import kopf

from orchestrator.operator import (
    completion,
    kube,
    provisioning,
    recovery,
    rolling,
    scaling,
    suspended,
)
from orchestrator.operator.lifecycle import (
    AgentCounts,
    Availability,
    AvailabilityDecision,
    LaunchStep,
    Phase,
    ScaleStep,
    TaskSpec,
    Wanted,
    availability,
    heartbeat_silent,
    idle_report,
    launch_step,
    parse_time,
    resume_outcome,
    scale_step,
    should_idle_pause,
    wanted_transition,
)
from orchestrator.operator.pacing import (
    Requeue,
    RunningWatch,
    heartbeat_signature,
    streak_resets_at,
)
from orchestrator.operator.taskpass import (
    TaskPass,
    counts_of,
    iso,
    utc_now,
)

log = logging.getLogger(__name__)


async def await_running(p: TaskPass, spec: TaskSpec) -> None:
    """A task on its way to Running (Provisioning, Resuming): Running once its daemon's
    heartbeat reports its agents live, a recovery if it reports them stopped; until then
    it waits for the next heartbeat, an operation's move or a child's change, unpolled."""
    p.requeue = p.waiting_for_daemon()
    op = await p.last_operation()
    if op is not None:
        p.record_operation(op)
        outcome = resume_outcome(op.state, op.error)
        if outcome.condition is not None:
            p.apply_condition(outcome.condition)
            if outcome.condition.reason == "CheckpointMismatch":
                # Not recovered either: a recovery would resume what the checkpoint
                # does not hold, the very thing the check refused.
                if p.phase != Phase.FAILED:
                    kopf.warn(p.body, reason="CheckpointMismatch", message=str(op.error))
                p.set_status(agents=0)
                p.set_phase(Phase.FAILED, str(op.error))
                return
        if outcome.still_resuming:
            return
    activity = await p.fresh_activity()
    if p.phase == Phase.PROVISIONING and heartbeat_silent(
        p.heartbeat_age(await p.latest_activity()), p.settings.heartbeat_interval_secs
    ):
        await provisioning.ensure_sandbox(p, spec)
        if p.phase == Phase.FAILED:
            return
    if activity is not None and not await p.since_last_operation(activity):
        return  # a heartbeat from before the resume finished: wait for the next one
    reported = None
    if activity is not None:
        reported = p.counts = counts_of(activity)
    step = launch_step(p.phase, reported)
    # Without a heartbeat launch_step answers WAIT: both branches below have one.
    if step is LaunchStep.RUNNING:
        assert activity is not None and reported is not None
        p.set_status(agents=activity.agents_live)
        p.apply_condition(
            availability(
                reported,
                0.0,
                p.settings.heartbeat_interval_secs,
                p.recovery_history(),
                p.now,
            ).condition
        )
        recovery.recovered(p, reported)
        p.consume_wake()
        p.requeue = None  # Running: looked at again soon, to settle what it watches
        await provisioning.refresh_sandbox(p, spec)
        p.set_phase(Phase.RUNNING, f"{activity.agents_live} agents live")
    elif step is LaunchStep.RECOVER:
        assert activity is not None and reported is not None
        await act_on(p, p.availability(reported, activity), spec, reported)


async def while_running(p: TaskPass, spec: TaskSpec) -> None:
    if await scaling.follow_scaling(p):
        return  # a pause, a completion or a further scale waits for the agents to settle
    activity = await p.latest_activity()
    counts = p.counts = None if activity is None else counts_of(activity)
    if await completion.complete_when_done(p, spec, counts, activity):
        return
    wanted = wanted_transition(spec, Phase.RUNNING, None, p.wake_value(), p.status.last_wake)
    if wanted is Wanted.PAUSE:
        await suspended.start_pause(p, spec, "manual")
        return
    decision = availability(
        counts,
        p.heartbeat_age(activity),
        p.settings.heartbeat_interval_secs,
        p.recovery_history(),
        p.now,
    )
    if activity is not None:
        p.set_status(agents=activity.agents_live)
    if decision.step is Availability.AVAILABLE:
        assert counts is not None and activity is not None
        p.apply_condition(decision.condition)
        if decision.streak_over:
            p.set_status(recovery_streak=0)
        recovery.recovered(p, counts)
        p.consume_wake()
        p.set_phase(Phase.RUNNING, decision.condition.message)
        fresh = await p.fresh_activity()
        # idleSince is the daemon's wall clock, shown as it is; the decision never
        # reads it.
        idle_since = fresh.all_idle_since if fresh is not None else None
        p.set_status(idle_since=iso(idle_since))
        since = counts if await p.since_last_operation(activity) else None
        step = scale_step(spec.agents, p.status.applied_agents, since)
        if step is ScaleStep.ADOPT:
            p.set_status(applied_agents=spec.agents)
        elif step is not ScaleStep.HOLD:
            await scaling.start_scaling(p, spec, step, counts)
            return
        elif spec.agents != p.status.applied_agents:
            return  # a scale waits for a heartbeat from after the last operation
        if await rolling.follow_spec(p, spec):
            return  # the roll's drain is under way
        bridge = p.settings.heartbeat_gap_secs
        if should_idle_pause(spec, Phase.RUNNING, idle_report(fresh), p.now, bridge):
            await suspended.start_pause(p, spec, "idle")
            return
        history = p.recovery_history()
        p.requeue = Requeue(
            RunningWatch(
                heartbeat_signature(activity),
                spec.idle_timeout_secs,
                streak_resets_at(0 if decision.streak_over else history.streak, history.last_at),
                fresh_since=parse_time(p.status.phase_since),
            )
        )
        return
    # Stopped or unknown agents are never idle: nothing to pause.
    p.set_status(idle_since=None)
    if decision.step is Availability.DAEMON_SILENT:
        p.apply_condition(decision.condition)
        p.set_status(agents=0)  # none is known to run
        recovery.disrupted(p, "DaemonSilent", decision.condition.message)
        await provisioning.ensure_sandbox(p, spec)
        p.set_phase(Phase.PROVISIONING, f"waiting for the daemon: {decision.condition.message}")
        return
    assert counts is not None and activity is not None
    if not await p.since_last_operation(activity):
        return  # what a recovery found, not what it left: wait for the next heartbeat
    await act_on(p, decision, spec, counts)


async def act_on(
    p: TaskPass, decision: AvailabilityDecision, spec: TaskSpec, counts: AgentCounts
) -> None:
    """Begin a recovery of interrupted agents, or say why not yet."""
    if decision.step is Availability.CRASH_LOOP and recovery.rearmed(p):
        decision = AvailabilityDecision(Availability.RECOVER, decision.condition)
        p.set_status(recovery_streak=0)
    p.apply_condition(decision.condition)
    if decision.step is Availability.RECOVER:
        await recovery.start_recovery(
            p, counts, decision.condition.reason, streak_over=decision.streak_over
        )
        return
    if decision.step is Availability.CRASH_LOOP:
        recovery.disrupted(p, "CrashLoop", decision.condition.message)
    p.set_phase(Phase.RUNNING, decision.condition.message)


async def no_daemon_to_answer(p: TaskPass, spec: TaskSpec) -> str | None:
    """Why no daemon can answer this task's drain, or None: its Sandbox is gone (so
    nothing will start one) and its daemon silent. A deletion then takes its forced
    checkpoint at once rather than at drainTimeout; the daemon's own SIGTERM drain
    has flushed what the PVC holds."""
    if not p.settings.manage_sandbox:
        return None
    name = p.sandbox_of(spec)
    if await kube.get_sandbox(spec.sandbox_version, p.namespace, name):
        return None
    p.now = utc_now()  # a deletion's pass follows its drain for a while
    age = p.heartbeat_age(await p.latest_activity())
    if not heartbeat_silent(age, p.settings.heartbeat_interval_secs):
        return None
    silent = "ever" if age is None else f"for {age:.0f}s"
    return f"its Sandbox is gone and no heartbeat came from its daemon {silent}"
