"""The contract between the daemon side and the orchestrator, written once, here.

Queue names, task names, the Celery configuration both halves share, and the payloads
and results of ``drain``, ``resume`` and activity heartbeats as strict pydantic models.
The daemon-side consumer (``worker_agent.consumer``) and the orchestrator
(``orchestrator.pipeline``) both build their Celery app with ``make_celery`` and both
validate what they receive with these models; Celery still carries plain JSON
(``model_dump(mode="json")``), whose shape ``tests/unit/test_contract.py`` pins.

This module imports only Celery, pydantic and ``worker_agent.proto``; it must never import
``orchestrator`` (the daemon pod ships without it), and ``orchestrator`` imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Final

from celery import Celery
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker_agent.k8s_names import is_dns_label, is_dns_subdomain
from worker_agent.proto import ResumeRef

# ------------------------------------------------------------------ queues and names

ORCHESTRATOR_QUEUE: Final = "orchestrator"
"""The queue of every orchestrator-side task (``caliban.orchestrator.*``)."""

# Task names: the wire contract. Neither side imports the other's task code; each sends
# the other's tasks by name.
DAEMON_DRAIN: Final = "caliban.daemon.drain"
DAEMON_RESUME: Final = "caliban.daemon.resume"
DAEMON_SCALE_DOWN: Final = "caliban.daemon.scale_down"
DAEMON_SCALE_UP: Final = "caliban.daemon.scale_up"
RECORD_CHECKPOINT: Final = "caliban.orchestrator.record_checkpoint"
RECORD_RESUME: Final = "caliban.orchestrator.record_resume"
ACTIVITY: Final = "caliban.orchestrator.activity"

OP_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
"""An operation id as it may appear in a task id and a journal file name (the ledger's
are uuid4s)."""


class TaskNameError(ValueError):
    """A namespace/name pair that cannot name a Kubernetes object or a queue."""


def parse_task_ref(ref: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` → (namespace, name), validated like Kubernetes names."""
    namespace, sep, name = ref.partition("/")
    if not sep:
        raise TaskNameError(f"{ref!r} is not NAMESPACE/NAME")
    check_task_name(namespace, name)
    return namespace, name


def check_task_name(namespace: str, name: str) -> None:
    if not is_dns_label(namespace):
        raise TaskNameError(f"namespace {namespace!r} is not a DNS-1123 label")
    if not is_dns_subdomain(name):
        raise TaskNameError(f"name {name!r} is not a DNS-1123 subdomain")


def daemon_queue(namespace: str, name: str) -> str:
    """The queue one task's daemon consumes. Dots cannot occur in a namespace, so
    ``caliband.<ns>.<name>`` is unambiguous even when the name has dots."""
    check_task_name(namespace, name)
    return f"caliband.{namespace}.{name}"


def parse_daemon_queue(queue: str) -> tuple[str, str]:
    """``caliband.<namespace>.<name>`` → (namespace, name); the inverse of ``daemon_queue``."""
    prefix, _, rest = queue.partition(".")
    namespace, _, name = rest.partition(".")
    if prefix != "caliband":
        raise TaskNameError(f"queue {queue!r} is not caliband.<namespace>.<name>")
    check_task_name(namespace, name)
    return namespace, name


# ------------------------------------------------------------------ Celery settings

AMQP_SCHEMES: Final = frozenset({"amqp", "amqps", "pyamqp"})
"""Broker URL schemes of RabbitMQ (kombu's py-amqp transport)."""
SENDER_ONLY_BACKENDS: Final = frozenset({"rpc", *AMQP_SCHEMES})
"""Result backends no other process can read: ``rpc://`` sends each result to the process
that sent the task, and Celery 5 has no ``amqp://`` result backend."""


def url_scheme(url: str) -> str:
    """``redis://host/0`` → ``redis``; ``db+postgresql://…`` → ``db``."""
    return url.partition("://")[0].partition("+")[0].lower()


class BrokerSettings(BaseSettings):
    """What both halves need to reach each other, read from ``DRAIN_*`` variables.

    ``orchestrator.settings.Settings`` extends this class, so each setting is declared
    and documented once; the daemon's consumer reads only these.
    """

    model_config = SettingsConfigDict(env_prefix="DRAIN_", extra="ignore")

    broker_url: str = "redis://127.0.0.1:6379/0"
    """Celery broker (``DRAIN_BROKER_URL``): ``redis://`` (default) or ``amqp://``."""
    result_backend: str | None = Field(default=None, validate_default=True)
    """Celery result backend (``DRAIN_RESULT_BACKEND``); defaults to the broker URL with a
    Redis broker, or to a results folder beside the embedded broker's. With RabbitMQ it
    must be set (checked below): RabbitMQ keeps no results."""
    broker_folder: str | None = None
    """With ``DRAIN_BROKER_URL=filesystem://`` (kombu's filesystem transport; no
    acknowledgements, so a killed consumer's message is lost — ``drainctl dev up``'s
    embedded broker speaks Redis instead): the folder messages are exchanged through."""
    visibility_timeout_secs: float = Field(default=60.0, gt=0)
    """Redis redelivers a message whose consumer died, unacknowledged, after this. It is
    short so that a drain redelivered after a killed consumer arrives before it expires
    (``orchestrator.settings`` checks the relation); a drain that runs longer than this is
    redelivered while it runs, which is harmless: the daemon answers a repeated drain with
    the same refs and the ledger records one checkpoint per operation. RabbitMQ does not
    use it (see ``broker_heartbeat_secs``)."""
    unacked_restore_interval_secs: float = Field(default=10.0, gt=0)
    """How often a worker sweeps for messages whose visibility timeout has passed (Redis)."""
    broker_heartbeat_secs: int = Field(default=60, ge=1)
    """RabbitMQ: the AMQP heartbeat timeout in whole seconds, as AMQP carries it
    (``DRAIN_BROKER_HEARTBEAT_SECS``; the server's own, 60 s by default, caps it). RabbitMQ
    redelivers a consumer's unacknowledged messages as soon as its connection closes —
    at once when the process dies, its socket closed by the kernel; for a pod that
    vanishes with its node, when about two heartbeats go unanswered. A solo-pool
    consumer answers no heartbeat while a drain runs, so a drain longer than this loses
    its connection and is redelivered when it ends: harmless, like a drain outlasting
    Redis's visibility timeout (the journal answers it, the ledger records once)."""
    heartbeat_interval_secs: float = Field(default=15.0, gt=0)
    """Daemons send an activity heartbeat at least this often (and on every change)."""
    heartbeat_poll_secs: float = Field(default=1.0, gt=0)
    """How often a daemon's consumer looks for activity changes."""

    @field_validator("result_backend")
    @classmethod
    def _results_every_process_reads(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The deadline sweeper (an orchestrator worker) reads a drain result the daemon's
        consumer stored, for a chain the operator or ``drainctl`` sent: the backend must
        be one store that every process reads."""
        broker = str(info.data.get("broker_url", ""))
        if not value and url_scheme(broker) in AMQP_SCHEMES:
            raise ValueError(
                "must be set with a RabbitMQ broker (DRAIN_BROKER_URL=amqp://…), which keeps no "
                "results: set it to a Redis database every orchestrator worker and daemon can "
                "reach, e.g. redis://redis:6379/1"
            )
        if value and url_scheme(value) in SENDER_ONLY_BACKENDS:
            raise ValueError(
                f"{url_scheme(value)}:// cannot keep results for the deadline sweeper, which "
                "reads a drain's result in another process than the one that sent it: set it "
                "to a Redis database every orchestrator worker and daemon can reach, e.g. "
                "redis://redis:6379/1"
            )
        return value

    @property
    def amqp(self) -> bool:
        """The broker is RabbitMQ."""
        return url_scheme(self.broker_url) in AMQP_SCHEMES

    @property
    def heartbeat_gap_secs(self) -> float:
        """The longest a healthy consumer leaves between two heartbeats: the interval,
        noticed at the next poll. The operator bridges at most this much wall-clock time
        between heartbeats when it times an idle task (``lifecycle.idle_secs``)."""
        return self.heartbeat_interval_secs + self.heartbeat_poll_secs

    def backend(self) -> str:
        if self.result_backend:
            return self.result_backend
        if self.broker_url.startswith("filesystem://"):
            return f"file://{self.broker_folder or '.'}/results"
        return self.broker_url


def _transport_options(settings: BrokerSettings, url: str) -> dict[str, object]:
    """kombu transport options for the broker or backend at ``url``.

    The visibility timeout and the unacked restore are Redis's emulation of
    acknowledgements; RabbitMQ acknowledges natively and redelivers when a connection
    closes, so it gets none of them, and publisher confirms instead: a publish returns
    once RabbitMQ has taken the message, and one it refuses raises instead of vanishing.
    """
    scheme = url_scheme(url)
    if scheme in ("redis", "rediss", "sentinel"):
        return {
            "visibility_timeout": settings.visibility_timeout_secs,
            "unacked_restore_interval": settings.unacked_restore_interval_secs,
            "unacked_restore_throttle": 1,
        }
    if scheme in AMQP_SCHEMES:
        return {"confirm_publish": True}
    if scheme == "filesystem":
        # The embedded broker: processes on one machine exchange messages as files.
        folder = Path(settings.broker_folder or "./.broker")
        for sub in ("queue", "processed", "results", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        return {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": 0.1,
        }
    return {}


def celery_config(settings: BrokerSettings) -> dict[str, Any]:
    """The Celery configuration docs/pipeline.md describes, for either half.

    JSON only, acks late, reject on worker lost, prefetch 1, task events on, redelivery
    of a dead consumer's messages (Redis: the visibility timeout; RabbitMQ: when its
    connection closes, heartbeats for one that vanished), connection retry on start-up;
    ``caliban.orchestrator.*`` routed to the orchestrator queue.
    """
    backend = settings.backend()
    return dict(
        broker_url=settings.broker_url,
        result_backend=backend,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        result_extended=True,
        result_expires=7 * 24 * 3600,
        broker_transport_options=_transport_options(settings, settings.broker_url),
        result_backend_transport_options=_transport_options(settings, backend),
        broker_heartbeat=settings.broker_heartbeat_secs,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_default_queue=ORCHESTRATOR_QUEUE,
        task_create_missing_queues=True,
        task_routes={"caliban.orchestrator.*": {"queue": ORCHESTRATOR_QUEUE}},
        task_publish_retry=True,
        task_publish_retry_policy={
            "max_retries": 30,
            "interval_start": 0.2,
            "interval_step": 0.5,
            "interval_max": 5,
        },
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        enable_utc=True,
    )


def daemon_unacked_keys(namespace: str) -> dict[str, str]:
    """Where a Redis broker keeps the messages ``namespace``'s daemons have taken and not
    acknowledged yet: keys of their own, under their queues' prefix (``_`` cannot begin
    a task's name), not the one hash every other consumer shares. A tenant's broker user
    (``orchestrator.broker_tenants``) reaches these and no one else's."""
    own = f"caliband.{namespace}._unacked"
    return {
        "unacked_key": own,
        "unacked_index_key": f"{own}_index",
        "unacked_mutex_key": f"{own}_mutex",
    }


TENANT_USER_PREFIX: Final = "caliban-drain."
"""The broker users the operator makes for task namespaces (``orchestrator.broker_tenants``)
are named ``caliban-drain.<namespace>.<fingerprint>``: a daemon whose broker URL names
such a user knows it holds a tenant's rights only."""


def is_tenant_url(url: str) -> bool:
    from urllib.parse import unquote, urlsplit

    return unquote(urlsplit(url).username or "").startswith(TENANT_USER_PREFIX)


def daemon_celery_config(settings: BrokerSettings, namespace: str) -> dict[str, Any]:
    """What a daemon's consumer of ``namespace`` runs with on top of ``celery_config``,
    so that it needs no broker right beyond its own queues and publishing to the
    orchestrator's:

    - on Redis, its unacknowledged messages under its own keys (``daemon_unacked_keys``);
    - no remote control: a worker that takes remote control listens to, and so must be
      allowed to publish on, the broadcast every worker obeys (a ``shutdown`` from one
      tenant would reach the orchestrator's workers);
    - as a tenant (``is_tenant_url``), the orchestrator's queue published to, never
      declared: declaring it needs the right to delete it on RabbitMQ, and on Redis to
      read it and to bind queues of one's own to it. The orchestrator's worker declares
      it when it starts. (Without a tenant's user the daemon declares it, as every
      Celery client does, so a daemon started before any worker still reaches it.)"""
    from kombu import Exchange, Queue

    options = dict(_transport_options(settings, settings.broker_url))
    if url_scheme(settings.broker_url) in ("redis", "rediss", "sentinel"):
        options.update(daemon_unacked_keys(namespace))
    config: dict[str, Any] = {
        "broker_transport_options": options,
        "worker_enable_remote_control": False,
    }
    if is_tenant_url(settings.broker_url):
        # Through the orchestrator's exchange: Celery would otherwise publish through
        # the default exchange, which reaches every queue by name and which a tenant
        # may not use.
        config["task_routes"] = {
            "caliban.orchestrator.*": {
                "queue": ORCHESTRATOR_QUEUE,
                "exchange": ORCHESTRATOR_QUEUE,
                "routing_key": ORCHESTRATOR_QUEUE,
            }
        }
        config["task_queues"] = [
            Queue(
                ORCHESTRATOR_QUEUE,
                Exchange(ORCHESTRATOR_QUEUE),
                routing_key=ORCHESTRATOR_QUEUE,
                no_declare=True,
            )
        ]
    return config


def stamp_messages() -> None:
    """Every message this process publishes carries its sent time, for the queue wait."""
    from celery.signals import before_task_publish

    from worker_agent.metrics import stamp_sent_at

    before_task_publish.connect(stamp_sent_at, weak=False)


def make_celery(settings: BrokerSettings) -> Celery:
    """A Celery app configured from ``settings`` (``celery_config``)."""
    app = Celery("caliban-drain")
    app.conf.update(celery_config(settings))
    stamp_messages()
    return app


# ------------------------------------------------------------------------- payloads


class Payload(BaseModel):
    """A Celery payload or result. Both sides are ours, so an unknown field is an error
    (a mismatched deployment), and values are JSON's own types, never coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WithOptional(Payload):
    """A payload some of whose fields travel only when set (``_OPTIONAL``): a message
    without them has the shape it had before they were added."""

    _OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        shape: dict[str, object] = handler(self)
        for field in self._OPTIONAL:
            if shape.get(field) is None:
                shape.pop(field, None)
        return shape


class BoundToTask(WithOptional):
    """A payload that names the task (by Kubernetes uid) it is meant for.

    Queues are named by namespace and name, which a re-created task shares with the
    deleted one: a drain or resume the deleted task left in its queue reaches the new
    task's daemon. The uid is what tells them apart, so the daemon, which serves one
    uid, refuses a message for another. ``task_uid`` travels only when set: a message
    without one (``drainctl drain NAMESPACE/NAME``, a sender that predates it) has the
    shape it always had and is served by whichever daemon consumes the queue."""

    task_uid: str | None = Field(default=None, min_length=1, max_length=128)

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("task_uid",)


class DrainRequest(BoundToTask):
    """kwargs of ``caliban.daemon.drain``."""

    op_id: str = Field(pattern=OP_ID_PATTERN)
    grace_secs: float = Field(ge=0)


class ScaleDownRequest(BoundToTask):
    """kwargs of ``caliban.daemon.scale_down``: keep the task's ``agents`` oldest agents,
    drain the rest (``grace_secs``) into retirement. Answered with a ``DrainResult``
    whose refs are the retired agents', which ``record_checkpoint`` records."""

    op_id: str = Field(pattern=OP_ID_PATTERN)
    agents: int = Field(ge=1)
    grace_secs: float = Field(ge=0)


class ScaleUpRequest(BoundToTask):
    """kwargs of ``caliban.daemon.scale_up``: bring the task to ``agents`` agents, first
    by resuming agents a scale-down retired (oldest first, each at ``turns + 1``), then
    by spawning new ones with ``provider``, ``model`` and ``prompt`` (the task's
    ``spec.task``). Answered with a ``ResumeResult``, one outcome per agent it brought."""

    op_id: str = Field(pattern=OP_ID_PATTERN)
    agents: int = Field(ge=1)
    provider: str = Field(min_length=1)
    model: str | None = None
    prompt: str | None = None

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("task_uid", "model", "prompt")


class DrainResult(BoundToTask):
    """What ``caliban.daemon.drain`` answers; ``record_checkpoint`` receives it.

    ``error`` set means the daemon could not drain (or refused: the request was for
    another task uid) and ``refs`` is empty. ``task_uid`` is the uid the answering
    daemon serves, so the record can check that the agents it lists are the task's."""

    op_id: str
    namespace: str
    name: str
    refs: list[ResumeRef]
    error: str | None
    signature: str | None = None
    """The task's signature over the rest (``signing``), when its daemon has a key."""

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("task_uid", "signature")


class ResumeAgent(Payload):
    """One agent a resume asks for: its id and its session dir relative to the store, and,
    when it comes from a checkpoint, the turns and session sha256 the checkpoint recorded
    (the daemon refuses a session that is no longer that one)."""

    id: str = Field(min_length=1)
    session_dir: str = Field(min_length=1)
    turns: int | None = Field(default=None, ge=0)
    session_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_serializer(mode="plain")
    def _present_fields(self) -> dict[str, object]:
        # The expectations travel only when there are some (a forced checkpoint has none).
        shape: dict[str, object] = {"id": self.id, "session_dir": self.session_dir}
        if self.turns is not None:
            shape["turns"] = self.turns
        if self.session_sha256 is not None:
            shape["session_sha256"] = self.session_sha256
        return shape


class ResumeRequest(BoundToTask):
    """kwargs of ``caliban.daemon.resume``. No agents means every agent in the store (a
    forced checkpoint names none: it is the PVC as it was)."""

    op_id: str = Field(pattern=OP_ID_PATTERN)
    agents: list[ResumeAgent]
    provider: str | None = Field(default=None, min_length=1)
    """A restore's: every agent continues with the restoring task's provider and model
    (``spec.task``), not the ones it was spawned with. None: as spawned."""
    model: str | None = None

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("task_uid", "provider", "model")


class AgentResumeOutcome(Payload):
    """How one agent's resume went: ``ok`` with an optional ``note``, or an ``error``."""

    id: str
    ok: bool
    note: str | None = None
    error: str | None = None

    @model_serializer(mode="plain")
    def _present_fields(self) -> dict[str, object]:
        # The wire shape carries note/error only when there is one.
        shape: dict[str, object] = {"id": self.id, "ok": self.ok}
        if self.note is not None:
            shape["note"] = self.note
        if self.error is not None:
            shape["error"] = self.error
        return shape


class ResumeResult(WithOptional):
    """What ``caliban.daemon.resume`` answers; ``record_resume`` receives it."""

    op_id: str
    results: list[AgentResumeOutcome]
    error: str | None
    task_uid: str | None = None
    """The uid of the task the answering daemon serves, where its answer is signed."""
    signature: str | None = None
    """The task's signature over the rest (``signing``), when its daemon has a key."""

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("task_uid", "signature")


class ActivityReport(WithOptional):
    """kwargs of ``caliban.orchestrator.activity``: one daemon's heartbeat.

    ``seq`` grows across daemon restarts (wall-clock nanoseconds, never less than the last
    one plus one), so the orchestrator keeps only the newest. ``reported_at`` and
    ``all_idle_since`` are the daemon's wall clock (Unix seconds), for display only.

    ``idle_for_secs`` is the idle decision's input: how long every agent has been idle
    when this report was made, on the daemon host's monotonic clock, so no clock step
    and no skew between hosts changes it; None while the task is not idle. A report from
    a daemon older than this field carries none, and none means no idle decision: such a
    daemon's task is never idle-paused (upgrade the orchestrator before the daemons, as
    ``extra="forbid"`` refuses the field on an older orchestrator)."""

    namespace: str
    name: str
    task_uid: str | None
    seq: int = Field(ge=0)
    reported_at: float
    agents_total: int = Field(ge=0)
    agents_live: int = Field(ge=0)
    agents_idle: int = Field(ge=0)
    all_idle_since: float | None
    idle_for_secs: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    agents_interrupted: int = Field(default=0, ge=0)
    """Agents stopped with work left (``AgentStatus.interrupted``): the orchestrator
    resumes them. Defaults to 0 for a daemon older than the field."""
    agents_done: int = Field(default=0, ge=0)
    """Agents whose worker exited 0 by itself (``done``), their work over: when every
    agent is, the task completes. Defaults to 0 for a daemon older than the field."""
    signature: str | None = None
    """The task's signature over the rest (``signing``), when its daemon has a key."""

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("signature",)


def refusal(message_uid: str | None, served_uid: str | None, served: str) -> str | None:
    """Why a daemon serving ``served`` (``namespace/name``) with uid ``served_uid`` must not
    act on a message for ``message_uid``, or None when it may (either uid unknown, or
    the same)."""
    if message_uid is None or served_uid is None or message_uid == served_uid:
        return None
    return (
        f"refused: the message is for task uid {message_uid}, this daemon serves {served} "
        f"uid {served_uid} (a message of a deleted task of the same name)"
    )


CHECKPOINT_MISMATCH: Final = "the workspace does not hold this checkpoint"
"""How a resume refused because a session is not what its checkpoint recorded begins: no
agent was resumed, and the operator reports ``CheckpointMismatch``."""


def says_checkpoint_mismatch(error: str | None) -> bool:
    return error is not None and error.startswith(CHECKPOINT_MISMATCH)


def malformed(what: str, exc: ValidationError) -> str:
    """One line naming each flaw of a received payload, for an operation's error:
    ``malformed drain result: refs.0.clean: Input should be a valid boolean``."""
    flaws = "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or '(payload)'}: {err['msg']}"
        for err in exc.errors()
    )
    return f"malformed {what}: {flaws}"


JsonObject = dict[str, object]
"""A payload as Celery carries it: ``model.model_dump(mode="json")``."""
