"""The daemon-side Celery consumer: one per Sandbox pod, beside the supervisor daemon.

It consumes the pod's own queue ``caliband.<namespace>.<name>`` and turns each task into
control requests on the local supervisor's Unix socket:

- ``caliban.daemon.drain(op_id, grace_secs)`` → ``drain`` → the resume refs;
- ``caliban.daemon.resume(op_id, agents)`` → ``resume`` of each agent not already live;

each refused, acked and answered with the reason, when it names a task uid other than
the one this pod serves (``DRAIN_TASK_UID``): a message a deleted task of the same name
left in the queue never touches the new task's agents;

and it sends ``caliban.orchestrator.activity`` heartbeats (counts, and how long the task
has been idle on this host's monotonic clock) on every change and at least every
heartbeat interval. The pod holds no Kubernetes credentials and no database URL: the
broker is its only way out. Run by ``drainctl daemon``, it also reports its broker
connection to the daemon's ``/readyz`` (:class:`BrokerWatch`, ``worker_agent.broker_state``).

``drainctl daemon --queue … --broker …`` starts this module as a child process and
restarts it if it dies; it can also run alone as ``python -m worker_agent.consumer``.

Everything it shares with the orchestrator (names, Celery settings, payload models)
comes from ``worker_agent.contract``; it never imports ``orchestrator``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from celery import Celery, Task, bootsteps
from celery.exceptions import Reject
from celery.signals import worker_ready, worker_shutting_down
from pydantic import ValidationError

from worker_agent import broker_state, logformat, metrics, signing
from worker_agent.celery_worker import run_worker
from worker_agent.client import ControlError, SupervisorClient
from worker_agent.contract import (
    ACTIVITY,
    CHECKPOINT_MISMATCH,
    DAEMON_DRAIN,
    DAEMON_RESUME,
    DAEMON_SCALE_DOWN,
    DAEMON_SCALE_UP,
    ORCHESTRATOR_QUEUE,
    ActivityReport,
    AgentResumeOutcome,
    BrokerSettings,
    DrainRequest,
    DrainResult,
    JsonObject,
    ResumeAgent,
    ResumeRequest,
    ResumeResult,
    ScaleDownRequest,
    ScaleUpRequest,
    celery_config,
    daemon_celery_config,
    malformed,
    parse_daemon_queue,
    refusal,
    stamp_messages,
)
from worker_agent.exiting import exit_now
from worker_agent.journal import OperationJournal, Verb
from worker_agent.proto import (
    DAEMON_STOPPING,
    AgentRecord,
    AgentStatus,
    ProtocolError,
    ResumeRef,
    says_daemon_stopping,
)
from worker_agent.session import SessionError, load_session
from worker_agent.store import Store

log = logging.getLogger(__name__)

SUPERVISOR_RETRIES = 5
HAND_BACK_PAUSE_SECS = 1.0
"""How long a consumer whose daemon is stopping waits before it hands a resume back."""


def _configure(sender: Celery, **_: object) -> None:
    sender.config_from_object(celery_config(BrokerSettings()))
    stamp_messages()


app = Celery("caliban-drain")
"""The consumer's own Celery app, configured from the contract like the orchestrator's,
from ``BrokerSettings`` the first time its configuration is read (Celery's
``on_configure``), not when this module is imported."""
app.on_configure.connect(_configure, weak=False)


@dataclass(frozen=True)
class ConsumerConfig:
    """Where the supervisor is and which task this pod serves (``main``'s options, and
    ``DRAIN_TASK_UID`` as the daemon sets it for its consumer child): its Unix socket, or
    a caliband's TCP+TLS listener (``connect``) with a bearer token and a CA."""

    socket: Path | None
    store: Path
    namespace: str
    name: str
    task_uid: str | None
    connect: tuple[str, int] | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    task_key: bytes | None = None
    """The task's key (``DRAIN_TASK_KEY``), which every result and heartbeat this pod
    sends is signed with (``signing``); None: they go unsigned."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ConsumerConfig:
        """The configuration ``main``'s parsed options give (``--connect`` checked),
        with the task uid from ``environ``."""
        namespace, name = parse_daemon_queue(args.queue)
        key = environ.get(signing.TASK_KEY_ENV)
        return cls(
            socket=args.socket,
            store=args.store,
            namespace=namespace,
            name=name,
            task_uid=environ.get("DRAIN_TASK_UID") or None,
            connect=host_port(args.connect) if args.connect else None,
            token_file=args.token_file,
            ca_file=args.ca_file,
            task_key=signing.parse_key(key, signing.TASK_KEY_ENV) if key else None,
        )

    def signed(self, body: JsonObject) -> JsonObject:
        """``body`` as this pod sends it: where it has a key, naming the task uid it
        serves and signed with the task's key (``signing``)."""
        if self.task_key is None:
            return body
        if body.get("task_uid") is None and self.task_uid is not None:
            body = {**body, "task_uid": self.task_uid}
        return signing.sign(self.task_key, body)

    def refusal(self, message_uid: str | None) -> str | None:
        """Why a message for ``message_uid`` is not this pod's to act on, or None."""
        return refusal(message_uid, self.task_uid, f"{self.namespace}/{self.name}")


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets), or ``ValueError`` saying what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT with a port from 1 to 65535")
    return host, int(port)


class ConsumerTask(Task):  # type: ignore[type-arg]
    """The base of the consumer's tasks: the pod they serve (``pod``, set once by
    ``main`` before the worker starts), and each task's run timed for the metrics."""

    pod: ClassVar[ConsumerConfig | None] = None
    _started = 0.0  # when the running task began (the solo pool: one at a time)

    @classmethod
    def serve(cls, config: ConsumerConfig) -> None:
        cls.pod = config

    @property
    def config(self) -> ConsumerConfig:
        if self.pod is None:
            raise RuntimeError(
                "the consumer serves no pod: run it as python -m worker_agent.consumer"
            )
        return self.pod

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        metrics.observe_queue_wait(metrics.DAEMON_QUEUE_WAIT, self)
        self._started = time.monotonic()

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        if self.name == DAEMON_RESUME:
            metrics.DAEMON_RESUME_DURATION.labels(outcome=resume_outcome(retval)).observe(
                time.monotonic() - self._started
            )


def _client(config: ConsumerConfig, timeout: float) -> SupervisorClient:
    if config.connect is None:
        return SupervisorClient(socket_path=config.socket, timeout=timeout)
    token = config.token_file.read_text().strip() if config.token_file else None
    return SupervisorClient(
        address=config.connect, token=token, cafile=config.ca_file, timeout=timeout
    )


@app.task(name=DAEMON_DRAIN, bind=True, base=ConsumerTask, max_retries=SUPERVISOR_RETRIES)
def drain(self: ConsumerTask, /, **payload: object) -> JsonObject:
    """Drain every agent of this pod; answer the refs (the same ones on redelivery)."""
    return self.config.signed(
        _drain_refs(
            self,
            payload,
            DrainRequest,
            "drain",
            lambda client, request: client.drain(request.grace_secs),
        )
    )


@app.task(name=DAEMON_SCALE_DOWN, bind=True, base=ConsumerTask, max_retries=SUPERVISOR_RETRIES)
def scale_down(self: ConsumerTask, /, **payload: object) -> JsonObject:
    """Keep the task's ``agents`` oldest agents and drain the rest into retirement; answer
    the retired agents' refs (the same ones on redelivery), for their checkpoint."""
    return self.config.signed(
        _drain_refs(
            self,
            payload,
            ScaleDownRequest,
            "scale_down",
            lambda client, request: client.retire(request.agents, request.grace_secs),
        )
    )


_Drains = TypeVar("_Drains", DrainRequest, ScaleDownRequest)


def _drain_refs(
    task: ConsumerTask,
    payload: dict[str, object],
    model: type[_Drains],
    what: Verb,
    drain_with: Callable[[SupervisorClient, _Drains], list[ResumeRef]],
) -> JsonObject:
    """A drain of some or all of this pod's agents, as a ``DrainResult``: journaled under
    its op id, so a redelivered message is answered with the same refs and drains
    nothing twice.

    A malformed request is answered with an error result (the operation fails with the
    reason), never raised: a task that raises on its input would be retried forever."""
    config = task.config
    try:
        request = model.model_validate(payload)
    except ValidationError as exc:
        reason = malformed(f"{what.replace('_', '-')} request", exc)
        log.error("%s_refused reason=%s", what, reason)
        return _drain_result(config, str(payload.get("op_id", "")), reason)
    journal = OperationJournal(config.store)
    if (done := journal.get(request.op_id, what, DrainResult)) is not None:
        log.info("%s_redelivered op=%s answered_from=journal", what, request.op_id)
        return done.model_dump(mode="json")
    if (refused := config.refusal(request.task_uid)) is not None:
        # Acked and answered: the operation fails with the reason; no agent is touched.
        log.warning("%s_refused op=%s reason=%s", what, request.op_id, refused)
        answer = DrainResult.model_validate(_drain_result(config, request.op_id, refused))
        journal.put(request.op_id, what, answer)
        return answer.model_dump(mode="json")
    try:
        with _client(config, timeout=request.grace_secs + 120) as client:
            refs = drain_with(client, request)
    except (ConnectionError, OSError, ControlError) as exc:
        if task.request.retries < SUPERVISOR_RETRIES:
            raise task.retry(countdown=1 + task.request.retries, exc=exc) from None
        return _drain_result(config, request.op_id, f"supervisor unreachable: {exc}")
    result = DrainResult(
        op_id=request.op_id,
        namespace=config.namespace,
        name=config.name,
        refs=refs,
        error=None,
        task_uid=config.task_uid,
    )
    journal.put(request.op_id, what, result)
    log.info(
        "%s_done op=%s task=%s/%s agents=%d unclean=%d",
        what,
        request.op_id,
        config.namespace,
        config.name,
        len(refs),
        sum(not r.clean for r in refs),
    )
    return result.model_dump(mode="json")


def _drain_result(config: ConsumerConfig, op_id: str, error: str) -> JsonObject:
    """A drain that did not happen: no refs, and the reason."""
    return DrainResult(
        op_id=op_id,
        namespace=config.namespace,
        name=config.name,
        refs=[],
        error=error,
        task_uid=config.task_uid,
    ).model_dump(mode="json")


@app.task(name=DAEMON_RESUME, bind=True, base=ConsumerTask, max_retries=SUPERVISOR_RETRIES)
def resume(self: ConsumerTask, /, **payload: object) -> JsonObject:
    """Resume each agent of a checkpoint (all in the store when it names none); one that
    is already live counts as resumed."""
    return self.config.signed(
        _bring_agents(self, payload, ResumeRequest, "resume", _resume_checkpoint)
    )


@app.task(name=DAEMON_SCALE_UP, bind=True, base=ConsumerTask, max_retries=SUPERVISOR_RETRIES)
def scale_up(self: ConsumerTask, /, **payload: object) -> JsonObject:
    """Bring the task to ``agents`` agents: resume agents a scale-down retired, oldest
    first, each continuing its conversation at ``turns + 1``, then spawn new ones. Judged
    against the agents the task has when it runs, so a redelivery that finds the task
    grown already brings nobody twice."""
    return self.config.signed(_bring_agents(self, payload, ScaleUpRequest, "scale_up", _grow))


_Brings = TypeVar("_Brings", ResumeRequest, ScaleUpRequest)


def _bring_agents(
    task: ConsumerTask,
    payload: dict[str, object],
    model: type[_Brings],
    what: Verb,
    bring: Callable[
        [SupervisorClient, ConsumerConfig, _Brings, list[AgentResumeOutcome]], str | None
    ],
) -> JsonObject:
    """Agents brought back or started, as a ``ResumeResult``: ``bring`` appends one
    outcome per agent, or answers why the whole operation is refused (nothing brought).
    Journaled under its op id, so a redelivered message is answered the same.

    A malformed request is answered with an error result, never raised (a task that
    raises on its input would be retried forever)."""
    try:
        request = model.model_validate(payload)
    except ValidationError as exc:
        reason = malformed(f"{what.replace('_', '-')} request", exc)
        log.error("%s_refused reason=%s", what, reason)
        op_id = str(payload.get("op_id", ""))
        return ResumeResult(op_id=op_id, results=[], error=reason).model_dump(mode="json")
    config = task.config
    journal = OperationJournal(config.store)
    if (done := journal.get(request.op_id, what, ResumeResult)) is not None:
        log.info("%s_redelivered op=%s answered_from=journal", what, request.op_id)
        return done.model_dump(mode="json")
    results: list[AgentResumeOutcome] = []
    refused = config.refusal(request.task_uid)
    try:
        if refused is None:
            with _client(config, timeout=120) as client:
                refused = bring(client, config, request, results)
    except (ConnectionError, OSError) as exc:
        if task.request.retries < SUPERVISOR_RETRIES:
            raise task.retry(countdown=1 + task.request.retries, exc=exc) from None
        unreachable = ResumeResult(
            op_id=request.op_id, results=results, error=f"supervisor unreachable: {exc}"
        )
        return unreachable.model_dump(mode="json")
    if refused is not None:
        log.warning("%s_refused op=%s reason=%s", what, request.op_id, refused)
        answer = ResumeResult(op_id=request.op_id, results=[], error=refused)
        journal.put(request.op_id, what, answer)
        return answer.model_dump(mode="json")
    result = ResumeResult(op_id=request.op_id, results=results, error=None)
    journal.put(request.op_id, what, result)
    log.info(
        "%s_done op=%s ok=%d failed=%d",
        what,
        request.op_id,
        sum(r.ok for r in results),
        sum(not r.ok for r in results),
    )
    return result.model_dump(mode="json")


def _resume_checkpoint(
    client: SupervisorClient,
    config: ConsumerConfig,
    request: ResumeRequest,
    results: list[AgentResumeOutcome],
) -> str | None:
    records = client.agents()
    live = {r.id for r in records if r.status.live}
    agents = request.agents
    # One a redelivered resume already brought back has moved on: not checked.
    waiting = [a for a in agents if a.id not in live]
    if (mismatch := _not_this_checkpoint(config.store, waiting)) is not None:
        return mismatch
    if not agents:
        # A forced checkpoint or a recovery names no agents: it is the PVC as it is, so
        # every agent in the store with work left is resumed; one a user killed, or that
        # finished its work, stays as it is, and so does one a scale-down retired: it is
        # no longer the task's.
        agents = [
            ResumeAgent(id=r.id, session_dir=f"agents/{r.id}")
            for r in records
            if (r.status.live or r.status.interrupted) and not r.retired
        ]
        for r in records:
            if not (r.status.live or r.status.interrupted) or r.retired:
                log.info("resume_skipped agent=%s status=%s", r.id, r.status)
    for agent in agents:
        if agent.id in live:
            results.append(AgentResumeOutcome(id=agent.id, ok=True, note="already running"))
            continue
        try:
            client.resume(
                agent.session_dir,
                expect_turns=agent.turns,
                expect_sha256=agent.session_sha256,
                provider=request.provider,
                model=request.model,
            )
        except ControlError as exc:
            if says_daemon_stopping(exc.body.kind, exc.body.message):
                _hand_back(request.op_id)
            results.append(AgentResumeOutcome(id=agent.id, ok=False, error=exc.body.message))
        else:
            results.append(AgentResumeOutcome(id=agent.id, ok=True))
    return None


def _grow(
    client: SupervisorClient,
    config: ConsumerConfig,
    request: ScaleUpRequest,
    results: list[AgentResumeOutcome],
) -> None:
    records = client.agents()
    missing = request.agents - sum(not r.retired for r in records)
    # A retired agent that never saved a turn (drained before its first) has nothing to
    # resume: a new agent is spawned in its place.
    revive = [r for r in records if r.retired and r.turns][: max(0, missing)]
    for record in revive:
        results.append(_bring(client, request, record.id))
    for _ in range(max(0, missing - len(revive))):
        results.append(_bring(client, request, None))


def _bring(
    client: SupervisorClient, request: ScaleUpRequest, retired: str | None
) -> AgentResumeOutcome:
    """One agent of a scale-up: the ``retired`` agent resumed, or (None) a new one spawned,
    as its outcome. A daemon that is stopping hands the whole scale-up back."""
    try:
        if retired is not None:
            started = client.resume(f"agents/{retired}").id
        else:
            started = client.spawn(
                provider=request.provider, model=request.model, initial_prompt=request.prompt
            ).id
    except ControlError as exc:
        if says_daemon_stopping(exc.body.kind, exc.body.message):
            _hand_back(request.op_id)
        return AgentResumeOutcome(id=retired or "(new)", ok=False, error=exc.body.message)
    return AgentResumeOutcome(id=started, ok=True, note="resumed" if retired else "spawned")


def _not_this_checkpoint(store_root: Path, agents: list[ResumeAgent]) -> str | None:
    """Why the workspace does not hold the checkpoint these agents come from, or None.

    Every agent's session is checked against the turns and sha256 its checkpoint
    recorded before any is resumed: a restore continues exactly the checkpoint's state
    or refuses as a whole, never a mix of it and of what the workspace moved on to."""
    store = Store(store_root)
    problems: list[str] = []
    for agent in agents:
        if agent.turns is None and agent.session_sha256 is None:
            continue  # a forced checkpoint or a recovery: the workspace as it is
        try:
            session = store.resolve_session_dir(agent.session_dir)
            held = load_session(session)
        except (ProtocolError, SessionError, OSError):
            continue  # missing or unreadable: that agent fails alone, the rest resume
        try:
            store.check_expected(session, agent.turns, agent.session_sha256)
        except ProtocolError as exc:
            problems.append(f"{agent.id}: {exc.message}")
            if lost := metrics.lost_turns(agent.turns, held.turns):
                metrics.DAEMON_LOST_TURNS.inc(lost)
                log.error(
                    "lost_turns agent=%s recorded=%s found=%d", agent.id, agent.turns, held.turns
                )
    if not problems:
        return None
    return f"{CHECKPOINT_MISMATCH}; no agent was resumed: {'; '.join(problems)}"


def _hand_back(op_id: str) -> None:
    """Give a resume back to the queue, unanswered: this pod's daemon is stopping (its pod
    is going), and the next pod's consumer, on the same store, will serve it. Nothing is
    journaled, so that consumer runs the whole resume, for exactly the agents it names.

    The pause is so that a consumer not yet told to stop does not spin on the message;
    once it is (``request_stop``, or its death with the daemon), it takes no more."""
    log.warning(
        "resume_handed_back op=%s reason=%s: the next pod's consumer takes it",
        op_id,
        DAEMON_STOPPING,
    )
    time.sleep(HAND_BACK_PAUSE_SECS)
    raise Reject(DAEMON_STOPPING, requeue=True)


# ------------------------------------------------------------------------ heartbeats


STOPPED_ON_PURPOSE = frozenset({AgentStatus.DONE, AgentStatus.KILLED})
"""Stopped agents that leave the task idle: finished, or killed by a user; never resumed."""


@dataclass(frozen=True)
class ActivityCounts:
    """The part of a heartbeat the daemon's agent records decide."""

    agents_total: int
    agents_live: int
    agents_idle: int
    all_idle_since: float | None
    """Wall-clock start of the current all-idle period, from the records; None while the
    task is not idle. It names the period (a new value is a new period) and is shown as
    ``status.idleSince``; no duration is ever computed from it."""
    agents_interrupted: int = 0
    agents_done: int = 0


def summarize(records: list[AgentRecord]) -> ActivityCounts:
    """Counts, and since when the task has been idle (None while it is not).

    The task is idle when every live agent is ``idle`` and every stopped agent stopped on
    purpose: ``done`` (its worker exited 0 by itself, its work over) or ``killed`` (a
    user's ``kill``; nothing resumes it). A stopped agent with work left — ``crashed`` (a
    restarted daemon), ``drained`` (the daemon's own SIGTERM, whatever its exit code),
    ``failed`` (a non-zero exit by itself) — holds the task out of idle: what comes next
    is a recovery resume, not an idle pause. So no live agents means not idle unless
    every agent stopped on purpose, and no agents at all means not idle.

    The period starts when its last agent went idle (``idle_since``, else the record's
    ``updated_at``) or stopped (``updated_at``).
    """
    records = [r for r in records if not r.retired]  # no longer the task's agents
    live = [r for r in records if r.status.live]
    idle = [r for r in live if r.status is AgentStatus.IDLE]
    stopped = [r for r in records if not r.status.live]
    all_idle_since: float | None = None
    if records and len(idle) == len(live) and all(r.status in STOPPED_ON_PURPOSE for r in stopped):
        moments = [r.idle_since or r.updated_at for r in idle]
        moments += [r.updated_at for r in stopped]
        all_idle_since = max(moments)
    return ActivityCounts(
        agents_total=len(records),
        agents_live=len(live),
        agents_idle=len(idle),
        all_idle_since=all_idle_since,
        agents_interrupted=sum(r.status.interrupted for r in records),
        agents_done=sum(r.status is AgentStatus.DONE for r in records),
    )


class IdleClock:
    """How long the task has been idle, on this host's monotonic clock.

    The agents' ``idle_since`` stamps are wall-clock times that an NTP step, a resumed
    VM or a hand-set clock moves at will, so no duration is taken from them. Instead the
    clock starts when the consumer first sees an all-idle period (at most one poll after
    it began: a pause comes at most that much later, never earlier) and restarts
    whenever the period's identity, its ``all_idle_since``, changes — an agent that
    worked and went idle again between two polls starts a new period. A restarted
    consumer starts counting again from zero, which delays a pause and never hastens one.
    """

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = monotonic
        self._period: float | None = None
        self._began = 0.0

    def idle_for(self, all_idle_since: float | None) -> float | None:
        """Seconds the period named by ``all_idle_since`` has been seen idle (None: none)."""
        if all_idle_since is None:
            self._period = None
            return None
        now = self.monotonic()
        if all_idle_since != self._period:
            self._period, self._began = all_idle_since, now
        return now - self._began


class Heartbeat(threading.Thread):
    """Sends an ``ActivityReport`` on every change of the counts, and at least every
    heartbeat interval, so the orchestrator's idle timing never goes stale.

    ``report`` decides what to send from the agents' records and the injected clocks,
    ``run`` does the I/O. The idle duration comes from an ``IdleClock`` on ``monotonic``;
    ``wall`` only stamps ``reported_at`` and ``seq``. ``seq`` is wall-clock nanoseconds
    so that it grows across consumer restarts, but never less than the last one sent
    plus one, so a backward clock step does not make the orchestrator drop this
    consumer's heartbeats.
    """

    def __init__(
        self,
        config: ConsumerConfig,
        *,
        settings: BrokerSettings | None = None,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="caliban-heartbeat", daemon=True)
        settings = settings if settings is not None else BrokerSettings()
        self.config = config
        self.interval = settings.heartbeat_interval_secs
        self.poll = settings.heartbeat_poll_secs
        self.stopping = threading.Event()
        self.wall = wall
        self.monotonic = monotonic
        self.idle_clock = IdleClock(monotonic)
        self._last: ActivityCounts | None = None
        self._last_sent = 0.0
        self._last_seq = 0

    def report(self, records: list[AgentRecord]) -> tuple[ActivityCounts, ActivityReport] | None:
        """The heartbeat due for these records, or None: nothing changed and the last one
        was sent less than an interval ago. Call ``sent`` once it is on its way."""
        counts = summarize(records)
        idle_for = self.idle_clock.idle_for(counts.all_idle_since)
        if counts == self._last and self.monotonic() - self._last_sent < self.interval:
            return None
        now = self.wall()
        seq = max(int(now * 1_000_000_000), self._last_seq + 1)
        report = ActivityReport(
            namespace=self.config.namespace,
            name=self.config.name,
            task_uid=self.config.task_uid,
            seq=seq,
            reported_at=now,
            agents_total=counts.agents_total,
            agents_live=counts.agents_live,
            agents_idle=counts.agents_idle,
            all_idle_since=counts.all_idle_since,
            idle_for_secs=idle_for,
            agents_interrupted=counts.agents_interrupted,
            agents_done=counts.agents_done,
        )
        return counts, report

    def sent(self, counts: ActivityCounts, report: ActivityReport) -> None:
        self._last, self._last_sent, self._last_seq = counts, self.monotonic(), report.seq

    def run(self) -> None:
        while not self.stopping.wait(self.poll):
            try:
                with _client(self.config, timeout=10) as client:
                    records = client.agents()
            except (ConnectionError, OSError) as exc:
                log.warning("heartbeat_supervisor_unreachable error=%s", exc)
                continue
            if (due := self.report(records)) is None:
                continue
            counts, report = due
            try:
                app.send_task(
                    ACTIVITY,
                    kwargs=self.config.signed(report.model_dump(mode="json")),
                    queue=ORCHESTRATOR_QUEUE,
                    expires=self.interval * 4,
                )
            except Exception as exc:  # the broker may be restarting; try next poll
                log.warning("heartbeat_send_failed error=%s", exc)
                continue
            self.sent(counts, report)


# ---------------------------------------------------------------- broker connection


def check_broker(timeout: float = broker_state.CHECK_TIMEOUT_SECS) -> str | None:
    """Why the broker does not answer a fresh connection within ``timeout`` (connect,
    then a round trip: Redis's PING, AMQP's handshake), or None when it does."""
    options = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
    try:
        with app.connection_for_read(transport_options=options, connect_timeout=timeout) as conn:
            conn.ensure_connection(max_retries=0)
            conn.default_channel  # noqa: B018 (opening the channel is the round trip)
    except Exception as exc:  # refused, timed out, unknown host, bad credentials
        return str(exc) or type(exc).__name__
    return None


class BrokerWatch(threading.Thread):
    """Writes the consumer's broker report (``worker_agent.broker_state``) for the
    supervisor's ``/readyz``: every check interval and at once when the worker's
    connection changes (:class:`BrokerConnected`). It is the report's only writer.

    A thread, not a timer on the worker's loop: the solo pool runs a drain on that loop,
    and a drain must not make the daemon look stuck, nor hide a broker lost meanwhile.
    """

    def __init__(self, directory: Path) -> None:
        super().__init__(name="caliban-broker-watch", daemon=True)
        self.directory = directory
        self.connection = broker_state.Connection.NOT_YET
        self.changed = threading.Event()

    def tell(self, connection: broker_state.Connection) -> None:
        if connection is not self.connection:
            log.info("broker_connection state=%s", connection.name.lower())
        self.connection = connection
        self.changed.set()

    def run(self) -> None:
        pid = os.getpid()
        while True:
            self.changed.clear()
            connection = self.connection
            check_error = None if connection is broker_state.Connection.STOPPING else check_broker()
            problem = broker_state.problem(connection, check_error)
            try:
                broker_state.write(self.directory, broker_state.Report(pid, problem))
            except OSError as exc:  # the supervisor removed the dir: it is stopping
                log.warning("broker_report_unwritable error=%s", exc)
            self.changed.wait(broker_state.CHECK_SECS)


def broker_connected(watch: BrokerWatch) -> type[bootsteps.StartStopStep]:
    """A step for the worker's consumer blueprint telling ``watch`` of the worker's own
    connection: started once it is up and its queues consumed, stopped when Celery
    restarts the blueprint on a lost connection (and at shutdown)."""

    class BrokerConnected(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer:Tasks",)

        def start(self, parent: Any) -> None:
            watch.tell(broker_state.Connection.CONNECTED)

        def stop(self, parent: Any) -> None:
            watch.tell(broker_state.Connection.LOST)

        def shutdown(self, parent: Any) -> None:
            watch.tell(broker_state.Connection.STOPPING)

    return BrokerConnected


def attend(worker_app: Celery, config: ConsumerConfig, metrics_dir: str | None) -> None:
    """What runs beside the worker's tasks, tied to its signals: the heartbeat from the
    moment the worker is ready, and (under a supervisor, which gives its metrics dir)
    the broker report. Both are told when the worker shuts down."""
    heartbeat = Heartbeat(config)
    watch = BrokerWatch(Path(metrics_dir)) if metrics_dir else None

    def ready(**_: Any) -> None:
        heartbeat.start()

    def shutting_down(**_: Any) -> None:
        heartbeat.stopping.set()
        if watch is not None:
            watch.tell(broker_state.Connection.STOPPING)

    worker_ready.connect(ready, weak=False)
    worker_shutting_down.connect(shutting_down, weak=False)
    if watch is not None:
        worker_app.steps["consumer"].add(broker_connected(watch))
        watch.start()


def resume_outcome(answer: object) -> str:
    """The ``outcome`` label of a resume task's answer (see ``DAEMON_RESUME_DURATION``)."""
    if not isinstance(answer, dict):
        return "failed"  # retried or raised: no answer
    error = answer.get("error")
    if isinstance(error, str) and error.startswith(CHECKPOINT_MISMATCH):
        return "refused"
    results = [r for r in answer.get("results") or [] if isinstance(r, dict)]
    ok = sum(bool(r.get("ok")) for r in results)
    if error or (results and not ok):
        return "failed"
    return "ok" if ok == len(results) else "partial"


def options(
    argv: list[str] | None, environ: Mapping[str, str]
) -> tuple[ConsumerConfig, argparse.Namespace]:
    """``main``'s command line as the pod's configuration (and the options it was
    parsed from); what is wrong with it exits 2 with one line."""
    parser = argparse.ArgumentParser(prog="python -m worker_agent.consumer")
    parser.add_argument("--queue", required=True, help="caliband.<namespace>.<name>")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", type=Path, help="the daemon's Unix control socket")
    where.add_argument(
        "--connect", metavar="HOST:PORT", help="a daemon's (or caliband's) TLS listener"
    )
    parser.add_argument("--token-file", type=Path, help="bearer token for --connect")
    parser.add_argument("--ca-file", type=Path, help="CA that signed --connect's certificate")
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--loglevel", default="INFO")
    args = parser.parse_args(argv)
    if args.connect is not None:
        try:
            host_port(args.connect)
        except ValueError as exc:
            parser.error(f"--connect {exc}")
        if args.token_file is None:
            parser.error("--connect needs --token-file: the listener takes a bearer token")
        try:
            if not args.token_file.read_text().strip():
                parser.error(f"--token-file {args.token_file} is empty")
        except OSError as exc:
            parser.error(f"--token-file {args.token_file}: {exc.strerror}")
    try:
        return ConsumerConfig.from_args(args, environ), args
    except signing.BadKey as exc:
        parser.error(str(exc))
    except ValueError as exc:  # --queue is not caliband.<namespace>.<name>
        parser.error(f"--queue: {exc}")


def main(argv: list[str] | None = None) -> None:
    config, args = options(argv, os.environ)
    # The same lines as drainctl's own processes (DRAIN_LOG_FORMAT), each naming the
    # task this pod serves, and a drain's or resume's operation id while it runs.
    logformat.configure(args.loglevel)
    logformat.set_process_context(
        namespace=config.namespace, name=config.name, task_uid=config.task_uid
    )
    logformat.install_celery_hooks()
    ConsumerTask.serve(config)
    app.conf.update(daemon_celery_config(BrokerSettings(), config.namespace))
    attend(app, config, os.environ.get(metrics.MULTIPROC_ENV))
    code = run_worker(
        app,
        queues=[args.queue],
        hostname=f"{args.queue}@%h",
        pool="solo",
        loglevel=args.loglevel,
        without_gossip=True,
        without_mingle=True,
    )
    # The worker has stopped: its last task acknowledged, its result stored, its events
    # sent. Skip the interpreter's teardown (``exiting``).
    exit_now(code)


if __name__ == "__main__":
    main()
