"""The orchestrator's settings, in one typed place, read from ``DRAIN_*`` variables.

The Celery app, the ledger, the operator and ``drainctl`` all take their configuration
from ``Settings``; no module reads the environment for configuration on its own.
``Settings`` extends the contract's ``BrokerSettings`` (broker, result backend,
visibility timeout, heartbeat timing), which the daemon's consumer reads as well, so
each of those is declared once, in ``worker_agent.contract``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from orchestrator.operator import crd
from worker_agent import signing
from worker_agent.contract import BrokerSettings

RECORD_SLACK_SECS = 10.0
"""Room for the record itself once its message is back and the database answers."""


_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def parse_labels(text: str, name: str) -> dict[str, str]:
    """``key=value[,key=value]`` as a label selector's ``matchLabels``; empty: none.
    A malformed pair is refused with a message naming ``name`` and the pair."""
    found: dict[str, str] = {}
    for pair in (part.strip() for part in text.split(",")):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if (
            not sep
            or not _LABEL_KEY.match(key)
            or len(key) > 316
            or not _LABEL_VALUE.match(value)
            or len(value) > 63
        ):
            raise ValueError(f"{name}: {pair!r} is not a label key=value (e.g. team=monitoring)")
        found[key] = value
    return found


class Settings(BrokerSettings):
    model_config = SettingsConfigDict(env_prefix="DRAIN_", extra="ignore")

    database_url: str = "sqlite:///./caliban-drain.db"
    """The checkpoint ledger (``DRAIN_DATABASE_URL``): SQLite or ``postgresql+psycopg://``."""

    default_grace_secs: float = Field(default=30.0, ge=0)
    """Drain grace when a caller gives none."""
    drain_expires_secs: float = Field(default=300.0, gt=0)
    """A drain message not picked up by its daemon within this expires unrun."""
    send_concurrency: int = Field(default=8, ge=1)
    """How many chains ``start_drains`` publishes at once (``DRAIN_SEND_CONCURRENCY``):
    a publish is a few broker round trips, which a batch overlaps."""
    resume_expires_secs: float = Field(default=3600.0, gt=0)
    """A resume waits in its daemon's queue this long for the new pod's consumer."""
    record_deadline_secs: float = Field(default=900.0, gt=0)
    """How long after a drain's expiry and grace its operation may still be recorded: long
    enough for a ``record_checkpoint`` redelivered after its worker died, then retrying
    through a database outage (checked below)."""
    db_retry_window_secs: float = Field(default=600.0, ge=15)
    """How long an orchestrator task retries through a ledger outage (a PostgreSQL
    restart) before it gives up."""
    sweep_interval_secs: float = Field(default=15.0, gt=0)
    """How often the orchestrator worker fails operations past their deadline."""

    reconcile_interval_secs: float = Field(default=2.0, gt=0)
    """How often the operator re-examines a CalibanTask while something is on its way for
    it (provisioning, an operation, a resume, a backoff). A task at rest is examined on
    events only: a change of the object, a heartbeat that says something new, an
    operation that moved, a deadline (``operator.pacing``)."""
    resync_interval_secs: float = Field(default=300.0, gt=0)
    """How often the operator re-examines every CalibanTask whatever happened: the safety
    net under its events."""
    event_feed_interval_secs: float = Field(default=0.5, gt=0)
    """How often the operator asks the ledger what was stored since it last looked
    (heartbeats, operations that moved): one read for the whole fleet."""
    manage_sandbox: bool = False
    """Provision each task's Sandbox and workspace PVC (``--manage-sandbox``)."""
    existing_sandboxes: bool = False
    """Each task's Sandbox is provisioned by another controller (caliban-operator names it
    ``<task>-sbx``) or by hand (``--existing-sandboxes``): the operator drains, suspends
    and resumes it as ``--manage-sandbox`` does, reads its workspace PVC from it, and
    never creates a Sandbox, a PVC or the pod's other children. Implies
    ``manage_sandbox``."""
    workspace_status: Literal["auto", "on", "off"] = "auto"
    """Whether the operator writes each Workspace's status (``DRAIN_WORKSPACE_STATUS``):
    ``phase`` Ready or Failed, ``message``, ``observedGeneration`` and a ``Ready``
    condition, as caliban-operator's Workspace controller does, from this operator's own
    validation (docs/operator.md, "Workspaces"). ``on``: always; ``off``: never (it only
    reads Workspaces); ``auto`` (the default): when this operator builds tasks' pods from
    their Workspaces, that is with ``--manage-sandbox`` and without
    ``--existing-sandboxes``. Without those another controller (caliban-operator)
    provisions the tasks, and its own Workspace controller writes that status, so two
    writers never disagree over one field."""
    peering: str | None = None
    """The kopf peering object the operator's replicas share (``drainctl operator
    --peering``): a ClusterKopfPeering for a clusterwide operator, a KopfPeering in each
    watched namespace otherwise. One replica acts, the others stand by until its
    keep-alive lapses. Unset: standalone, one replica (``operator.peering``)."""
    peering_lifetime_secs: int = Field(default=15, ge=11)
    """How long a replica's keep-alive counts: a standby takes over at most this long
    after the active replica dies. kopf renews it 5-10 s before it lapses, so below 11 s
    the renewal could come after the lapse (``operator.peering``)."""
    peering_priority: int | None = None
    """This replica's peering priority (``--priority``); unset: the earlier-started
    replica wins (``operator.peering.startup_priority``)."""
    daemon_image: str = "ghcr.io/caliban-ai/caliban-drain:latest"
    """The image of the daemon container in provisioned Sandboxes."""
    allowed_images: Annotated[tuple[str, ...], NoDecode] = ()
    """The images a task's ``spec.task.image`` may name besides ``daemon_image``
    (``DRAIN_ALLOWED_IMAGES``, comma-separated, each exact); empty: only
    ``daemon_image``. A task naming another fails (``SpecValid=False``) before anything
    runs: an image is code that runs with the workspace and the broker credential."""
    daemon_broker_url: str | None = None
    """The broker URL daemons use (as seen from their pods); defaults to ``broker_url``."""
    broker_admin_url: SecretStr | None = None
    """An admin connection to the daemons' broker, held by the operator alone
    (``DRAIN_BROKER_ADMIN_URL``): Redis's (``redis://``, a user allowed ``ACL SETUSER``)
    or RabbitMQ's management API (``http(s)://user:password@HOST:15672``). Set, each task
    namespace's daemons get a broker user of their own (``broker_tenants``) that reaches
    only that namespace's queues and the orchestrator's; its URL is what the namespace's
    broker Secret holds. Needs ``DRAIN_MESSAGE_KEY`` (the users' passwords derive from
    it). Unset: the Secret holds ``daemon_broker_url`` as it is."""
    monitoring_namespace_selector: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {crd.MONITORING_NAMESPACE_LABEL: "true"}
    )
    """The labels of the namespaces whose pods may reach a task pod's metrics and probe
    port (``DRAIN_MONITORING_NAMESPACE_SELECTOR``, ``key=value[,key=value]``): the task's
    NetworkPolicy admits nothing else (the kubelet's probes are not subject to it)."""
    broker_namespace_selector: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {crd.BROKER_NAMESPACE_LABEL: "true"}
    )
    """The labels of the broker's namespace (``DRAIN_BROKER_NAMESPACE_SELECTOR``), with
    ``broker_pod_selector`` the only destination a task pod reaches on the broker's port.
    Both empty: the broker's port anywhere (a broker outside the cluster)."""
    broker_pod_selector: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {crd.BROKER_POD_LABEL: "true"}
    )
    """The labels of the broker's pods (``DRAIN_BROKER_POD_SELECTOR``)."""
    daemon_broker_secret: str = "caliban-drain-broker"  # noqa: S105 - a Secret's name
    """The Secret (key ``url``) the operator keeps in each task's namespace holding the
    daemon broker URL (``DRAIN_DAEMON_BROKER_SECRET``); daemon pods read it through a
    ``secretKeyRef``, so the URL, which may hold a password, never sits in a Sandbox spec."""
    message_key: SecretStr | None = None
    """The key daemon messages are proven with (``DRAIN_MESSAGE_KEY``, hex, at least 32
    bytes; the operator and the orchestrator worker both need it, and nothing else may
    hold it). The operator derives each task's key from it (``signing.task_key``) and
    writes it to a Secret of the task's own that its pod reads; the orchestrator worker
    refuses any drain result, resume result or heartbeat not signed with the key of the
    task the ledger says it is for. Unset: daemons sign nothing and the worker takes
    every message as it comes (one tenant only; the worker says so when it starts)."""
    snapshots: bool = True
    """Take a VolumeSnapshot of the workspace for every checkpoint where the cluster offers
    CSI snapshots (``DRAIN_SNAPSHOTS=false``: never; checkpoints are the retained PVC)."""
    snapshot_class: str | None = None
    """The VolumeSnapshotClass to use (``DRAIN_SNAPSHOT_CLASS``); unset: the class of the
    workspace StorageClass's CSI driver, the default one if several."""
    snapshot_cut_timeout_secs: float = Field(default=300.0, gt=0)
    """How long after its checkpoint a snapshot may take to be cut (``creationTime`` set,
    bound to its content: its point in time fixed) before the operator gives up on it (a
    Warning, ``Snapshotted=False``): a pause or a deletion waits this long at most."""
    snapshot_ready_timeout_secs: float = Field(default=3600.0, gt=0)
    """How long after its checkpoint a cut snapshot may take to become ``readyToUse``
    (its data uploaded) before the operator records it failed. Nothing is held while it
    uploads but a restore of that checkpoint, which waits for it."""
    snapshot_follow_interval_secs: float = Field(default=5.0, gt=0)
    """How often the operator looks at the snapshots that are cut and not ready yet (one
    ledger read, then one list per namespace that has any)."""

    metrics_port: int = Field(default=9100, ge=0, le=65535)
    """The operator's ``/metrics`` (``DRAIN_METRICS_PORT``); 0 serves none."""
    metrics_host: str = "0.0.0.0"  # noqa: S104 - a pod's port, reached through its IP
    """The address the operator's metrics are served on (``DRAIN_METRICS_HOST``)."""
    worker_metrics_port: int = Field(default=9101, ge=0, le=65535)
    """The orchestrator worker's ``/metrics``, ``/healthz`` and ``/readyz``
    (``DRAIN_WORKER_METRICS_PORT``, or ``drainctl worker --metrics-port``); 0: none. It
    is served on ``DRAIN_METRICS_HOST`` too."""

    audit_interval_secs: float = Field(default=60.0, gt=0)
    """How often the periodic audit (``drainctl audit --every``) runs."""
    audit_full_pass_secs: float = Field(default=3600.0, gt=0)
    """Every restorable checkpoint's workspace and sessions are checked at least once in
    this period; each run takes its share of them (never fewer than the batches below)."""
    audit_checkpoint_batch: int = Field(default=2000, ge=1)
    """Checkpoints whose workspace one periodic run checks, at least."""
    audit_session_batch: int = Field(default=200, ge=1)
    """Agent sessions one periodic run reads and hashes, at least."""
    audit_first_heartbeat_secs: float = Field(default=600.0, gt=0)
    """How long a new task's pod may take to send its first heartbeat (image pulls,
    scheduling) before the audit calls its daemon silent."""
    audit_volumes_dir: Path | None = None
    """Where the audit can read workspaces and snapshot copies directly: the stand-in
    Sandbox controller's dir (``<state>/sandboxes``) in the dev stack. Unset: session
    contents are not checked, only that each workspace exists."""

    @property
    def redelivery_secs(self) -> float:
        """The longest a message whose consumer died takes to come back.

        Redis: the visibility timeout, noticed at the next restore sweep. RabbitMQ
        redelivers when the consumer's connection closes: at once for a killed process,
        and for one that vanished (its node gone) once it has missed heartbeats, which
        RabbitMQ notices within two heartbeat timeouts."""
        if self.amqp:
            return 2 * self.broker_heartbeat_secs
        return self.visibility_timeout_secs + self.unacked_restore_interval_secs

    @property
    def _redelivery_settings(self) -> str:
        if self.amqp:
            return "2 * DRAIN_BROKER_HEARTBEAT_SECS"
        return "DRAIN_VISIBILITY_TIMEOUT_SECS + DRAIN_UNACKED_RESTORE_INTERVAL_SECS"

    @field_validator("allowed_images", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(image.strip() for image in value.split(",") if image.strip())
        return value

    @field_validator(
        "monitoring_namespace_selector",
        "broker_namespace_selector",
        "broker_pod_selector",
        mode="before",
    )
    @classmethod
    def _label_selector(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            return parse_labels(value, f"DRAIN_{(info.field_name or '').upper()}")
        return value

    @field_validator("message_key")
    @classmethod
    def _a_usable_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            signing.parse_key(value.get_secret_value(), "DRAIN_MESSAGE_KEY")
        return value

    @property
    def message_key_bytes(self) -> bytes | None:
        """``message_key`` as bytes, or None when messages are not signed."""
        if self.message_key is None:
            return None
        return signing.parse_key(self.message_key.get_secret_value(), "DRAIN_MESSAGE_KEY")

    @property
    def writes_workspace_status(self) -> bool:
        """``workspace_status`` decided: ``auto`` is on where this operator provisions."""
        if self.workspace_status == "auto":
            return self.manage_sandbox and not self.existing_sandboxes
        return self.workspace_status == "on"

    @property
    def runnable_images(self) -> tuple[str, ...]:
        """The images a task may run: ``daemon_image``, then ``allowed_images``."""
        return (self.daemon_image, *self.allowed_images)

    @model_validator(mode="after")
    def _existing_sandboxes_are_managed(self) -> Self:
        """Operating on Sandboxes another controller made is managing them, less making."""
        if self.existing_sandboxes:
            self.manage_sandbox = True
        return self

    @model_validator(mode="after")
    def _tenants_can_be_made(self) -> Self:
        if self.broker_admin_url is None:
            return self
        from orchestrator.broker_tenants import check_admin_url

        # Only the operator that provisions makes tenants: the other processes of a stack
        # given the same environment (drainctl audit, the worker) never use the key for it.
        if self.message_key is None and self.manage_sandbox:
            raise ValueError(
                "DRAIN_BROKER_ADMIN_URL needs DRAIN_MESSAGE_KEY: the tenants' broker "
                "passwords are derived from it"
            )
        check_admin_url(self.broker_admin_url.get_secret_value(), self.daemons_broker_url)
        return self

    @property
    def daemons_broker_url(self) -> str:
        """The broker URL daemons reach, before any tenant's credentials."""
        return self.daemon_broker_url or self.broker_url

    @model_validator(mode="after")
    def _a_snapshot_is_cut_before_it_is_ready(self) -> Self:
        """Both snapshot deadlines count from the checkpoint, and a snapshot is ready only
        after it is cut: a ready deadline before the cut's would fail snapshots a pause
        or a deletion is still allowed to wait for."""
        if self.snapshot_ready_timeout_secs < self.snapshot_cut_timeout_secs:
            raise ValueError(
                f"DRAIN_SNAPSHOT_READY_TIMEOUT_SECS ({self.snapshot_ready_timeout_secs:g} s) "
                f"must be at least DRAIN_SNAPSHOT_CUT_TIMEOUT_SECS "
                f"({self.snapshot_cut_timeout_secs:g} s): both count from the checkpoint, "
                "and a snapshot becomes ready only after it is cut"
            )
        return self

    @model_validator(mode="after")
    def _redelivery_lands_in_time(self) -> Self:
        """The timing relations that make a killed consumer or worker harmless.

        A drain whose consumer was SIGKILLed is redelivered after ``redelivery_secs``: it
        must arrive before the drain expires, or it is discarded and the agents the
        daemon drained are never recorded. A ``record_checkpoint`` whose worker was
        SIGKILLed is redelivered the same way and may then retry through a database
        outage: all of that must fit before the deadline sweeper may fail the operation.
        """
        if self.redelivery_secs >= self.drain_expires_secs:
            raise ValueError(
                f"{self._redelivery_settings} ({self.redelivery_secs:g} s) must be less than "
                f"DRAIN_DRAIN_EXPIRES_SECS ({self.drain_expires_secs:g} s): a drain redelivered "
                "after its consumer died would expire before it arrives"
            )
        needed = self.redelivery_secs + self.db_retry_window_secs + RECORD_SLACK_SECS
        if self.record_deadline_secs < needed:
            raise ValueError(
                f"DRAIN_RECORD_DEADLINE_SECS ({self.record_deadline_secs:g} s) must be at least "
                f"{needed:g} s (redelivery {self.redelivery_secs:g} s + database retries "
                f"{self.db_retry_window_secs:g} s + {RECORD_SLACK_SECS:g} s): a record redelivered "
                "after its worker died could otherwise land after the operation was failed"
            )
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
